"""An export's reads on a SQLite file through the stdlib driver on a thread: its snapshot and first
page of finished sessions, each page's calls' token blobs and stored summaries. SQLAlchemy's async
layer over aiosqlite costs more than SQLite takes to read them. Any other database reads them
through the Repository and the selection's queries."""

from __future__ import annotations

import asyncio
import functools
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from sqlalchemy import Integer, bindparam
from sqlalchemy.dialects.sqlite.pysqlite import SQLiteDialect_pysqlite
from sqlalchemy.engine import make_url

from proxy.export.read_connections import READERS
from proxy.store.database import database_error, is_database_failure
from proxy.store.models import CallRow, SegmentSummaryRow, SessionRow
from proxy.store.repository import TokenCall
from proxy.store.selection import LAST_SEQ, Page, Selection, finished_query
from proxy.store.turn_store import Compiled

T = TypeVar("T")
Calls = dict[str, dict[int, TokenCall]]
Stored = dict[str, dict[int, bytes]]
Metas = Callable[[list[dict[str, Any]]], None]


def sqlite_file(url: str) -> str | None:
    """The database file of a SQLite URL; None for any other database, an in-memory one, or a URL
    with options (`?uri=true`, `?mode=ro`: SQLAlchemy's path honours them, this one would not)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") or parsed.query:
        return None
    return parsed.database


def _marks(count: int) -> str:
    return ",".join("?" * count)


def _blobs(db: sqlite3.Connection, session_ids: Sequence[str], drift_mode: str) -> tuple[Calls, Stored]:
    calls: Calls = {session_id: {} for session_id in session_ids}
    stored: Stored = {session_id: {} for session_id in session_ids}
    # Ordered as the session_id index holds them (each session's calls by id): ordered by id alone,
    # SQLite copied every row, blobs and all, through a sort first.
    for session_id, call_id, parent_id, added, output, logprobs, reward, experts in db.execute(
        f"SELECT session_id, id, parent_id, prompt_added, output_ids, output_logprobs, reward,"
        f" routed_experts FROM {CallRow.__tablename__}"
        f" WHERE session_id IN ({_marks(len(session_ids))}) AND status = 'ok'"
        " ORDER BY session_id, id",
        list(session_ids),
    ):
        calls[session_id][call_id] = TokenCall(call_id, parent_id, added, output, logprobs, reward, experts)
    for session_id, leaf, summary in db.execute(
        f"SELECT session_id, leaf_call_id, summary FROM {SegmentSummaryRow.__tablename__}"
        f" WHERE session_id IN ({_marks(len(session_ids))}) AND drift_mode = ?",
        [*session_ids, drift_mode],
    ):
        stored[session_id][int(leaf)] = summary
    return calls, stored


def _read(path: str, session_ids: Sequence[str], drift_mode: str) -> tuple[Calls, Stored]:
    with READERS.transaction(path) as db:  # both reads see one snapshot, as the Repository's do
        return _blobs(db, session_ids, drift_mode)


async def _on_thread(read: Callable[[], T]) -> T:
    """A read run on a thread; a failing database is a DatabaseUnavailable (503)."""
    try:
        return await asyncio.to_thread(read)
    except Exception as exc:
        if is_database_failure(exc):
            raise database_error(exc) from exc
        raise


async def read_page(path: str, session_ids: Sequence[str], drift_mode: str) -> tuple[Calls, Stored]:
    """The completed calls (by id, in recording order) and the stored summaries (by leaf call) of
    these sessions, read in one transaction; a failing database is a DatabaseUnavailable (503)."""
    return await _on_thread(functools.partial(_read, path, session_ids, drift_mode))


# The statements SQLAlchemy runs for the snapshot and a page of finished sessions, compiled once
# (a page's once per shape of its filters): compiling one costs about what running it does.
_DIALECT = SQLiteDialect_pysqlite(paramstyle="qmark")
_LAST_SEQ_SQL = str(LAST_SEQ.compile(dialect=_DIALECT))
_KEYS = [attr.key for attr in SessionRow.__mapper__.column_attrs]


def _filters(ids: bool, groups: bool, consumer: bool) -> tuple[Selection, list[Any]]:
    """A selection of this shape whose filters are bind parameters (selection.py's filters take
    them), and the cursor, snapshot and page size marks: a page statement compiled once."""
    filters: dict[str, Any] = {
        "consumer": bindparam("consumer") if consumer else None,
        "session_ids": bindparam("session_ids", expanding=True) if ids else None,
        "group_ids": bindparam("group_ids", expanding=True) if groups else None,
    }
    return Selection(**filters), [bindparam(name, type_=Integer) for name in ("after", "last_seq", "size")]


@functools.lru_cache(maxsize=8)
def _page_query(ids: bool, groups: bool, consumer: bool) -> Compiled:
    """The page query for filters of this shape, its lists bound as expanding parameters."""
    shape, marks = _filters(ids, groups, consumer)
    columns = [attr.columns[0] for attr in SessionRow.__mapper__.column_attrs]
    return Compiled(finished_query(shape, *marks, *columns), _DIALECT)


@functools.lru_cache(maxsize=8)
def _metas_query(ids: bool, groups: bool, consumer: bool) -> Compiled:
    """The metadata of the sessions the page query gives, a page at a time (Parquet's first pass)."""
    shape, marks = _filters(ids, groups, consumer)
    return Compiled(finished_query(shape, *marks, SessionRow.meta), _DIALECT)


# Sessions whose metadata is read at once by the metadata pass.
METAS_PAGE = 256


def _read_metas(db: sqlite3.Connection, values: dict[str, Any], query: Compiled, add: Metas) -> None:
    """Every selected session's metadata, a page at a time, handed to `add` (memory stays bounded)."""
    after = values["after"]
    while True:
        rows = query.rows(db, values | {"after": after, "size": METAS_PAGE})
        if rows:
            add([meta for _, meta in rows])
        if len(rows) < METAS_PAGE:
            return
        after = int(rows[-1][0])


@dataclass(frozen=True)
class Start:
    """An export's snapshot and its first page of finished sessions with their calls and summaries."""

    last_seq: int
    page: Page
    calls: Calls
    stored: Stored


def _start(path: str, selection: Selection, size: int, drift_mode: str, metas: Metas | None) -> Start:
    ids, groups = selection.session_ids, selection.group_ids
    shape = (ids is not None, groups is not None, selection.consumer is not None)
    query = _page_query(*shape)
    values: dict[str, Any] = {"after": selection.after, "size": size, "consumer": selection.consumer}
    values |= {"session_ids": list(ids or ()), "group_ids": list(groups or ())}
    with READERS.transaction(path) as db:  # the snapshot and the first page in one transaction
        last_seq = int(db.execute(_LAST_SEQ_SQL).fetchone()[0] or 0)
        rows = query.rows(db, values | {"last_seq": last_seq})
        page: Page = [(int(row[0]), SessionRow(**dict(zip(_KEYS, row[1:], strict=True)))) for row in rows]
        calls, stored = _blobs(db, [session.id for _, session in page], drift_mode)
        if metas is not None:
            _read_metas(db, values | {"last_seq": last_seq}, _metas_query(*shape), metas)
    return Start(last_seq, page, calls, stored)


async def read_start(
    path: str, selection: Selection, size: int, drift_mode: str, metas: Metas | None = None
) -> Start:
    """The snapshot (the last finished sequence number now) and the first page of up to `size`
    finished sessions `selection` gives (not whole groups), read in one transaction; with `metas`,
    every selected session's metadata handed to it page by page in that transaction too (a Parquet
    export's first pass, which through SQLAlchemy cost more than the page it precedes)."""
    if selection.status != "finished" or selection.whole_groups:
        raise ValueError("read_start reads finished sessions, not whole groups")
    return await _on_thread(functools.partial(_start, path, selection, size, drift_mode, metas))
