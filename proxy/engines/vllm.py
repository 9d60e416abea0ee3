"""Client for vLLM's token-in/token-out routes: prompt ids in, sampled ids and their logprobs out.

Mapping (facts from vLLM 0.33.0's source, ../shared/docs/vllm-generate.md):

- Route: `POST /inference/v1/generate` (`token_ids`, `sampling_params`) where the server has it
  enabled (`--enable-scale-out`); else `POST /v1/completions` with the ids as `prompt`,
  `return_token_ids`, `return_tokens_as_token_ids` and `return_weight_versions`. Chosen at start by
  probing; a 403 from a disabled generate route later switches to completions.
- Sampling: vLLM's own names (`max_tokens`, `seed`, `logprobs`, `structured_outputs`), every field
  sent, so neither vLLM's defaults nor the model's generation_config.json fill anything in; `n` is
  always 1 (each OpenAI choice is its own request and branch). Temperatures in (0, 0.01), which
  vLLM raises to 0.01, are refused.
- Stops: `stop_token_ids` and `stop` strings as given; `finish_reason` "stop" with an integer
  `stop_reason` is that stop token, a string the stop string, null the tokenizer's EOS (the last
  id); "length" and "abort" as named. Ids include the stop token, as SGLang's.
- Logprobs: `logprobs: k` (0 = the sampled token only); each sampled id's own logprob, checked
  against its id; top logprobs are the k best of vLLM's candidates (it lists the sampled token
  first). vLLM's "no logprob" (-9999.0) is an engine error, never recorded. The logprobs mode
  (raw by default: before temperature and truncation) is read at start where vLLM tells it and
  recorded with every call (`engine_meta.logprobs_mode`, `sampled_distribution`).
- Structured output: `structured_outputs` with `json`, `regex`, `grammar` or `structural_tag`.
- Context: vLLM clamps prompt + max_tokens to `max_model_len` silently, so the proxy checks the
  room itself (margin 0: prompt + output may reach `max_model_len`); `max_tokens: null` on the
  generate route means "up to the limit", and is computed for /v1/completions (where null is 16).
- Weight versions: `weight_versions` spans are kept per call; vLLM's "default" (no version named)
  is recorded as the trainer's version at the call's dispatch; the call's version is its first
  token's (proxy/turns/recording.py).
- Abort: `/inference/v1/abort_requests` with vLLM's engine id (`generate-tokens-<id>`; for
  completions `cmpl-<id>-0` through the dev-mode `/abort_requests`); closing a stream aborts too.
- LoRA: a request for an adapter sends its name as `model` (generate route; the completions route's
  `model` too); vLLM's 404 for an adapter it no longer serves is a 404 model_not_found. Adapters are
  the `/v1/models` cards with a `parent`.
- Routed experts (MoE routing replay, proxy/engines/routed_experts.py): `routed_experts_prompt_start`
  in `sampling_params` on the generate route; the last chunk's `routed_experts` (base64 `.npy`).
- Streams are deltas (one choice per chunk); errors the engine finds arrive as an HTTP 200 whose
  first event is `{"error": ...}` and are raised before the first chunk, as plain errors are.
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from proxy.engines.answers import json_answer, refusal, request_json
from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.engines.http1 import Answer, AnswerCut, EngineHTTP, Stream
from proxy.engines.routed_experts import RoutedExperts, from_vllm
from proxy.engines.sglang import adapter_cards, lines_of
from proxy.engines.vllm_probe import LogprobsMode, VLLMProbe, base_model, mode_in_server_info
from proxy.engines.vllm_protocol import (
    COMPLETIONS_PATH,
    GENERATE_PATH,
    ParsedChoice,
    Route,
    check_counts,
    completions_payload,
    error_message,
    generate_payload,
    parse_choice,
    single_choice,
    vllm_sampling,
)
from proxy.errors import (
    EngineError,
    EngineMismatch,
    EngineTimeout,
    EngineUnavailable,
    ModelNotFound,
)
from proxy.weight_versions import named

log = logging.getLogger("tito_proxy.vllm")
_KEEPALIVE_S = 4.0  # below uvicorn's 5 s keep-alive, which vLLM serves with


class _Disabled(Exception):
    """The generate route answered 403: served without --enable-scale-out."""


class VLLMEngine:
    """A vLLM server over HTTP."""

    name = "vllm"
    supports_constraints = True
    supports_routed_experts = True  # on the generate route, with --enable-return-routed-experts
    honours_seed = True  # vLLM seeds each request's own generator
    # A prompt of at most M - 1 tokens, and prompt + output may fill max_model_len M exactly.
    limits = ContextLimits(prompt_reserve=1, output_reserve=0)

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float,
        declared_logprobs_mode: LogprobsMode | None = None,
        api_key: str | None = None,
    ) -> None:
        self._base_url = base_url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s)
        self._declared_mode = declared_logprobs_mode
        self._headers = {"content-type": "application/json"}
        if api_key:
            self._headers["authorization"] = f"Bearer {api_key}"
        self._timeout_s = timeout_s
        self._client: aiohttp.ClientSession | None = None  # streams, probes and aborts
        self._plain: EngineHTTP | None = None  # plain generations, the hot path
        self.probe: VLLMProbe | None = None
        self._running: set[str] = set()  # engine ids of the requests in progress, for abort_all

    def _url(self, path: str) -> URL:
        return URL(self._base_url + path)

    def _session(self) -> aiohttp.ClientSession:
        if self._client is None:
            connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=_KEEPALIVE_S)
            self._client = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._client

    def _http(self) -> EngineHTTP:
        if self._plain is None:
            self._plain = EngineHTTP(self._base_url, engine="vLLM", timeout_s=self._timeout_s)
        return self._plain

    # --- start-up probe ---

    async def start(self) -> VLLMProbe:
        """Read what the server is; raises EngineUnavailable if it cannot be reached and
        EngineMismatch for a logprobs mode that is not logprobs at all or contradicts the declared one."""
        try:
            version_body = await self._get_json("/version")
            models = await self._get_json("/v1/models")
            route = await self._token_route()
            info = await self._get_json("/server_info?config_format=json")
        except TimeoutError as exc:
            raise EngineTimeout(f"vLLM at {self._base_url} did not answer its info routes in time") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"cannot reach vLLM at {self._base_url}: {exc}") from exc
        if models is None:
            raise EngineUnavailable(f"vLLM at {self._base_url} does not list its model yet (/v1/models)")
        model, context_length = base_model(models)
        detected = mode_in_server_info(info) if info is not None else None
        mode, source = self._logprobs_mode(detected)
        version = version_body.get("version") if isinstance(version_body, dict) else None
        self.probe = VLLMProbe(
            version=str(version) if version is not None else None,
            route=route,
            model=model,
            context_length=context_length,
            logprobs_mode=mode,
            mode_source=source,
        )
        return self.probe

    def _logprobs_mode(self, detected: LogprobsMode | None) -> tuple[LogprobsMode | None, Any]:
        declared = self._declared_mode
        if detected is not None and declared is not None and detected != declared:
            raise EngineMismatch(
                f"vLLM reports --logprobs-mode {detected}, but the proxy was told {declared} "
                "(--vllm-logprobs-mode)"
            )
        mode = detected or declared
        if mode in ("raw_logits", "processed_logits"):
            raise EngineMismatch(
                f"vLLM runs with --logprobs-mode {mode}: its logprobs are logits; restart it with "
                "--logprobs-mode processed_logprobs"
            )
        return mode, "server_info" if detected else ("declared" if declared else "unknown")

    async def _token_route(self) -> Route:
        """Which token route answers: an invalid body is a 400 where the generate route runs, a 403
        where it is disabled, a 404 where the release lacks it."""
        async with self._session().post(
            self._url(GENERATE_PATH), data=b"{}", headers=self._headers
        ) as response:
            status = response.status
            content = await response.read()
        if status == 401:
            raise EngineMismatch(
                f"vLLM at {self._base_url} wants an API key: {error_message(status, content)} "
                "(pass --engine-api-key)"
            )
        return "generate" if status in (400, 422) else "completions"

    async def _ensure(self) -> VLLMProbe:
        return self.probe if self.probe is not None else await self.start()

    def report(self) -> dict[str, Any]:
        # No URL: /v1/template is open to harnesses, which need not learn where the engine runs.
        if self.probe is None:
            return {"kind": "vllm", "probed": False}
        return self.probe.report()

    # --- generation ---

    def wire_sampling(self, params: SamplingParams) -> dict[str, Any]:
        """The sampling_params a call is sent with, as recorded beside it."""
        return vllm_sampling(params, max_tokens=params.max_new_tokens)

    def _payload(
        self, probe: VLLMProbe, prompt: PromptIds, params: SamplingParams, rid: str, *, stream: bool
    ) -> dict[str, Any]:
        if probe.route == "generate":
            return generate_payload(prompt, params, rid, stream=stream)
        max_tokens = params.max_new_tokens
        if max_tokens is None:
            if probe.context_length is None:
                raise EngineError("vLLM's context length is unknown, so max_tokens cannot be bounded")
            max_tokens = probe.context_length - len(prompt)
        return completions_payload(
            prompt, params, rid, model=params.adapter or probe.model, max_tokens=max_tokens, stream=stream
        )

    async def _open(self, prompt: PromptIds, params: SamplingParams, rid: str) -> tuple[VLLMProbe, Stream]:
        """Send a stream request on the probed route; a disabled generate route switches to completions."""
        probe = await self._ensure()
        try:
            return probe, await self._send(probe, prompt, params, rid)
        except _Disabled:
            probe = self._to_completions(probe)
            return probe, await self._send(probe, prompt, params, rid)

    async def _answer(self, prompt: PromptIds, params: SamplingParams, rid: str) -> tuple[VLLMProbe, Answer]:
        """A plain request's whole answer, as _open sends a stream's."""
        probe = await self._ensure()
        try:
            return probe, await self._post(probe, prompt, params, rid)
        except _Disabled:
            probe = self._to_completions(probe)
            return probe, await self._post(probe, prompt, params, rid)

    def _to_completions(self, probe: VLLMProbe) -> VLLMProbe:
        log.warning(
            "vLLM's %s is disabled (no --enable-scale-out): using %s", GENERATE_PATH, COMPLETIONS_PATH
        )
        self.probe = probe = replace(probe, route="completions")
        return probe

    def _request(
        self, probe: VLLMProbe, prompt: PromptIds, params: SamplingParams, rid: str, *, stream: bool
    ) -> tuple[str, bytes]:
        """The path the probed route takes and the request's body."""
        path = GENERATE_PATH if probe.route == "generate" else COMPLETIONS_PATH
        return path, request_json(self._payload(probe, prompt, params, rid, stream=stream))

    async def _post(self, probe: VLLMProbe, prompt: PromptIds, params: SamplingParams, rid: str) -> Answer:
        answer = await self._http().post(
            *self._request(probe, prompt, params, rid, stream=False), self._headers
        )
        if answer.status != 200:
            raise _refusal(probe, params, answer.status, answer.body)
        return answer

    async def _send(self, probe: VLLMProbe, prompt: PromptIds, params: SamplingParams, rid: str) -> Stream:
        response = await self._http().open(
            *self._request(probe, prompt, params, rid, stream=True), self._headers
        )
        if response.status == 200:
            return response
        try:
            content = await response.read()
        except (TimeoutError, AnswerCut):
            content = b""
        finally:
            response.release()
        raise _refusal(probe, params, response.status, content)

    def _generation(
        self, probe: VLLMProbe, parsed: ParsedChoice, params: SamplingParams, rid: str, experts: Any
    ) -> Generation:
        return Generation(
            output_ids=parsed.output_ids,
            logprobs=parsed.logprobs,
            finish=parsed.finish,  # type: ignore[arg-type]  # final answers always carry one
            weight_version=parsed.weight_version,
            meta=self._meta(probe, parsed, params, rid),
            top_logprobs=parsed.top_logprobs,
            routed_experts=experts,
        )

    @staticmethod
    def _meta(probe: VLLMProbe, parsed: ParsedChoice, params: SamplingParams, rid: str) -> dict[str, Any]:
        meta = {"id": _engine_id(probe.route, rid), **probe.call_meta(params), **parsed.meta}
        if parsed.weight_versions is not None:
            meta["weight_versions"] = parsed.weight_versions
        return meta

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        rid = request_id or uuid.uuid4().hex
        engine_id = _engine_id(self.probe.route if self.probe else "generate", rid)
        self._running.add(engine_id)
        try:
            return await self._generate(input_ids, params, rid)
        finally:
            self._running.discard(engine_id)

    async def _generate(self, input_ids: PromptIds, params: SamplingParams, rid: str) -> Generation:
        probe, answer = await self._answer(input_ids, params, rid)
        body = json_answer(answer.body, "vLLM")
        choice = single_choice(body)
        if choice is None:
            raise EngineError("vLLM answered without a choice")
        parsed = parse_choice(choice, probe.route, top_k=params.top_logprobs, final=True)
        check_counts(parsed, len(parsed.output_ids), body.get("usage"))
        end = len(input_ids) + len(parsed.output_ids) - 1
        return self._generation(probe, parsed, params, rid, _routed_experts(choice, params, end))

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        probe, response = await self._open(input_ids, params, request_id)
        self._running.add(_engine_id(probe.route, request_id))
        if not response.content_type.startswith("text/event-stream"):
            response.close()
            raise EngineError("vLLM answered a stream request without server-sent events")
        events = _events(response)
        try:
            first = await anext(events, None)
        except BaseException:
            self._running.discard(_engine_id(probe.route, request_id))
            await events.aclose()
            raise
        # Errors vLLM's engine finds (vocabulary, context, paused) come as a 200 and a first error event.
        return self._chunks(probe, (params, len(input_ids)), request_id, first, events)

    async def _chunks(
        self,
        probe: VLLMProbe,
        asked: tuple[SamplingParams, int],
        rid: str,
        first: dict[str, Any] | None,
        events: AsyncGenerator[dict[str, Any], None],
    ) -> AsyncIterator[StreamChunk]:
        params, held = asked  # held: the prompt, then each output id as it arrives
        prompt_len = held
        try:
            body = first
            while body is not None:
                choice = single_choice(body)
                if choice is not None:
                    parsed = parse_choice(choice, probe.route, top_k=params.top_logprobs, final=False)
                    held += len(parsed.output_ids)
                    if parsed.finish is not None:  # its spans cover the whole output
                        check_counts(parsed, held - prompt_len)
                    yield StreamChunk(
                        output_ids=parsed.output_ids,
                        logprobs=parsed.logprobs,
                        finish=parsed.finish,
                        weight_version=parsed.weight_version,
                        meta=self._meta(probe, parsed, params, rid),
                        top_logprobs=parsed.top_logprobs,
                        # In the last chunk, over the whole output.
                        routed_experts=_routed_experts(choice, params, held - 1) if parsed.finish else None,
                    )
                    if parsed.finish is not None:
                        return
                body = await anext(events, None)
        finally:
            self._running.discard(_engine_id(probe.route, rid))
            await events.aclose()
        raise EngineError("vLLM's stream ended without a finish reason")

    async def abort(self, request_id: str) -> None:
        route = self.probe.route if self.probe is not None else "generate"
        await self._abort([_engine_id(route, request_id)])

    async def abort_all(self) -> None:
        """Abort every request this client has running (a trainer's pause with abort)."""
        if self._running:
            await self._abort(sorted(self._running))

    async def _abort(self, engine_ids: list[str]) -> None:
        route = self.probe.route if self.probe is not None else "generate"
        path = "/inference/v1/abort_requests" if route == "generate" else "/abort_requests"
        # Best effort: closing the request's connection aborts it too.
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with self._session().post(
                self._url(path),
                data=orjson.dumps({"request_ids": engine_ids}),
                headers=self._headers,
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as response:
                await response.read()

    # --- info and health ---

    async def _get_json(self, path: str) -> Any | None:
        """The JSON body of a GET, or None when the route answers anything but 200 JSON."""
        async with self._session().get(self._url(path), headers=self._headers) as response:
            if response.status != 200:
                return None
            try:
                return orjson.loads(await response.read())
            except orjson.JSONDecodeError:
                return None

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters vLLM serves, name -> path: its /v1/models cards with a `parent`."""
        try:
            models = await self._get_json("/v1/models")
        except TimeoutError as exc:
            raise EngineTimeout("vLLM did not list its models in time") from exc
        except aiohttp.ClientError as exc:
            raise EngineUnavailable(f"cannot list vLLM's models at {self._base_url}: {exc}") from exc
        return adapter_cards(models)

    async def info(self) -> EngineInfo:
        probe = await self._ensure()
        try:
            weights = await self._get_json("/weight_info")  # dev mode only
        except (TimeoutError, aiohttp.ClientError):
            weights = None
        version = weights.get("weight_version") if isinstance(weights, dict) else None
        return EngineInfo(
            model=probe.model,
            context_length=probe.context_length,
            weight_version=named(version),
        )

    async def ready(self) -> bool:
        try:
            async with self._session().get(
                self._url("/health"), timeout=aiohttp.ClientTimeout(total=5.0)
            ) as response:
                return response.status == 200
        except (TimeoutError, aiohttp.ClientError):
            return False

    async def aclose(self) -> None:
        if self._plain is not None:
            await self._plain.aclose()
        if self._client is not None:
            await self._client.close()


def _routed_experts(choice: dict[str, Any], params: SamplingParams, end: int) -> RoutedExperts | None:
    """A choice's routed experts over [ask.start, end), where asked and sent (the server runs with
    --enable-return-routed-experts)."""
    if params.routed_experts is None or choice.get("routed_experts") is None:
        return None
    return from_vllm(choice["routed_experts"], params.routed_experts, end)


def _engine_id(route: Route, request_id: str) -> str:
    """The id vLLM's engine gives a request, which is what its abort routes take."""
    return f"generate-tokens-{request_id}" if route == "generate" else f"cmpl-{request_id}-0"


