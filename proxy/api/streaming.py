"""Server-sent events for `stream: true`, driven by the engine's own stream.

Content, reasoning and tool-call deltas are sent as tokens arrive (proxy/chat/streaming.py keeps
them prefixes of the final parse). The turn is committed before the chunk carrying finish_reason
is sent. A client that goes away aborts the engine request, and the turn is recorded as aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import anyio
import orjson

from proxy.chat.streaming import StreamedMessage
from proxy.engines.base import Engine, FinishReason, Generation, StreamChunk
from proxy.errors import ProxyError
from proxy.turns import PreparedTurn, TurnRunner

log = logging.getLogger("tito_proxy.stream")


def _sse(payload: dict[str, Any] | str) -> bytes:
    body = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {body}\n\n".encode()


class ChunkWriter:
    def __init__(self, completion_id: str, model: str) -> None:
        self.base = {
            "id": completion_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": model,
        }

    def delta(self, delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return _sse({**self.base, "choices": [choice]})

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return _sse({**self.base, "choices": [], "usage": usage})


async def sse_events(
    *,
    turns: TurnRunner,
    engine: Engine,
    turn: PreparedTurn,
    chunks: AsyncIterator[StreamChunk],
    request_id: str,
    model: str,
    include_usage: bool,
    keepalive_s: float,
) -> AsyncIterator[bytes]:
    writer = ChunkWriter(f"chatcmpl-{request_id}", model)
    view = StreamedMessage(turns.parser, reasoning_open=turn.reasoning_open, stop_strings=turn.params.stop)
    ids: list[int] = []
    logprobs: list[float] = []
    version: str | None = None
    meta: dict[str, Any] = {}
    finished = False
    pending: asyncio.Future[StreamChunk] | None = None
    yield writer.delta({"role": "assistant", "content": ""})
    try:
        iterator = chunks.__aiter__()
        while True:
            pending = asyncio.ensure_future(iterator.__anext__())
            while not pending.done():
                # Waiting must not cancel the engine read: a timeout only sends a keepalive comment.
                await asyncio.wait({pending}, timeout=keepalive_s)
                if not pending.done():
                    yield b": keepalive\n\n"
            try:
                piece = pending.result()
            except StopAsyncIteration:
                break
            ids += piece.output_ids
            logprobs += piece.logprobs
            version = piece.weight_version or version
            meta.update(piece.meta)
            if piece.finish is None:
                delta = view.update(turns.output_text(ids, None))
                if delta:
                    yield writer.delta(delta)
            else:
                # The last chunk's text goes out from the final parse (view.finish), never twice.
                generation = Generation(ids, logprobs, piece.finish, weight_version=version, meta=meta)
                result = await turns.record(turn, generation)  # committed before finish_reason goes out
                finished = True
                if piece.finish.kind == "abort":
                    error = {
                        "message": f"the engine aborted the request: {piece.finish.message}",
                        "type": "engine_error",
                        "param": None,
                        "code": "engine_aborted",
                    }
                    yield _sse({"error": error})
                    break
                text_delta, call_deltas = view.finish(result.output)
                if view.diverged:
                    log.warning(
                        "session %s: streamed text is not a prefix of the final parse", turn.session_id
                    )
                if text_delta:
                    yield writer.delta(text_delta)
                for call_delta in call_deltas:
                    yield writer.delta({"tool_calls": [call_delta]})
                yield writer.delta({}, finish_reason=result.finish_reason)
                if include_usage:
                    yield writer.usage(result.prompt_tokens, result.completion_tokens)
                break
    except ProxyError as exc:
        yield _sse(exc.envelope())
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        if not finished:
            # The client left or the engine failed: stop sampling, and keep what was sampled as aborted.
            with anyio.CancelScope(shield=True):
                await engine.abort(request_id)
                if ids:
                    partial = Generation(
                        ids,
                        logprobs,
                        FinishReason("abort", message="stream not completed"),
                        weight_version=version,
                        meta=meta,
                    )
                    await turns.record(turn, partial, status="aborted")
    yield _sse("[DONE]")
