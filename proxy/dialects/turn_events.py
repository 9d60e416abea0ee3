"""The turn core's answer as neutral events, for dialects that translate it into their own stream.

One choice per request. A streamed turn runs through the same engine stream, recording and
abort-on-disconnect as a chat stream (proxy/api/streaming.py); its chat deltas are read back here as
text, reasoning and tool-call events, so a dialect only decides how each one is written. A retry of
an answered request (same Idempotency-Key, or an SDK retry with the same body) replays the record.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from proxy.api.answering import run_watched
from proxy.api.retries import RetryIdentity, recorded_answer, replayed_results
from proxy.api.streaming import ChunkWriter, StreamOptions, _choice_events, open_streams
from proxy.app_state import AppState
from proxy.engines.base import StreamChunk
from proxy.errors import InvalidRequest, ProxyError
from proxy.store.repository import Repository
from proxy.turns import PreparedTurn, TurnRequest, TurnResult


@dataclass(frozen=True)
class Keepalive:
    """Nothing new for a while: the dialect may send its own ping."""


@dataclass(frozen=True)
class TextDelta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class ToolCallDelta:
    """A whole tool call: the core knows a call only once it is parsed."""

    index: int
    call_id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Failed:
    """A fault after the stream started: the partial turn is recorded as aborted."""

    error: dict[str, Any]


@dataclass(frozen=True)
class Finished:
    result: TurnResult


TurnEvent = Keepalive | TextDelta | ToolCallDelta | Failed | Finished


@dataclass
class _Calls:
    """Chat tool-call deltas (id and name, then arguments) gathered into whole calls."""

    open: dict[int, dict[str, str]] = field(default_factory=dict)

    def add(self, delta: dict[str, Any]) -> ToolCallDelta | None:
        index = int(delta["index"])
        if "id" in delta:
            self.open[index] = {"id": delta["id"], "name": delta["function"]["name"]}
            return None
        call = self.open.pop(index)
        return ToolCallDelta(index, call["id"], call["name"], delta["function"]["arguments"])


def _events_of_chunk(chunk: bytes) -> list[dict[str, Any] | None]:
    """The payloads of one chat SSE chunk; None for a keepalive comment."""
    if chunk.startswith(b":"):
        return [None]
    text = chunk.decode().removeprefix("data: ").strip()
    if text == "[DONE]":
        return []
    payload: dict[str, Any] = orjson.loads(text)
    return [payload]


def _translated(payload: dict[str, Any], calls: _Calls, results: list[TurnResult]) -> list[TurnEvent]:
    if "error" in payload:
        return [Failed(payload["error"])]
    events: list[TurnEvent] = []
    for choice in payload.get("choices", []):
        delta = choice.get("delta") or {}
        if delta.get("reasoning_content") or delta.get("content"):
            events.append(TextDelta(delta.get("reasoning_content") or "", delta.get("content") or ""))
        for call in delta.get("tool_calls") or []:
            whole = calls.add(call)
            if whole is not None:
                events.append(whole)
        if choice.get("finish_reason") is not None and results:
            events.append(Finished(results[0]))
    return events


async def streamed(
    state: AppState, session_id: str, request: TurnRequest
) -> tuple[int, str, AsyncGenerator[TurnEvent, None]]:
    """One turn sampled from the engine's stream: its prompt's length, the turn's request id, and its
    events (committed before `Finished`). Raises before any event when the request or the engine
    refuses."""
    turn = await state.turns.prepare(session_id, request)
    [(request_id, chunks)] = await open_streams(
        state.engine, turn, 1, admission_wait_s=state.settings.stream_keepalive_s
    )
    # The answer is named by the turn's request id (recorded, so a replay has it), as chat's streams
    # are; the engine stream's own id is for aborts.
    return len(turn.plan.prompt), turn.request_id, _streamed_events(state, turn, request_id, chunks)


async def _streamed_events(
    state: AppState, turn: PreparedTurn, request_id: str, chunks: AsyncIterator[StreamChunk]
) -> AsyncGenerator[TurnEvent, None]:
    results: list[TurnResult] = []
    options = StreamOptions(
        model=state.model_name,
        include_usage=False,
        keepalive_s=state.settings.stream_keepalive_s,
        top_logprobs=None,
    )
    inner = _choice_events(
        turns=state.turns,
        engine=state.engine,
        turn=turn,
        chunks=chunks,
        request_id=request_id,
        writer=ChunkWriter(request_id, state.model_name),
        index=0,
        options=options,
        pieces=state.pieces,
        on_result=results.append,
    )
    calls = _Calls()
    try:
        async for chunk in inner:
            for payload in _events_of_chunk(chunk):
                if payload is None:
                    yield Keepalive()
                    continue
                for event in _translated(payload, calls, results):
                    yield event
    finally:
        # A client that left: the inner stream aborts the engine request and records what it has.
        with anyio.CancelScope(shield=True):
            await inner.aclose()  # type: ignore[attr-defined]


def replayed(result: TurnResult) -> list[TurnEvent]:
    """A recorded answer as events: whole text, then its calls, then the end."""
    output = result.output
    events: list[TurnEvent] = []
    if output.reasoning_content or output.content:
        events.append(TextDelta(output.reasoning_content or "", output.content or ""))
    for index, call in enumerate(output.tool_calls):
        function = call["function"]
        events.append(ToolCallDelta(index, call["id"], function["name"], function["arguments"]))
    events.append(Finished(result))
    return events


async def _listed(events: list[TurnEvent]) -> AsyncGenerator[TurnEvent, None]:
    for event in events:
        yield event


@dataclass
class Answer:
    """What the core gave: results of a plain turn, or a stream of events; `replayed` for a retry.
    `request_id` names the answer (a retry answered from the record has the original's)."""

    results: list[TurnResult] | None = None
    events: AsyncGenerator[TurnEvent, None] | None = None
    prompt_tokens: int = 0
    replayed: bool = False
    request_id: str = ""


async def run_turn(
    state: AppState,
    session_id: str,
    request: TurnRequest,
    identity: RetryIdentity | None,
    *,
    stream: bool,
    exit_stack: contextlib.AsyncExitStack,
    client: Request | None = None,
) -> Answer:
    """Answer from the record for a retry, else sample; `exit_stack` holds the retry lock and the
    session's busy mark, and a stream takes them over (the caller releases them after the last
    event). `client` is watched for a disconnect while a plain turn samples."""
    exit_stack.enter_context(state.turns.busy(session_id))
    await exit_stack.enter_async_context(state.retries.hold(session_id, identity))
    if identity is not None:
        async with state.db_sessions() as db:
            since = state.retries.retry_since(identity)
            recorded = await recorded_answer(Repository(db), session_id, identity, since)
        if recorded is not None:
            results = replayed_results(recorded)
            if len(results) != 1:
                raise InvalidRequest("the recorded answer of this retry has a different number of choices")
            prompt_tokens, request_id = results[0].prompt_tokens, results[0].request_id
            if stream:
                events = _listed(replayed(results[0]))
                return Answer(None, events, prompt_tokens, replayed=True, request_id=request_id)
            return Answer(results, None, prompt_tokens, replayed=True, request_id=request_id)
    try:
        if stream:
            prompt_tokens, request_id, events = await streamed(state, session_id, request)
            return Answer(events=events, prompt_tokens=prompt_tokens, request_id=request_id)
        results = await run_watched(state, session_id, request, client)
    except ProxyError:
        if identity is not None:
            state.retries.attempt_failed(identity)
        raise
    return Answer(results=results, prompt_tokens=results[0].prompt_tokens, request_id=results[0].request_id)


async def answer_turn(
    state: AppState,
    session_id: str,
    request: TurnRequest,
    identity: RetryIdentity | None,
    *,
    stream: bool,
    client: Request,
    events: Callable[[Answer, contextlib.AsyncExitStack], AsyncIterator[bytes]],
    body: Callable[[TurnResult], Any],
) -> Response:
    """run_turn, answered in a dialect: its `events` as server-sent events, or its JSON `body` of the
    one result."""
    headers = {"X-Session-Id": session_id}
    exit_stack = contextlib.AsyncExitStack()
    try:
        answer = await run_turn(
            state, session_id, request, identity, stream=stream, exit_stack=exit_stack, client=client
        )
        if answer.replayed:
            headers["X-Tito-Replayed"] = "true"
        if answer.events is not None:
            # The retry lock now belongs to the stream: released after its last event.
            return StreamingResponse(
                events(answer, exit_stack.pop_all()),
                media_type="text/event-stream",
                headers={**headers, "Cache-Control": "no-cache"},
            )
    finally:
        await exit_stack.aclose()
    assert answer.results is not None
    # The recorded call, as chat names it: what POST /sessions/{id}/reward's call_rewards takes.
    headers["X-Tito-Call-Ids"] = str(answer.results[0].call_id)
    return Response(orjson.dumps(body(answer.results[0])), media_type="application/json", headers=headers)
