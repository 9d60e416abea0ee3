"""Which engine protocol a URL speaks, told from routes that only one of SGLang and vLLM has.

Evidence, without generating anything (../shared/docs/vllm-generate.md, "Health and telling vLLM
from SGLang"): `/v1/models` cards are `owned_by` "sglang" or "vllm"; SGLang serves `/model_info`
(`/get_model_info` before, and behind sglang-router) with a `model_path`; a POST-only route answers
a GET with 405 where it exists and 404 where it does not, so `GET /generate` tells SGLang's native
route and `GET /inference/v1/generate` vLLM's token route (0.11.1+); `/version` answers
`{"version": ...}` on vLLM. An SGLang URL whose GET /workers or /list_workers lists workers is an
sglang-router (proxy/engines/router.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
import orjson

from proxy.engines import router
from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.errors import EngineMismatch

Kind = Literal["sglang", "vllm", "unknown", "unreachable"]
_QUICK = aiohttp.ClientTimeout(total=5.0)


@dataclass(frozen=True)
class Identity:
    kind: Kind
    evidence: list[str] = field(default_factory=list)
    # An sglang-router in front of workers (its GET /workers or /list_workers lists them).
    router: bool = False

    def describe(self) -> str:
        return f"{self.kind} ({'; '.join(self.evidence) or 'no evidence'})"


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, object]:
    """Status and JSON body (None when not JSON) of a GET; status 0 when nothing answers."""
    try:
        async with session.get(url, timeout=_QUICK) as response:
            content = await response.read()
            try:
                return response.status, orjson.loads(content) if content else None
            except orjson.JSONDecodeError:
                return response.status, None
    except (TimeoutError, aiohttp.ClientError):
        return 0, None


async def identify(base_url: str, *, api_key: str | None = None) -> Identity:
    """What `base_url` speaks, with the answers that tell it."""
    base = base_url.rstrip("/")
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    paths = (
        "/v1/models",
        "/model_info",
        "/get_model_info",
        "/generate",
        "/inference/v1/generate",
        "/version",
        "/workers",
        "/list_workers",
    )
    async with aiohttp.ClientSession(headers=headers) as session:
        answers = dict(
            zip(paths, await asyncio.gather(*(_get(session, base + path) for path in paths)), strict=True)
        )
    if all(status == 0 for status, _ in answers.values()):
        return Identity("unreachable", [f"nothing answers at {base}"])
    sglang: list[str] = []
    vllm: list[str] = []
    owners = _owners(answers["/v1/models"][1])
    for owner in owners:
        (sglang if owner == "sglang" else vllm if owner == "vllm" else []).append(
            f"/v1/models owned_by {owner!r}"
        )
    for path in ("/model_info", "/get_model_info"):
        status, body = answers[path]
        if status == 200 and isinstance(body, dict) and "model_path" in body:
            sglang.append(f"GET {path} has model_path")
    if answers["/generate"][0] == 405:
        sglang.append("POST /generate exists")
    if answers["/inference/v1/generate"][0] == 405:
        vllm.append("POST /inference/v1/generate exists")
    status, body = answers["/version"]
    if status == 200 and isinstance(body, dict) and isinstance(body.get("version"), str) and not sglang:
        vllm.append(f"/version is {body['version']}")
    routed = [
        f"GET {path} lists workers"
        for path in ("/workers", "/list_workers")
        if answers[path][0] == 200 and router.worker_urls(path, answers[path][1])
    ]
    if sglang and not vllm:
        return Identity("sglang", [*sglang, *routed], router=bool(routed))
    if vllm and not sglang:
        return Identity("vllm", vllm)
    seen = [f"GET {path}: HTTP {status}" for path, (status, _) in answers.items() if status]
    return Identity("unknown", [*sglang, *vllm] or seen)


def _owners(models: object) -> list[str]:
    data = models.get("data") if isinstance(models, dict) else None
    found = {
        str(card.get("owned_by")) for card in data or [] if isinstance(card, dict) and card.get("owned_by")
    }
    return sorted(found)


def check_identity(configured: str, url: str, identity: Identity) -> None:
    """Raise a start-up error naming what was found when the URL speaks another protocol, or none."""
    if identity.kind in (configured, "unreachable"):
        return
    if identity.kind == "unknown":
        raise EngineMismatch(
            f"the engine URL {url} speaks neither SGLang's nor vLLM's protocol "
            f"(configured --engine {configured}); found: {'; '.join(identity.evidence)}"
        )
    raise EngineMismatch(
        f"the engine URL {url} speaks {identity.kind}, not {configured}: {'; '.join(identity.evidence)}. "
        f"Start the proxy with --engine {identity.kind}, or point --engine-url at a {configured} server."
    )


class ProtocolGuard:
    """An engine whose URL did not answer at start: its protocol is checked once it answers, so that a
    wrong engine coming up later fails every call with a clear 503, never with an engine's 4xx."""

    def __init__(self, inner: Any, configured: str, url: str, *, api_key: str | None = None) -> None:
        self.inner = inner
        self.name: str = inner.name
        self.supports_constraints: bool = inner.supports_constraints
        self.limits: ContextLimits = inner.limits
        self._configured = configured
        self._url = url
        self._api_key = api_key
        self._verified = False
        self._lock = asyncio.Lock()

    def __getattr__(self, attribute: str) -> Any:
        # Extras an engine may have (report, honours_seed, wire_sampling...).
        return getattr(self.inner, attribute)

    async def _verify(self) -> None:
        if self._verified:
            return
        async with self._lock:
            if self._verified:
                return
            identity = await identify(self._url, api_key=self._api_key)
            check_identity(self._configured, self._url, identity)
            self._verified = identity.kind != "unreachable"
            if identity.router and hasattr(self.inner, "router"):
                self.inner.router = True  # an sglang-router that came up after the proxy

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        await self._verify()
        result: Generation = await self.inner.generate(input_ids, params, request_id, affinity=affinity)
        return result

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        await self._verify()
        chunks: AsyncIterator[StreamChunk] = await self.inner.stream(
            input_ids, params, request_id, affinity=affinity
        )
        return chunks

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def info(self) -> EngineInfo:
        await self._verify()
        found: EngineInfo = await self.inner.info()
        return found

    async def ready(self) -> bool:
        try:
            await self._verify()
        except EngineMismatch:
            return False
        ready: bool = await self.inner.ready()
        return ready

    async def aclose(self) -> None:
        await self.inner.aclose()
