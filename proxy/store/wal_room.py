"""Room made in a SQLite write-ahead log before the first turn, so turn commits overwrite it.

A commit's fdatasync costs about twice as much when its frames extend the log file as when they
overwrite it (the file's new size must reach the disk too, through the filesystem's journal):
~0.35 ms against ~0.17 ms per commit on this project's test host. SQLite reuses the log from its
start after each checkpoint but never shrinks it (journal_size_limit stays unset), so only a new
log pays this, for its first tens of megabytes: every turn of a freshly started proxy. PostgreSQL
zero-fills its WAL segments before use for the same reason.

The room is made with SQLite's own machinery, never by writing its files: a transaction whose pages
spill to the log (a page cache of a few pages) is rolled back. Its frames stay in the file, past
the last commit, where no reader or checkpoint looks and the next commits overwrite them; the
database file and its schema are left as they were. A crash in the middle leaves the same
uncommitted frames, which recovery ignores. No room is made on a filesystem short of free space.
"""

from __future__ import annotations

import logging
import os
import sqlite3
from pathlib import Path

log = logging.getLogger("tito_proxy.store")

# About what a busy proxy writes between two checkpoints (turn_store.WAL_LIMIT_PAGES 4 KiB pages,
# and the checkpointer's second), so its log rarely grows past the room.
WAL_ROOM_BYTES = 24 << 20
# Dirty pages held in memory while the room is made: fewer spill to the log sooner.
_SPILL_CACHE_PAGES = 16
# No room is made on a filesystem with less free space than this: the room would take space other
# writers (and this database's own checkpoints) need.
MIN_FREE_BYTES = 1 << 30


def make_wal_room(db: sqlite3.Connection, wal_path: Path, room_bytes: int = WAL_ROOM_BYTES) -> None:
    """Grow the log at `wal_path` (the connection's database's) to about `room_bytes`, unless it is
    that long already; a failure only logs (commits then extend the log as they would have)."""
    if _size(wal_path) >= room_bytes or _journal_mode(db) != "wal" or _free(wal_path) < MIN_FREE_BYTES:
        return
    try:
        _spill_and_roll_back(db, room_bytes)
        _sync(wal_path)  # else the first turn's commit would flush the whole room
    except (sqlite3.Error, OSError) as exc:
        log.warning("could not make room in the SQLite write-ahead log: %s", exc)


def _spill_and_roll_back(db: sqlite3.Connection, room_bytes: int) -> None:
    [(cache_pages,)] = db.execute("PRAGMA cache_size").fetchall()
    [(page_bytes,)] = db.execute("PRAGMA page_size").fetchall()
    # The pages still cached at the rollback never reach the log: written on top.
    blob_bytes = room_bytes + 2 * _SPILL_CACHE_PAGES * int(page_bytes)
    db.execute(f"PRAGMA cache_size={_SPILL_CACHE_PAGES}")
    try:
        db.execute("BEGIN IMMEDIATE")
        try:
            db.execute("CREATE TABLE tito_wal_room (room BLOB)")
            db.execute("INSERT INTO tito_wal_room VALUES (zeroblob(?))", (blob_bytes,))
        finally:
            db.execute("ROLLBACK")
    finally:
        db.execute(f"PRAGMA cache_size={int(cache_pages)}")


def _journal_mode(db: sqlite3.Connection) -> str:
    [(mode,)] = db.execute("PRAGMA journal_mode").fetchall()
    return str(mode).lower()


def _free(path: Path) -> int:
    """Bytes free to an unprivileged writer on the filesystem holding `path`."""
    stats = os.statvfs(path.parent)
    return stats.f_bavail * stats.f_frsize


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _sync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(descriptor)
    finally:
        os.close(descriptor)
