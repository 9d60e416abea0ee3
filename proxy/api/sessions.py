"""Sessions for trainers: lifecycle, rewards, one session's trajectory."""

from __future__ import annotations

from collections import Counter
from datetime import datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Response
from pydantic import BaseModel, ConfigDict, Field, FiniteFloat, Strict

from proxy.api.deps import StateDep, check_session_id, known_query, new_session_id
from proxy.api.groups import group_claim
from proxy.api.schemas import Exportable, RowId, Shallow
from proxy.errors import Conflict, InvalidRequest, NotFound
from proxy.export.branches import BranchFilter
from proxy.export.rows import group_fields
from proxy.export.summaries import store_on_finish
from proxy.export.trajectory import build_trajectories
from proxy.store.groups import check_group
from proxy.store.models import SessionRow
from proxy.store.repository import Repository, utc_iso

router = APIRouter(prefix="/sessions", tags=["sessions"])


# A reward is a JSON number: "1.0" or true is refused, not read as one.
Reward = Annotated[FiniteFloat, Strict()]


class NewSession(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: str | None = None
    metadata: Annotated[dict[str, Any], Shallow, Exportable] = Field(default_factory=dict)
    # GRPO: the group this session is one sample of (see proxy/api/groups.py).
    group_id: str | None = None
    sample_index: int | None = Field(default=None, ge=0, le=2**31 - 1)
    group_size: int | None = Field(default=None, ge=1, le=2**31 - 1)


class RewardBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    # NaN or infinity would erase the reward in the record (JSON has neither): a 400 instead.
    reward: Reward | None = None
    # Lax about the keys alone: JSON writes a call id key as a string.
    call_rewards: dict[RowId, Reward] | None = None


def session_json(session: SessionRow) -> dict[str, Any]:
    return {
        "id": session.id,
        "status": session.status,
        "created_at": utc_iso(session.created_at),
        "updated_at": utc_iso(session.updated_at),
        "finished_at": utc_iso(session.finished_at) if session.finished_at else None,
        "metadata": session.meta,
        "reward": session.reward,
        **group_fields(session),
    }


async def _session(repo: Repository, session_id: str) -> SessionRow:
    check_session_id(session_id)
    session = await repo.get_session(session_id)
    if session is None:
        raise NotFound(f"no session {session_id!r}", param="session_id")
    return session


@router.post("", status_code=201)
async def create_session(state: StateDep, body: NewSession | None = None) -> dict[str, Any]:
    body = body or NewSession()  # every field is optional: a bare POST creates a session
    session_id = check_session_id(body.id) if body.id is not None else new_session_id()
    claim = group_claim(body.group_id, body.sample_index, body.group_size)
    async with state.db_sessions() as db, db.begin():
        if claim is not None:
            await check_group(db, claim, session_id)
        created = await Repository(db).create_session(session_id, body.metadata, datetime.now(), claim)
        if created is None:
            raise Conflict(
                f"session {session_id!r} exists (or its group's sample index is taken)", param="id"
            )
        return session_json(created)


@router.get("", dependencies=[Depends(known_query("status", "after", "limit"))])
async def list_sessions(
    state: StateDep,
    status: Literal["active", "finished"] | None = None,
    after: str | None = None,
    limit: int = Query(default=100, ge=1, le=1000),
) -> dict[str, Any]:
    async with state.db_sessions() as db:
        rows = await Repository(db).list_sessions(status, after, limit)
    data = [session_json(s) for s in rows]
    return {"data": data, "next_cursor": data[-1]["id"] if len(data) == limit else None}


@router.get("/{session_id}")
async def get_session(session_id: str, state: StateDep) -> dict[str, Any]:
    async with state.db_sessions() as db:
        repo = Repository(db)
        session = await _session(repo, session_id)
        calls = await repo.session_calls(session_id)
    return {
        **session_json(session),
        "num_calls": len(calls),
        "num_segments": len({c.segment_id for c in calls}),
        # ok calls are training samples; aborted ones (a client or engine that left mid-stream) are not.
        "calls_by_status": dict(Counter(c.status for c in calls)),
    }


@router.delete("/{session_id}", status_code=204)
async def delete_session(session_id: str, state: StateDep) -> Response:
    async with state.db_sessions() as db, db.begin():
        repo = Repository(db)
        await _session(repo, session_id)
        await repo.delete_session(session_id)
    return Response(status_code=204)


@router.post("/{session_id}/finish")
async def finish_session(session_id: str, state: StateDep) -> dict[str, Any]:
    async with state.db_sessions() as db, db.begin():
        repo = Repository(db)
        session = await _session(repo, session_id)
        finished = await repo.finish_session(session)
    if finished:
        # After the finish's commit (no turn can land any more), outside its write transaction.
        await store_on_finish(state.db_sessions, [session], state.renderer, state.settings.drift_report)
    return session_json(session)


@router.post("/{session_id}/reward")
async def set_reward(session_id: str, body: RewardBody, state: StateDep) -> dict[str, Any]:
    if body.reward is None and not body.call_rewards:
        raise InvalidRequest("give a reward, call_rewards, or both", param="reward")
    async with state.db_sessions() as db, db.begin():
        repo = Repository(db)
        session = await _session(repo, session_id)
        if body.reward is not None:
            session.reward = body.reward
        if body.call_rewards:
            unknown = await repo.set_call_rewards(session_id, body.call_rewards)
            if unknown:
                raise InvalidRequest(
                    f"calls {sorted(unknown)} are not calls of this session", param="call_rewards"
                )
        return session_json(session)


@router.get("/{session_id}/trajectory", dependencies=[Depends(known_query("branches"))])
async def trajectory(session_id: str, state: StateDep, branches: BranchFilter = "final") -> dict[str, Any]:
    """The session's branches, each flagged; abandoned ones only with `branches=all`."""
    async with state.db_sessions() as db:
        repo = Repository(db)
        session = await _session(repo, session_id)
        calls = await repo.session_calls(session_id)
    trajectories = build_trajectories(
        calls,
        renderer=state.renderer,
        drift_mode=state.settings.drift_report,
        template_now=session.template_now,
        session_id=session_id,
        branches=branches,
    )
    return {"session_id": session_id, "segments": [t.as_json() for t in trajectories]}
