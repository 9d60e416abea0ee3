"""Reads and writes of sessions, segments and calls: the only module that builds SQL."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import delete, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.orm import load_only

from proxy.store.models import CallRow, ExportAckRow, FinishedRow, SegmentRow, SessionRow, SettingRow


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
    idempotency_key: str | None = None
    request_hash: str | None = None


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

    async def segment_rows(self, segment_id: int) -> Sequence[CallRow]:
        """The calls of a segment with what rebuilding their contexts and conversations needs."""
        result = await self.db.scalars(
            select(CallRow)
            .where(CallRow.segment_id == segment_id)
            .options(
                load_only(
                    CallRow.id,
                    CallRow.parent_id,
                    CallRow.prompt_added,
                    CallRow.output_ids,
                    CallRow.request,
                    CallRow.response_message,
                )
            )
            .order_by(CallRow.id)
        )
        return result.all()

    async def answered_calls(
        self,
        session_id: str,
        *,
        idempotency_key: str | None = None,
        request_hash: str | None = None,
        since: datetime | None = None,
    ) -> Sequence[CallRow]:
        """Completed calls a retry may be answered from: by key, else by body hash (newest request)."""
        query = select(CallRow).where(CallRow.session_id == session_id, CallRow.status == "ok")
        if idempotency_key is not None:
            query = query.where(CallRow.idempotency_key == idempotency_key)
        elif request_hash is not None:
            query = query.where(CallRow.request_hash == request_hash)
        else:
            return []
        if since is not None:
            query = query.where(CallRow.created_at >= since)
        result = await self.db.scalars(query.order_by(CallRow.id))
        return result.all()

    async def latest_answered(self, session_id: str, limit: int) -> Sequence[CallRow]:
        result = await self.db.scalars(
            select(CallRow)
            .where(CallRow.session_id == session_id, CallRow.status == "ok")
            .order_by(CallRow.id.desc())
            .limit(limit)
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
            idempotency_key=call.idempotency_key,
            request_hash=call.request_hash,
        )
        self.db.add(row)
        session = await self.db.get(SessionRow, call.session_id)
        if session is not None:
            session.updated_at = now
        await self.db.flush()
        return row

    # Session lifecycle ------------------------------------------------------------------------

    async def create_session(
        self, session_id: str, meta: dict[str, Any], template_now: datetime
    ) -> SessionRow | None:
        """A new session, or None when the id is taken."""
        now = utcnow()
        row = SessionRow(
            id=session_id,
            status="active",
            created_at=now,
            updated_at=now,
            template_now=template_now,
            meta=meta,
        )
        try:
            async with self.db.begin_nested():
                self.db.add(row)
        except IntegrityError:
            return None
        return row

    async def finish_session(self, session: SessionRow) -> None:
        """Finished sessions get the next export cursor; finishing twice changes nothing."""
        if session.status == "finished":
            return
        session.status = "finished"
        session.finished_at = session.updated_at = utcnow()
        self.db.add(FinishedRow(session_id=session.id))
        await self.db.flush()

    async def idle_sessions(self, idle_before: datetime, limit: int = 500) -> Sequence[SessionRow]:
        result = await self.db.scalars(
            select(SessionRow)
            .where(SessionRow.status == "active", SessionRow.updated_at < idle_before)
            .order_by(SessionRow.updated_at)
            .limit(limit)
        )
        return result.all()

    async def list_sessions(self, status: str | None, after: str | None, limit: int) -> Sequence[SessionRow]:
        query = select(SessionRow).order_by(SessionRow.id).limit(limit)
        if status is not None:
            query = query.where(SessionRow.status == status)
        if after is not None:
            query = query.where(SessionRow.id > after)
        return (await self.db.scalars(query)).all()

    async def delete_session(self, session_id: str) -> bool:
        # Children first: SQLite enforces the foreign keys but the ORM does not cascade for us here.
        for table, column in (
            (ExportAckRow, ExportAckRow.session_id),
            (FinishedRow, FinishedRow.session_id),
            (CallRow, CallRow.session_id),
            (SegmentRow, SegmentRow.session_id),
        ):
            await self.db.execute(delete(table).where(column == session_id))
        result = await self.db.execute(delete(SessionRow).where(SessionRow.id == session_id))
        return bool(getattr(result, "rowcount", 0))

    async def set_call_rewards(self, session_id: str, rewards: dict[int, float]) -> set[int]:
        """Rewards per call id; returns the ids that are not calls of this session."""
        known = set(
            (
                await self.db.scalars(
                    select(CallRow.id).where(CallRow.session_id == session_id, CallRow.id.in_(list(rewards)))
                )
            ).all()
        )
        for call_id in known:
            await self.db.execute(
                update(CallRow).where(CallRow.id == call_id).values(reward=rewards[call_id])
            )
        return set(rewards) - known

    # Export -----------------------------------------------------------------------------------

    async def finished_page(
        self, *, after: int, consumer: str | None, limit: int
    ) -> Sequence[tuple[int, SessionRow]]:
        """Finished sessions after cursor `after`, in finishing order, minus those `consumer` acked."""
        query = (
            select(FinishedRow.seq, SessionRow)
            .join(SessionRow, SessionRow.id == FinishedRow.session_id)
            .where(FinishedRow.seq > after)
            .order_by(FinishedRow.seq)
            .limit(limit)
        )
        if consumer is not None:
            acked = select(ExportAckRow.session_id).where(ExportAckRow.consumer == consumer)
            query = query.where(FinishedRow.session_id.not_in(acked))
        rows = (await self.db.execute(query)).all()
        return [(int(seq), session) for seq, session in rows]

    async def ack(self, consumer: str, session_ids: Sequence[str]) -> int:
        """Record that `consumer` has the exports of these finished sessions; returns how many are new."""
        finished = set(
            (
                await self.db.scalars(
                    select(FinishedRow.session_id).where(FinishedRow.session_id.in_(list(session_ids)))
                )
            ).all()
        )
        done = set(
            (
                await self.db.scalars(
                    select(ExportAckRow.session_id).where(
                        ExportAckRow.consumer == consumer, ExportAckRow.session_id.in_(list(finished))
                    )
                )
            ).all()
        )
        now = utcnow()
        for session_id in sorted(finished - done):
            self.db.add(ExportAckRow(consumer=consumer, session_id=session_id, acked_at=now))
        await self.db.flush()
        return len(finished - done)

    async def session_ids_up_to(self, cursor: int) -> Sequence[str]:
        result = await self.db.scalars(select(FinishedRow.session_id).where(FinishedRow.seq <= cursor))
        return result.all()

    # Settings ---------------------------------------------------------------------------------

    async def get_setting(self, key: str) -> str | None:
        row = await self.db.get(SettingRow, key)
        return row.value if row is not None else None

    async def set_setting(self, key: str, value: str) -> None:
        row = await self.db.get(SettingRow, key)
        if row is None:
            self.db.add(SettingRow(key=key, value=value))
        else:
            row.value = value
        await self.db.flush()
