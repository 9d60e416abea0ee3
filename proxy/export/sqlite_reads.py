"""An export page's bulk reads on a SQLite file (its calls' token blobs and its stored summaries)
through the stdlib driver on a thread: SQLAlchemy's async layer over aiosqlite costs more than
SQLite takes to read the blobs. Any other database reads them through the Repository."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence

from sqlalchemy.engine import make_url

from proxy.store.database import database_error, is_database_failure
from proxy.store.models import CallRow, SegmentSummaryRow
from proxy.store.repository import TokenCall

# SQLite reads the blobs from the mapped file instead of copying them page by page through its
# cache (about half the read time). The map is the connection's, gone when it closes after the
# page, so the proxy's resident memory does not grow with the database.
MMAP_BYTES = 1 << 30
BUSY_TIMEOUT_MS = 30_000

Calls = dict[str, dict[int, TokenCall]]
Stored = dict[str, dict[int, bytes]]


def sqlite_file(url: str) -> str | None:
    """The database file of a SQLite URL; None for any other database, an in-memory one, or a URL
    with options (`?uri=true`, `?mode=ro`: SQLAlchemy's path honours them, this one would not)."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or parsed.database in (None, "", ":memory:") or parsed.query:
        return None
    return parsed.database


def _marks(count: int) -> str:
    return ",".join("?" * count)


def _read(path: str, session_ids: Sequence[str], drift_mode: str) -> tuple[Calls, Stored]:
    calls: Calls = {session_id: {} for session_id in session_ids}
    stored: Stored = {session_id: {} for session_id in session_ids}
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        db.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
        db.execute("BEGIN")  # both reads see one snapshot, as the Repository's transaction does
        for session_id, call_id, parent_id, added, output, logprobs, reward, experts in db.execute(
            f"SELECT session_id, id, parent_id, prompt_added, output_ids, output_logprobs, reward,"
            f" routed_experts FROM {CallRow.__tablename__}"
            f" WHERE session_id IN ({_marks(len(session_ids))}) AND status = 'ok' ORDER BY id",
            list(session_ids),
        ):
            calls[session_id][call_id] = TokenCall(
                call_id, parent_id, added, output, logprobs, reward, experts
            )
        for session_id, leaf, summary in db.execute(
            f"SELECT session_id, leaf_call_id, summary FROM {SegmentSummaryRow.__tablename__}"
            f" WHERE session_id IN ({_marks(len(session_ids))}) AND drift_mode = ?",
            [*session_ids, drift_mode],
        ):
            stored[session_id][int(leaf)] = summary
    finally:
        db.close()
    return calls, stored


async def read_page(path: str, session_ids: Sequence[str], drift_mode: str) -> tuple[Calls, Stored]:
    """The completed calls (by id, in recording order) and the stored summaries (by leaf call) of
    these sessions, read in one transaction; a failing database is a DatabaseUnavailable (503)."""
    try:
        return await asyncio.to_thread(_read, path, session_ids, drift_mode)
    except Exception as exc:
        if is_database_failure(exc):
            raise database_error(exc) from exc
        raise
