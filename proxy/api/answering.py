"""One request answered: from the record when it retries one already answered, else sampled, plain
or streamed. Shared by chat and text completions."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson
from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from proxy.api.retries import RetryIdentity, recorded_answer, replayed_results
from proxy.api.streaming import StreamOptions, open_streams, replayed_events, sse_events
from proxy.app_state import AppState
from proxy.errors import InvalidRequest, ProxyError
from proxy.store.repository import Repository
from proxy.turns import TurnRequest, TurnResult


def event_response(events: AsyncIterator[bytes], headers: dict[str, str]) -> StreamingResponse:
    return StreamingResponse(
        events, media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"}
    )


async def _held(events: AsyncIterator[bytes], exit_stack: contextlib.AsyncExitStack) -> AsyncIterator[bytes]:
    """The events, with the retry lock held until the last one is sent."""
    async with exit_stack:
        async for event in events:
            yield event


async def _hang_up(client: Request) -> None:
    """Returns when the client hangs up (its body is read: the next message is the disconnect)."""
    while (await client.receive())["type"] != "http.disconnect":
        pass


async def run_watched(
    state: AppState, session_id: str, request: TurnRequest, client: Request | None
) -> list[TurnResult]:
    """A plain turn; a client that hangs up before its answer aborts it (as a stream's does)."""
    if client is None:
        return await state.turns.run(session_id, request)
    # The one task a turn needs to hear a hang-up; the turn races its sampling against it.
    watcher = asyncio.create_task(_hang_up(client))
    try:
        return await state.turns.run(session_id, request, client_gone=watcher)
    finally:
        if watcher.done():  # the client left: whatever the watcher ended with is read, as before
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        else:
            # Not awaited: the answer goes out now, and the loop ends the watcher on its next pass
            # (waiting for that cost the turn a suspension and a wake-up).
            watcher.cancel()


async def retried_session(state: AppState, session: tuple[str, bool], identity: RetryIdentity | None) -> str:
    """The request's session; for an SDK retry that names none (the SDKs at /v1), its original's
    session, so that the retry waits for it there (its retry lock) and is answered from its record
    instead of being sampled again: an original still under way (in this process, else, by its
    claim, in another), else the newest one recorded."""
    session_id, unnamed = session
    if not unnamed or identity is None or not identity.is_sdk_retry or identity.idempotency_key:
        return session_id
    guard = state.retries
    running = guard.running_session(identity.lock_name)
    if running is None and guard.claims is not None:
        running = await guard.claims.claimed_session(identity.lock_name)
    if running is not None:
        return running
    async with state.db_sessions() as db:
        since = guard.retry_since(identity)
        return await Repository(db).session_of_request(identity.request_hash, since) or session_id


async def answer(
    state: AppState,
    session_id: str,
    request: TurnRequest,
    identity: RetryIdentity | None,
    *,
    stream: bool,
    options: StreamOptions,
    text_completion: bool,
    body_of: Callable[[Sequence[TurnResult]], dict[str, Any]],
    client: Request | None = None,
) -> Response:
    """`client`: the HTTP request, watched for a disconnect while a plain turn samples."""
    headers = {"X-Session-Id": session_id}
    if identity is None and not stream:
        # Nearly every turn: no retry identity to hold or look up, no lock to hand to a stream, so
        # no exit stack (entering and closing one cost more than the rest of this function).
        with state.turns.busy(session_id):
            results = await run_watched(state, session_id, request, client)
        return _answered(results, headers, body_of)
    exit_stack = contextlib.AsyncExitStack()
    exit_stack.enter_context(state.turns.busy(session_id))
    await exit_stack.enter_async_context(state.retries.hold(session_id, identity))
    try:
        recorded = None
        if identity is not None:
            async with state.db_sessions() as db:
                since = state.retries.retry_since(identity)
                recorded = await recorded_answer(Repository(db), session_id, identity, since)
        if recorded is not None:
            results = replayed_results(recorded)
            if len(results) != request.choices:
                raise InvalidRequest("the recorded answer of this retry has a different number of choices")
            headers["X-Tito-Replayed"] = "true"
            if stream:
                parser = state.turns.parser_for(request)
                return event_response(
                    replayed_events(results, options, state.pieces, parser, text_completion=text_completion),
                    headers,
                )
        elif stream:
            turn = await state.turns.prepare(session_id, request)
            streams = await open_streams(
                state.engine, turn, request.choices, admission_wait_s=options.keepalive_s
            )
            events = sse_events(
                turns=state.turns,
                engine=state.engine,
                turn=turn,
                streams=streams,
                options=options,
                pieces=state.pieces,
                text_completion=text_completion,
            )
            # The lock now belongs to the stream: a retry waits until this answer is recorded.
            held = _held(events, exit_stack.pop_all())
            return event_response(held, headers)
        else:
            results = await run_watched(state, session_id, request, client)
    except ProxyError:
        if identity is not None:
            state.retries.attempt_failed(identity)
        raise
    finally:
        await exit_stack.aclose()
    return _answered(results, headers, body_of)


def _answered(
    results: Sequence[TurnResult],
    headers: dict[str, str],
    body_of: Callable[[Sequence[TurnResult]], dict[str, Any]],
) -> Response:
    # The recorded calls, in choice order: what POST /sessions/{id}/reward's call_rewards names.
    headers["X-Tito-Call-Ids"] = ",".join(str(result.call_id) for result in results)
    # Serialized here, once, by orjson: FastAPI's encoder would walk the body in Python first.
    return Response(orjson.dumps(body_of(results)), media_type="application/json", headers=headers)
