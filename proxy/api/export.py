"""Bulk export of sessions, streamed in constant memory, filtered, delivered once per consumer;
one session's rows on their own."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from sqlalchemy import select

from proxy.api.deps import StateDep, check_session_id, known_query
from proxy.api.export_stream import ExportStream
from proxy.api.schemas import MAX_DB_INTEGER, RowId
from proxy.app_state import AppState
from proxy.errors import InvalidRequest, NotFound
from proxy.export.branches import BranchFilter
from proxy.export.columns import as_lists
from proxy.export.formats import MetadataType, jsonl, parquet_stream, require_pyarrow
from proxy.export.rows import merged_rows_of, stepwise_rows_of
from proxy.export.sqlite_reads import (
    METAS_PAGE,
    Calls,
    Start,
    Stored,
    read_page,
    read_start,
    sqlite_file,
)
from proxy.export.summaries import Summary, decode, fresh_summaries, leaves
from proxy.observe.export_tally import ExportTally
from proxy.store.models import FinishedRow, SessionRow
from proxy.store.repository import Repository, TokenCall, utcnow
from proxy.store.selection import (
    ExportStatus,
    Page,
    Selection,
    Snapshot,
    selected_metas,
    selected_pages,
    take_snapshot,
)
from proxy.weight_versions import at_least, row_versions

router = APIRouter(tags=["export"])
PAGE_SESSIONS = 16
Mode = Literal["merged", "stepwise"]
IdList = Annotated[list[str] | None, Query()]


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    consumer: str = Field(min_length=1, max_length=128)
    session_ids: list[str] | None = None
    cursor: RowId | None = None


@dataclass(frozen=True)
class RowFilter:
    """What is decided on a session's rows rather than in SQL."""

    mode: Mode
    branches: BranchFilter = "final"
    min_weight_version: str | None = None
    limit: int | None = None
    whole_groups: bool = False


def _stored(blobs: dict[int, bytes], calls: dict[int, TokenCall]) -> dict[int, Summary] | None:
    """The stored summaries of every branch of these calls, or None when one is missing."""
    wanted = leaves(calls)
    if not wanted <= blobs.keys():
        return None
    return {leaf: decode(blobs[leaf]) for leaf in wanted}


async def _page_rows(
    state: AppState, page: Page, rows: RowFilter
) -> list[tuple[int | None, SessionRow, list[dict[str, Any]]]]:
    """The page's rows from stored summaries and token blobs (two queries); a session without
    summaries gets them made now."""
    ids = [session.id for _, session in page]
    drift_mode = state.settings.drift_report
    path = sqlite_file(state.settings.db)
    if path is not None:
        calls, stored = await read_page(path, ids, drift_mode)
    else:
        async with state.db_sessions() as db:
            repo = Repository(db)
            calls = await repo.token_calls(ids)
            stored = await repo.segment_summaries(ids, drift_mode)
    return await _built(state, page, rows, calls, stored)


async def _built(
    state: AppState, page: Page, rows: RowFilter, calls: Calls, stored: Stored
) -> list[tuple[int | None, SessionRow, list[dict[str, Any]]]]:
    drift_mode = state.settings.drift_report
    build = merged_rows_of if rows.mode == "merged" else stepwise_rows_of
    built = []
    for seq, session in page:
        session_calls, summaries = calls[session.id], _stored(stored[session.id], calls[session.id])
        if summaries is None:
            # Step-wise rows carry no drift report: an active session's (never stored) needs no render.
            renderer = state.renderer if rows.mode == "merged" or session.status == "finished" else None
            session_calls, summaries = await fresh_summaries(state.db_sessions, session, renderer, drift_mode)
        built.append((seq, session, build(session, summaries, session_calls, rows.branches)))
    return built


def _fresh(rows: list[dict[str, Any]], minimum: str | None) -> bool:
    """Every exported call of these rows was sampled with weights at `minimum` or newer."""
    if minimum is None:
        return True
    return all(at_least(v, minimum) for row in rows for v in row_versions(row))


