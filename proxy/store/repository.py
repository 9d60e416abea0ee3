"""Reads and writes of sessions, segments and calls: the only module that builds SQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.orm import load_only

from proxy.store.models import CallRow, SegmentRow, SessionRow


@dataclass(frozen=True)
class NewCall:
    """Everything recorded for one engine call, in one transaction."""

    session_id: str
    segment_id: int | None  # None: this call opens a new segment
    parent_id: int | None
    depth: int
    status: str
    history_key: str
    prompt_len: int
    prompt_added: bytes
    output_ids: bytes
    output_logprobs: bytes
    finish_reason: str
    finish_detail: dict[str, Any]
    boundary_edits: list[Any]
    request: dict[str, Any]
    response_message: dict[str, Any]
    sampling_params: dict[str, Any]
    weight_version: str | None
    engine_meta: dict[str, Any]
    timings: dict[str, Any]


def utcnow() -> datetime:
    return datetime.now(UTC)


class Repository:
    def __init__(self, db: DbSession) -> None:
        self.db = db

    async def get_session(self, session_id: str) -> SessionRow | None:
        return await self.db.get(SessionRow, session_id)

    async def get_or_create_session(self, session_id: str, *, template_now: datetime) -> SessionRow:
        """The session, created on first use; concurrent first uses converge on one row."""
        found = await self.get_session(session_id)
        if found is not None:
            return found
        now = utcnow()
        row = SessionRow(
            id=session_id, status="active", created_at=now, updated_at=now, template_now=template_now
        )
        try:
            async with self.db.begin_nested():
                self.db.add(row)
        except IntegrityError:
            found = await self.get_session(session_id)
            assert found is not None
            return found
        return row

    async def calls_with_history(self, session_id: str, history_key: str) -> Sequence[CallRow]:
        """Completed calls whose conversation (request + reply) has this key, newest first."""
        result = await self.db.scalars(
            select(CallRow)
            .where(
                CallRow.session_id == session_id, CallRow.history_key == history_key, CallRow.status == "ok"
            )
            .order_by(CallRow.id.desc())
        )
        return result.all()

    async def segment_token_rows(self, segment_id: int) -> Sequence[CallRow]:
        """The calls of a segment with only what rebuilding their prompts needs."""
        result = await self.db.scalars(
            select(CallRow)
            .where(CallRow.segment_id == segment_id)
            .options(load_only(CallRow.id, CallRow.parent_id, CallRow.prompt_added, CallRow.output_ids))
            .order_by(CallRow.id)
        )
        return result.all()

    async def session_calls(self, session_id: str) -> Sequence[CallRow]:
        result = await self.db.scalars(
            select(CallRow).where(CallRow.session_id == session_id).order_by(CallRow.id)
        )
        return result.all()

    async def add_call(self, call: NewCall) -> CallRow:
        now = utcnow()
        segment_id = call.segment_id
        if segment_id is None:
            segment = SegmentRow(session_id=call.session_id, created_at=now)
            self.db.add(segment)
            await self.db.flush()
            segment_id = segment.id
        row = CallRow(
            session_id=call.session_id,
            segment_id=segment_id,
            parent_id=call.parent_id,
            depth=call.depth,
            status=call.status,
            history_key=call.history_key,
            prompt_len=call.prompt_len,
            prompt_added=call.prompt_added,
            output_ids=call.output_ids,
            output_logprobs=call.output_logprobs,
            finish_reason=call.finish_reason,
            finish_detail=call.finish_detail,
            boundary_edits=call.boundary_edits,
            request=call.request,
            response_message=call.response_message,
            sampling_params=call.sampling_params,
            weight_version=call.weight_version,
            engine_meta=call.engine_meta,
            timings=call.timings,
            created_at=now,
        )
        self.db.add(row)
        session = await self.db.get(SessionRow, call.session_id)
        if session is not None:
            session.updated_at = now
        await self.db.flush()
        return row
