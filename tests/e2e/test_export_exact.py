"""Exported logprobs are the stored float32 values exactly, in JSON lines and Parquet, merged and
step-wise: JSON prints each as the float64 of that float32 (reading it back gives the stored number
bit for bit), Parquet holds the float32 itself; positions the engine did not sample hold 0.0."""

from __future__ import annotations

import asyncio
import io
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from proxy.api.export import PAGE_SESSIONS
from proxy.client import TitoClient
from proxy.export import sqlite_reads
from proxy.export.sqlite_reads import read_page, read_start
from proxy.store.database import create_engine, session_factory
from proxy.store.models import SessionRow
from proxy.store.repository import Repository, utcnow
from proxy.store.selection import Selection, _finished, selected_metas, take_snapshot
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import token_id

# Values with no short float32 text, a float32 subnormal, a negative zero, a large magnitude, and
# float64 values that round to float32 (what the engine sends is not what is stored).
ODD = [-0.1, -1 / 3, -1e-45, -0.0, -3.0e38, -2.718281828459045, -1e-7, -123.456789]


def _conversation(url: str, engine: FakeSGLang, tok: Tokenizer, session: str, turns: int) -> None:
    im_end = token_id(tok, "<|im_end|>")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for turn in range(turns):
        ids = [*tok.encode(f"answer number {turn} is here", add_special_tokens=False).ids, im_end]
        engine.push(ids, [ODD[(turn + i) % len(ODD)] - 0.001 * turn for i in range(len(ids))])
        reply = httpx.post(
            f"{url}/sessions/{session}/v1/chat/completions", json={"model": "m", "messages": messages}
        )
        assert reply.status_code == 200, reply.text
        messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"more {turn}"}]
    assert httpx.post(f"{url}/sessions/{session}/finish").status_code == 200


def _stored(db: Path, session: str) -> list[tuple[bytes, bytes]]:
    """Each call's stored output logprobs (float32 blob) and prompt ids added, in recording order."""
    with sqlite3.connect(db) as connection:
        return list(
            connection.execute(
                "SELECT output_logprobs, prompt_added FROM calls WHERE session_id = ? ORDER BY id", (session,)
            )
        )


def _get(url: str, mode: str, fmt: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params={"mode": mode, "format": fmt}, timeout=60)
    assert response.status_code == 200, response.text
    if fmt == "parquet":
        table = pq.read_table(io.BytesIO(response.content))
        # As float32 buffers, untouched by a conversion to Python floats.
        logprobs = [np.asarray(v, dtype=np.float32) for v in table.column("rollout_logprobs").to_numpy()]
        return [{**row, "rollout_logprobs": lp} for row, lp in zip(table.to_pylist(), logprobs, strict=True)]
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def _same_bits(exported: Any, stored: bytes) -> None:
    """The exported values are the stored float32s bit for bit (a JSON float read back as float64
    is exactly the float32's value, so converting it loses nothing)."""
    if not isinstance(exported, np.ndarray):
        values = [float(v) for v in exported]
        assert values == np.frombuffer(stored, dtype="<f4").astype(np.float64).tolist()
        exported = np.asarray(values, dtype=np.float64).astype(np.float32)
    assert exported.astype("<f4").tobytes() == stored


