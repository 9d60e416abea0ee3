"""The turn path's reads and writes: a few indexed reads before the engine call, one commit after it.

On a SQLite file the statements run on a synchronous connection: an indexed read takes microseconds,
far less than a hop through aiosqlite's thread and SQLAlchemy's async layer. Commits are grouped: one
writer thread commits every turn waiting at that moment in one transaction (one fsync), then wakes
their requests, so a turn is still durable before it is answered. PostgreSQL runs the same reads on
asyncpg's connections (pg_turns.py); an in-memory SQLite database runs them through the async engine.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import queue
import sqlite3
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple, cast

import orjson
from sqlalchemy import (
    JSON,
    Connection,
    Integer,
    Select,
    Table,
    bindparam,
    create_engine,
    event,
    select,
    true,
)
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.engine import Dialect, make_url
from sqlalchemy.exc import DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from proxy.errors import Conflict, ProxyError, RecordFailed, SessionFinished
from proxy.store.database import database_error, is_database_failure, sqlite_pragmas
from proxy.store.models import WEIGHT_VERSION_KEY, CallRow, SegmentRow, SessionRow, SettingRow
from proxy.store.packed_json import PackedJSON, json_bytes, pack_json
from proxy.store.repository import utcnow
from proxy.store.wal_room import WAL_ROOM_BYTES, make_wal_room

log = logging.getLogger("tito_proxy.store")

# Turns committed together at most: bounds one transaction's size when hundreds wait.
MAX_GROUP = 256
# How often, at most, the WAL is checkpointed while turns are written (SQLite's own default, every
# 1,000 pages, is ~1 s of a busy proxy's commits).
CHECKPOINT_EVERY_S = 1.0
# Commits between two checkpoints at least: each checkpoint syncs the database file, and SQLite's
# own default (a checkpoint per 1,000 pages) is some dozens of commits.
CHECKPOINT_AFTER_COMMITS = 32
# A WAL this long (in pages) is checkpointed by the writer itself, between two commits: under writes
# that never pause, the checkpointer's copies never catch up and the WAL would only grow.
WAL_LIMIT_PAGES = 4_000
# A turn alone is committed on the event loop only while commits take less than this (a smoothed
# average): on a slow disk an fsync held on the loop would stall the requests that arrive meanwhile.
INLINE_COMMIT_MAX_S = 0.002


class NewCall(NamedTuple):
    """Everything recorded for one engine call. A named tuple: one is built per call on the event
    loop, where a frozen dataclass's field-by-field assignment of these 23 fields cost ~4 µs, and the
    writer reads it as the row it writes."""

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
    adapter: str | None = None
    routed_experts: bytes | None = None


@dataclass(frozen=True)
class SessionState:
    status: str
    template_now: datetime


@dataclass(frozen=True)
class ContinuedCall:
    """What continuing a recorded call needs of it."""

    id: int
    session_id: str
    segment_id: int
    depth: int
    response_message: dict[str, Any]


@dataclass(frozen=True)
class SegmentCall:
    """What rebuilding a call's context and conversation reads of each call of its segment."""

    id: int
    parent_id: int | None
    prompt_added: bytes
    output_ids: bytes
    request: dict[str, Any]
    response_message: dict[str, Any]


@dataclass(frozen=True)
class TurnWrite:
    """The calls of one request, committed together (all choices, or none)."""

    session_id: str
    template_now: datetime  # for a session created by this write
    calls: Sequence[NewCall]


# A statement of the turn path (SQLAlchemy's Select is generic over its row's columns).
Query = Select[*tuple[Any, ...]]

