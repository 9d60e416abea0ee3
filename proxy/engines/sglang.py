"""Client for SGLang's native /generate, speaking token ids in and out."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import aiohttp
import orjson
from yarl import URL

from proxy.engines import router as sglang_router
from proxy.engines.answers import json_answer, refusal, request_json
from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
    TopLogprobs,
)
from proxy.engines.http1 import AnswerCut, EngineHTTP, Stream
from proxy.engines.prompt_json import json_value
from proxy.engines.routed_experts import ExpertsAsk, RoutedExperts, from_sglang
from proxy.errors import (
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    InvalidEngineAnswer,
    InvalidRequest,
    ModelNotFound,
    ProxyError,
)

# A stream line may hold a whole cumulative output with its logprobs: far past aiohttp's line limit.
_MAX_STREAM_LINE = 64 * 1024 * 1024
# Below uvicorn's 5 s keep-alive (SGLang serves with it): a pooled connection is never reused just as
# the engine closes it.
_KEEPALIVE_S = 4.0
# Measured on SGLang 0.5.23: inputs of context - 6 tokens or more are refused (max_req_input_len),
# and generation is capped at context - 2 - input tokens (max_req_len - input - 1).
SGLANG_LIMITS = ContextLimits(prompt_reserve=7, output_reserve=2)


def _error_message(status: int, content: bytes) -> str:
    # SGLang answers errors as {"error": "text"} or {"error": {"message": "text"}}.
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        return content[:500].decode(errors="replace") or f"HTTP {status}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return error
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(body)[:500]


def _finish_reason(raw: Any) -> FinishReason:
    if not isinstance(raw, dict):
        raise InvalidEngineAnswer(f"SGLang returned an unexpected finish_reason: {raw!r}")
    kind = raw.get("type")
    if kind == "stop":
        matched = raw.get("matched")
        if isinstance(matched, int):
            return FinishReason("stop", matched_token=matched)
        return FinishReason("stop", matched_text=matched if isinstance(matched, str) else None)
    if kind == "length":
        return FinishReason("length")
    if kind == "abort":
        return FinishReason("abort", message=str(raw.get("message") or "aborted"))
    raise InvalidEngineAnswer(f"SGLang returned an unknown finish_reason type: {kind!r}")


def _raise_if_refused(raw_finish: Any) -> None:
    """A refusal SGLang reports as an abort with a status code (streamed: HTTP 200, a fake output id
    0 and no logprobs): read it before anything else of the answer."""
    if isinstance(raw_finish, dict) and raw_finish.get("type") == "abort":
        status = raw_finish.get("status_code")
        if type(status) is int and status >= 400:
            raise refusal(status, str(raw_finish.get("message") or "aborted"))


def _top_logprobs(raw: Any, count: int) -> list[TopLogprobs]:
    """`output_top_logprobs`: per position, a list of [logprob, token_id, text] entries."""
    if not isinstance(raw, list) or len(raw) != count:
        raise InvalidEngineAnswer("SGLang response has no output_top_logprobs aligned with output_ids")
    positions: list[TopLogprobs] = []
    for entries in raw:
        if not isinstance(entries, list) or not all(isinstance(e, list) and len(e) >= 2 for e in entries):
            raise InvalidEngineAnswer("SGLang returned a malformed top-logprob entry")
        # As sent: the types are checked with everything else (proxy/engines/checked.py).
        positions.append([(e[1], e[0]) for e in entries])
    return positions


def _aligned_logprobs(output_ids: list[Any], entries: Any) -> list[Any]:
    """The logprob of each output id, from its [logprob, token_id, text] entry."""
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        raise InvalidEngineAnswer("SGLang returned output_token_logprobs not aligned with output_ids")
    # Each entry a list of at least two items whose second is its output id, read by two list
    # comprehensions rather than a Python test per token.
    if (
        set(map(type, entries)) <= {list}
        and min(map(len, entries), default=2) >= 2
        and [entry[1] for entry in entries] == output_ids
    ):
        return [entry[0] for entry in entries]
    raise InvalidEngineAnswer("SGLang returned a logprob entry that does not match its output id")


def _request_payload(
    input_ids: PromptIds, params: SamplingParams, rid: str, *, stream: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "input_ids": json_value(input_ids),
        "sampling_params": params.as_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
        # Fixed-length unique ids: SGLang aborts by rid prefix.
        "rid": rid,
    }
    if params.top_logprobs:
        payload["top_logprobs_num"] = params.top_logprobs
    if params.adapter is not None:
        payload["lora_path"] = params.adapter  # a loaded adapter's name (SGLang's LoRA registry)
    if params.routed_experts is not None:
        payload["return_routed_experts"] = True
        payload["routed_experts_start_len"] = params.routed_experts.start
    return payload


def _routed_experts(meta: dict[str, Any], ask: ExpertsAsk | None, end: int) -> RoutedExperts | None:
    """The routed experts asked for, over positions [ask.start, end); None when the server sent none
    (it runs without --enable-return-routed-experts): the call is recorded without them."""
    if ask is None or meta.get("routed_experts") is None:
        return None
    return from_sglang(meta["routed_experts"], ask, end)


def _check_whole(output_ids: list[Any], meta: dict[str, Any]) -> None:
    """Ids missing from an answer would leave a turn recorded as ended where the model did not end
    it: `completion_tokens` counts them all. (How the output ends, on its stop token, is checked
    for every engine: proxy/engines/checked.py.)"""
    total = meta.get("completion_tokens")
    if total is not None and total != len(output_ids):
        raise InvalidEngineAnswer(
            f"SGLang returned {len(output_ids)} output ids with completion_tokens {total}"
        )


def parse_generation(
    body: Any, *, top_logprobs: bool = False, experts: ExpertsAsk | None = None, prompt_len: int = 0
) -> Generation:
    """Turn one /generate response object into a Generation, checking every field we rely on."""
    if not isinstance(body, dict):
        raise InvalidEngineAnswer("SGLang returned a non-object response")
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(output_ids, list):
        raise InvalidEngineAnswer("SGLang response lacks output_ids or meta_info")
    _raise_if_refused(meta.get("finish_reason"))
    _check_whole(output_ids, meta)
    logprobs = _aligned_logprobs(output_ids, meta.get("output_token_logprobs"))
    version = meta.get("weight_version")
    cached = meta.get("cached_tokens")
    kept_meta = {
        k: meta[k]
        for k in ("id", "prompt_tokens", "completion_tokens", "e2e_latency", "weight_versions")
        if k in meta
    }
    return Generation(
        output_ids=output_ids,
        logprobs=logprobs,
        finish=_finish_reason(meta.get("finish_reason")),
        weight_version=str(version) if version is not None else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        meta=kept_meta,
        top_logprobs=_top_logprobs(meta.get("output_top_logprobs"), len(output_ids))
        if top_logprobs
        else None,
        routed_experts=_routed_experts(meta, experts, prompt_len + len(output_ids) - 1),
    )


class SGLangEngine:
    """An SGLang server (or anything speaking its /generate protocol) over HTTP."""

    name = "sglang"
    supports_constraints = True
    limits = SGLANG_LIMITS
    supports_routed_experts = True  # with --enable-return-routed-experts on the server

    def __init__(self, base_url: str, *, timeout_s: float, router: bool = False) -> None:
        self._base_url = base_url.rstrip("/")
        # Behind sglang-router: calls carry the session's routing key, aborts reach every worker.
        self.router = router
        # A generation may take long; what must not is the wait for its next bytes.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=10.0, sock_read=timeout_s)
        self._timeout_s = timeout_s
        self._client: aiohttp.ClientSession | None = None  # streams and the other routes
        self._plain: EngineHTTP | None = None  # plain generations, the hot path

    def _url(self, path: str) -> URL:
        return URL(self._base_url + path)

    def _session(self) -> aiohttp.ClientSession:
        # Opened on first use, inside the event loop that serves the requests.
        if self._client is None:
            connector = aiohttp.TCPConnector(limit=1024, keepalive_timeout=_KEEPALIVE_S)
            self._client = aiohttp.ClientSession(connector=connector, timeout=self._timeout)
        return self._client

    def _http(self) -> EngineHTTP:
        if self._plain is None:
            self._plain = EngineHTTP(self._base_url, engine="the engine", timeout_s=self._timeout_s)
        return self._plain

    def _headers(self, affinity: str | None) -> dict[str, str]:
        headers = {"content-type": "application/json"}
        if self.router and affinity is not None:
            headers.update(sglang_router.routing_headers(affinity))
        return headers

    async def _raise_for_status(self, response: Stream, params: SamplingParams) -> None:
        if response.status == 200:
            return
        try:
            content = await response.read()
        except (TimeoutError, AnswerCut):
            content = b""
        finally:
            response.release()
        raise _adapter_refusal(refusal(response.status, _error_message(response.status, content)), params)

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        payload = _request_payload(input_ids, params, request_id or uuid.uuid4().hex, stream=False)
        answer = await self._http().post("/generate", request_json(payload), self._headers(affinity))
        if answer.status != 200:
            message = _error_message(answer.status, answer.body)
            raise _adapter_refusal(refusal(answer.status, message), params)
        body = json_answer(answer.body, "the engine")
        if isinstance(body, list):
            if len(body) != 1:
                raise EngineError(f"the engine answered {len(body)} outputs for one prompt")
            body = body[0]
        try:
            return parse_generation(
                body,
                top_logprobs=params.top_logprobs > 0,
                experts=params.routed_experts,
                prompt_len=len(input_ids),
            )
        except InvalidRequest as exc:
            raise _adapter_refusal(exc, params) from exc

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        payload = _request_payload(input_ids, params, request_id, stream=True)
        response = await self._http().open("/generate", request_json(payload), self._headers(affinity))
        await self._raise_for_status(response, params)
        if not response.content_type.startswith("text/event-stream"):
            response.close()
            raise EngineError(
                "the engine answered a stream request with malformed JSON, not server-sent events"
            )
        return self._chunks(response, top_logprobs=params.top_logprobs > 0, experts=(params, len(input_ids)))

    async def _chunks(
        self,
        response: Stream,
        *,
        top_logprobs: bool,
        experts: tuple[SamplingParams, int],
    ) -> AsyncIterator[StreamChunk]:
        held = 0  # output ids received so far
        finished = False
        try:
            async for line in lines_of(response.blocks()):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    finished = True
                    return
                try:
                    body = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise EngineError("the engine streamed malformed JSON") from exc
                if isinstance(body, dict) and "error" in body:
                    raise _adapter_refusal(_stream_error(body["error"]), experts[0])
                try:
                    chunk, held = _stream_chunk(body, held, top_logprobs=top_logprobs, experts=experts)
                except InvalidRequest as exc:
                    raise _adapter_refusal(exc, experts[0]) from exc
                if chunk.finish is not None:
                    finished = True
                yield chunk
                if finished:
                    return
        except TimeoutError as exc:
            raise EngineTimeout("the engine stream stalled past the timeout") from exc
        except AnswerCut as exc:
            raise EngineError(f"the engine stream was cut: {exc}") from exc
        finally:
            # An unfinished stream closes its connection: SGLang aborts a request whose client left.
            if finished:
                response.release()
            else:
                response.close()
        raise EngineError("the engine stream ended without a finish reason")

    async def abort(self, request_id: str) -> None:
        # Best effort: the request also ends when its connection closes.
        await self._abort({"rid": request_id, "abort_all": False})

    async def abort_all(self) -> None:
        """Abort every request on the server (a trainer's pause with abort): each ends "abort" with the
        tokens it has, which the resuming wrapper continues after the pause."""
        await self._abort({"rid": "", "abort_all": True})

    async def _abort(self, body: dict[str, Any]) -> None:
        status = await self._post_abort(self._url("/abort_request"), body)
        if self.router and status == 404:
            # A router without the route (sgl-model-gateway up to its abort fan-out): the proxy sends
            # the abort to every worker itself; rids are unique, so only the one running it acts.
            await sglang_router.abort_on_workers(self._session(), self._base_url, body)

    async def _post_abort(self, url: URL, body: dict[str, Any]) -> int:
        """The status of one /abort_request; 0 when nothing answered."""
        with contextlib.suppress(TimeoutError, aiohttp.ClientError):
            async with self._session().post(
                url,
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=5.0),
            ) as response:
                await response.read()
                return response.status
        return 0

    async def _get_json(self, path: str) -> Any | None:
        """The JSON body of a GET, or None when the route answers another 2xx-4xx (an older server
        without it). A 5xx is a server not ready (a router with no worker up yet): unavailable."""
        async with self._session().get(self._url(path)) as response:
            if response.status >= 500:
                raise EngineUnavailable(f"{self._url(path)} answered {response.status}: not ready")
            if response.status != 200:
                return None
            return orjson.loads(await response.read())

    async def info(self) -> EngineInfo:
        model = "unknown"
        context_length: int | None = None
        weight_version: str | None = None
        try:
            models = await self._get_json("/v1/models")
            data = (models.get("data") if isinstance(models, dict) else None) or []
            if data:
                model = str(data[0].get("id", model))
                raw_len = data[0].get("max_model_len")
                context_length = raw_len if isinstance(raw_len, int) else None
            model_info = await self._get_json("/model_info")
            if isinstance(model_info, dict):
                weight_version = model_info.get("weight_version")
        except TimeoutError as exc:
            raise EngineTimeout("the engine did not answer its info routes in time") from exc
        except (aiohttp.ClientError, orjson.JSONDecodeError, AttributeError) as exc:
            raise EngineUnavailable(f"cannot read the engine's info at {self._base_url}: {exc}") from exc
        return EngineInfo(model=model, context_length=context_length, weight_version=weight_version)

    async def adapters(self) -> dict[str, str]:
        """The LoRA adapters the server has loaded, name -> path: the `/v1/models` cards with a
        `parent` (SGLang lists its LoRA registry there, as vLLM does)."""
        try:
            models = await self._get_json("/v1/models")
        except TimeoutError as exc:
            raise EngineTimeout("the engine did not list its models in time") from exc
        except (aiohttp.ClientError, orjson.JSONDecodeError) as exc:
            raise EngineUnavailable(f"cannot list the engine's models at {self._base_url}: {exc}") from exc
        return adapter_cards(models)

    async def ready(self) -> bool:
        # /ready answers without generating; /health (a one-token generation) where /ready is
        # missing, as behind sglang-router.
        quick = aiohttp.ClientTimeout(total=5.0)
        try:
            async with self._session().get(self._url("/ready"), timeout=quick) as response:
                status = response.status
            if status == 404:
                async with self._session().get(self._url("/health"), timeout=quick) as response:
                    status = response.status
        except (TimeoutError, aiohttp.ClientError):
            return False
        return status == 200

    async def aclose(self) -> None:
        if self._plain is not None:
            await self._plain.aclose()
        if self._client is not None:
            await self._client.close()


def adapter_cards(models: Any) -> dict[str, str]:
    """The adapters of an OpenAI model list: cards with a `parent` (SGLang and vLLM list LoRA adapters
    as {"id": name, "root": path, "parent": base model})."""
    data = models.get("data") if isinstance(models, dict) else None
    return {
        str(card["id"]): str(card.get("root") or card["id"])
        for card in data or []
        if isinstance(card, dict) and card.get("parent") is not None and card.get("id")
    }


def _stream_error(error: Any) -> ProxyError:
    """An error event in a stream: {"message", "type", "code": <HTTP status>}, SGLang's errors found
    after the stream began (measured); answered as the same error unstreamed."""
    message = str(error.get("message") if isinstance(error, dict) else error)
    code = error.get("code") if isinstance(error, dict) else None
    if type(code) is int and code >= 400:
        return refusal(code, message)
    return EngineError(f"the engine failed mid-stream: {message}")


async def lines_of(blocks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The lines of a body read in blocks, however long (aiohttp's own line reader stops at 64 KiB)."""
    partial = bytearray()  # the start of a line whose end has not arrived
    async for block in blocks:
        start = 0
        while (end := block.find(b"\n", start)) >= 0:
            if partial:
                partial += block[start:end]
                yield bytes(partial)
                partial.clear()
            else:
                yield block[start:end]
            start = end + 1
        partial += block[start:]
        if len(partial) > _MAX_STREAM_LINE:
            raise EngineError("the engine streamed a line longer than 64 MiB")
    if partial:
        yield bytes(partial)


def _repeats_last(finish: Any, total: Any, held: int, ids: list[Any]) -> bool:
    """SGLang's chunk for a request aborted while it waited (a retracted one, at a weight sync's
    abort): the last id again, with completion_tokens counting only what was held. Nothing new."""
    aborted = isinstance(finish, dict) and finish.get("type") == "abort"
    return aborted and held > 0 and total == held and len(ids) <= 1


def _cumulative(total: Any, held: int, size: int) -> bool:
    """Whether a chunk of `size` ids is the whole output so far (SGLang's default) rather than its
    next part (--incremental-streaming-output), told by `completion_tokens`, the output's length so
    far in both. A chunk that is neither (no count, a shrinking output, ids missing) would put tokens
    the engine never sampled into the record: refused."""
    if not isinstance(total, int) or isinstance(total, bool):
        raise InvalidEngineAnswer("the engine streamed a chunk without completion_tokens")
    if total == size and size >= held:
        return True
    if total == held + size:
        return False
    raise InvalidEngineAnswer(
        f"the engine streamed {size} output ids with completion_tokens {total} after {held}: "
        "neither the whole output so far nor its next part"
    )


def _stream_chunk(
    body: Any, held: int, *, top_logprobs: bool, experts: tuple[SamplingParams, int] | None = None
) -> tuple[StreamChunk, int]:
    """One SSE chunk as new ids: SGLang sends cumulative output by default, deltas with
    --incremental-streaming-output; completion_tokens is cumulative in both."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise InvalidEngineAnswer("the engine streamed a chunk without meta_info")
    meta = body["meta_info"]
    raw_finish = meta.get("finish_reason")
    _raise_if_refused(raw_finish)  # its output id 0 is no sampled token
    ids = body.get("output_ids") or []
    entries = meta.get("output_token_logprobs") or []
    if not isinstance(ids, list) or not isinstance(entries, list):
        raise InvalidEngineAnswer("the engine streamed output_ids or logprobs that are not lists")
    raw_top = meta.get("output_top_logprobs") or []
    if _repeats_last(raw_finish, meta.get("completion_tokens"), held, ids):
        new_ids, new_entries, raw_top = [], [], []
    elif _cumulative(meta.get("completion_tokens"), held, len(ids)):
        new_ids, new_entries, raw_top = ids[held:], entries[held:], raw_top[held:]
    else:
        new_ids, new_entries = ids, entries
    top = _top_logprobs(raw_top, len(new_ids)) if top_logprobs else None
    version = meta.get("weight_version")
    chunk = StreamChunk(
        output_ids=new_ids,
        logprobs=_aligned_logprobs(new_ids, new_entries),
        finish=_finish_reason(raw_finish) if raw_finish is not None else None,
        weight_version=str(version) if version is not None else None,
        meta={
            k: meta[k] for k in ("id", "prompt_tokens", "completion_tokens", "weight_versions") if k in meta
        },
        top_logprobs=top,
    )
    if experts is not None and raw_finish is not None:  # sent with the last chunk, over the whole output
        params, prompt_len = experts
        total_ids = held + len(new_ids)
        chunk = replace(
            chunk, routed_experts=_routed_experts(meta, params.routed_experts, prompt_len + total_ids - 1)
        )
    return chunk, held + len(new_ids)


def _adapter_refusal(error: ProxyError, params: SamplingParams) -> ProxyError:
    """SGLang's refusal of a LoRA adapter (not loaded, or LoRA off) names the adapter the request
    asked for: a clear 404 for that name, never an answer from the base weights."""
    if params.adapter is None or not isinstance(error, InvalidRequest) or "lora" not in error.message.lower():
        return error
    return ModelNotFound(
        f"the engine does not serve the LoRA adapter {params.adapter!r} (any more): {error.message}"
    )