def _refusal(probe: VLLMProbe, params: SamplingParams, status: int, content: bytes) -> Exception:
    """The error for a non-200 answer; _Disabled for a generate route served without it."""
    if status == 403 and probe.route == "generate":
        return _Disabled()
    message = error_message(status, content)
    if status == 404 and params.adapter is not None:  # vLLM's answer for an unknown model
        return ModelNotFound(f"vLLM does not serve the LoRA adapter {params.adapter!r} (any more): {message}")
    return refusal(status, message)


async def _events(response: Stream) -> AsyncGenerator[dict[str, Any], None]:
    """The JSON events of an SSE body up to `[DONE]`; an error event is raised as the error it names."""
    finished = False
    try:
        async for line in lines_of(response.blocks()):
            if not line.startswith(b"data:"):
                continue  # blank separators and ": keep-alive" comments
            data = line[5:].strip()
            if data == b"[DONE]":
                finished = True
                return
            try:
                body = orjson.loads(data)
            except orjson.JSONDecodeError as exc:
                raise EngineError("vLLM streamed malformed JSON") from exc
            if isinstance(body, dict) and "error" in body:
                error = body["error"]
                message = error.get("message") if isinstance(error, dict) else str(error)
                code = error.get("code") if isinstance(error, dict) else None
                raise refusal(code if isinstance(code, int) else 500, str(message))
            yield body
    except TimeoutError as exc:
        raise EngineTimeout("vLLM's stream stalled past the timeout") from exc
    except AnswerCut as exc:
        raise EngineError(f"vLLM's stream was cut: {exc}") from exc
    finally:
        # An unfinished stream closes its connection: vLLM aborts a request whose client left.
        if finished:
            response.release()
        else:
            response.close()