def _units(
    built: list[tuple[int | None, SessionRow, list[dict[str, Any]]]], whole_groups: bool
) -> list[list[tuple[int | None, SessionRow, list[dict[str, Any]]]]]:
    """The page cut into what is delivered or dropped as one: a whole group, else a session."""
    if not whole_groups:
        return [[item] for item in built]
    units: dict[str | None, list[tuple[int | None, SessionRow, list[dict[str, Any]]]]] = {}
    for item in built:
        units.setdefault(item[1].group_id, []).append(item)
    return list(units.values())


async def _pages_built(
    state: AppState, selection: Selection, snapshot: Snapshot, rows: RowFilter, start: Start | None
) -> AsyncIterator[list[tuple[int | None, SessionRow, list[dict[str, Any]]]]]:
    """The selected pages' rows; with `start`, its first page already read (finished sessions, not
    whole groups), the rest after its last cursor unless it was short (the last one)."""
    if start is not None:
        if start.page:
            yield await _built(state, start.page, rows, start.calls, start.stored)
        if len(start.page) < PAGE_SESSIONS:
            return
        selection = replace(selection, after=start.page[-1][0] or 0)  # finished: never None
    async for page in selected_pages(state.db_sessions, selection, snapshot, PAGE_SESSIONS):
        yield await _page_rows(state, page, rows)


async def export_pages(
    state: AppState, selection: Selection, snapshot: Snapshot, rows: RowFilter, start: Start | None = None
) -> AsyncIterator[list[dict[str, Any]]]:
    """Rows a session (or a whole group) at a time; pages of PAGE_SESSIONS sessions are read at once,
    so memory stays bounded by a page's token blobs."""
    delivered = 0
    async for built in _pages_built(state, selection, snapshot, rows, start):
        for unit in _units(built, rows.whole_groups):
            if rows.limit is not None and delivered >= rows.limit:
                return
            if not all(_fresh(made, rows.min_weight_version) for _, _, made in unit):
                continue
            delivered += 1
            out = [{"cursor": seq, **row} for seq, _, made in unit for row in made]
            if out:
                yield out
        if rows.limit is not None and delivered >= rows.limit:
            return


async def _chained(
    first: list[dict[str, Any]] | None, rest: AsyncIterator[list[dict[str, Any]]]
) -> AsyncIterator[list[dict[str, Any]]]:
    if first is None:
        return
    yield first
    async for page in rest:
        yield page


def _id_list(values: list[str] | None, param: str) -> list[str] | None:
    """Ids given as repeated parameters, comma-separated lists, or both."""
    if values is None:
        return None
    ids = [part for value in values for part in value.split(",") if part]
    for one in ids:
        try:
            check_session_id(one)
        except InvalidRequest as exc:
            raise InvalidRequest(f"{param}: {exc}", param=param) from exc
    return ids


async def _snapshot(
    state: AppState, selection: Selection, metadata: MetadataType | None
) -> tuple[Snapshot, Start | None]:
    """The export's snapshot; on a SQLite file, for finished sessions (not whole groups), read with
    the first page and its blobs in one transaction on the stdlib driver (the fixed cost of an
    export through SQLAlchemy and aiosqlite was most of a small one's), and with it, for Parquet,
    every selected session's metadata (`metadata`'s pass). Elsewhere `metadata` is left as it is."""
    now = utcnow()
    path = sqlite_file(state.settings.db)
    if path is not None and selection.status == "finished" and not selection.whole_groups:
        metas = None if metadata is None else metadata.add
        start = await read_start(path, selection, PAGE_SESSIONS, state.settings.drift_report, metas)
        return Snapshot(start.last_seq, now), start
    async with state.db_sessions() as db:
        return await take_snapshot(db, now), None


