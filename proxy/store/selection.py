"""Which sessions an export delivers, page by page: status, explicit ids, groups (whole or not),
not yet acked by a consumer, up to the moment the export started."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from sqlalchemy import BindParameter, func, select
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.store.groups import whole_groups_page
from proxy.store.models import ExportAckRow, FinishedRow, SessionRow

ExportStatus = Literal["finished", "active", "all"]
# A page: (export cursor, or None for a session not finished yet; the session).
Page = list[tuple[int | None, SessionRow]]


@dataclass(frozen=True)
class Selection:
    status: ExportStatus = "finished"
    after: int = 0
    consumer: str | None = None
    session_ids: Sequence[str] | None = None
    group_ids: Sequence[str] | None = None
    whole_groups: bool = False


@dataclass(frozen=True)
class Snapshot:
    """The export's bound: sessions finished (or created) later belong to the next export."""

    last_seq: int
    created_before: datetime


LAST_SEQ = select(func.max(FinishedRow.seq))


async def take_snapshot(db: DbSession, now: datetime) -> Snapshot:
    last = await db.scalar(LAST_SEQ)
    return Snapshot(int(last or 0), now)


def _values(given: Any) -> Any:
    """A list of values, or the expanding bind parameter standing for one (a statement compiled once)."""
    return given if isinstance(given, BindParameter) else list(given)


def _filtered(query: Any, selection: Selection) -> Any:
    if selection.session_ids is not None:
        query = query.where(SessionRow.id.in_(_values(selection.session_ids)))
    if selection.group_ids is not None:
        query = query.where(SessionRow.group_id.in_(_values(selection.group_ids)))
    if selection.consumer is not None:
        acked = select(ExportAckRow.session_id).where(ExportAckRow.consumer == selection.consumer)
        query = query.where(SessionRow.id.not_in(acked))
    return query


def finished_query(selection: Selection, after: Any, last_seq: Any, size: Any, *columns: Any) -> Any:
    """A page of finished sessions after cursor `after` up to the snapshot's `last_seq` (values or
    bind parameters: the SQLite export path compiles this once per shape), with these columns (the
    whole SessionRow by default) after the cursor."""
    query = (
        select(FinishedRow.seq, *(columns or (SessionRow,)))
        .join(SessionRow, SessionRow.id == FinishedRow.session_id)
        .where(FinishedRow.seq > after, FinishedRow.seq <= last_seq)
        .order_by(FinishedRow.seq)
        .limit(size)
    )
    return _filtered(query, selection)


async def _finished(
    db: DbSession, selection: Selection, snapshot: Snapshot, after: int, size: int
) -> tuple[Page, int | None]:
    """A page of finished sessions, and the cursor after it (None: nothing left)."""
    query = finished_query(selection, after, snapshot.last_seq, size)
    page: Page = [(int(seq), session) for seq, session in (await db.execute(query)).all()]
    return page, (page[-1][0] if page else None)


async def selected_metas(
    db_sessions: Callable[[], AbstractAsyncContextManager[DbSession]],
    selection: Selection,
    snapshot: Snapshot,
    page_size: int,
) -> AsyncIterator[list[dict[str, Any]]]:
    """The metadata of the sessions selected_pages gives, page by page. Finished sessions (not whole
    groups) are read as one column, not as sessions: loading them was most of a Parquet export's
    first pass."""
    if selection.status != "finished" or selection.whole_groups:
        async for page in selected_pages(db_sessions, selection, snapshot, page_size):
            yield [session.meta for _, session in page]
        return
    after = selection.after
    while True:
        query = (
            select(FinishedRow.seq, SessionRow.meta)
            .join(SessionRow, SessionRow.id == FinishedRow.session_id)
            .where(FinishedRow.seq > after, FinishedRow.seq <= snapshot.last_seq)
            .order_by(FinishedRow.seq)
            .limit(page_size)
        )
        async with db_sessions() as db:
            rows = (await db.execute(_filtered(query, selection))).all()
        if rows:
            yield [meta for _, meta in rows]
        if len(rows) < page_size:
            return
        after = int(rows[-1][0])


async def _active(db: DbSession, selection: Selection, snapshot: Snapshot, after_id: str, size: int) -> Page:
    query = (
        select(SessionRow)
        .where(
            SessionRow.status == "active",
            SessionRow.id > after_id,
            SessionRow.created_at <= snapshot.created_before,
        )
        .order_by(SessionRow.id)
        .limit(size)
    )
    return [(None, session) for session in (await db.scalars(_filtered(query, selection))).all()]


async def _whole_groups(
    db: DbSession, selection: Selection, snapshot: Snapshot, after: int, size: int
) -> tuple[Page, int | None]:
    """Sessions of whole groups, group after group; each row's cursor is the group's (when it became
    whole), so `after` resumes after the last group delivered. The page may be empty while the
    cursor moves on (every member of its groups acked or filtered out). For a consumer a group is
    the unit: one it has acked whole is left out, any other is delivered whole, its sessions acked
    before included (a consumer that stopped in the middle of a group, or acked part of it, would
    otherwise get the rest of it as if it were the group)."""
    groups = await whole_groups_page(db, after=after, group_ids=selection.group_ids, limit=size)
    groups = [(group, seq) for group, seq in groups if seq <= snapshot.last_seq]
    if not groups:
        return [], None
    done_at = dict(groups)
    query = select(SessionRow).where(SessionRow.group_id.in_(list(done_at)))
    members = list((await db.scalars(_filtered(query, replace(selection, consumer=None)))).all())
    if selection.consumer is not None:
        members = await _without_groups_acked_whole(db, selection.consumer, members)
    members = sorted(members, key=lambda s: (done_at[s.group_id or ""], s.sample_index or 0, s.id))
    return [(done_at[s.group_id or ""], s) for s in members], groups[-1][1]


async def _without_groups_acked_whole(
    db: DbSession, consumer: str, members: list[SessionRow]
) -> list[SessionRow]:
    acked = set(
        await db.scalars(
            select(ExportAckRow.session_id).where(
                ExportAckRow.consumer == consumer, ExportAckRow.session_id.in_([s.id for s in members])
            )
        )
    )
    open_groups = {s.group_id for s in members if s.id not in acked}
    return [s for s in members if s.group_id in open_groups]


async def selected_pages(
    db_sessions: Callable[[], AbstractAsyncContextManager[DbSession]],
    selection: Selection,
    snapshot: Snapshot,
    page_size: int,
) -> AsyncIterator[Page]:
    """The selected sessions page by page, each page read in its own short transaction."""
    if selection.status in ("finished", "all"):
        cursor = selection.after
        page_of = _whole_groups if selection.whole_groups else _finished
        while True:
            async with db_sessions() as db:
                page, next_cursor = await page_of(db, selection, snapshot, cursor, page_size)
            if next_cursor is None:
                break
            cursor = next_cursor
            if page:
                yield page
            if not selection.whole_groups and len(page) < page_size:
                break  # a short page is the last one: no query to find nothing after it
    if selection.status in ("active", "all"):
        after_id = ""
        while True:
            async with db_sessions() as db:
                page = await _active(db, selection, snapshot, after_id, page_size)
            if not page:
                break
            after_id = page[-1][1].id
            yield page
