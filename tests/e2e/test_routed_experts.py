"""MoE routing replay: with --record-routed-experts the proxy asks SGLang for the experts each position
was routed to (return_routed_experts, routed_experts_start_len), records them compactly per call and
exports them per position (the trainers' shape) and per sampled token, exact through continuations,
streams and resumed generations."""

from __future__ import annotations

import io
import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from proxy.config import Settings
from proxy.export.samples import merge_steps
from proxy.trainers.verifiers import step_tokens
from proxy.trainers.verl import verl_batch
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import chat, stream_events

USER = [{"role": "user", "content": "hi"}]
SHAPE = (3, 2)  # layers, top_k
MOE = {"record_routed_experts": True, "routed_experts_shape": "3,2"}


def _samples(url: str, session: str, mode: str = "stepwise") -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/sessions/{session}/samples", params={"mode": mode})
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["samples"]
    return rows


def _expected(engine: FakeSGLang, ids: list[int]) -> list[list[list[int]]]:
    """Every position but the last, as the stand-in routed it (a function of position and token)."""
    return [engine.experts_at(position, ids[position]) for position in range(len(ids) - 1)]


def _check_row(engine: FakeSGLang, row: dict[str, Any]) -> None:
    ids = row["prompt_ids"] + row["response_ids"]
    assert row["routed_experts"] == _expected(engine, ids)
    prompt_len = len(row["prompt_ids"])
    per_token = row["response_routed_experts"]
    assert len(per_token) == len(row["response_ids"]) == len(row["loss_mask"])
    for j, mask in enumerate(row["loss_mask"]):
        # The experts of the forward pass that sampled token j; none where nothing was sampled.
        assert per_token[j] == (row["routed_experts"][prompt_len + j - 1] if mask == 1 else None)


def test_routed_experts_are_recorded_and_exported_over_a_continued_conversation(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path
) -> None:
    engine.routed_experts_shape = SHAPE
    db = tmp_path / "moe.db"
    with start_proxy(db=db, **MOE) as url:
        first = chat(url, USER, "moe")["choices"][0]["message"]
        history = [
            *USER,
            {"role": "assistant", "content": first["content"]},
            {"role": "user", "content": "on"},
        ]
        chat(url, history, "moe")
        opening, continued = engine.requests
        assert (opening["return_routed_experts"], opening["routed_experts_start_len"]) == (True, 0)
        steps = _samples(url, "moe")
        assert len(steps) == 2
        # The second call asks from the first call's last sampled token, which its request never fed.
        assert (
            continued["routed_experts_start_len"]
            == len(steps[0]["prompt_ids"] + steps[0]["response_ids"]) - 1
        )
        for row in steps:
            _check_row(engine, row)
        [merged] = _samples(url, "moe", "merged")
        _check_row(engine, merged)
        [segment] = httpx.get(f"{url}/sessions/moe/trajectory").json()["segments"]
        assert segment["routed_experts"] == merged["routed_experts"]
        assert segment["response_routed_experts"] == merged["response_routed_experts"]
        assert None in merged["response_routed_experts"]  # the user turn in between: mask 0
        httpx.post(f"{url}/sessions/moe/finish").raise_for_status()
        table = pq.read_table(io.BytesIO(httpx.get(f"{url}/export", params={"format": "parquet"}).content))
        assert table.column("routed_experts").to_pylist() == [merged["routed_experts"]]
        lines = httpx.get(f"{url}/export", params={"mode": "stepwise"}).text.splitlines()
        assert [json.loads(line)["routed_experts"] for line in lines] == [s["routed_experts"] for s in steps]
        _check_trainers(merged, steps)
    with sqlite3.connect(db) as conn:
        blobs = [row[0] for row in conn.execute("SELECT routed_experts FROM calls ORDER BY id")]
    positions = len(merged["routed_experts"])
    # 1-2 bytes per expert slot (ids past 255 here: uint16) plus a 9-byte header per call.
    assert sum(len(b) for b in blobs) <= positions * SHAPE[0] * SHAPE[1] * 2 + 9 * len(blobs)


