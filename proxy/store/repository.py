"""Reads and writes of sessions, segments and calls for the admin, export and retry routes
(the turn path has its own, in turn_store.py)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession as DbSession
from sqlalchemy.ext.asyncio import async_sessionmaker

from proxy.store.groups import GroupClaim, apply_claim
from proxy.store.models import (
    CallRow,
    ExportAckRow,
    FinishedRow,
    SegmentRow,
    SegmentSummaryRow,
    SessionRow,
    SettingRow,
)


class TokenCall(NamedTuple):
    """What an export row reads of a completed call besides its stored summary: the token blobs
    and the reward (which a trainer may set after the finish). A named tuple: an export makes one
    per call, and a frozen dataclass's constructor costs several times more."""

    id: int
    parent_id: int | None
    prompt_added: bytes
    output_ids: bytes
    output_logprobs: bytes
    reward: float | None
    routed_experts: bytes | None = None  # MoE routing replay, where recorded


# The PostgreSQL advisory lock that orders finishes by their export cursors ("tito" in ASCII).
_CURSOR_ORDER_LOCK = 0x7469746F
_TOKEN_CALLS = select(
    CallRow.session_id,
    CallRow.id,
    CallRow.parent_id,
    CallRow.prompt_added,
    CallRow.output_ids,
    CallRow.output_logprobs,
    CallRow.reward,
    CallRow.routed_experts,
).order_by(CallRow.id)


def utcnow() -> datetime:
    return datetime.now(UTC)


def utc_iso(moment: datetime) -> str:
    """ISO 8601 with its zone: times are stored in UTC, and SQLite hands them back without a zone."""
    return (moment if moment.tzinfo is not None else moment.replace(tzinfo=UTC)).isoformat()


def in_utc(moment: datetime) -> datetime:
    """A time to compare with stored ones, in UTC (a time without a zone is taken as UTC): SQLite
    compares the stored text, which drops the zone, so 07:00+02:00 must become 05:00."""
    return moment.astimezone(UTC) if moment.tzinfo is not None else moment


async def first_setting(db_sessions: async_sessionmaker[DbSession], key: str, proposed: str) -> str:
    """The setting's stored value; `proposed` is stored when there is none. Processes starting at
    once all get the value the first of them stored (the primary key admits one)."""
    async with db_sessions() as db:
        found = await Repository(db).get_setting(key)
    if found is not None:
        return found
    # The IntegrityError is caught inside the session: leaving it, the error would become a Conflict.
    async with db_sessions() as db:
        try:
            async with db.begin():
                db.add(SettingRow(key=key, value=proposed))
            return proposed
        except IntegrityError:
            pass
    async with db_sessions() as db:
        stored = await Repository(db).get_setting(key)
    assert stored is not None, f"the setting {key} vanished"
    return stored


