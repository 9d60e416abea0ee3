"""The turn store: every record is durable when it returns, grouped commits stay independent."""

from __future__ import annotations

import asyncio
import base64
import os
import sqlite3
import threading
from collections.abc import Callable
from contextlib import closing
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine, event

from proxy.errors import Conflict, RecordFailed, SessionFinished
from proxy.store import turn_store
from proxy.store.database import create_engine, upgrade_blocking
from proxy.store.packed_json import unpack_json
from proxy.store.turn_store import AsyncTurnStore, SqliteTurnStore, TurnStore
from tests.turn_writes import turn_write

StoreFactory = Callable[[str], TurnStore]


class _OwnEngineStore(AsyncTurnStore):
    """The async store with an engine of its own (the app disposes its shared engine itself)."""

    def __init__(self, url: str) -> None:
        self._own_engine = create_engine(url)
        super().__init__(self._own_engine)

    async def close(self) -> None:
        await self._own_engine.dispose()


STORES: dict[str, StoreFactory] = {"sqlite-writer-thread": SqliteTurnStore, "async-engine": _OwnEngineStore}


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "turns.db"
    upgrade_blocking(f"sqlite:///{path}")
    return path


def _recorded_ids(db: Path) -> set[int]:
    """Read by a separate connection, as a crash-restarted proxy would."""
    with sqlite3.connect(db) as other:
        return {row[0] for row in other.execute("select id from calls")}


@pytest.mark.parametrize("kind", STORES)
def test_a_record_is_durable_when_it_returns_and_reads_see_it(db: Path, kind: str) -> None:
    async def scenario() -> None:
        store = STORES[kind](f"sqlite:///{db}")
        try:
            assert await store.session_state("s") is None
            [first] = await store.record(turn_write("s"))
            assert _recorded_ids(db) == {first}
            [continued] = await store.calls_with_history("s", "k")
            assert continued.id == first
            assert continued.depth == 0
            [second] = await store.record(turn_write("s", segment_id=continued.segment_id, parent_id=first))
            assert _recorded_ids(db) == {first, second}
            state = await store.session_state("s")
            assert state is not None
            assert state.status == "active"
            assert state.template_now == datetime(2026, 1, 2)
            latest = await store.latest_answered("s", 1)
            assert [call.id for call in latest] == [second]
            segment = await store.segment_rows(continued.segment_id)
            assert [(call.id, call.parent_id) for call in segment] == [(first, None), (second, first)]
            assert segment[1].request == {"messages": [{"role": "user", "content": "hi"}]}
            # What a process rebuilding a context another process recorded reads.
            assert await store.segment_links(continued.segment_id) == {first: None, second: first}
            assert [call.id for call in await store.calls([second, first])] == [first, second]
            assert [call.request for call in await store.calls([second])] == [segment[1].request]
        finally:
            await store.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", STORES)
def test_one_read_gives_the_session_state_and_the_calls_continuing_a_history(db: Path, kind: str) -> None:
    """turn_start_with_history reads what turn_start and calls_with_history read, in one statement."""

    async def scenario() -> None:
        store = STORES[kind](f"sqlite:///{db}")
        try:
            assert await store.turn_start_with_history("s", "k") == (None, None, [])
            first, second = await store.record(turn_write("s", calls=2))
            with sqlite3.connect(db) as other:  # set by another process (POST /admin/weight_version)
                other.execute("insert into settings (key, value) values ('weight_version', 'v7')")
            state, version, calls = await store.turn_start_with_history("s", "k")
            assert (state, version) == await store.turn_start("s")
            assert state is not None
            assert (state.status, state.template_now, version) == ("active", datetime(2026, 1, 2), "v7")
            assert calls == await store.calls_with_history("s", "k")
            assert [call.id for call in calls] == [second, first]  # newest first
            assert calls[0].response_message == {"role": "assistant", "content": "ok"}
            # A history no call has, and a session without calls: the state alone.
            assert await store.turn_start_with_history("s", "other") == (state, "v7", [])
            assert await store.turn_start_with_history("t", "k") == (None, "v7", [])
        finally:
            await store.close()

    asyncio.run(scenario())


