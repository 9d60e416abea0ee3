"""Server-sent events for `stream: true`, driven by the engine's own stream.

Content, reasoning and tool-call deltas are sent as tokens arrive (proxy/chat/streaming.py keeps
them prefixes of the final parse). Each turn is committed before the chunk carrying its
finish_reason is sent. A client that goes away aborts the engine request, and the turn is recorded
as aborted. With n > 1 every choice streams from its own engine request, chunks interleaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import anyio
import orjson

from proxy.api.logprobs import TextOffsets, answered_positions, chat_logprobs, completion_logprobs
from proxy.api.schemas import SamplingRequest
from proxy.chat.parsing import OutputParser
from proxy.chat.streaming import StreamedMessage
from proxy.chat.token_pieces import TokenPieces
from proxy.engines.base import Engine, FinishReason, Generation, StreamChunk, TopLogprobs
from proxy.errors import EngineError, InvalidEngineAnswer, ProxyError
from proxy.turns import PreparedTurn, TurnResult, TurnRunner

log = logging.getLogger("tito_proxy.stream")

_DONE = object()


def sse(payload: dict[str, Any] | str) -> bytes:
    body = payload if isinstance(payload, str) else orjson.dumps(payload).decode()
    return f"data: {body}\n\n".encode()


class ErrorEvent(bytes):
    """An error event: the stream ends with it, every choice's (OpenAI's streams send nothing after
    one, and an SDK raises at it: a choice finished after it would be recorded but never read)."""


@dataclass(frozen=True)
class StreamOptions:
    model: str
    include_usage: bool
    keepalive_s: float
    top_logprobs: int | None  # None: no logprobs requested

    @classmethod
    def of(cls, body: SamplingRequest, *, keepalive_s: float, top_logprobs: int | None) -> StreamOptions:
        return cls(
            model=body.model,
            include_usage=bool((body.stream_options or {}).get("include_usage")),
            keepalive_s=keepalive_s,
            top_logprobs=top_logprobs,
        )


class ChunkWriter:
    """Chunks of a chat completion stream."""

    object_name = "chat.completion.chunk"
    logprobs_shape = staticmethod(chat_logprobs)
    # Request fields the dialect names otherwise than the turn core (an error's `param`).
    field_names: ClassVar[dict[str, str]] = {}

    def __init__(self, completion_id: str, model: str, *, include_usage: bool = False) -> None:
        self.base: dict[str, Any] = {
            "id": completion_id,
            "object": self.object_name,
            "created": int(time.time()),
            "model": model,
        }
        if include_usage:
            # OpenAI's stream_options.include_usage: every chunk before the usage one has usage null.
            self.base["usage"] = None

    def delta(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        *,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.base, "choices": [choice]})

    def error(self, envelope: dict[str, Any]) -> bytes:
        """An error event, its `param` named as the dialect's request names it."""
        error = envelope["error"]
        param = error.get("param")
        if param in self.field_names:
            envelope = {**envelope, "error": {**error, "param": self.field_names[param]}}
        return ErrorEvent(sse(envelope))

    def usage(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        return sse({**self.base, "choices": [], "usage": usage})


# The turn core names request fields as chat does; a legacy completion's prompt is `prompt`.
COMPLETION_FIELD_NAMES = {"messages": "prompt"}


class TextChunkWriter(ChunkWriter):
    """Chunks of a legacy text completion stream: `text` instead of a delta, no role chunk."""

    object_name = "text_completion"
    logprobs_shape = staticmethod(completion_logprobs)
    field_names = COMPLETION_FIELD_NAMES

    def delta(
        self,
        delta: dict[str, Any],
        finish_reason: str | None = None,
        *,
        index: int = 0,
        logprobs: dict[str, Any] | None = None,
    ) -> bytes:
        text = delta.get("content") or ""
        if not text and finish_reason is None and logprobs is None:
            return b""
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse({**self.base, "choices": [choice]})


def _writer(completion_id: str, options: StreamOptions, *, text_completion: bool) -> ChunkWriter:
    if text_completion:
        return TextChunkWriter(f"cmpl-{completion_id}", options.model, include_usage=options.include_usage)
    return ChunkWriter(f"chatcmpl-{completion_id}", options.model, include_usage=options.include_usage)


class _Logprobs:
    """The logprobs not yet sent, attached to whichever chunk of this choice goes out next."""

    def __init__(self, pieces: TokenPieces, top_count: int | None, writer: ChunkWriter) -> None:
        self.pieces = pieces
        self.top_count = top_count
        self.shape = writer.logprobs_shape
        self.sent = 0
        # A completion's text offsets run over the whole text, its characters split across chunks too.
        self.offsets = TextOffsets()

    def take(
        self, ids: Sequence[int], logprobs: Sequence[float], top: Sequence[TopLogprobs] | None, upto: int
    ) -> dict[str, Any] | None:
        if self.top_count is None or upto <= self.sent:
            return None
        start, self.sent = self.sent, upto
        shaped = self.shape(
            self.pieces,
            ids[start:upto],
            logprobs[start:upto],
            top[start:upto] if top is not None else None,
            self.top_count,
        )
        if "text_offset" in shaped:  # offsets into the whole completion's text, as unstreamed
            shaped["text_offset"] = self.offsets.of(self.pieces, ids[start:upto])
        return shaped


async def _choice_events(
    *,
    turns: TurnRunner,
    engine: Engine,
    turn: PreparedTurn,
    chunks: AsyncIterator[StreamChunk],
    request_id: str,
    writer: ChunkWriter,
    index: int,
    options: StreamOptions,
    pieces: TokenPieces,
    on_result: Callable[[TurnResult], None],
) -> AsyncIterator[bytes]:
    view = StreamedMessage(turn.parser, reasoning_open=turn.reasoning_open, stop_strings=turn.params.stop)
    pending_logprobs = _Logprobs(pieces, options.top_logprobs, writer)
    ids: list[int] = []
    logprobs: list[float] = []
    top: list[TopLogprobs] | None = [] if turn.params.top_logprobs else None
    version: str | None = None
    meta: dict[str, Any] = {}
    finished = False
    invalid = False  # the engine's answer failed the checks: nothing of it is recorded
    pending: asyncio.Future[StreamChunk] | None = None
    yield writer.delta({"role": "assistant", "content": ""}, index=index)
    try:
        iterator = chunks.__aiter__()
        while True:
            pending = asyncio.ensure_future(iterator.__anext__())
            while not pending.done():
                # Waiting must not cancel the engine read: a timeout only sends a keepalive comment.
                await asyncio.wait({pending}, timeout=options.keepalive_s)
                if not pending.done():
                    yield b": keepalive\n\n"
            try:
                piece = pending.result()
            except StopAsyncIteration:
                break
            if not ids and piece.output_ids and turns.metrics is not None:
                turns.metrics.ttft.observe(time.perf_counter() - turn.started)
            ids += piece.output_ids
            logprobs += piece.logprobs
            if top is not None and piece.top_logprobs is not None:
                top += piece.top_logprobs
            version = piece.weight_version or version
            meta.update(piece.meta)
            if piece.finish is None:
                delta = view.update(turns.output_text(ids, None))
                if delta:
                    yield writer.delta(
                        delta, index=index, logprobs=pending_logprobs.take(ids, logprobs, top, len(ids))
                    )
                continue
            # The last chunk's text goes out from the final parse (view.finish), never twice.
            generation = Generation(
                ids,
                logprobs,
                piece.finish,
                weight_version=version,
                meta=meta,
                top_logprobs=top,
                routed_experts=piece.routed_experts,  # the last chunk's, over the whole output
            )
            result = await turns.record(turn, generation, choice_index=index)  # committed first
            finished = True
            if piece.finish.kind == "abort":
                if turns.metrics is not None:  # as the plain path's EngineError is counted
                    turns.metrics.failed(502, "engine_aborted", True)
                error = {
                    "message": f"the engine aborted the request: {piece.finish.message}",
                    "type": "engine_error",
                    "param": None,
                    "code": "engine_aborted",
                }
                yield ErrorEvent(sse({"error": error}))
                break
            on_result(result)
            text_delta, call_deltas = view.finish(result.output)
            if view.diverged:
                log.warning("session %s: streamed text is not a prefix of the final parse", turn.session_id)
            rest = pending_logprobs.take(
                ids, logprobs, top, answered_positions(ids, piece.finish.matched_token)
            )
            if text_delta:
                yield writer.delta(text_delta, index=index, logprobs=rest)
                rest = None
            for call_delta in call_deltas:
                yield writer.delta({"tool_calls": [call_delta]}, index=index)
            yield writer.delta({}, finish_reason=result.finish_reason, index=index, logprobs=rest)
            break
    except ProxyError as exc:
        invalid = isinstance(exc, InvalidEngineAnswer)
        if turns.metrics is not None:
            turns.metrics.failed(exc.status_code, exc.code, isinstance(exc, EngineError))
        yield writer.error(exc.envelope())
    finally:
        if pending is not None and not pending.done():
            pending.cancel()
        if not finished:
            # The client left or the engine failed: stop sampling, and keep what was sampled as aborted
            # (unless the engine's answer failed the checks: none of it is kept).
            with anyio.CancelScope(shield=True):
                await engine.abort(request_id)
                if ids and not invalid:
                    partial = Generation(
                        ids,
                        logprobs,
                        FinishReason("abort", message="stream not completed"),
                        weight_version=version,
                        meta=meta,
                    )
                    try:
                        await turns.record(turn, partial, status="aborted", choice_index=index)
                    except ProxyError as exc:  # finished meanwhile, or the database is down
                        log.warning("session %s: aborted turn not recorded: %s", turn.session_id, exc.message)


async def open_streams(
    engine: Engine, turn: PreparedTurn, count: int, *, admission_wait_s: float
) -> list[tuple[str, AsyncIterator[StreamChunk]]]:
    """One engine stream per choice. Opening raises before any byte is sent when the engine refuses,
    also when it refuses in a stream's first event (SGLang's admission checks) that comes within
    `admission_wait_s`; the streams already opened are then aborted."""
    opened: list[tuple[str, AsyncIterator[StreamChunk]]] = []
    firsts: list[asyncio.Future[StreamChunk]] = []
    prompt = turn.plan.engine_prompt()
    try:
        for index in range(count):
            request_id = uuid.uuid4().hex  # fixed length: SGLang aborts by rid prefix
            params = turn.params.for_choice(index)
            chunks = await engine.stream(prompt, params, request_id, affinity=turn.session_id)
            opened.append((request_id, chunks))
        firsts = [asyncio.ensure_future(chunks.__anext__()) for _, chunks in opened]
        await asyncio.wait(firsts, timeout=admission_wait_s, return_when=asyncio.FIRST_EXCEPTION)
        for first in firsts:
            error = first.exception() if first.done() and not first.cancelled() else None
            if isinstance(error, ProxyError):
                raise error
    except BaseException:
        with anyio.CancelScope(shield=True):
            for first in firsts:
                await _settled(first)
            for request_id, chunks in opened:
                await engine.abort(request_id)
                await _closed(chunks)
        raise
    return [
        (request_id, _resumed(first, chunks))
        for (request_id, chunks), first in zip(opened, firsts, strict=True)
    ]


async def _resumed(
    first: asyncio.Future[StreamChunk], chunks: AsyncIterator[StreamChunk]
) -> AsyncIterator[StreamChunk]:
    """A stream whose first chunk was already asked for."""
    try:
        try:
            yield await first
        except StopAsyncIteration:
            return
        async for chunk in chunks:
            yield chunk
    finally:
        with anyio.CancelScope(shield=True):
            await _settled(first)
            await _closed(chunks)


async def _settled(future: asyncio.Future[Any]) -> None:
    """The future cancelled if it still runs, and done: its generator may then be closed."""
    if not future.done():
        future.cancel()
    with contextlib.suppress(BaseException):
        await future


async def _closed(chunks: AsyncIterator[StreamChunk]) -> None:
    if isinstance(chunks, AsyncGenerator):
        await chunks.aclose()


async def _merged(streams: list[AsyncIterator[bytes]]) -> AsyncIterator[bytes]:
    """Interleave the choices' events as they come; cancelling this cancels (and so aborts) them all."""
    queue: asyncio.Queue[object] = asyncio.Queue()

    async def pump(stream: AsyncIterator[bytes]) -> None:
        try:
            async for event in stream:
                await queue.put(event)
        finally:
            await queue.put(_DONE)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        running = len(tasks)
        while running:
            item = await queue.get()
            if item is _DONE:
                running -= 1
            elif isinstance(item, bytes):
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with anyio.CancelScope(shield=True):
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def sse_events(
    *,
    turns: TurnRunner,
    engine: Engine,
    turn: PreparedTurn,
    streams: list[tuple[str, AsyncIterator[StreamChunk]]],
    options: StreamOptions,
    pieces: TokenPieces,
    text_completion: bool = False,
) -> AsyncIterator[bytes]:
    """The whole event stream of one request: every choice, usage, then [DONE]."""
    writer = _writer(turn.request_id, options, text_completion=text_completion)
    results: list[TurnResult] = []
    choices = [
        _choice_events(
            turns=turns,
            engine=engine,
            turn=turn,
            chunks=chunks,
            request_id=request_id,
            writer=writer,
            index=index,
            options=options,
            pieces=pieces,
            on_result=results.append,
        )
        for index, (request_id, chunks) in enumerate(streams)
    ]
    events = choices[0] if len(choices) == 1 else _merged(choices)
    try:
        async for event in events:
            if event:
                yield event
            if isinstance(event, ErrorEvent):
                break
    finally:
        if isinstance(events, AsyncGenerator):  # an error ends the others: aborted, as a hang-up would
            await events.aclose()
    if options.include_usage and len(results) == len(streams):
        yield writer.usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results))
    yield sse("[DONE]")


