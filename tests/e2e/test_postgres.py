"""PostgreSQL, the database for a scaled-out deployment: the same migrations without drift, the turn
store's writes, and a recorded, branched, exported conversation through the served proxy."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from typing import Any

import httpx
import orjson
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import Connection, text

from proxy.errors import Conflict, SessionFinished
from proxy.store.database import create_engine, session_factory, upgrade_blocking
from proxy.store.models import Base
from proxy.store.pg_turns import PostgresTurnStore
from proxy.store.repository import Repository
from proxy.store.turn_store import AsyncTurnStore, write_turns
from tests.conftest import ProxyFactory
from tests.support import reply, segments
from tests.turn_writes import turn_write


def test_migrations_build_the_schema_without_drift(postgres_url: str) -> None:
    upgrade_blocking(postgres_url)

    async def drift() -> list[Any]:
        engine = create_engine(postgres_url)
        try:
            async with engine.connect() as connection:
                return await connection.run_sync(
                    lambda c: compare_metadata(MigrationContext.configure(c), Base.metadata)
                )
        finally:
            await engine.dispose()

    assert asyncio.run(drift()) == []


def test_the_turn_store_writes_groups_and_refuses_a_write_to_a_deleted_segment(postgres_url: str) -> None:
    upgrade_blocking(postgres_url)

    async def scenario() -> None:
        engine = create_engine(postgres_url)
        store = AsyncTurnStore(engine)
        try:
            # Several requests in one transaction, as the SQLite writer groups them: each gets its ids.
            writes = [turn_write("a", calls=2, content="ünï 🌍"), turn_write("b"), turn_write("a")]
            async with engine.begin() as db:
                ids = await db.run_sync(write_turns, writes)

            def placed(db: Connection) -> dict[int, str]:
                rows = db.execute(
                    text("select c.id, s.session_id from calls c join segments s on s.id = c.segment_id")
                )
                return {row[0]: row[1] for row in rows}

            async with engine.connect() as db:
                sessions = await db.run_sync(placed)
            assert [[sessions[i] for i in group] for group in ids] == [["a", "a"], ["b"], ["a"]]
            assert len({i for group in ids for i in group}) == 4
            state = await store.session_state("a")
            assert state is not None
            assert state.template_now == datetime(2026, 1, 2)
            [latest] = await store.latest_answered("b", 1)
            assert latest.response_message == {"role": "assistant", "content": "ok"}
            with pytest.raises(Conflict):
                await store.record(turn_write("c", segment_id=987654))
            assert await store.session_state("c") is None  # rolled back with the refused call
        finally:
            await engine.dispose()

    asyncio.run(scenario())


def test_the_asyncpg_store_writes_a_turn_in_one_statement_and_refuses_what_the_engine_store_refuses(
    postgres_url: str,
) -> None:
    upgrade_blocking(postgres_url)

    async def scenario() -> None:
        engine = create_engine(postgres_url)
        store = PostgresTurnStore(engine)
        try:
            assert await store.turn_start("a") == (None, None)
            first, second = await store.record(turn_write("a", calls=2, content="ünï 🌍"))
            assert second > first  # choices in order, each in a segment of its own
            continued, _ = await store.calls_with_history("a", "k")  # newest first
            assert continued.id == second
            [later] = await store.record(turn_write("a", segment_id=continued.segment_id, parent_id=second))
            segment = await store.segment_rows(continued.segment_id)
            assert [(call.id, call.parent_id) for call in segment] == [(second, None), (later, second)]
            assert segment[0].request == {"messages": [{"role": "user", "content": "ünï 🌍"}]}
            assert segment[0].output_ids == b"\x02\x00\x00\x00"
            assert [call.id for call in await store.calls([later, first])] == [first, later]
            state, version = await store.turn_start("a")
            assert state is not None
            assert (state.status, state.template_now, version) == ("active", datetime(2026, 1, 2), None)
            # Both reads of a turn that echoes a history, in one statement.
            assert await store.turn_start_with_history("a", "k") == (
                state,
                None,
                await store.calls_with_history("a", "k"),
            )
            assert await store.turn_start_with_history("b", "k") == (None, None, [])
            # A segment deleted while the turn ran: a 409, and nothing of the write stays (its session).
            with pytest.raises(Conflict):
                await store.record(turn_write("c", segment_id=987654))
            assert await store.session_state("c") is None
            # A finished session takes no turn, and its row is not touched.
            async with engine.begin() as db:
                await db.execute(text("update sessions set status = 'finished' where id = 'a'"))
                touched = (await db.execute(text("select updated_at from sessions where id = 'a'"))).scalar()
            with pytest.raises(SessionFinished):
                await store.record(turn_write("a"))
            recorded = (
                "select count(*), max(s.updated_at) from calls c join sessions s on s.id = c.session_id"
            )
            async with engine.connect() as db:
                rows = (await db.execute(text(recorded))).one()
            assert tuple(rows) == (3, touched)
        finally:
            await store.close()
            await engine.dispose()

    asyncio.run(scenario())


def test_a_branched_conversation_is_recorded_and_exported(
    start_proxy: ProxyFactory, postgres_url: str
) -> None:
    user = [{"role": "user", "content": "hi"}]
    with start_proxy(db=postgres_url) as url:
        first = reply(url, user, "pg")
        history = [*user, {"role": "assistant", "content": first["content"]}]
        second = reply(url, [*history, {"role": "user", "content": "again"}], "pg")
        assert second["role"] == "assistant"

        def branch(i: int) -> int:
            messages = [*history, {"role": "user", "content": f"branch {i}"}]
            response = httpx.post(
                f"{url}/sessions/pg/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 16},
                timeout=60,
            )
            return response.status_code

        with ThreadPoolExecutor(max_workers=6) as pool:
            assert list(pool.map(branch, range(6))) == [200] * 6
        found = segments(url, "pg")
        # One segment per branch off the first turn: the second turn and the six siblings.
        assert sorted(s["num_calls"] for s in found) == [2] * 7
        for segment in found:
            assert len(segment["response_ids"]) == len(segment["loss_mask"])
        assert httpx.post(f"{url}/sessions/pg/finish").status_code == 200
        response = httpx.get(f"{url}/export", params={"mode": "merged"}, timeout=60)
        rows = [orjson.loads(line) for line in response.content.splitlines() if line]
        assert {row["session_id"] for row in rows} == {"pg"}
        assert len(rows) == 7


def test_groups_and_export_filters_on_postgresql(start_proxy: ProxyFactory, postgres_url: str) -> None:
    user = [{"role": "user", "content": "hi"}]
    with start_proxy(db=postgres_url) as url:
        for index in range(2):
            body = {"id": f"g{index}", "group_id": "G", "sample_index": index, "group_size": 2}
            assert httpx.post(f"{url}/sessions", json=body).status_code == 201
            reply(url, user, f"g{index}")
        taken = httpx.post(f"{url}/sessions", json={"group_id": "G", "sample_index": 0})
        assert taken.status_code == 409

        def exported(**params: Any) -> list[str]:
            response = httpx.get(f"{url}/export", params=params, timeout=60)
            assert response.status_code == 200, response.text
            return [orjson.loads(line)["session_id"] for line in response.content.splitlines()]

        httpx.post(f"{url}/sessions/g1/finish")
        assert exported(whole_groups="true") == []
        httpx.post(f"{url}/sessions/g0/finish")
        assert exported(whole_groups="true") == ["g0", "g1"]
        assert exported(session_ids="g0", limit=1, min_weight_version="0") == ["g0"]
        assert exported(status="active") == []


def test_finishes_commit_in_the_order_of_their_export_cursors(postgres_url: str) -> None:
    """A finish that took cursor N holds every later finish until it commits: an export that went
    past N+1 cannot miss N committed late (sequence values are taken at insert, not at commit)."""
    upgrade_blocking(postgres_url)

    async def scenario() -> tuple[list[str], dict[str, int]]:
        engine = create_engine(postgres_url)
        factory = session_factory(engine)
        try:
            async with factory() as db, db.begin():
                for name in ("slow", "fast"):
                    await Repository(db).create_session(f"order-{name}", {}, datetime.now())
            committed: list[str] = []
            slow_took_cursor = asyncio.Event()
            slow_may_commit = asyncio.Event()

            async def finish(name: str) -> None:
                async with factory() as db, db.begin():
                    repo = Repository(db)
                    session = await repo.get_session(f"order-{name}")
                    assert session is not None
                    assert await repo.finish_session(session)
                    if name == "slow":  # a finish delayed between its cursor and its commit
                        slow_took_cursor.set()
                        await slow_may_commit.wait()
                committed.append(name)

            slow = asyncio.create_task(finish("slow"))
            await slow_took_cursor.wait()
            fast = asyncio.create_task(finish("fast"))
            await asyncio.sleep(0.5)
            assert not fast.done()  # held: it would take cursor N+1 and commit before N
            slow_may_commit.set()
            await asyncio.gather(slow, fast)
            async with engine.connect() as connection:
                rows = await connection.execute(
                    text("select session_id, seq from finished_sessions where session_id like 'order-%'")
                )
                cursors = {session_id: seq for session_id, seq in rows}
            return committed, cursors
        finally:
            await engine.dispose()

    committed, cursors = asyncio.run(scenario())
    assert committed == ["slow", "fast"]
    assert cursors["order-slow"] < cursors["order-fast"]
