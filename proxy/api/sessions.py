"""Trajectories of a session for trainers."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from proxy.api.deps import StateDep, check_session_id
from proxy.errors import NotFound
from proxy.export.trajectory import build_trajectories
from proxy.store.repository import Repository

router = APIRouter(prefix="/sessions", tags=["sessions"])


@router.get("/{session_id}/trajectory")
async def trajectory(session_id: str, state: StateDep) -> dict[str, Any]:
    check_session_id(session_id)
    async with state.db_sessions() as db:
        repo = Repository(db)
        session = await repo.get_session(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id")
        calls = await repo.session_calls(session_id)
    trajectories = build_trajectories(
        calls,
        renderer=state.renderer,
        drift_mode=state.settings.drift_report,
        template_now=session.template_now,
        session_id=session_id,
    )
    return {"session_id": session_id, "segments": [t.as_json() for t in trajectories]}
