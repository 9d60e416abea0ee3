"""Export reads what a finish stored (each branch's summary, its drift report rendered once) and
renders nothing; a session finished without stored summaries gets them on its first export, with
the very same rows."""

from __future__ import annotations

import asyncio
import sqlite3
import zlib
from pathlib import Path
from typing import Any

import httpx
import orjson
from sqlalchemy import text

from proxy.store.database import create_engine
from tests.conftest import ProxyFactory


def _session(url: str, session: str, turns: int, *, resend: bool = False) -> None:
    """A conversation of `turns` turns; with `resend`, its first turn is sent twice (a branch)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": "work"}]
    with httpx.Client(base_url=url, timeout=60) as client:
        for turn in range(turns):
            body = {"model": "m", "messages": messages, "max_tokens": 16}
            for _ in range(2 if resend and turn == 0 else 1):
                reply = client.post(f"/sessions/{session}/v1/chat/completions", json=body)
                assert reply.status_code == 200, reply.text
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
        assert client.post(f"/sessions/{session}/finish").status_code == 200


def _bodies(url: str) -> dict[tuple[str, str], bytes]:
    bodies = {}
    for mode in ("merged", "stepwise"):
        for fmt in ("jsonl", "parquet"):
            for branches in ("final", "all"):
                response = httpx.get(
                    f"{url}/export", params={"mode": mode, "format": fmt, "branches": branches}, timeout=60
                )
                assert response.status_code == 200, response.text
                bodies[(f"{mode}-{branches}", fmt)] = response.content
    return bodies


def _summaries(db: Path) -> dict[int, dict[str, Any]]:
    with sqlite3.connect(db) as connection:
        rows = connection.execute("select leaf_call_id, summary from segment_summaries").fetchall()
    return {leaf: orjson.loads(zlib.decompress(blob)) for leaf, blob in rows}


def test_finish_stores_each_branch_summary_and_export_only_reads_it(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    db = tmp_path / "proxy.db"
    with start_proxy(db) as url:
        _session(url, "s1", 3)
        stored = _summaries(db)
        assert len(stored) == 1
        [summary] = stored.values()
        assert summary["drift"]["mode"] == "strict"
        assert len(summary["call_ids"]) == 3
        # What export delivers is what was stored, not a render made now: change the stored
        # report and the export shows the change.
        summary["drift"]["counts"]["assistant_bpe"] = 7
        with sqlite3.connect(db) as connection:
            connection.execute(
                "update segment_summaries set summary = ?", (zlib.compress(orjson.dumps(summary)),)
            )
        [row] = [orjson.loads(line) for line in httpx.get(f"{url}/export").content.splitlines()]
        assert row["drift"]["counts"]["assistant_bpe"] == 7


def test_a_session_without_stored_summaries_gets_them_on_its_first_export_with_the_same_rows(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    db = tmp_path / "proxy.db"
    with start_proxy(db) as url:
        for n in range(3):
            _session(url, f"s{n}", 2 + n, resend=n == 1)
        before = _bodies(url)
        stored = _summaries(db)
        # As a database migrated from before summaries existed: finished sessions without them.
        with sqlite3.connect(db) as connection:
            connection.execute("delete from segment_summaries")
        assert _bodies(url) == before
        assert _summaries(db) == stored


def test_summaries_follow_the_drift_mode_and_go_with_their_session(
    start_proxy: ProxyFactory, tmp_path: Path
) -> None:
    db = tmp_path / "proxy.db"
    with start_proxy(db) as url:
        _session(url, "s1", 2)
        strict = httpx.get(f"{url}/export").content
    with start_proxy(db, drift_report="disable") as url:
        [row] = [orjson.loads(line) for line in httpx.get(f"{url}/export").content.splitlines()]
        assert row["drift"] is None
        with sqlite3.connect(db) as connection:
            modes = {m for (m,) in connection.execute("select drift_mode from segment_summaries")}
        assert modes == {"strict", "disable"}
        assert httpx.delete(f"{url}/sessions/s1").status_code == 204
        assert _summaries(db) == {}
    assert orjson.loads(strict.splitlines()[0])["drift"]["mode"] == "strict"


def test_one_sessions_samples_are_its_export_rows(proxy_url: str) -> None:
    _session(proxy_url, "s1", 3, resend=True)
    for mode in ("merged", "stepwise"):
        exported = httpx.get(f"{proxy_url}/export", params={"mode": mode, "branches": "all"}).content
        samples = httpx.get(f"{proxy_url}/sessions/s1/samples", params={"mode": mode, "branches": "all"})
        assert samples.status_code == 200, samples.text
        assert samples.json()["samples"] == [orjson.loads(line) for line in exported.splitlines()]


async def _execute(url: str, statement: str) -> list[Any]:
    engine = create_engine(url)
    try:
        async with engine.begin() as connection:
            result = await connection.execute(text(statement))
            return list(result.all()) if result.returns_rows else []
    finally:
        await engine.dispose()


def test_summaries_on_postgresql(start_proxy: ProxyFactory, postgres_url: str) -> None:
    with start_proxy(postgres_url) as url:
        for n in range(2):
            _session(url, f"s{n}", 2, resend=n == 1)
        assert len(asyncio.run(_execute(postgres_url, "select leaf_call_id from segment_summaries"))) == 3
        before = _bodies(url)
        asyncio.run(_execute(postgres_url, "delete from segment_summaries"))
        assert _bodies(url) == before
        assert len(asyncio.run(_execute(postgres_url, "select leaf_call_id from segment_summaries"))) == 3
