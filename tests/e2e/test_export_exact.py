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
from tokenizers import Tokenizer

from proxy.export.sqlite_reads import read_page
from proxy.store.database import create_engine, session_factory
from proxy.store.repository import Repository
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