@pytest.mark.parametrize("kind", STORES)
def test_a_bad_write_fails_alone_and_commits_nothing_of_itself(db: Path, kind: str) -> None:
    async def scenario() -> None:
        store = STORES[kind](f"sqlite:///{db}")
        try:
            results = await asyncio.gather(
                store.record(turn_write("a")),
                store.record(turn_write("bad", segment_id=987654)),  # no such segment: a foreign-key error
                store.record(turn_write("b")),
                return_exceptions=True,
            )
        finally:
            await store.close()
        good_a, bad, good_b = results
        assert isinstance(bad, Conflict)  # a segment that is not there: deleted while the turn ran
        assert isinstance(good_a, list)
        assert isinstance(good_b, list)
        assert _recorded_ids(db) == {*good_a, *good_b}
        with sqlite3.connect(db) as other:
            sessions = {row[0] for row in other.execute("select id from sessions")}
        assert sessions == {"a", "b"}  # the failed write's session upsert was rolled back with it

    asyncio.run(scenario())


def _hold_write_lock(db: Path) -> sqlite3.Connection:
    """Another writer holds the database: the store's writer waits (busy_timeout) while turns queue."""
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    return holder


def test_turns_waiting_together_commit_in_one_transaction(db: Path) -> None:
    commits: list[object] = []

    def count(connection: object) -> None:
        commits.append(connection)

    async def scenario() -> list[list[int]]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        holder = _hold_write_lock(db)
        try:
            pending = [asyncio.create_task(store.record(turn_write(f"s{i}"))) for i in range(40)]
            await asyncio.sleep(0.2)  # every record is queued behind the held lock
            assert not any(task.done() for task in pending)
            holder.rollback()
            return await asyncio.gather(*pending)
        finally:
            holder.close()
            await store.close()

    event.listen(Engine, "commit", count)
    try:
        results = asyncio.run(scenario())
    finally:
        event.remove(Engine, "commit", count)
    ids = [call_id for call_ids in results for call_id in call_ids]
    assert len(set(ids)) == 40
    assert _recorded_ids(db) == set(ids)
    # Each request got back its own call's id, in a segment of its own session.
    with sqlite3.connect(db) as other:
        placed = dict(
            other.execute(
                "select calls.id, segments.session_id from calls"
                " join segments on segments.id = calls.segment_id"
            ).fetchall()
        )
    assert [placed[call_ids[0]] for call_ids in results] == [f"s{i}" for i in range(40)]
    # The first turn may have been taken alone before the others queued; the other 39 share a commit.
    assert len(commits) <= 2


def test_a_group_of_many_choices_and_continuations_gives_each_request_its_own_ids(db: Path) -> None:
    """The group's calls go in with one statement: each request still gets back its own calls' ids."""

    async def scenario() -> tuple[list[int], list[list[int]]]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        try:
            first = await store.record(turn_write("a"))
            with closing(sqlite3.connect(db)) as other:
                [(segment,)] = other.execute("select segment_id from calls").fetchall()
            holder = _hold_write_lock(db)
            writes = [
                turn_write("b", calls=3),
                turn_write("a", segment_id=segment, parent_id=first[0], content="next"),
                turn_write("c", calls=2, content="c"),
            ]
            pending = [asyncio.create_task(store.record(write)) for write in writes]
            await asyncio.sleep(0.2)
            holder.rollback()
            holder.close()
            return first, await asyncio.gather(*pending)
        finally:
            await store.close()

    first, (b, a, c) = asyncio.run(scenario())
    assert (len(b), len(a), len(c)) == (3, 1, 2)
    with sqlite3.connect(db) as other:
        rows = {
            call_id: (session, parent, unpack_json(request)["messages"][0]["content"])
            for call_id, session, parent, request in other.execute(
                "select id, session_id, parent_id, request from calls"
            )
        }
    assert [rows[i] for i in b] == [("b", None, "hi")] * 3
    assert [rows[i] for i in a] == [("a", first[0], "next")]
    assert [rows[i] for i in c] == [("c", None, "c")] * 2
    assert len(rows) == 7


def test_a_cancelled_request_still_has_its_turn_committed(db: Path) -> None:
    async def scenario() -> None:
        store = SqliteTurnStore(f"sqlite:///{db}")
        holder = _hold_write_lock(db)
        try:
            task = asyncio.create_task(store.record(turn_write("gone")))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            holder.rollback()
        finally:
            holder.close()
            await store.close()  # waits for the writer to finish what it took

    asyncio.run(scenario())
    assert len(_recorded_ids(db)) == 1


