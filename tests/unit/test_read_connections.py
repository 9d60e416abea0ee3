"""Export read connections kept idle between exports: reused for the same file, each read in its own
snapshot with the file mapped only while it reads, never reused for a file replaced at that path or
after a failed read, and no more than KEEP kept over all files."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.export.read_connections import KEEP, MMAP_BYTES, ReadConnections


@pytest.fixture
def readers() -> Iterator[ReadConnections]:
    kept = ReadConnections()
    yield kept
    kept.close()


def _database(path: Path, value: int) -> str:
    with sqlite3.connect(path) as db:
        db.execute("CREATE TABLE IF NOT EXISTS t (v INTEGER)")
        db.execute("INSERT INTO t VALUES (?)", (value,))
    db.close()
    return str(path)


def _values(readers: ReadConnections, path: str) -> list[int]:
    with readers.transaction(path) as db:
        return [v for (v,) in db.execute("SELECT v FROM t ORDER BY v")]


def test_a_connection_is_reused_each_read_in_a_new_snapshot_mapped_only_while_it_reads(
    readers: ReadConnections, tmp_path: Path
) -> None:
    path = _database(tmp_path / "a.db", 1)
    with readers.transaction(path) as first:
        assert first.in_transaction
        assert first.execute("PRAGMA mmap_size").fetchone()[0] == MMAP_BYTES
    assert not first.in_transaction
    assert first.execute("PRAGMA mmap_size").fetchone()[0] == 0
    _database(tmp_path / "a.db", 2)  # written in between: the next read sees it
    with readers.transaction(path) as second:
        assert second is first
        assert [v for (v,) in second.execute("SELECT v FROM t ORDER BY v")] == [1, 2]


def test_a_file_replaced_at_the_same_path_is_read_afresh(readers: ReadConnections, tmp_path: Path) -> None:
    path = _database(tmp_path / "a.db", 1)
    assert _values(readers, path) == [1]
    Path(path).rename(tmp_path / "old.db")
    _database(tmp_path / "a.db", 7)
    assert _values(readers, path) == [7]


def test_a_failed_read_does_not_leave_its_connection_for_the_next(
    readers: ReadConnections, tmp_path: Path
) -> None:
    path = _database(tmp_path / "a.db", 1)
    with pytest.raises(sqlite3.OperationalError), readers.transaction(path) as failed:
        failed.execute("SELECT nothing FROM nowhere")
    with readers.transaction(path) as next_one:
        assert next_one is not failed
        assert [v for (v,) in next_one.execute("SELECT v FROM t")] == [1]


def test_no_more_than_keep_idle_connections_over_all_files(readers: ReadConnections, tmp_path: Path) -> None:
    paths = [_database(tmp_path / f"{n}.db", n) for n in range(KEEP + 3)]
    held = []
    for path in paths:
        with readers.transaction(path) as db:
            held.append(db)
    for db in held[: len(paths) - KEEP]:
        with pytest.raises(sqlite3.ProgrammingError):  # closed when it fell out
            db.execute("SELECT 1")
    assert [_values(readers, path) for path in paths] == [[n] for n in range(KEEP + 3)]


def test_exports_at_once_read_on_their_own_connections_and_both_are_kept(
    readers: ReadConnections, tmp_path: Path
) -> None:
    path = _database(tmp_path / "a.db", 1)
    with readers.transaction(path) as first, readers.transaction(path) as second:
        assert first is not second
    with readers.transaction(path) as again, readers.transaction(path) as other:
        assert {id(again), id(other)} == {id(first), id(second)}


def test_a_file_deleted_and_created_again_at_the_same_path_is_read_afresh(
    readers: ReadConnections, tmp_path: Path
) -> None:
    path = _database(tmp_path / "a.db", 1)
    assert _values(readers, path) == [1]
    Path(path).unlink()
    _database(tmp_path / "a.db", 5)
    assert _values(readers, path) == [5]
