"""GRPO groups on the wire: the group fields of POST /sessions, and the X-Tito-Group-* headers that
place a session in a group on its first turn."""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Annotated

from fastapi import Header, Request

from proxy.api.deps import SessionIdDep, StateDep, check_session_id
from proxy.app_state import AppState
from proxy.errors import Conflict, InvalidRequest
from proxy.store.groups import GroupClaim, check_group, claim_on_turn
from proxy.store.repository import Repository

GROUP_HEADER = "X-Tito-Group-Id"
SAMPLE_HEADER = "X-Tito-Sample-Index"
SIZE_HEADER = "X-Tito-Group-Size"


def group_claim(group_id: str | None, sample_index: int | None, group_size: int | None) -> GroupClaim | None:
    """The group fields, checked: a sample index or size needs a group, and fits in its size."""
    if group_id is None:
        if sample_index is not None or group_size is not None:
            raise InvalidRequest("sample_index and group_size need a group_id", param="group_id")
        return None
    try:
        check_session_id(group_id)
    except InvalidRequest as exc:
        raise InvalidRequest(f"group_id: {exc}", param="group_id") from exc
    if sample_index is not None and group_size is not None and sample_index >= group_size:
        raise InvalidRequest(
            f"sample_index {sample_index} is not below group_size {group_size}", param="sample_index"
        )
    return GroupClaim(group_id, sample_index, group_size)


def _header_int(value: str | None, name: str, minimum: int) -> int | None:
    if value is None:
        return None
    if not value.strip().isdigit() or not minimum <= int(value) < 2**31:
        raise InvalidRequest(f"the {name} header is an integer of at least {minimum}", param=name)
    return int(value)


# The routes whose request runs a turn (every dialect's); the headers are ignored elsewhere, so a
# harness that sends them on every request (an SDK's default headers) creates no session by
# listing models or counting tokens.
_TURN_PATHS = ("/chat/completions", "/completions", "/responses", "/messages")


async def group_from_headers(
    request: Request,
    state: StateDep,
    session: SessionIdDep,
    *,
    x_tito_group_id: Annotated[str | None, Header()] = None,
    x_tito_sample_index: Annotated[str | None, Header()] = None,
    x_tito_group_size: Annotated[str | None, Header()] = None,
) -> None:
    """Places the session in the headers' group before its turn (see join_group)."""
    headers = {
        GROUP_HEADER: x_tito_group_id,
        SAMPLE_HEADER: x_tito_sample_index,
        SIZE_HEADER: x_tito_group_size,
    }
    await join_group(state, request.method, request.scope["path"], session[0], headers)


async def join_group(
    state: AppState, method: str, path: str, session_id: str, headers: Mapping[str, str | None]
) -> None:
    """Places the session in the headers' group before its turn: creates it when it is new, sets
    the group of a session without calls, and refuses (409) a session already elsewhere."""
    if method != "POST" or not path.endswith(_TURN_PATHS):
        return
    claim = group_claim(
        headers.get(GROUP_HEADER),
        _header_int(headers.get(SAMPLE_HEADER), SAMPLE_HEADER, 0),
        _header_int(headers.get(SIZE_HEADER), SIZE_HEADER, 1),
    )
    if claim is None:
        return
    async with state.db_sessions() as db, db.begin():
        repo = Repository(db)
        existing = await repo.get_session(session_id)
        if existing is not None:
            await claim_on_turn(db, existing, claim)
            return
        await check_group(db, claim, session_id)
        if await repo.create_session(session_id, {}, datetime.now(), claim) is None:
            existing = await repo.get_session(session_id)
            if existing is None:  # the unique (group, sample index) refused it
                raise Conflict(
                    f"sample index {claim.sample_index} of group {claim.group_id!r} is taken",
                    param=SAMPLE_HEADER,
                )
            await claim_on_turn(db, existing, claim)  # created by a concurrent first turn