def test_every_exported_logprob_is_the_stored_float32(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    db = tmp_path / "exact.db"
    with start_proxy(db=db) as url:
        _conversation(url, engine, qwen_tokenizer, "exact", 4)
        calls = _stored(db, "exact")
        for fmt in ("jsonl", "parquet"):
            [merged] = _get(url, "merged", fmt)
            mask = np.asarray(merged["loss_mask"])
            logprobs = merged["rollout_logprobs"]
            # Sampled positions: the calls' stored outputs in order; the others 0.0 (added ids).
            _same_bits([logprobs[i] for i in np.flatnonzero(mask == 1)], b"".join(lp for lp, _ in calls))
            assert [float(logprobs[i]) for i in np.flatnonzero(mask == 0)] == [0.0] * int((mask == 0).sum())
            assert int((mask == 0).sum()) == sum(len(added) // 4 for _, added in calls[1:])
            steps = _get(url, "stepwise", fmt)
            assert len(steps) == len(calls)
            for step, (stored, _) in zip(steps, calls, strict=True):
                _same_bits(step["rollout_logprobs"], stored)


def test_the_sqlite_export_reads_what_the_repository_reads(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The stdlib read path of a SQLite export (proxy.export.sqlite_reads) returns the same calls
    and summaries as the Repository's queries, which PostgreSQL uses."""
    db = tmp_path / "reads.db"
    with start_proxy(db=db) as url:
        for session in ("r0", "r1"):
            _conversation(url, engine, qwen_tokenizer, session, 3)
        assert httpx.get(f"{url}/export", timeout=60).status_code == 200  # summaries stored
    ids = ["r0", "r1", "missing"]

    async def both() -> tuple[Any, Any]:
        database = create_engine(f"sqlite:///{db}")
        try:
            async with session_factory(database)() as session:
                repo = Repository(session)
                expected = (await repo.token_calls(ids), await repo.segment_summaries(ids, "strict"))
        finally:
            await database.dispose()
        return expected, await read_page(str(db), ids, "strict")

    expected, got = asyncio.run(both())
    assert got == expected
    assert all(got[0][session] for session in ("r0", "r1"))
    assert got[0]["missing"] == {}
    assert all(got[1][session] for session in ("r0", "r1"))
    assert [list(calls) for calls in got[0].values()] == [sorted(calls) for calls in got[0].values()]


def _one_turn(url: str, client: TitoClient, session: str, group: str | None, index: int | None) -> None:
    client.create_session(
        session, {"n": session, "nested": {"at": [1, 2.5, None]}}, group_id=group, sample_index=index
    )
    reply = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=_HI, timeout=60)
    assert reply.status_code == 200, reply.text


_HI = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _as_columns(session: SessionRow) -> dict[str, Any]:
    return {attr.key: getattr(session, attr.key) for attr in SessionRow.__mapper__.column_attrs}


async def _through_sqlalchemy(db: Path, selection: Selection, size: int) -> tuple[Any, ...]:
    """What the SQLAlchemy path reads for an export's start: snapshot, first page, blobs, and the
    metadata of every selected session (Parquet's first pass)."""
    database = create_engine(f"sqlite:///{db}")
    try:
        factory = session_factory(database)
        async with factory() as session:
            snapshot = await take_snapshot(session, utcnow())
            page, _ = await _finished(session, selection, snapshot, selection.after, size)
            ids = [row.id for _, row in page]
            repo = Repository(session)
            blobs = (await repo.token_calls(ids), await repo.segment_summaries(ids, "strict"))
        metas = [meta async for metas in selected_metas(factory, selection, snapshot, 256) for meta in metas]
    finally:
        await database.dispose()
    return snapshot.last_seq, [(seq, _as_columns(row)) for seq, row in page], *blobs, metas


def test_the_sqlite_export_start_reads_what_sqlalchemy_reads(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An export's snapshot and first page on a SQLite file (proxy.export.sqlite_reads.read_start:
    SQLAlchemy's statements run on the stdlib driver) are what the selection's queries read, the
    sessions' columns converted alike (datetimes, JSON metadata), for every shape of filter; so is
    the metadata of every selected session, read in the same transaction page by page (pages of 2
    here, so that a selection spans several)."""
    monkeypatch.setattr(sqlite_reads, "METAS_PAGE", 2)
    db = tmp_path / "start.db"
    with start_proxy(db=db) as url, TitoClient(url) as client:
        for n in range(6):
            _one_turn(url, client, f"s{n}", "g1" if n % 2 else None, n if n % 2 else None)
            if n != 4:  # s4 stays active
                assert httpx.post(f"{url}/sessions/s{n}/finish").status_code == 200
        assert httpx.get(f"{url}/export", timeout=60).status_code == 200  # summaries stored
        assert (
            httpx.post(f"{url}/export/ack", json={"consumer": "c", "session_ids": ["s1"]}).status_code == 200
        )
    selections = [
        Selection(),
        Selection(after=2),
        Selection(session_ids=["s0", "s3", "s4", "missing"]),
        Selection(session_ids=[]),
        Selection(group_ids=["g1"]),
        Selection(consumer="c"),
        Selection(consumer="c", session_ids=["s1", "s3", "s5"], group_ids=["g1", "g2"], after=1),
    ]
    for selection in selections:
        for size in (2, 16):
            expected = asyncio.run(_through_sqlalchemy(db, selection, size))
            metas: list[dict[str, Any]] = []
            start = asyncio.run(read_start(str(db), selection, size, "strict", metas.extend))
            got = (
                start.last_seq,
                [(seq, _as_columns(row)) for seq, row in start.page],
                start.calls,
                start.stored,
                metas,
            )
            assert got == expected, (selection, size)
    assert [row["id"] for _, row in expected[1]] == ["s3", "s5"]  # the last shape: s1 acked, s4 active
    assert all(expected[2].values())
    assert all(expected[3].values())
    assert expected[4] == [
        {"n": "s3", "nested": {"at": [1, 2.5, None]}},
        {"n": "s5", "nested": {"at": [1, 2.5, None]}},
    ]


def test_a_multi_page_export_delivers_every_session_once_in_order(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path
) -> None:
    """More sessions than a page: the first page read with the snapshot, the others after it, each
    row what the session's own samples give; `after` and a consumer's acks are honoured."""
    sessions = [f"p{n:02d}" for n in range(PAGE_SESSIONS + 3)]
    with start_proxy(db=tmp_path / "pages.db") as url, TitoClient(url) as client:
        for session in sessions:
            _one_turn(url, client, session, None, None)
            assert httpx.post(f"{url}/sessions/{session}/finish").status_code == 200
        rows = _get(url, "merged", "jsonl")
        assert [row["session_id"] for row in rows] == sessions
        assert [row["cursor"] for row in rows] == list(range(1, len(sessions) + 1))
        for row in rows:
            samples = httpx.get(f"{url}/sessions/{row['session_id']}/samples", params={"mode": "merged"})
            assert samples.json()["samples"] == [row]
        after = httpx.get(f"{url}/export", params={"after": PAGE_SESSIONS}, timeout=60).content.splitlines()
        assert [orjson.loads(line) for line in after] == rows[PAGE_SESSIONS:]
        acked = {"consumer": "c", "session_ids": sessions[1 : PAGE_SESSIONS + 1]}
        assert httpx.post(f"{url}/export/ack", json=acked).status_code == 200
        left = httpx.get(f"{url}/export", params={"consumer": "c"}, timeout=60).content.splitlines()
        assert [orjson.loads(line)["session_id"] for line in left] == [
            sessions[0],
            *sessions[PAGE_SESSIONS + 1 :],
        ]