# Built once with bound parameters: building and hashing a statement costs more than running it.
_CONTINUED = select(
    CallRow.id, CallRow.session_id, CallRow.segment_id, CallRow.depth, CallRow.response_message
)
_SESSION = SessionRow.id == bindparam("session")
# One row, whether the session exists or not: its state, and the trainer-set weight version, read
# from the database on every turn (it is set on any process or replica; a copy kept here goes stale).
_SESSION_STATE = select(
    select(SessionRow.status).where(_SESSION).scalar_subquery().label("status"),
    select(SessionRow.template_now).where(_SESSION).scalar_subquery().label("template_now"),
    select(SettingRow.value)
    .where(SettingRow.key == WEIGHT_VERSION_KEY)
    .scalar_subquery()
    .label("weight_version"),
)
_TRAINER_VERSION = select(SettingRow.value).where(SettingRow.key == WEIGHT_VERSION_KEY)
# Completed calls whose conversation (request + reply) has this key, newest first.
_WITH_HISTORY = _CONTINUED.where(
    CallRow.session_id == bindparam("session"),
    CallRow.history_key == bindparam("key"),
    CallRow.status == "ok",
).order_by(CallRow.id.desc())
# A message turn's two reads in one statement (one read transaction, one round trip): the session's
# state row, then each call continuing the history, newest first; a row of NULL calls when none does.
_STATE = _SESSION_STATE.subquery("state")
_HISTORY = _WITH_HISTORY.order_by(None).subquery("history")
_STATE_WITH_HISTORY = (
    select(_STATE, _HISTORY).select_from(_STATE.outerjoin(_HISTORY, true())).order_by(_HISTORY.c.id.desc())
)
_LATEST_ANSWERED = (
    _CONTINUED.where(CallRow.session_id == bindparam("session"), CallRow.status == "ok")
    .order_by(CallRow.id.desc())
    .limit(bindparam("limit", type_=Integer))
)
_SEGMENT_COLUMNS = select(
    CallRow.id,
    CallRow.parent_id,
    CallRow.prompt_added,
    CallRow.output_ids,
    CallRow.request,
    CallRow.response_message,
)
_SEGMENT = _SEGMENT_COLUMNS.where(CallRow.segment_id == bindparam("segment")).order_by(CallRow.id)
# A segment's tree alone (a few bytes a call), and then only the calls a rebuild lacks.
_SEGMENT_LINKS = select(CallRow.id, CallRow.parent_id).where(CallRow.segment_id == bindparam("segment"))
_CALLS_BY_ID = _SEGMENT_COLUMNS.where(CallRow.id.in_(bindparam("ids", expanding=True))).order_by(CallRow.id)


_SESSIONS = cast(Table, SessionRow.__table__)
_SEGMENTS = cast(Table, SegmentRow.__table__)
_CALLS = cast(Table, CallRow.__table__)
NEW_CALL_FIELDS: tuple[str, ...] = NewCall._fields
_SEGMENT_INDEX = NEW_CALL_FIELDS.index("segment_id")


def _session_upsert(insert_for: Any) -> Any:
    """Creates a session on its first call and marks it touched on every later one; returns each
    session's status as the commit sees it (the upsert holds the row: SQLite's one writer, or
    PostgreSQL's row lock, which a concurrent finish waits for or has released)."""
    statement = insert_for(_SESSIONS)
    return statement.on_conflict_do_update(
        index_elements=[_SESSIONS.c.id], set_={"updated_at": statement.excluded.updated_at}
    ).returning(_SESSIONS.c.id, _SESSIONS.c.status)


# Core statements, built once: ORM-level inserts with .values() rebuild and re-key a statement per
# row, which cost more than the write itself. Each runs once per group, with one row per turn.
_UPSERT_SESSIONS = {
    "sqlite": _session_upsert(sqlite.insert),
    "postgresql": _session_upsert(postgresql.insert),
}
_OPEN_SEGMENTS = _SEGMENTS.insert().returning(_SEGMENTS.c.id, sort_by_parameter_order=True)
_INSERT_CALLS = _CALLS.insert().returning(_CALLS.c.id, sort_by_parameter_order=True)


