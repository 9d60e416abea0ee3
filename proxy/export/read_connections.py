"""SQLite read connections for exports, kept idle between them: opening one (the file, then its
schema, then preparing each statement anew) cost about a fifth of reading a page of blobs."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# SQLite reads the blobs from the mapped file instead of copying them page by page through its
# cache (about half the read time). The map is on only while an export reads: it is dropped when
# the connection goes back idle, so the proxy's resident memory does not grow with the database.
MMAP_BYTES = 1 << 30
BUSY_TIMEOUT_MS = 30_000
# Idle connections kept over all files (a test run opens many databases; a server reads one).
KEEP = 4

# A file as the connection opened it: a file replaced at the same path is another database.
Identity = tuple[int, int]


def _identity(path: str) -> Identity | None:
    try:
        found = os.stat(path)
    except OSError:
        return None
    return found.st_dev, found.st_ino


def _connect(path: str) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    try:
        db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    except BaseException:
        db.close()
        raise
    return db


@dataclass(frozen=True)
class _Held:
    path: str
    # The file as it was when the connection opened it. The connection holds that file open, so no
    # file created later at the path can have its inode: a different identity is a replaced file.
    identity: Identity
    db: sqlite3.Connection


class ReadConnections:
    """At most KEEP idle connections, the most recently used last; one export uses one at a time."""

    def __init__(self) -> None:
        self._idle: list[_Held] = []
        self._lock = threading.Lock()

    def _take(self, path: str) -> tuple[sqlite3.Connection, Identity | None]:
        """An idle connection to the file now at `path` (those to a file since replaced are closed),
        or a new one."""
        current = _identity(path)
        with self._lock:
            stale = [held for held in self._idle if held.path == path and held.identity != current]
            fresh = [held for held in self._idle if held.path == path and held.identity == current]
            taken = fresh[-1] if fresh else None
            self._idle = [held for held in self._idle if held not in stale and held is not taken]
        for held in stale:
            held.db.close()
        if taken is not None:
            return taken.db, taken.identity
        db = _connect(path)
        return db, _identity(path)

    def _give(self, path: str, db: sqlite3.Connection, identity: Identity | None) -> None:
        if identity is None:
            db.close()
            return
        with self._lock:
            self._idle.append(_Held(path, identity, db))
            evicted = self._idle[:-KEEP]
            del self._idle[:-KEEP]
        for held in evicted:
            held.db.close()

    def close(self) -> None:
        """Close the idle connections (those in use close or come back idle as usual)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for held in idle:
            held.db.close()

    @contextmanager
    def transaction(self, path: str) -> Iterator[sqlite3.Connection]:
        """A connection to `path` in a read transaction (one snapshot for all its reads), the file
        mapped; idle again afterwards, or closed if anything failed."""
        db, identity = self._take(path)
        try:
            db.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            db.execute("BEGIN")
            yield db
            db.execute("ROLLBACK")  # only read: ends the snapshot, so checkpoints can go past it
            db.execute("PRAGMA mmap_size=0")
        except BaseException:
            db.close()
            raise
        self._give(path, db, identity)


READERS = ReadConnections()
