"""SQLite read connections for exports, kept idle between them: opening one (the file, then its
schema, then preparing each statement anew) cost about a fifth of reading a page of blobs."""

from __future__ import annotations

import os
import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager

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


class ReadConnections:
    """At most KEEP idle connections, the most recently used last; one export uses one at a time."""

    def __init__(self) -> None:
        self._idle: list[tuple[str, Identity, sqlite3.Connection]] = []
        self._lock = threading.Lock()

    def _take(self, path: str) -> sqlite3.Connection:
        identity = _identity(path)
        stale: list[sqlite3.Connection] = []
        taken = None
        with self._lock:
            for index in range(len(self._idle) - 1, -1, -1):
                held_path, held_identity, db = self._idle[index]
                if held_path != path:
                    continue
                del self._idle[index]
                if taken is None and identity is not None and held_identity == identity:
                    taken = db
                else:
                    stale.append(db)
        for db in stale:
            db.close()
        return taken if taken is not None else _connect(path)

    def _give(self, path: str, db: sqlite3.Connection) -> None:
        identity = _identity(path)
        if identity is None:
            db.close()
            return
        with self._lock:
            self._idle.append((path, identity, db))
            evicted = self._idle[:-KEEP]
            del self._idle[:-KEEP]
        for _, _, old in evicted:
            old.close()

    def close(self) -> None:
        """Close the idle connections (those in use close or come back idle as usual)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for _, _, db in idle:
            db.close()

    @contextmanager
    def transaction(self, path: str) -> Iterator[sqlite3.Connection]:
        """A connection to `path` in a read transaction (one snapshot for all its reads), the file
        mapped; idle again afterwards, or closed if anything failed."""
        db = self._take(path)
        try:
            db.execute(f"PRAGMA mmap_size={MMAP_BYTES}")
            db.execute("BEGIN")
            yield db
            db.execute("ROLLBACK")  # only read: ends the snapshot, so checkpoints can go past it
            db.execute("PRAGMA mmap_size=0")
        except BaseException:
            db.close()
            raise
        self._give(path, db)


READERS = ReadConnections()
