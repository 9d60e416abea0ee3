"""Indexes over optional columns (idempotency key, request hash, group) hold only rows with a value,
and every lookup the proxy makes by such a column still reads an index, never the whole table."""

from __future__ import annotations

import asyncio
import sqlite3
from contextlib import closing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from sqlalchemy import event

from proxy.store.database import create_engine, session_factory, upgrade_blocking
from proxy.store.groups import GroupClaim, check_group, whole_groups_page
from proxy.store.repository import Repository


def _lookups(url: str) -> list[tuple[str, Any]]:
    """The SQL (and parameters) of each lookup by an optional column, as the proxy sends it."""
    engine = create_engine(url)
    sent: list[tuple[str, Any]] = []
    event.listen(
        engine.sync_engine, "before_cursor_execute", lambda *a: sent.append((a[2], a[3])), retval=False
    )

    async def run() -> None:
        since = datetime(2026, 1, 1, tzinfo=UTC)
        async with session_factory(engine)() as db:
            repo = Repository(db)
            await repo.answered_calls("s", idempotency_key="key")
            await repo.answered_calls("s", request_hash="f" * 64, since=since)
            await repo.session_of_request("f" * 64, since)
            await check_group(db, GroupClaim(group_id="g", sample_index=0, group_size=2), "s")
            await whole_groups_page(db, after=0, group_ids=None, limit=10)
        await engine.dispose()

    asyncio.run(run())
    return sent


def test_lookups_by_an_optional_column_read_an_index(tmp_path: Path) -> None:
    db = tmp_path / "plans.db"
    url = f"sqlite:///{db}"
    upgrade_blocking(url)
    lookups = _lookups(url)
    assert len(lookups) == 5
    with closing(sqlite3.connect(db)) as connection:
        for statement, parameters in lookups:
            plan = " | ".join(
                row[3] for row in connection.execute(f"EXPLAIN QUERY PLAN {statement}", parameters)
            )
            # A full scan of either table reads every row; SCAN ... USING INDEX walks an index instead.
            scans = [step for step in plan.split(" | ") if step.startswith("SCAN") and "INDEX" not in step]
            assert not [step for step in scans if "calls" in step or "sessions" in step], (statement, plan)
            assert "INDEX" in plan, (statement, plan)


def test_rows_without_the_value_are_not_indexed(tmp_path: Path) -> None:
    db = tmp_path / "sizes.db"
    upgrade_blocking(f"sqlite:///{db}")
    with closing(sqlite3.connect(db)) as connection:
        partial = {
            name: sql
            for name, sql in connection.execute("select name, sql from sqlite_master where type = 'index'")
            if sql is not None
        }
    assert "WHERE group_id IS NOT NULL" in partial["ux_sessions_group_sample"]
    assert "WHERE idempotency_key IS NOT NULL" in partial["ix_calls_session_idempotency"]
    assert "WHERE request_hash IS NOT NULL" in partial["ix_calls_request_hash_session"]
    assert "ix_sessions_group_id" not in partial  # the unique (group_id, sample_index) index serves it
