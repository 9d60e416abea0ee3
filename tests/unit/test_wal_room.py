"""Room made in a SQLite write-ahead log: the log grows, and nothing else about the database changes."""

from __future__ import annotations

import asyncio
import logging
import shutil
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.store import wal_room
from proxy.store.database import upgrade_blocking
from proxy.store.turn_store import SqliteTurnStore
from proxy.store.wal_room import WAL_ROOM_BYTES, make_wal_room

ROOM = 2 << 20


def _connect(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=FULL")
    db.execute("PRAGMA wal_autocheckpoint=0")
    return db


@pytest.fixture
def database(tmp_path: Path) -> Iterator[tuple[sqlite3.Connection, Path]]:
    path = tmp_path / "turns.db"
    db = _connect(path)
    db.execute("CREATE TABLE calls (id INTEGER PRIMARY KEY, ids BLOB)")
    db.executemany("INSERT INTO calls (ids) VALUES (?)", [(bytes([n]) * 3000,) for n in range(50)])
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    yield db, path
    db.close()


def _rows(db: sqlite3.Connection) -> list[tuple[int, bytes]]:
    return db.execute("SELECT id, ids FROM calls ORDER BY id").fetchall()


def test_the_log_grows_and_the_database_file_and_schema_stay_as_they_were(
    database: tuple[sqlite3.Connection, Path],
) -> None:
    db, path = database
    file_before, rows_before = path.read_bytes(), _rows(db)
    schema_before = db.execute("SELECT * FROM sqlite_schema ORDER BY name").fetchall()
    [(cache_before,)] = db.execute("PRAGMA cache_size").fetchall()

    make_wal_room(db, Path(f"{path}-wal"), ROOM)

    assert Path(f"{path}-wal").stat().st_size >= ROOM
    assert path.read_bytes() == file_before
    assert db.execute("SELECT * FROM sqlite_schema ORDER BY name").fetchall() == schema_before
    assert db.execute("PRAGMA cache_size").fetchall() == [(cache_before,)]
    assert not db.in_transaction
    assert _rows(db) == rows_before
    # A checkpoint copies nothing of the room into the database.
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    assert path.read_bytes() == file_before


def test_commits_after_it_overwrite_the_room_and_are_read_back_after_a_crash(
    database: tuple[sqlite3.Connection, Path], tmp_path: Path
) -> None:
    db, path = database
    wal = Path(f"{path}-wal")
    make_wal_room(db, wal, ROOM)
    room = wal.stat().st_size
    for n in range(20):
        db.execute("INSERT INTO calls (ids) VALUES (?)", (bytes([n]) * 5000,))
    assert wal.stat().st_size == room  # overwritten, not extended
    committed = _rows(db)

    # The files as a crash would leave them (no checkpoint, the log still open): recovery must find
    # the committed rows and nothing of the room.
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    for suffix in ("", "-wal"):
        shutil.copyfile(f"{path}{suffix}", crashed / f"turns.db{suffix}")
    recovered = _connect(crashed / "turns.db")
    try:
        assert _rows(recovered) == committed
        assert recovered.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        room_table = "SELECT name FROM sqlite_schema WHERE name = 'tito_wal_room'"
        assert recovered.execute(room_table).fetchall() == []
    finally:
        recovered.close()


def test_a_log_with_room_already_is_left_alone(database: tuple[sqlite3.Connection, Path]) -> None:
    db, path = database
    wal = Path(f"{path}-wal")
    make_wal_room(db, wal, ROOM)
    written = wal.stat().st_mtime_ns
    make_wal_room(db, wal, ROOM)
    assert wal.stat().st_mtime_ns == written


def test_a_database_another_connection_is_writing_is_only_warned_about(
    database: tuple[sqlite3.Connection, Path], caplog: pytest.LogCaptureFixture
) -> None:
    db, path = database
    other = _connect(path)
    other.execute("BEGIN IMMEDIATE")
    other.execute("INSERT INTO calls (ids) VALUES (x'01')")
    db.execute("PRAGMA busy_timeout=0")
    try:
        with caplog.at_level(logging.WARNING, logger="tito_proxy.store"):
            make_wal_room(db, Path(f"{path}-wal"), ROOM)
        assert "could not make room" in caplog.text
        assert not db.in_transaction
        other.execute("COMMIT")
        assert len(_rows(db)) == 51
    finally:
        other.close()


def test_a_database_without_a_write_ahead_log_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "rollback-journal.db"
    db = sqlite3.connect(path, isolation_level=None)
    try:
        db.execute("CREATE TABLE calls (id INTEGER PRIMARY KEY)")
        before = path.read_bytes()
        make_wal_room(db, Path(f"{path}-wal"), ROOM)
        assert not Path(f"{path}-wal").exists()
        assert path.read_bytes() == before
    finally:
        db.close()


def test_the_turn_store_makes_room_before_its_first_turn(tmp_path: Path) -> None:
    path = tmp_path / "turns.db"
    upgrade_blocking(f"sqlite:///{path}")
    store = SqliteTurnStore(f"sqlite:///{path}")
    try:
        assert Path(f"{path}-wal").stat().st_size >= WAL_ROOM_BYTES
    finally:
        asyncio.run(store.close())


def test_no_room_is_taken_from_a_filesystem_short_of_space(
    database: tuple[sqlite3.Connection, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The room would take space other writers and the database's own checkpoints need."""
    db, path = database
    monkeypatch.setattr(wal_room, "MIN_FREE_BYTES", 1 << 62)
    before = Path(f"{path}-wal").stat().st_size
    make_wal_room(db, Path(f"{path}-wal"), ROOM)
    assert Path(f"{path}-wal").stat().st_size == before