def _check_trainers(merged: dict[str, Any], steps: list[dict[str, Any]]) -> None:
    """verl's R3 tensor (aligned with input_ids, prompts left-padded) and verifiers' step tokens."""
    batch = verl_batch([merged], pad_id=0, prompt_length=len(merged["prompt_ids"]) + 2)
    tensor = batch.tensors["routed_experts"]
    positions = len(merged["routed_experts"])
    assert tensor.shape == (1, batch.tensors["input_ids"].shape[1], *SHAPE)
    assert tensor[0, 2 : 2 + positions].tolist() == merged["routed_experts"]
    assert not tensor[0, :2].any()
    assert not tensor[0, 2 + positions :].any()
    assert [step_tokens(step)["routed_experts"] for step in steps] == [s["routed_experts"] for s in steps]
    assert merge_steps(steps)[0]["routed_experts"] == merged["routed_experts"]
    assert merge_steps(steps)[0]["response_routed_experts"] == merged["response_routed_experts"]


def test_a_streamed_turn_records_its_routed_experts(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    engine.routed_experts_shape = SHAPE
    with start_proxy(**MOE) as url:
        stream_events(url, {"model": "m", "messages": USER, "max_tokens": 16, "stream": True}, "moe-s")
        [row] = _samples(url, "moe-s")
        _check_row(engine, row)


def test_a_resumed_generation_concatenates_the_routed_experts_of_its_attempts(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Any
) -> None:
    engine.routed_experts_shape = SHAPE
    words = qwen_tokenizer.encode("one two three four five six", add_special_tokens=False).ids
    eos = engine.eos_ids[0]
    with start_proxy(**MOE) as url:
        for session, streamed in (("moe-r", False), ("moe-rs", True)):
            engine.requests.clear()
            engine.push(words[:3], finish={"type": "abort", "message": "Abort by weight update"})
            engine.push([*words[3:], eos])
            body = {"model": "m", "messages": USER, "max_tokens": 32, "stream": streamed}
            if streamed:
                stream_events(url, body, session)
            else:
                chat(url, USER, session, max_tokens=32)
            first, second = engine.requests
            prompt_len = len(first["input_ids"])
            assert second["routed_experts_start_len"] == prompt_len + 3 - 1
            [row] = _samples(url, session)
            assert row["response_ids"] == [*words, eos]
            _check_row(engine, row)


def test_an_engine_that_sends_none_records_the_call_without_them(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path
) -> None:
    db = tmp_path / "none.db"
    with start_proxy(db=db, **MOE) as url:  # the stand-in runs without --enable-return-routed-experts
        chat(url, USER, "moe-none")
        [row] = _samples(url, "moe-none")
        assert (row["routed_experts"], row["response_routed_experts"]) == (None, None)
    with sqlite3.connect(db) as conn:
        [(meta,)] = conn.execute("SELECT engine_meta FROM calls").fetchall()
    assert json.loads(meta)["routed_experts_missing"] is True


def test_without_the_flag_nothing_is_asked_or_exported(proxy_url: str, engine: FakeSGLang) -> None:
    engine.routed_experts_shape = SHAPE
    chat(proxy_url, USER, "plain")
    assert "return_routed_experts" not in engine.requests[-1]
    [row] = _samples(proxy_url, "plain")
    assert row["routed_experts"] is None


def test_the_start_fails_when_routings_cannot_be_read(qwen_dir: Path) -> None:
    # The test tokenizer has no config.json: SGLang's shapeless arrays could not be read.
    with pytest.raises(ValidationError, match="--routed-experts-shape"):
        Settings(tokenizer=qwen_dir, record_routed_experts=True)
    with pytest.raises(ValidationError, match="local engine"):
        Settings(engine="local", model=qwen_dir, record_routed_experts=True)
    assert Settings(tokenizer=qwen_dir, engine="vllm", record_routed_experts=True).routed_experts_dims is None
    assert Settings(tokenizer=qwen_dir, **MOE).routed_experts_dims == SHAPE  # type: ignore[arg-type]
