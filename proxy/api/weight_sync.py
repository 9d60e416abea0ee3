"""Trainer routes for weight syncs: pause and resume generation, and the state of in-flight turns."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict

from proxy.api.deps import StateDep
from proxy.app_state import AppState
from proxy.engines.resuming import ResumingEngine
from proxy.errors import ProxyError

router = APIRouter(prefix="/admin", tags=["admin"])


class PauseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # False: in-flight generations finish; true: they are aborted now and continued after the resume.
    abort_in_flight: bool = False


def _engine(state: AppState) -> ResumingEngine:
    if not isinstance(state.engine, ResumingEngine):
        raise ProxyError("this proxy's engine has no pause gate")
    return state.engine


def _state(state: AppState, engine: ResumingEngine) -> dict[str, Any]:
    gate = engine.gate.state()
    if state.pool is None or len(state.pool.members) == 1:  # one engine: the shape it always had
        return {**gate, "engines": [{"name": engine.name, "in_flight": gate["in_flight"]}]}
    engines = [
        {
            "name": engine.name,
            "id": m["id"],
            "url": m["url"],
            "healthy": m["healthy"],
            "in_flight": m["in_flight"],
        }
        for m in state.pool.engines_report()
    ]
    return {**gate, "engines": engines}


@router.post("/pause")
async def pause(state: StateDep, body: PauseRequest | None = None) -> dict[str, Any]:
    engine = _engine(state)
    async with _told(state):
        engine.gate.pause()
        abort = body is not None and body.abort_in_flight
        if abort:
            await engine.abort_in_flight()
        if state.shared_pause is not None:  # every other process on the database follows
            await state.shared_pause.publish(paused=True, abort=abort)
    return _state(state, engine)


@router.post("/resume")
async def resume(state: StateDep) -> dict[str, Any]:
    engine = _engine(state)
    async with _told(state):
        await engine.refresh_version()  # the version the trainer just loaded, before anything samples
        if state.shared_pause is not None:
            await state.shared_pause.publish(paused=False)
        engine.gate.resume()
    return _state(state, engine)


def _told(state: AppState) -> contextlib.AbstractAsyncContextManager[None]:
    """While this process applies and publishes a pause or resume, its own poll of the stored
    pause must not undo it with a value read before the publishing."""
    return state.shared_pause.told() if state.shared_pause is not None else contextlib.nullcontext()


@router.get("/state")
async def pause_state(state: StateDep) -> dict[str, Any]:
    if state.shared_pause is not None:
        await state.shared_pause.follow_once()  # the pause as stored, not as last polled
    return _state(state, _engine(state))