class Repository:
    def __init__(self, db: DbSession) -> None:
        self.db = db

    async def get_session(self, session_id: str) -> SessionRow | None:
        return await self.db.get(SessionRow, session_id)

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

    async def session_of_request(self, request_hash: str, since: datetime) -> str | None:
        """The session of the newest completed call answering a request with this body hash since
        `since`, in any session (a sessionless SDK retry's original); None if there is none. Only a
        retry that names no session asks; the request-hash index leads with the hash for it."""
        query = (
            select(CallRow.session_id)
            .where(CallRow.request_hash == request_hash, CallRow.status == "ok", CallRow.created_at >= since)
            .order_by(CallRow.id.desc())
            .limit(1)
        )
        found: str | None = await self.db.scalar(query)
        return found

    async def session_calls(self, session_id: str) -> Sequence[CallRow]:
        result = await self.db.scalars(
            select(CallRow).where(CallRow.session_id == session_id).order_by(CallRow.id)
        )
        return result.all()

    # Session lifecycle ------------------------------------------------------------------------

    async def create_session(
        self, session_id: str, meta: dict[str, Any], template_now: datetime, group: GroupClaim | None = None
    ) -> SessionRow | None:
        """A new session, or None when the id (or its group's sample index) is taken."""
        now = utcnow()
        row = SessionRow(
            id=session_id,
            status="active",
            created_at=now,
            updated_at=now,
            template_now=template_now,
            meta=meta,
        )
        if group is not None:
            apply_claim(row, group)
        try:
            async with self.db.begin_nested():
                self.db.add(row)
        except IntegrityError:
            return None
        return row

    async def finish_session(self, session: SessionRow, *, idle_before: datetime | None = None) -> bool:
        """Finish an active session (only if idle since `idle_before`, when given); it gets the next
        export cursor. One conditional UPDATE: it waits for a turn's commit holding the row, and a
        turn committing later sees the finish and is refused. Finishing twice changes nothing."""
        now = utcnow()
        query = update(SessionRow).where(SessionRow.id == session.id, SessionRow.status == "active")
        if idle_before is not None:
            query = query.where(SessionRow.updated_at < idle_before)
        result = await self.db.execute(
            query.values(status="finished", finished_at=now, updated_at=now),
            execution_options={"synchronize_session": False},
        )
        changed = bool(getattr(result, "rowcount", 0))
        if changed:
            await self._in_cursor_order()
            self.db.add(FinishedRow(session_id=session.id))
            await self.db.flush()
        await self.db.refresh(session)
        return changed

    async def _in_cursor_order(self) -> None:
        """Finishes commit in the order of their cursors. On PostgreSQL, sequence values are taken at
        insert, not at commit: a finish that took cursor N and committed after one that took N+1
        was delivered by no export that had gone past N+1 (nor acked truly by a cursor ack). A lock
        held from the cursor's taking to the commit orders them; SQLite has one writer already."""
        if self.db.get_bind().dialect.name == "postgresql":
            await self.db.execute(select(func.pg_advisory_xact_lock(_CURSOR_ORDER_LOCK)))

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
            (SegmentSummaryRow, SegmentSummaryRow.session_id),
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

    async def token_calls(self, session_ids: Sequence[str]) -> dict[str, dict[int, TokenCall]]:
        """The completed calls of these sessions, by call id in recording order, in one query."""
        query = _TOKEN_CALLS.where(CallRow.session_id.in_(list(session_ids)), CallRow.status == "ok")
        calls: dict[str, dict[int, TokenCall]] = {session_id: {} for session_id in session_ids}
        # Core, not the ORM: plain rows, no identity map, for the export's bulk of blobs.
        connection = await self.db.connection()
        for session_id, call_id, parent_id, added, output, logprobs, reward, experts in (
            await connection.execute(query)
        ).all():
            calls[session_id][call_id] = TokenCall(
                call_id, parent_id, added, output, logprobs, reward, experts
            )
        return calls

    async def segment_summaries(
        self, session_ids: Sequence[str], drift_mode: str
    ) -> dict[str, dict[int, bytes]]:
        """The stored summaries (JSON) of these sessions' branches under this drift mode, by leaf call."""
        result = await self.db.execute(
            select(
                SegmentSummaryRow.session_id, SegmentSummaryRow.leaf_call_id, SegmentSummaryRow.summary
            ).where(
                SegmentSummaryRow.session_id.in_(list(session_ids)),
                SegmentSummaryRow.drift_mode == drift_mode,
            )
        )
        stored: dict[str, dict[int, bytes]] = {session_id: {} for session_id in session_ids}
        for session_id, leaf, summary in result.all():
            stored[session_id][int(leaf)] = bytes(summary)
        return stored

    async def add_segment_summaries(
        self, session_id: str, drift_mode: str, summaries: dict[int, bytes]
    ) -> None:
        """Store summaries; one stored meanwhile (another export, another worker) is the same and stays."""
        if not summaries:
            return
        dialect = postgresql if self.db.get_bind().dialect.name == "postgresql" else sqlite
        insert = dialect.insert(SegmentSummaryRow).on_conflict_do_nothing()
        await self.db.execute(
            insert,
            [
                {"leaf_call_id": leaf, "drift_mode": drift_mode, "session_id": session_id, "summary": blob}
                for leaf, blob in summaries.items()
            ],
        )

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