def write_turns(db: Connection, writes: Sequence[TurnWrite]) -> list[list[int]]:
    """Insert the calls of several requests (and their sessions, on a first call); returns each
    request's call ids. The caller owns the transaction."""
    now = utcnow()
    first_render: dict[str, datetime] = {}
    for write in writes:
        first_render.setdefault(write.session_id, write.template_now)
    statuses = db.execute(
        _UPSERT_SESSIONS[db.dialect.name],
        [
            {"id": session_id, "status": "active", "created_at": now, "updated_at": now, "template_now": at}
            for session_id, at in first_render.items()
        ],
    ).all()
    refuse_finished(statuses)
    calls = [call for write in writes for call in write.calls]
    rows = [{name: getattr(call, name) for name in NEW_CALL_FIELDS} | {"created_at": now} for call in calls]
    opening = [row for row in rows if row["segment_id"] is None]  # each opens a segment of its own
    if opening:
        segment_ids = db.execute(
            _OPEN_SEGMENTS, [{"session_id": row["session_id"], "created_at": now} for row in opening]
        ).scalars()
        for row, segment_id in zip(opening, segment_ids, strict=True):
            row["segment_id"] = segment_id
    call_ids = list(db.execute(_INSERT_CALLS, rows).scalars())
    per_write, start = [], 0
    for write in writes:
        per_write.append(call_ids[start : start + len(write.calls)])
        start += len(write.calls)
    return per_write


def refuse_finished(statuses: Sequence[Any]) -> None:
    finished = sorted(session_id for session_id, status in statuses if status == "finished")
    if finished:
        # The rule: no turn is recorded after its session's finish, so none is missing from the
        # export that follows it. The whole transaction is refused (the writer retries a group's
        # other turns alone).
        raise SessionFinished(
            f"session {finished[0]!r} was finished while this turn ran; the turn is not recorded",
            param="session_id",
        )


def recording_error(error: BaseException) -> ProxyError:
    """What the client is told when its turn cannot be committed (nothing of it is recorded)."""
    # SQLSTATE class 23, integrity constraint violation, as asyncpg raises it on its own connections.
    if isinstance(error, IntegrityError) or str(getattr(error, "sqlstate", "")).startswith("23"):
        # A session or segment deleted while the turn ran: its rows have nothing to belong to.
        return Conflict("the session was deleted or changed while this turn ran; nothing was recorded")
    reason = error.orig if isinstance(error, DBAPIError) else error  # the driver's words, not the SQL
    return RecordFailed(f"the turn could not be recorded, so it is not answered: {reason}")


class TurnStore(abc.ABC):
    """The reads of the turn path, given a way to run a query, and its commit."""

    # Told each commit's group size and seconds (metrics); called from the writer thread on SQLite.
    on_commit: Callable[[int, float], None] | None = None

    @abc.abstractmethod
    async def _rows(self, query: Query, params: dict[str, Any]) -> Sequence[Any]: ...

    @abc.abstractmethod
    async def record(self, write: TurnWrite, *, alone: bool = False) -> list[int]:
        """Commit the calls; returns only once they are durable. `alone`: no other turn is under way
        in this process, so nothing would wait if the commit blocked the event loop."""

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def _read(self, query: Query, params: dict[str, Any]) -> Sequence[Any]:
        try:
            return await self._rows(query, params)
        except Exception as exc:
            if is_database_failure(exc):
                raise database_error(exc) from exc
            raise

    async def session_state(self, session_id: str) -> SessionState | None:
        return (await self.turn_start(session_id))[0]

    async def turn_start(self, session_id: str) -> tuple[SessionState | None, str | None]:
        """The session's state (None before its first call) and the trainer-set weight version."""
        [(status, template_now, weight_version)] = await self._read(_SESSION_STATE, {"session": session_id})
        state = None if status is None else SessionState(status=status, template_now=template_now)
        return state, weight_version

    async def trainer_version(self) -> str | None:
        """The trainer-set weight version (POST /admin/weight_version), whichever process set it."""
        rows = await self._read(_TRAINER_VERSION, {})
        return rows[0][0] if rows else None

    async def turn_start_with_history(
        self, session_id: str, history_key: str
    ) -> tuple[SessionState | None, str | None, list[ContinuedCall]]:
        """turn_start and calls_with_history in one read: what a turn that echoes a history reads
        before it is planned."""
        rows = await self._read(_STATE_WITH_HISTORY, {"session": session_id, "key": history_key})
        status, template_now, weight_version = rows[0][:3]
        state = None if status is None else SessionState(status=status, template_now=template_now)
        return state, weight_version, [ContinuedCall(*row[3:]) for row in rows if row[3] is not None]

    async def calls_with_history(self, session_id: str, history_key: str) -> list[ContinuedCall]:
        rows = await self._read(_WITH_HISTORY, {"session": session_id, "key": history_key})
        return [ContinuedCall(*row) for row in rows]

    async def latest_answered(self, session_id: str, limit: int) -> list[ContinuedCall]:
        rows = await self._read(_LATEST_ANSWERED, {"session": session_id, "limit": limit})
        return [ContinuedCall(*row) for row in rows]

    async def segment_rows(self, segment_id: int) -> list[SegmentCall]:
        return [SegmentCall(*row) for row in await self._read(_SEGMENT, {"segment": segment_id})]

    async def segment_links(self, segment_id: int) -> dict[int, int | None]:
        """Each call of the segment: its parent's id."""
        rows = await self._read(_SEGMENT_LINKS, {"segment": segment_id})
        return {call_id: parent_id for call_id, parent_id in rows}

    async def calls(self, call_ids: Sequence[int]) -> list[SegmentCall]:
        """These calls, oldest first."""
        return [SegmentCall(*row) for row in await self._read(_CALLS_BY_ID, {"ids": list(call_ids)})]


