"""Bulk export of finished sessions, streamed in constant memory, delivered once per consumer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from proxy.api.deps import StateDep
from proxy.api.schemas import MAX_DB_INTEGER, RowId
from proxy.app_state import AppState
from proxy.errors import InvalidRequest
from proxy.export.branches import BranchFilter
from proxy.export.formats import jsonl, parquet_stream, require_pyarrow
from proxy.export.samples import merged_rows, stepwise_rows
from proxy.observe.export_tally import ExportTally
from proxy.store.repository import Repository

router = APIRouter(tags=["export"])
PAGE_SESSIONS = 16


class AckBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    consumer: str = Field(min_length=1, max_length=128)
    session_ids: list[str] | None = None
    cursor: RowId | None = None


async def export_pages(
    state: AppState, mode: str, after: int, consumer: str | None, branches: BranchFilter = "final"
) -> AsyncIterator[list[dict[str, Any]]]:
    """Rows page by page; each page holds PAGE_SESSIONS sessions, so memory stays bounded."""
    cursor = after
    while True:
        async with state.db_sessions() as db:
            repo = Repository(db)
            page = await repo.finished_page(after=cursor, consumer=consumer, limit=PAGE_SESSIONS)
            batch = [(seq, session, await repo.session_calls(session.id)) for seq, session in page]
        if not batch:
            return
        rows: list[dict[str, Any]] = []
        for seq, session, calls in batch:
            built = (
                merged_rows(session, calls, state.renderer, state.settings.drift_report, branches)
                if mode == "merged"
                else stepwise_rows(session, calls, branches)
            )
            rows.extend({"cursor": seq, **row} for row in built)
            cursor = seq
        yield rows


@router.get("/export")
async def export(
    request: Request,
    state: StateDep,
    *,
    mode: Literal["merged", "stepwise"] = "merged",
    format: Literal["jsonl", "parquet"] = "jsonl",
    status: Literal["finished"] = "finished",
    after: int = Query(default=0, ge=0, le=MAX_DB_INTEGER),
    consumer: str | None = Query(default=None, min_length=1, max_length=128),
    branches: BranchFilter = "final",
) -> StreamingResponse:
    """Finished sessions after cursor `after`; with `consumer`, only those it has not acked;
    abandoned branches (a retry the harness went on with superseded them) only with `branches=all`."""
    require_pyarrow(format)
    tally = ExportTally(request.app.state.metrics, mode, format)
    pages = tally.rows_of(export_pages(state, mode, after, consumer, branches))
    if format == "parquet":
        return StreamingResponse(
            tally.bytes_of(parquet_stream(mode, pages)), media_type="application/vnd.apache.parquet"
        )

    async def lines() -> AsyncIterator[bytes]:
        async for rows in pages:
            yield jsonl(rows)

    return StreamingResponse(tally.bytes_of(lines()), media_type="application/x-ndjson")


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