@router.get(
    "/export",
    # A misspelled filter (`min_version=...`) would export what the trainer asked to leave out.
    dependencies=[
        Depends(
            known_query(
                "mode",
                "format",
                "status",
                "after",
                "consumer",
                "branches",
                "session_ids",
                "group_ids",
                "whole_groups",
                "limit",
                "min_weight_version",
            )
        )
    ],
)
async def export(
    request: Request,
    state: StateDep,
    *,
    mode: Mode = "merged",
    format: Literal["jsonl", "parquet"] = "jsonl",
    status: ExportStatus = "finished",
    after: int = Query(default=0, ge=0, le=MAX_DB_INTEGER),
    consumer: str | None = Query(default=None, min_length=1, max_length=128),
    branches: BranchFilter = "final",
    session_ids: IdList = None,
    group_ids: IdList = None,
    whole_groups: bool = False,
    limit: int | None = Query(default=None, ge=1, le=MAX_DB_INTEGER),
    min_weight_version: str | None = Query(default=None, min_length=1, max_length=128),
) -> StreamingResponse:
    """Sessions after cursor `after` (finished ones by default); with `consumer`, only those it has
    not acked; abandoned branches (a retry the harness went on with superseded them) only with
    `branches=all`. Filters: `session_ids`, `group_ids`, `whole_groups` (a group once all its
    sessions finished), `limit` (sessions, or groups with whole_groups), `min_weight_version`."""
    require_pyarrow(format)
    if whole_groups and status != "finished":
        raise InvalidRequest(
            "whole_groups delivers finished groups only: use status=finished", param="status"
        )
    selection = Selection(
        status,
        after,
        consumer,
        _id_list(session_ids, "session_ids"),
        _id_list(group_ids, "group_ids"),
        whole_groups,
    )
    metadata = MetadataType() if format == "parquet" else None
    snapshot, start = await _snapshot(state, selection, metadata)
    row_filter = RowFilter(mode, branches, min_weight_version, limit, whole_groups)
    # The first page is read before the status line goes out, so that a failing database is a 503.
    rest = export_pages(state, selection, snapshot, row_filter, start)
    tally = ExportTally(request.app.state.metrics, mode, format)
    pages = tally.rows_of(_chained(await anext(rest, None), rest))
    if metadata is not None:
        if start is None:
            # A first pass over the same sessions (no calls read) settles the metadata column's type.
            async for metas in selected_metas(state.db_sessions, selection, snapshot, METAS_PAGE):
                metadata.add(metas)
        return ExportStream(
            tally.bytes_of(parquet_stream(mode, pages, metadata)), media_type="application/vnd.apache.parquet"
        )

    async def lines() -> AsyncIterator[bytes]:
        async for rows in pages:
            yield jsonl(rows, shared=mode == "stepwise")

    return ExportStream(tally.bytes_of(lines()), media_type="application/x-ndjson")


@router.get("/sessions/{session_id}/samples", dependencies=[Depends(known_query("mode", "branches"))])
async def session_samples(
    session_id: str, state: StateDep, mode: Mode = "stepwise", branches: BranchFilter = "final"
) -> dict[str, Any]:
    """One session's export rows (step-wise by default), finished or not (`cursor` null until then)."""
    check_session_id(session_id)
    async with state.db_sessions() as db:
        session = await Repository(db).get_session(session_id)
        if session is None:
            raise NotFound(f"no session {session_id!r}", param="session_id")
        seq = await db.scalar(select(FinishedRow.seq).where(FinishedRow.session_id == session_id))
    [(_, _, made)] = await _page_rows(state, [(seq, session)], RowFilter(mode, branches))
    rows = [{"cursor": seq, **as_lists(row)} for row in made]
    return {"session_id": session_id, "mode": mode, "samples": rows}


@router.post("/export/ack")
async def ack(body: AckBody, state: StateDep) -> dict[str, Any]:
    """The consumer has stored these sessions' exports; they are not delivered to it again."""
    if (body.session_ids is None) == (body.cursor is None):
        raise InvalidRequest("give either session_ids or cursor", param="session_ids")
    async with state.db_sessions() as db, db.begin():
        repo = Repository(db)
        ids = (
            body.session_ids
            if body.session_ids is not None
            else await repo.session_ids_up_to(body.cursor or 0)
        )
        acked = await repo.ack(body.consumer, ids)
    return {"consumer": body.consumer, "acked": acked}