class AsyncTurnStore(TurnStore):
    """The turn path on the async engine (in-memory SQLite, or another PostgreSQL driver than asyncpg)."""

    def __init__(self, engine: AsyncEngine) -> None:
        self._engine = engine

    async def _rows(self, query: Query, params: dict[str, Any]) -> Sequence[Any]:
        async with self._engine.connect() as db:
            return (await db.execute(query, params)).all()

    async def record(self, write: TurnWrite, *, alone: bool = False) -> list[int]:
        began = time.perf_counter()
        try:
            async with self._engine.begin() as db:
                [call_ids] = await db.run_sync(write_turns, [write])
        except Exception as exc:
            if is_database_failure(exc):
                raise recording_error(exc) from exc
            raise
        if self.on_commit is not None:
            self.on_commit(1, time.perf_counter() - began)
        return call_ids

    async def close(self) -> None:
        return None


class Compiled:
    """A statement compiled once and run on the driver's connection, its parameters and
    columns converted by SQLAlchemy's own types: building and compiling a statement per execution
    (even from SQLAlchemy's cache) cost more than the indexed read or the insert itself."""

    def __init__(self, statement: Any, dialect: Dialect, column_keys: Sequence[str] | None = None) -> None:
        compiled = statement.compile(dialect=dialect, column_keys=list(column_keys or ()) or None)
        self.sql = compiled.string
        self._names = tuple(compiled.positiontup or ())
        binds = compiled.binds
        # An `IN` over a list (expanding bind): its placeholders are only known once the list is.
        self._expanding = compiled if any(bind.expanding for bind in binds.values()) else None
        # Values written into the statement itself (`status == "ok"`), bound like the others.
        self._fixed = {name: bind.value for name, bind in binds.items() if not bind.required}
        self._writers = [
            binds[name].type.dialect_impl(dialect).bind_processor(dialect) for name in self._names
        ]
        columns = statement.selected_columns if hasattr(statement, "selected_columns") else ()
        self._readers = [
            column.type.dialect_impl(dialect).result_processor(dialect, None) for column in columns
        ]

    def parameters(self, values: dict[str, Any]) -> list[Any]:
        merged = {**self._fixed, **values}
        return [
            value if writer is None else writer(value)
            for writer, value in zip(self._writers, (merged[name] for name in self._names), strict=True)
        ]

    def _expanded(self, values: dict[str, Any]) -> tuple[str, list[Any]]:
        assert self._expanding is not None
        state = self._expanding.construct_expanded_state({**self._fixed, **values})
        processors = state.processors
        parameters = [
            processors[name](state.parameters[name]) if name in processors else state.parameters[name]
            for name in state.positiontup or ()
        ]
        return state.statement, parameters

    def bound(self, values: dict[str, Any]) -> tuple[str, list[Any]]:
        """The statement to run for these values, and its positional parameters."""
        return (self.sql, self.parameters(values)) if self._expanding is None else self._expanded(values)

    def rows(self, db: sqlite3.Connection, values: dict[str, Any]) -> list[tuple[Any, ...]]:
        sql, parameters = self.bound(values)
        cursor = db.execute(sql, parameters)
        try:
            found = cursor.fetchall()
        finally:
            cursor.close()
        return self.converted(found)

    def converted(self, found: list[Any]) -> list[Any]:
        """Rows with their columns read by SQLAlchemy's types (none on a driver that decodes them)."""
        readers = self._readers
        if not any(readers):
            return found
        return [
            tuple(
                value if read is None or value is None else read(value)
                for read, value in zip(readers, row, strict=True)
            )
            for row in found
        ]