async def replayed_events(
    results: Sequence[TurnResult],
    options: StreamOptions,
    pieces: TokenPieces,
    parser: OutputParser,
    *,
    text_completion: bool = False,
) -> AsyncIterator[bytes]:
    """A recorded answer streamed again (an idempotent retry): whole deltas, then finish and usage."""
    writer = _writer(results[0].request_id, options, text_completion=text_completion)
    for result in results:
        index = result.choice_index
        generation = result.generation
        role = writer.delta({"role": "assistant", "content": ""}, index=index)
        if role:
            yield role
        text_delta, call_deltas = StreamedMessage(parser).finish(result.output)
        upto = answered_positions(generation.output_ids, generation.finish.matched_token)
        logprobs = _Logprobs(pieces, options.top_logprobs, writer).take(
            generation.output_ids, generation.logprobs, generation.top_logprobs, upto
        )
        if text_delta:
            yield writer.delta(text_delta, index=index, logprobs=logprobs)
            logprobs = None
        for call_delta in call_deltas:
            yield writer.delta({"tool_calls": [call_delta]}, index=index)
        yield writer.delta({}, finish_reason=result.finish_reason, index=index, logprobs=logprobs)
    if options.include_usage:
        yield writer.usage(results[0].prompt_tokens, sum(r.completion_tokens for r in results))
    yield sse("[DONE]")
