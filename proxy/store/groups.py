"""GRPO groups: which group a session belongs to, and when a group is whole (every session finished)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.errors import Conflict
from proxy.store.models import CallRow, FinishedRow, SessionRow


@dataclass(frozen=True)
class GroupClaim:
    """A session's place in a group, as given at creation or on its first turn."""

    group_id: str
    sample_index: int | None = None
    group_size: int | None = None


async def check_group(db: DbSession, claim: GroupClaim, session_id: str) -> None:
    """The claim agrees with the group's other sessions: one size, free sample index, room left."""
    others = (
        await db.execute(
            select(SessionRow.id, SessionRow.sample_index, SessionRow.group_size).where(
                SessionRow.group_id == claim.group_id, SessionRow.id != session_id
            )
        )
    ).all()
    sizes = {size for _, _, size in others if size is not None}
    if claim.group_size is not None:
        sizes.add(claim.group_size)
    if len(sizes) > 1:
        raise Conflict(f"group {claim.group_id!r} was given sizes {sorted(sizes)}", param="group_size")
    if claim.sample_index is not None and any(index == claim.sample_index for _, index, _ in others):
        raise Conflict(
            f"sample index {claim.sample_index} of group {claim.group_id!r} is taken", param="sample_index"
        )
    if sizes and len(others) + 1 > next(iter(sizes)):
        raise Conflict(
            f"group {claim.group_id!r} already has its {next(iter(sizes))} sessions", param="group_id"
        )


def apply_claim(session: SessionRow, claim: GroupClaim) -> None:
    session.group_id = claim.group_id
    session.sample_index = claim.sample_index
    session.group_size = claim.group_size


async def claim_on_turn(db: DbSession, session: SessionRow, claim: GroupClaim) -> None:
    """Group headers on a turn: they set the group of a session without calls, and must repeat it later."""
    same = (
        session.group_id == claim.group_id
        and claim.sample_index in (None, session.sample_index)
        and claim.group_size in (None, session.group_size)
    )
    if same:
        return
    has_calls = await db.scalar(select(CallRow.id).where(CallRow.session_id == session.id).limit(1))
    if session.group_id is not None or has_calls is not None:
        raise Conflict(
            f"session {session.id!r} is in group {session.group_id!r} (index {session.sample_index}); "
            "a group is set at creation or by the headers of the first turn",
            param="X-Tito-Group-Id",
        )
    await check_group(db, claim, session.id)
    apply_claim(session, claim)
    try:
        await db.flush()
    except IntegrityError as exc:
        raise Conflict(f"sample index {claim.sample_index} of group {claim.group_id!r} is taken") from exc


async def whole_groups_page(
    db: DbSession, *, after: int, group_ids: Sequence[str] | None, limit: int
) -> list[tuple[str, int]]:
    """Groups whose sessions are all finished (and as many as their size, when given), with the
    export cursor at which the group became whole (its last session's), after `after`, in order."""
    done = func.max(FinishedRow.seq)
    query = (
        select(SessionRow.group_id, done)
        .outerjoin(FinishedRow, FinishedRow.session_id == SessionRow.id)
        .where(SessionRow.group_id.is_not(None))
        .group_by(SessionRow.group_id)
        .having(
            func.count(FinishedRow.seq) == func.count(SessionRow.id),
            (func.max(SessionRow.group_size).is_(None))
            | (func.count(SessionRow.id) >= func.max(SessionRow.group_size)),
            done > after,
        )
        .order_by(done)
        .limit(limit)
    )
    if group_ids is not None:
        query = query.where(SessionRow.group_id.in_(list(group_ids)))
    return [(str(group), int(seq)) for group, seq in (await db.execute(query)).all()]
