"""Client for SGLang's native /generate, speaking token ids in and out."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import orjson

from proxy.engines.base import (
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
    TopLogprobs,
)
from proxy.errors import EngineError, EngineTimeout, EngineUnavailable, InvalidRequest


def _error_message(response: httpx.Response) -> str:
    # SGLang answers errors as {"error": "text"} or {"error": {"message": "text"}}.
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, str):
        return error
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return str(error["message"])
    return str(body)[:500]


def _finish_reason(raw: Any) -> FinishReason:
    if not isinstance(raw, dict):
        raise EngineError(f"SGLang returned an unexpected finish_reason: {raw!r}")
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
    raise EngineError(f"SGLang returned an unknown finish_reason type: {kind!r}")


def _top_logprobs(raw: Any, count: int) -> list[TopLogprobs]:
    """`output_top_logprobs`: per position, a list of [logprob, token_id, text] entries."""
    if not isinstance(raw, list) or len(raw) != count:
        raise EngineError("SGLang response has no output_top_logprobs aligned with output_ids")
    positions: list[TopLogprobs] = []
    for entries in raw:
        if not isinstance(entries, list) or not all(
            isinstance(e, list) and len(e) >= 2 and isinstance(e[0], int | float) and isinstance(e[1], int)
            for e in entries
        ):
            raise EngineError("SGLang returned a malformed top-logprob entry")
        positions.append([(int(e[1]), float(e[0])) for e in entries])
    return positions


def _json(payload: dict[str, Any]) -> bytes:
    # A 32k-token prompt array is written straight from numpy, without a Python list in between.
    return orjson.dumps(payload, option=orjson.OPT_SERIALIZE_NUMPY)


def _request_payload(
    input_ids: PromptIds, params: SamplingParams, rid: str, *, stream: bool
) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "input_ids": input_ids,
        "sampling_params": params.as_sglang(),
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
        # Fixed-length unique ids: SGLang aborts by rid prefix.
        "rid": rid,
    }
    if params.top_logprobs:
        payload["top_logprobs_num"] = params.top_logprobs
    return payload


def parse_generation(body: Any, *, top_logprobs: bool = False) -> Generation:
    """Turn one /generate response object into a Generation, checking every field we rely on."""
    if not isinstance(body, dict):
        raise EngineError("SGLang returned a non-object response")
    meta = body.get("meta_info")
    output_ids = body.get("output_ids")
    if not isinstance(meta, dict) or not isinstance(output_ids, list):
        raise EngineError("SGLang response lacks output_ids or meta_info")
    entries = meta.get("output_token_logprobs")
    if not isinstance(entries, list) or len(entries) != len(output_ids):
        raise EngineError("SGLang response has no output_token_logprobs aligned with output_ids")
    logprobs: list[float] = []
    for token_id, entry in zip(output_ids, entries, strict=True):
        if not isinstance(entry, list) or len(entry) < 2 or entry[1] != token_id:
            raise EngineError("SGLang logprob entry does not match its output id")
        value = entry[0]
        if not isinstance(value, int | float):
            raise EngineError("SGLang returned a non-numeric logprob for an output token")
        logprobs.append(float(value))
    if not all(isinstance(t, int) for t in output_ids):
        raise EngineError("SGLang returned non-integer output ids")
    version = meta.get("weight_version")
    cached = meta.get("cached_tokens")
    kept_meta = {
        k: meta[k]
        for k in ("id", "prompt_tokens", "completion_tokens", "e2e_latency", "weight_versions")
        if k in meta
    }
    return Generation(
        output_ids=list(output_ids),
        logprobs=logprobs,
        finish=_finish_reason(meta.get("finish_reason")),
        weight_version=str(version) if version is not None else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        meta=kept_meta,
        top_logprobs=_top_logprobs(meta.get("output_top_logprobs"), len(output_ids))
        if top_logprobs
        else None,
    )


class SGLangEngine:
    """An SGLang server (or anything speaking its /generate protocol) over HTTP."""

    name = "sglang"
    supports_constraints = True

    def __init__(self, base_url: str, *, timeout_s: float, transport: httpx.AsyncBaseTransport | None = None):
        self._client = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            transport=transport,
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256),
        )

    async def _post(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        try:
            return await self._client.post(
                path, content=_json(payload), headers={"content-type": "application/json"}
            )
        except httpx.TimeoutException as exc:
            raise EngineTimeout(f"the engine did not answer {path} in time") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"cannot reach the engine at {self._client.base_url}: {exc}") from exc

    async def generate(self, input_ids: PromptIds, params: SamplingParams) -> Generation:
        payload = _request_payload(input_ids, params, uuid.uuid4().hex, stream=False)
        response = await self._post("/generate", payload)
        if response.status_code == 400:
            raise InvalidRequest(
                f"the engine rejected the request: {_error_message(response)}", code="engine_rejected"
            )
        if response.status_code == 503:
            raise EngineUnavailable(f"the engine is not ready: {_error_message(response)}")
        if response.status_code != 200:
            raise EngineError(f"the engine answered HTTP {response.status_code}: {_error_message(response)}")
        try:
            body = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise EngineError("the engine answered with malformed JSON") from exc
        if isinstance(body, list):
            if len(body) != 1:
                raise EngineError(f"the engine answered {len(body)} outputs for one prompt")
            body = body[0]
        return parse_generation(body, top_logprobs=params.top_logprobs > 0)

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str
    ) -> AsyncIterator[StreamChunk]:
        payload = _request_payload(input_ids, params, request_id, stream=True)
        request = self._client.build_request(
            "POST", "/generate", content=_json(payload), headers={"content-type": "application/json"}
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise EngineTimeout("the engine did not answer /generate in time") from exc
        except httpx.TransportError as exc:
            raise EngineUnavailable(f"cannot reach the engine at {self._client.base_url}: {exc}") from exc
        if response.status_code != 200:
            await response.aread()
            await response.aclose()
            if response.status_code == 400:
                raise InvalidRequest(
                    f"the engine rejected the request: {_error_message(response)}", code="engine_rejected"
                )
            if response.status_code == 503:
                raise EngineUnavailable(f"the engine is not ready: {_error_message(response)}")
            raise EngineError(f"the engine answered HTTP {response.status_code}: {_error_message(response)}")
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            await response.aclose()
            raise EngineError(
                "the engine answered a stream request with malformed JSON, not server-sent events"
            )
        return self._chunks(response, top_logprobs=params.top_logprobs > 0)

    async def _chunks(self, response: httpx.Response, *, top_logprobs: bool) -> AsyncIterator[StreamChunk]:
        held = 0  # output ids received so far
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                try:
                    body = orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise EngineError("the engine streamed malformed JSON") from exc
                if isinstance(body, dict) and "error" in body:
                    error = body["error"]
                    message = error.get("message") if isinstance(error, dict) else str(error)
                    raise EngineError(f"the engine failed mid-stream: {message}")
                chunk, held = _stream_chunk(body, held, top_logprobs=top_logprobs)
                yield chunk
                if chunk.finish is not None:
                    return
        except httpx.TimeoutException as exc:
            raise EngineTimeout("the engine stream stalled past the timeout") from exc
        except httpx.TransportError as exc:
            raise EngineError(f"the engine stream was cut: {exc}") from exc
        finally:
            await response.aclose()
        raise EngineError("the engine stream ended without a finish reason")

    async def abort(self, request_id: str) -> None:
        # Best effort: the request also ends when its connection closes.
        with contextlib.suppress(httpx.HTTPError):
            await self._client.post(
                "/abort_request", json={"rid": request_id, "abort_all": False}, timeout=5.0
            )

    async def info(self) -> EngineInfo:
        model = "unknown"
        context_length: int | None = None
        weight_version: str | None = None
        try:
            models = await self._client.get("/v1/models")
            if models.status_code == 200:
                data = models.json().get("data") or []
                if data:
                    model = str(data[0].get("id", model))
                    raw_len = data[0].get("max_model_len")
                    context_length = raw_len if isinstance(raw_len, int) else None
            model_info = await self._client.get("/model_info")
            if model_info.status_code == 200:
                weight_version = model_info.json().get("weight_version")
        except httpx.TimeoutException as exc:
            raise EngineTimeout("the engine did not answer its info routes in time") from exc
        except (httpx.TransportError, ValueError) as exc:
            raise EngineUnavailable(
                f"cannot read the engine's info at {self._client.base_url}: {exc}"
            ) from exc
        return EngineInfo(model=model, context_length=context_length, weight_version=weight_version)

    async def ready(self) -> bool:
        # /ready answers without generating; /health (a one-token generation) where /ready is
        # missing, as behind sglang-router.
        try:
            response = await self._client.get("/ready", timeout=5.0)
            if response.status_code == 404:
                response = await self._client.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def aclose(self) -> None:
        await self._client.aclose()


def _stream_chunk(body: Any, held: int, *, top_logprobs: bool) -> tuple[StreamChunk, int]:
    """One SSE chunk as new ids: SGLang sends cumulative output by default, deltas with
    --incremental-streaming-output; completion_tokens is cumulative in both."""
    if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
        raise EngineError("the engine streamed a chunk without meta_info")
    meta = body["meta_info"]
    ids = body.get("output_ids") or []
    entries = meta.get("output_token_logprobs") or []
    total = meta.get("completion_tokens")
    cumulative = isinstance(total, int) and total == len(ids) and len(ids) >= held
    new_ids, new_entries = (ids[held:], entries[held:]) if cumulative else (ids, entries)
    top: list[TopLogprobs] | None = None
    if top_logprobs:
        raw_top = meta.get("output_top_logprobs") or []
        top = _top_logprobs(raw_top[held:] if cumulative else raw_top, len(new_ids))
    if len(new_entries) != len(new_ids) or any(
        not isinstance(e, list) or len(e) < 2 or e[1] != t for t, e in zip(new_ids, new_entries, strict=False)
    ):
        raise EngineError("the engine streamed logprobs that do not match its output ids")
    raw_finish = meta.get("finish_reason")
    version = meta.get("weight_version")
    chunk = StreamChunk(
        output_ids=[int(t) for t in new_ids],
        logprobs=[float(e[0]) for e in new_entries],
        finish=_finish_reason(raw_finish) if raw_finish is not None else None,
        weight_version=str(version) if version is not None else None,
        meta={
            k: meta[k] for k in ("id", "prompt_tokens", "completion_tokens", "weight_versions") if k in meta
        },
        top_logprobs=top,
    )
    return chunk, held + len(new_ids)
