"""The trajectory viewer at /ui: a static page shipped in the package, and the JSON API it reads.

The page holds no data; it and every API route need the admin key (when keys are set), sent as a
Bearer header or as the `tito_admin_key` cookie that POST /ui/login sets once the key is checked.
Without it the page answers 401 and shows the form that asks for the key.
"""

from __future__ import annotations

import hmac
from datetime import datetime
from pathlib import Path
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import FileResponse
from pydantic import BaseModel, Field
from sqlalchemy import select

from proxy.api.auth import require_admin_key
from proxy.api.deps import StateDep
from proxy.api.schemas import MAX_DB_INTEGER
from proxy.errors import Forbidden, InvalidRequest, NotFound, Unauthorized
from proxy.observe.viewer_data import call_tree, group_of, summary, tokens, trajectories
from proxy.store.models import FinishedRow, SessionRow
from proxy.store.repository import Repository, in_utc

STATIC = Path(__file__).parent / "static"
COOKIE = "tito_admin_key"
SCAN_LIMIT = 2000  # sessions one listing request reads at most while filtering

page_router = APIRouter(tags=["ui"], include_in_schema=False)


async def require_viewer(request: Request) -> None:
    """The admin key, from the header (as everywhere) or from the viewer's cookie."""
    cookie = request.cookies.get(COOKIE)
    settings = request.app.state.proxy.settings
    key = settings.admin_key or settings.api_key
    if (
        cookie is not None
        and key is not None
        and hmac.compare_digest(cookie.encode(), key.get_secret_value().encode())
    ):
        return
    await require_admin_key(request)


api_router = APIRouter(prefix="/ui/api", tags=["ui"], dependencies=[Depends(require_viewer)])


@page_router.get("/ui")
async def page(request: Request) -> FileResponse:
    """The page; without the admin key (when keys are set) its status says so (401, or 403 for the
    harness key) and it shows only the form that asks for the key."""
    status = 200
    try:
        await require_viewer(request)
    except (Unauthorized, Forbidden) as exc:
        status = exc.status_code
    return FileResponse(STATIC / "index.html", media_type="text/html", status_code=status)


@page_router.get("/ui/static/{name}")
async def asset(name: Literal["viewer.js", "viewer.css"]) -> FileResponse:
    kind = "text/javascript" if name.endswith(".js") else "text/css"
    return FileResponse(STATIC / name, media_type=kind)


class Login(BaseModel):
    key: str = Field(min_length=1, max_length=512)


@page_router.post("/ui/login")
async def login(body: Login, request: Request, response: Response) -> dict[str, bool]:
    """Checks the key once and keeps it in an HttpOnly cookie the page's requests carry."""
    settings = request.app.state.proxy.settings
    key = settings.admin_key or settings.api_key
    if key is None:
        return {"ok": True}
    if not hmac.compare_digest(body.key.encode(), key.get_secret_value().encode()):
        raise Unauthorized("Incorrect admin key provided")
    response.set_cookie(COOKIE, body.key, httponly=True, samesite="strict", path="/ui")
    return {"ok": True}


@page_router.get("/ui/auth")
async def auth_state(request: Request) -> dict[str, bool]:
    """Whether the page must ask for the key (asked here, so a browser logs no failed request)."""
    try:
        await require_viewer(request)
    except (Unauthorized, Forbidden):
        return {"needs_key": True}
    return {"needs_key": False}


def _listing(status: str | None, after: str | None) -> tuple[Any, bool]:
    """Finished sessions page over the export cursor (finishing order); the rest over their ids."""
    if status == "finished":
        query = select(FinishedRow.seq, SessionRow).join(SessionRow, SessionRow.id == FinishedRow.session_id)
        if after:
            if not after.isdigit() or int(after) > MAX_DB_INTEGER:
                raise InvalidRequest(
                    "a finished listing's cursor is an export cursor (an integer)", param="after"
                )
            query = query.where(FinishedRow.seq > int(after))
        return query.order_by(FinishedRow.seq), True
    query = select(SessionRow.id, SessionRow)
    if status is not None:
        query = query.where(SessionRow.status == status)
    if after:
        query = query.where(SessionRow.id > after)
    return query.order_by(SessionRow.id), False


@api_router.get("/sessions")
async def list_sessions(
    state: StateDep,
    *,
    status: Literal["active", "finished"] | None = None,
    group: str | None = None,
    since: datetime | None = None,
    until: datetime | None = None,
    reward_min: float | None = None,
    reward_max: float | None = None,
    weight_version: str | None = None,
    drift: Annotated[str | None, Query(description="comma-separated drift kinds, all present")] = None,
    after: Annotated[str | None, Query(max_length=128, pattern=r"^[A-Za-z0-9._:@-]+$")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
) -> dict[str, Any]:
    query, by_cursor = _listing(status, after)
    if since is not None:
        query = query.where(SessionRow.created_at >= in_utc(since))
    if until is not None:
        query = query.where(SessionRow.created_at <= in_utc(until))
    if reward_min is not None:
        query = query.where(SessionRow.reward >= reward_min)
    if reward_max is not None:
        query = query.where(SessionRow.reward <= reward_max)
    wanted_drift = {kind for kind in (drift or "").split(",") if kind}
    found: list[dict[str, Any]] = []
    cursor: str | None = after
    scanned = 0
    async with state.db_sessions() as db:
        repo = Repository(db)
        for key, session in (await db.execute(query.limit(SCAN_LIMIT))).all():
            scanned += 1
            cursor = str(key)
            if group is not None and group_of(session) != group:
                continue
            calls = await repo.session_calls(session.id)
            if weight_version is not None and all(c.weight_version != weight_version for c in calls):
                continue
            # Drift needs a fresh render of every path: computed only when filtered on.
            paths = trajectories(state, session, calls) if wanted_drift else None
            row = summary(session, calls, paths)
            if paths is not None and not wanted_drift <= set(row["drift_kinds"]):
                continue
            found.append({**row, "cursor": key if by_cursor else None})
            if len(found) == limit:
                break
    more = len(found) == limit or scanned == SCAN_LIMIT
    return {"data": found, "next_cursor": cursor if more else None}


async def _session(state: StateDep, session_id: str) -> tuple[Any, Any]:
    async with state.db_sessions() as db:
        repo = Repository(db)
        session = await repo.get_session(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id")
        return session, await repo.session_calls(session_id)


@api_router.get("/sessions/{session_id}")
async def session_detail(session_id: str, state: StateDep) -> dict[str, Any]:
    session, calls = await _session(state, session_id)
    paths = trajectories(state, session, calls)
    return {
        **summary(session, calls, paths),
        "calls": call_tree(calls),
        "paths": [
            {
                "index": index,
                "segment_id": path.segment_id,
                "branch": path.branch,
                "call_ids": [c.id for c in path.calls],
                "num_tokens": len(path.prompt_ids) + len(path.response_ids),
                "drift_counts": path.drift.get("counts", {}),
            }
            for index, path in enumerate(paths)
        ],
    }


@api_router.get("/sessions/{session_id}/tokens")
async def session_tokens(
    session_id: str, state: StateDep, path: Annotated[int, Query(ge=0)] = 0
) -> dict[str, Any]:
    """One path (a segment's root-to-leaf line) token by token: ids, pieces, masks, logprobs, edits,
    drift, per-call spans, and a fresh render of the same messages for the diff."""
    session, calls = await _session(state, session_id)
    paths = trajectories(state, session, calls)
    if path >= len(paths):
        raise NotFound(f"session {session_id!r} has {len(paths)} paths", param="path")
    return tokens(state, session, paths[path], path)