def test_a_group_whose_commit_fails_answers_none_of_its_turns_and_leaves_nothing_behind(db: Path) -> None:
    """A commit that fails (the disk) fails every turn of its group, each retried alone first, and
    none of their rows stays in the connection for the next group's commit to write."""

    def failing(connection: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    async def scenario() -> tuple[list[list[int] | BaseException], list[int]]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        try:
            holder = _hold_write_lock(db)  # the five turns queue, and commit as one group
            pending = [asyncio.create_task(store.record(turn_write(f"s{i}"))) for i in range(5)]
            await asyncio.sleep(0.2)
            event.listen(Engine, "commit", failing)
            try:
                holder.rollback()
                holder.close()
                failed = await asyncio.gather(*pending, return_exceptions=True)
            finally:
                event.remove(Engine, "commit", failing)
            return failed, await store.record(turn_write("later"))
        finally:
            await store.close()

    failed, later = asyncio.run(scenario())
    assert all(isinstance(error, RecordFailed) for error in failed), failed
    assert _recorded_ids(db) == set(later)
    with sqlite3.connect(db) as other:
        assert [row[0] for row in other.execute("select id from sessions")] == ["later"]


@pytest.mark.parametrize("kind", STORES)
def test_a_turn_of_a_finished_session_is_refused_at_its_commit_and_others_commit(db: Path, kind: str) -> None:
    async def scenario() -> list[object]:
        store = STORES[kind](f"sqlite:///{db}")
        try:
            await store.record(turn_write("done"))
            with sqlite3.connect(db) as other:  # the trainer's finish, committed by another connection
                other.execute("update sessions set status = 'finished' where id = 'done'")
            holder = _hold_write_lock(db)  # so that the three writes below queue, and group
            pending = [
                asyncio.create_task(store.record(turn_write(session))) for session in ("a", "done", "b")
            ]
            await asyncio.sleep(0.2)
            holder.rollback()
            holder.close()
            return await asyncio.gather(*pending, return_exceptions=True)
        finally:
            await store.close()

    good_a, refused, good_b = asyncio.run(scenario())
    assert isinstance(refused, SessionFinished)
    assert refused.status_code == 409
    assert isinstance(good_a, list)
    assert isinstance(good_b, list)
    with sqlite3.connect(db) as other:
        per_session = dict(other.execute("select session_id, count(*) from calls group by session_id"))
    assert per_session == {"done": 1, "a": 1, "b": 1}  # nothing of the refused turn


def _sizes(db: Path) -> tuple[int, int]:
    return os.path.getsize(f"{db}-wal"), os.path.getsize(db)


def _write_many(db: Path, turns: int) -> tuple[int, int]:
    """Back-to-back turns of ~3 KB of random text (about 2.3 KB once deflated as it is stored);
    returns the WAL's and the database file's sizes before closing."""

    async def scenario() -> tuple[int, int]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        try:
            for i in range(turns):
                text = base64.b64encode(os.urandom(2250)).decode()
                await store.record(turn_write(f"s{i % 20}", content=text))
            await asyncio.sleep(0.3)  # the checkpointer's last pass
            return await asyncio.to_thread(_sizes, db)
        finally:
            await store.close()

    return asyncio.run(scenario())


def test_the_wal_is_checkpointed_off_the_writer(db: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Commits never run a checkpoint (every turn waiting on one would wait for its copy and fsync):
    the checkpointer thread copies the WAL into the database file."""
    monkeypatch.setattr(turn_store, "CHECKPOINT_EVERY_S", 0.01)
    monkeypatch.setattr(turn_store, "CHECKPOINT_AFTER_COMMITS", 4)
    monkeypatch.setattr(turn_store, "WAL_LIMIT_PAGES", 1_000_000)  # the writer never checkpoints
    before = db.stat().st_size
    _, after = _write_many(db, 40)
    assert after > before + 40 * 2000
    with sqlite3.connect(db) as other:
        assert other.execute("select count(*) from calls").fetchone()[0] == 40


def test_a_wal_the_checkpointer_cannot_keep_short_is_checkpointed_by_the_writer(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes that never pause leave the checkpointer's copies behind; past WAL_LIMIT_PAGES the
    writer checkpoints between two commits, so the WAL stays bounded."""
    monkeypatch.setattr(turn_store, "CHECKPOINT_EVERY_S", 0.01)
    monkeypatch.setattr(turn_store, "CHECKPOINT_AFTER_COMMITS", 4)
    monkeypatch.setattr(turn_store, "WAL_LIMIT_PAGES", 50)
    monkeypatch.setattr(turn_store, "WAL_ROOM_BYTES", 0)  # the file's size is then the log's length
    wal, _ = _write_many(db, 300)
    assert wal < 4 * 1024 * 1024  # unbounded, 300 such turns leave ~15 MB


def _commit_threads(store: TurnStore) -> list[str]:
    """The name of the thread each commit ran on, as the store reports its commits."""
    threads: list[str] = []
    store.on_commit = lambda size, seconds: threads.append(threading.current_thread().name)
    return threads


def test_a_turn_alone_is_committed_on_the_event_loop_and_is_durable_when_it_returns(db: Path) -> None:
    async def scenario() -> tuple[list[int], list[int], list[str]]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        threads = _commit_threads(store)
        try:
            alone = await store.record(turn_write("a"), alone=True)
            assert _recorded_ids(db) == set(alone)
            queued = await store.record(turn_write("b"))
            return alone, queued, threads
        finally:
            await store.close()

    alone, queued, threads = asyncio.run(scenario())
    assert threads == [threading.main_thread().name, "tito-turn-writer"]
    assert _recorded_ids(db) == {*alone, *queued}


def test_a_turn_alone_waits_for_the_writer_while_it_commits_others(db: Path) -> None:
    """The writer thread is inside a commit (held up by another connection's lock): a turn said to be
    alone queues behind it instead of blocking the event loop on the same lock."""

    async def scenario() -> tuple[list[list[int]], list[str]]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        threads = _commit_threads(store)
        holder = _hold_write_lock(db)
        try:
            first = asyncio.create_task(store.record(turn_write("queued")))
            await asyncio.sleep(0.2)  # the writer has taken it and waits for the database
            second = asyncio.create_task(store.record(turn_write("alone"), alone=True))
            await asyncio.sleep(0.2)
            assert not first.done()
            assert not second.done()  # the loop ran on: the sleep above returned
            holder.rollback()
            return list(await asyncio.gather(first, second)), threads
        finally:
            holder.close()
            await store.close()

    results, threads = asyncio.run(scenario())
    assert threads == ["tito-turn-writer", "tito-turn-writer"]
    assert _recorded_ids(db) == {call_id for call_ids in results for call_id in call_ids}


def test_a_refused_turn_alone_is_refused_as_a_queued_one_is(db: Path) -> None:
    async def scenario() -> SessionFinished:
        store = SqliteTurnStore(f"sqlite:///{db}")
        try:
            await store.record(turn_write("done"), alone=True)
            with sqlite3.connect(db) as other:
                other.execute("update sessions set status = 'finished' where id = 'done'")
            with pytest.raises(SessionFinished) as refused:
                await store.record(turn_write("done"), alone=True)
            await store.record(turn_write("next"), alone=True)  # the connection is left clean
            return refused.value
        finally:
            await store.close()

    refused = asyncio.run(scenario())
    assert refused.status_code == 409
    with sqlite3.connect(db) as other:
        per_session = dict(other.execute("select session_id, count(*) from calls group by session_id"))
    assert per_session == {"done": 1, "next": 1}


def test_a_turn_alone_goes_to_the_writer_while_commits_are_slow(
    db: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a disk whose commits take longer than INLINE_COMMIT_MAX_S, an fsync held on the event loop
    would stall every request arriving meanwhile: the writer thread commits instead."""
    monkeypatch.setattr(turn_store, "INLINE_COMMIT_MAX_S", 0.0)

    async def scenario() -> list[str]:
        store = SqliteTurnStore(f"sqlite:///{db}")
        threads = _commit_threads(store)
        try:
            await store.record(turn_write("a"))  # a first commit: its time is what the store knows
            await store.record(turn_write("b"), alone=True)
            return threads
        finally:
            await store.close()

    assert asyncio.run(scenario()) == ["tito-turn-writer", "tito-turn-writer"]
