"""Which weights sampled which tokens, through a trainer's weight sync (pause, update, POST
/admin/weight_version, resume): a call is recorded under the version it was dispatched with, each
resumed attempt's tokens under their own, and exports' staleness bound counts every token."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import orjson
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.e2e.test_vllm import VLLMProxy, vllm, vllm_proxy  # noqa: F401  (fixtures)
from tests.e2e.test_weight_syncs import _calls, _chat, _in_thread, _until, stream_chat
from tests.fakes.sglang import FakeSGLang
from tests.fakes.vllm import FakeVLLM
from tests.support import token_id


def _set_version(url: str, version: str) -> None:
    answer = httpx.post(f"{url}/admin/weight_version", json={"weight_version": version})
    assert answer.status_code == 200, answer.text


def _export(url: str, **params: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params=params, timeout=30)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def test_a_turn_held_at_the_pause_is_recorded_under_the_version_set_before_the_resume(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    """The engine names no version: the trainer's is recorded, as it was when the call went out
    (after the resume), not when the turn started (during the pause)."""
    engine.weight_version = None
    with start_proxy() as url:
        _set_version(url, "step-1")
        assert _chat(url, "before").status_code == 200
        httpx.post(f"{url}/admin/pause", json={})
        thread, answers = _in_thread(lambda: _chat(url, "held"))
        _until(lambda: httpx.get(f"{url}/admin/state").json()["waiting"] == 1)
        _set_version(url, "step-2")  # the trainer's update is done
        httpx.post(f"{url}/admin/resume", json={})
        thread.join(timeout=30)
        assert answers[0].status_code == 200, answers[0].text
        assert _chat(url, "after").status_code == 200
        for session in ("before", "held", "after"):
            httpx.post(f"{url}/sessions/{session}/finish")
        rows = {row["session_id"]: row for row in _export(url, mode="stepwise")}
        fresh = {row["session_id"] for row in _export(url, mode="stepwise", min_weight_version="step-2")}
    assert {s: r["weight_version"] for s, r in rows.items()} == {
        "before": "step-1",
        "held": "step-2",
        "after": "step-2",
    }
    assert fresh == {"held", "after"}


def test_unnamed_tokens_of_a_resumed_call_carry_the_trainers_version_of_their_attempt(
    vllm: FakeVLLM,  # noqa: F811
    vllm_proxy: VLLMProxy,  # noqa: F811
    qwen_tokenizer: Tokenizer,
    tmp_path: Path,
) -> None:
    """vLLM labels weights loaded without a name `default`: the tokens sampled before the sync are
    the trainer's version then, those after it the version it set during the pause. The call is
    recorded under its first token's version, and the staleness bound sees the older tokens."""
    vllm.weight_version = "default"
    vllm.chunk_delay_s = 0.05
    ids = qwen_tokenizer.encode(" one two three four five six seven eight", add_special_tokens=False).ids
    first = ids * 15  # long enough that the pause's abort lands mid-stream on a busy machine too
    vllm.push([*first, token_id(qwen_tokenizer, "<|im_end|>")])
    vllm.push([*ids, token_id(qwen_tokenizer, "<|im_end|>")])  # what the continuation samples
    with vllm_proxy() as url:
        _set_version(url, "step-1")
        events: list[dict[str, Any]] = []
        thread, answers = _in_thread(lambda: stream_chat(url, "sync", events))
        _until(lambda: len(events) >= 3)
        httpx.post(f"{url}/admin/pause", json={"abort_in_flight": True})
        _until(lambda: bool(vllm.aborted))
        _set_version(url, "step-2")
        time.sleep(0.2)
        httpx.post(f"{url}/admin/resume", json={})
        thread.join(timeout=30)
        assert answers[0].status_code == 200
        httpx.post(f"{url}/sessions/sync/finish")
        [step] = _export(url, mode="stepwise")
        [merged] = _export(url, mode="merged")
        stale = _export(url, mode="merged", min_weight_version="step-2")
        fresh = _export(url, mode="merged", min_weight_version="step-1")
    [call] = _calls(tmp_path / "proxy.db")
    spans = call["engine_meta"]["weight_versions"]
    assert [s["version"] for s in spans] == ["step-1", "step-2"]
    assert spans[0]["start"] == 0
    assert spans[0]["end"] == spans[1]["start"]
    assert spans[1]["end"] == len(step["response_ids"])
    assert "dispatched_version" not in call["engine_meta"]
    assert call["weight_version"] == "step-1"
    assert step["weight_version_spans"] == spans
    assert (merged["weight_version_min"], merged["weight_version_max"]) == ("step-1", "step-2")
    assert stale == []  # tokens sampled by "step-1" weights are older than the bound
    assert [row["session_id"] for row in fresh] == ["sync"]


def test_a_resumed_call_whose_engine_names_versions_is_held_to_its_oldest_tokens(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    """SGLang names its versions: a call aborted by the update's abort-all and continued under the
    new weights holds tokens of both, and `min_weight_version` counts the older ones."""
    held = engine.tokenizer.encode(" alpha beta", add_special_tokens=False).ids
    engine.push(held, finish={"type": "abort", "message": "Abort in waiting queue"}).weight_version = "v0"
    engine.push([*engine.tokenizer.encode(" gamma", add_special_tokens=False).ids, engine.eos_ids[0]])
    engine.script[-1].weight_version = "v1"
    with start_proxy() as url:
        assert _chat(url, "resumed").status_code == 200
        httpx.post(f"{url}/sessions/resumed/finish")
        [row] = _export(url, mode="merged")
        [step] = _export(url, mode="stepwise")
        bounded = _export(url, mode="merged", min_weight_version="v1")
    assert [s["version"] for s in step["weight_version_spans"]] == ["v0", "v1"]
    assert step["weight_version"] == "v0"
    assert row["weight_versions"] == ["v0"]
    assert (row["weight_version_min"], row["weight_version_max"]) == ("v0", "v1")
    assert bounded == []