class _SqliteWrites:
    """write_turns' statements on SQLite's DBAPI connection, their parameters converted by hand once
    per group where SQLAlchemy's types would convert each value of each row (the dates of a group
    are one value; only the JSON columns differ per row)."""

    def __init__(self, dialect: Dialect) -> None:
        when = _SESSIONS.c.created_at.type.dialect_impl(dialect).bind_processor(dialect)
        date = _SESSIONS.c.template_now.type.dialect_impl(dialect).bind_processor(dialect)
        assert when is not None
        assert date is not None
        self._when, self._date = when, date
        # A finished session's row is left as it is: no change (rowcount 0) refuses the group, with
        # no read after the write.
        self.sessions = (
            "INSERT INTO sessions (id, status, created_at, updated_at, template_now, metadata)"
            " VALUES (?, 'active', ?, ?, ?, '{}') ON CONFLICT (id) DO UPDATE"
            " SET updated_at = excluded.updated_at WHERE sessions.status != 'finished'"
        )
        self.segments = "INSERT INTO segments (session_id, created_at) VALUES (?, ?)"
        columns = (*NEW_CALL_FIELDS, "created_at")
        self.calls = f"INSERT INTO calls ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})"
        types = [_CALLS.c[name].type for name in NEW_CALL_FIELDS]
        self._json = [i for i, kind in enumerate(types) if isinstance(kind, JSON)]
        self._packed = [i for i, kind in enumerate(types) if isinstance(kind, PackedJSON)]

    def write(self, db: sqlite3.Connection, writes: Sequence[TurnWrite]) -> list[list[int]]:
        try:
            return self._write(db, writes)
        except sqlite3.Error as exc:
            # As SQLAlchemy raises it (IntegrityError, OperationalError): one error tree for both paths.
            raise DBAPIError.instance(None, None, exc, sqlite3.Error) from exc

    def _write(self, db: sqlite3.Connection, writes: Sequence[TurnWrite]) -> list[list[int]]:
        now = self._when(utcnow())
        first_render: dict[str, datetime] = {}
        for write in writes:
            first_render.setdefault(write.session_id, write.template_now)
        # One statement for the group's sessions (each sqlite3 call gives up the GIL and takes it back
        # from the event loop): a finished session's row is left as it is, so fewer rows changed than
        # sessions written refuses the group, naming the finished ones.
        upserts = [(session_id, now, now, self._date(at)) for session_id, at in first_render.items()]
        if db.executemany(self.sessions, upserts).rowcount != len(upserts):
            refuse_finished(self._finished(db, list(first_render)))
        rows = [self._row(db, call, now) for write in writes for call in write.calls]
        if not rows:
            return [[] for _ in writes]
        db.executemany(self.calls, rows)
        # One writer, one statement: its rows took consecutive ids (AUTOINCREMENT), the last of them
        # last_insert_rowid().
        [(last,)] = db.execute("SELECT last_insert_rowid()").fetchall()
        call_ids = iter(range(last - len(rows) + 1, last + 1))
        return [[next(call_ids) for _ in write.calls] for write in writes]

    @staticmethod
    def _finished(db: sqlite3.Connection, session_ids: list[str]) -> list[tuple[str, str]]:
        marks = ", ".join("?" * len(session_ids))
        return db.execute(
            f"SELECT id, status FROM sessions WHERE status = 'finished' AND id IN ({marks})", session_ids
        ).fetchall()

    def _row(self, db: sqlite3.Connection, call: NewCall, now: str) -> list[Any]:
        row = list(call)
        for index in self._json:
            row[index] = json_text(row[index])
        for index in self._packed:
            row[index] = pack_json(row[index])
        if call.segment_id is None:  # each opens a segment of its own
            row[_SEGMENT_INDEX] = db.execute(self.segments, (call.session_id, now)).lastrowid
        row.append(now)
        return row


@dataclass
class _Pending:
    write: TurnWrite
    future: asyncio.Future[list[int]]
    loop: asyncio.AbstractEventLoop


# A turn's outcome: its call ids once committed, or the error that kept it from being recorded.
_Committed = tuple[list[int], BaseException | None]
_Outcome = tuple[_Pending, list[int], BaseException | None]


def _settle(outcomes: list[_Outcome]) -> None:
    for pending, call_ids, error in outcomes:
        if pending.future.done():  # the request was cancelled; its turn is recorded all the same
            continue
        if error is not None:
            pending.future.set_exception(error)
        else:
            pending.future.set_result(call_ids)


def _recorded_error(error: BaseException) -> BaseException:
    """What a failed commit raises: SQLAlchemy's errors, or the driver's own from a commit, as the
    proxy's (chained to them); any other error as it is."""
    if not is_database_failure(error):
        return error
    converted = recording_error(error)
    converted.__cause__ = error
    return converted


def json_text(value: Any) -> str:
    return json_bytes(value).decode()


class SqliteTurnStore(TurnStore):
    """The turn path on a SQLite file: reads on the event loop, grouped commits on one writer thread."""

    def __init__(self, url: str) -> None:
        sync_url = make_url(url).set(drivername="sqlite")
        self._engine = create_engine(
            sync_url,
            # One thread at a time uses each connection: the reader the loop, the writer its thread.
            connect_args={"check_same_thread": False},
            json_serializer=json_text,
            json_deserializer=orjson.loads,
        )
        event.listen(self._engine, "connect", sqlite_pragmas)
        # Held open: a pool checkout costs more than the indexed read itself.
        self._reader = self._engine.connect()
        self._read_db = cast(sqlite3.Connection, self._reader.connection.dbapi_connection)
        self._compiled: dict[int, Compiled] = {}
        self._writes = _SqliteWrites(self._engine.dialect)
        # The one connection that writes turns: the writer thread's, or the event loop's for a turn
        # committed alone; whoever holds the lock uses it.
        self._write_db = self._engine.connect()
        self._write_raw = cast(sqlite3.Connection, self._write_db.connection.dbapi_connection)
        # Checkpoints are the checkpointer's (below); a commit never runs one.
        self._write_raw.execute("PRAGMA wal_autocheckpoint=0")
        if sync_url.database and sync_url.database != ":memory:":
            make_wal_room(self._write_raw, Path(f"{sync_url.database}-wal"), WAL_ROOM_BYTES)
        self._write_lock = threading.Lock()
        self._commit_s = 0.0  # seconds a commit takes, smoothed over the recent ones
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="tito-turn-writer", daemon=True)
        self._writer.start()
        # WAL checkpoints run here, off the writer: SQLite would run one inside a commit every ~1,000
        # pages, and every turn waiting on that commit would wait for the copy and its fsync.
        self._wal_written = threading.Event()  # set every CHECKPOINT_AFTER_COMMITS commits
        self._commits = 0  # since the last signal; the writer's own
        self._wal_long = False  # the checkpointer found more pages than WAL_LIMIT_PAGES
        self._stopping = False
        self._checkpointer = threading.Thread(
            target=self._checkpoint_loop, name="tito-wal-checkpoint", daemon=True
        )
        self._checkpointer.start()

    async def _rows(self, query: Query, params: dict[str, Any]) -> Sequence[Any]:
        compiled = self._compiled.get(id(query))
        if compiled is None:
            compiled = self._compiled[id(query)] = Compiled(query, self._engine.dialect)
        try:
            return compiled.rows(self._read_db, params)
        finally:
            if self._read_db.in_transaction:  # none left open: WAL checkpoints must not wait
                self._read_db.rollback()

    async def record(self, write: TurnWrite, *, alone: bool = False) -> list[int]:
        if (
            alone
            and self._commit_s < INLINE_COMMIT_MAX_S
            and self._queue.empty()
            and self._write_lock.acquire(blocking=False)
        ):
            # Nothing else under way: committing right here spares the hand-off to the writer thread
            # and back (~0.15 ms of a lone turn's answer). Under load turns wait for the writer, whose
            # group commits would be lost if the event loop held each fsync.
            try:
                [(call_ids, error)] = self._commit_group([write])
            finally:
                self._write_lock.release()
            if error is not None:
                raise _recorded_error(error)
            return call_ids
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[int]] = loop.create_future()
        self._queue.put(_Pending(write, future, loop))
        # A request cancelled while waiting cancels only this future: the writer commits its turn all
        # the same, and _settle passes over a future already done (no shield needed, nor its second
        # future and callbacks).
        try:
            return await future
        except Exception as exc:
            raise _recorded_error(exc)  # noqa: B904 - chained inside when it is another error

    async def close(self) -> None:
        self._queue.put(None)
        await asyncio.to_thread(self._writer.join)
        self._stopping = True
        self._wal_written.set()
        await asyncio.to_thread(self._checkpointer.join)
        self._write_db.close()
        self._reader.close()
        self._engine.dispose()

    def _checkpoint_loop(self) -> None:
        """Copies committed WAL frames into the database file (PASSIVE: it never blocks the writer or
        a reader), every CHECKPOINT_AFTER_COMMITS commits and at most every CHECKPOINT_EVERY_S."""
        with self._engine.connect() as db:
            raw = cast(sqlite3.Connection, db.connection.dbapi_connection)
            while not self._stopping:
                self._wal_written.wait()
                self._wal_written.clear()
                self._wal_long = _checkpoint(raw) > WAL_LIMIT_PAGES
                time.sleep(0 if self._stopping else CHECKPOINT_EVERY_S)

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            group = [first]
            stopping = False
            while len(group) < MAX_GROUP:
                try:
                    waiting = self._queue.get_nowait()
                except queue.Empty:
                    break
                if waiting is None:
                    stopping = True
                    break
                group.append(waiting)
            with self._write_lock:
                outcomes = self._commit_group([pending.write for pending in group])
            self._deliver([(pending, *outcome) for pending, outcome in zip(group, outcomes, strict=True)])
            if stopping:
                return

    def _commit_group(self, writes: list[TurnWrite]) -> list[_Committed]:
        """One commit of these turns on the writer's connection (its lock held), with the WAL kept short
        and the checkpointer told, as every commit does wherever it runs."""
        if self._wal_long:
            self._wal_long = _checkpoint(self._write_raw) > WAL_LIMIT_PAGES
        began = time.perf_counter()
        outcomes = self._commit(writes)
        took = time.perf_counter() - began
        self._commit_s += (took - self._commit_s) / 8
        self._commits += 1
        if self._commits >= CHECKPOINT_AFTER_COMMITS:
            self._commits = 0
            self._wal_written.set()
        if self.on_commit is not None:
            self.on_commit(len(writes), took)
        return outcomes

    def _commit(self, writes: list[TurnWrite]) -> list[_Committed]:
        """Each turn's call ids, or why it failed; a turn has ids only once its commit is done."""
        raw = self._write_raw
        try:
            with self._write_db.begin():
                results = self._writes.write(raw, writes)
        except Exception as error:
            # A failed COMMIT (the disk, a lock) may leave SQLite's transaction open: its rows would
            # be committed with the next group's, under turns told they were not recorded.
            if raw.in_transaction:
                raw.rollback()
            if len(writes) == 1:
                return [([], error)]
            # One bad write must not fail the others: commit each on its own.
            return [outcome for write in writes for outcome in self._commit([write])]
        return [(call_ids, None) for call_ids in results]

    @staticmethod
    def _deliver(outcomes: list[_Outcome]) -> None:
        """Wakes each event loop once for the whole group (a wake-up per turn costs the loop more)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        for outcome in outcomes:
            by_loop.setdefault(outcome[0].loop, []).append(outcome)
        for loop, settled in by_loop.items():
            try:
                loop.call_soon_threadsafe(_settle, settled)
            except RuntimeError:  # the loop has closed: nobody waits for these answers any more
                log.warning("%d turns' writes ended after their event loop closed", len(settled))


def _checkpoint(db: sqlite3.Connection) -> int:
    """A PASSIVE checkpoint (it waits for no reader or writer); returns the WAL's length in pages."""
    try:
        _, pages, _ = db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
    except sqlite3.Error as exc:  # the next commit asks again
        log.warning("WAL checkpoint failed: %s", exc)
        return 0
    return int(pages)
