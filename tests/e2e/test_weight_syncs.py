"""Weight syncs no rollout notices: the trainer's pause, 429/503 with Retry-After, aborted generations
continued from what was sampled, per-token version spans, versions compared as versions."""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import orjson
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.e2e.test_vllm import VLLMProxy, vllm, vllm_proxy  # noqa: F401  (fixtures)
from tests.fakes.sglang import FakeSGLang
from tests.fakes.vllm import FakeVLLM
from tests.support import assemble_stream, token_id

USER = [{"role": "user", "content": "hi"}]


def _chat(url: str, session: str, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": USER, "max_tokens": 64, **extra}
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60)


def _calls(db: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as conn:
        rows = conn.execute("SELECT weight_version, engine_meta, status FROM calls ORDER BY id").fetchall()
    return [{"weight_version": v, "engine_meta": json.loads(m), "status": s} for v, m, s in rows]


def _in_thread(call: Callable[[], httpx.Response]) -> tuple[threading.Thread, list[httpx.Response]]:
    answers: list[httpx.Response] = []
    thread = threading.Thread(target=lambda: answers.append(call()))
    thread.start()
    return thread, answers


def stream_chat(url: str, session: str, events: list[dict[str, Any]]) -> httpx.Response:
    """A streamed chat turn whose events go to `events` as they come (a sync may land mid-stream)."""
    body = {"model": "m", "messages": USER, "max_tokens": 256, "stream": True}
    with httpx.stream("POST", f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
        return r


def _until(check: Callable[[], bool], seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_versions_are_compared_as_versions_in_exports(proxy_url: str, engine: FakeSGLang) -> None:
    engine.weight_version = "9"
    _chat(proxy_url, "v")
    engine.weight_version = "10"
    messages = [*USER, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "more"}]
    _chat(proxy_url, "v", messages=messages)
    httpx.post(f"{proxy_url}/sessions/v/finish")
    response = httpx.get(f"{proxy_url}/export", params={"mode": "merged"})
    [row] = [orjson.loads(line) for line in response.content.splitlines() if line]
    assert row["weight_versions"] == ["9", "10"]
    assert (row["weight_version_min"], row["weight_version_max"]) == ("9", "10")


def test_503_answers_carry_retry_after(start_proxy: ProxyFactory) -> None:
    with start_proxy(engine_url="http://127.0.0.1:9", context_length=4096, retry_after_s=7) as url:
        down = _chat(url, "down")
        assert down.status_code == 503
        assert down.headers["retry-after"] == "7"
        health = httpx.get(f"{url}/health")
        assert health.status_code == 503
        assert health.headers["retry-after"] == "7"


def test_turns_wait_at_a_pause_and_run_at_the_resume(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    with start_proxy() as url:
        assert httpx.post(f"{url}/admin/pause").json()["paused"] is True
        thread, answers = _in_thread(lambda: _chat(url, "waits"))
        _until(lambda: httpx.get(f"{url}/admin/state").json()["waiting"] == 1)
        assert engine.requests == []
        state = httpx.post(f"{url}/admin/resume").json()
        assert state["paused"] is False
        thread.join(timeout=30)
        assert answers[0].status_code == 200
        state = httpx.get(f"{url}/admin/state").json()
        assert (state["in_flight"], state["waiting"]) == (0, 0)
        assert state["engines"] == [{"name": "sglang", "in_flight": 0}]


def test_a_pause_refuses_with_429_and_retry_after_when_configured(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    with start_proxy(pause_mode="reject", retry_after_s=3) as url:
        httpx.post(f"{url}/admin/pause")
        refused = _chat(url, "r")
        assert refused.status_code == 429
        assert refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["code"] == "engine_paused"
        streamed = _chat(url, "r", stream=True)
        assert streamed.status_code == 429
        httpx.post(f"{url}/admin/resume")
        assert _chat(url, "r").status_code == 200
    with start_proxy(pause_max_wait_s=0.3) as url:
        httpx.post(f"{url}/admin/pause")
        assert _chat(url, "late").status_code == 429  # waited the bounded time, then refused
    assert len(engine.requests) == 1


def vllm_logprobs(ids: list[int], start: int) -> list[float]:
    """The logprobs FakeVLLM.push gives a scripted output by default, as float32 exports them."""
    import numpy as np

    values: list[float] = np.asarray(
        [-0.01 * (i % 97 + 1) for i in range(start, start + len(ids))], dtype=np.float32
    ).tolist()
    return values


def _resumed_outputs(vllm: FakeVLLM, tokenizer: Tokenizer) -> tuple[list[int], list[int]]:  # noqa: F811
    first = tokenizer.encode(" alpha beta gamma delta", add_special_tokens=False).ids
    rest = [
        *tokenizer.encode(" epsilon zeta", add_special_tokens=False).ids,
        token_id(tokenizer, "<|im_end|>"),
    ]
    vllm.push(first)
    vllm.push(rest)
    return list(first[:3]), rest


def test_an_aborted_generation_is_continued_and_recorded_whole(
    vllm: FakeVLLM,  # noqa: F811
    vllm_proxy: VLLMProxy,  # noqa: F811
    qwen_tokenizer: Tokenizer,
    tmp_path: Path,
) -> None:
    vllm.weight_version, vllm.version_after_abort = "v1", "v2"
    vllm.abort_at.append(3)  # the weight update's abort-all, after 3 tokens
    kept, rest = _resumed_outputs(vllm, qwen_tokenizer)
    with vllm_proxy() as url:
        answer = _chat(url, "resumed")
        assert answer.status_code == 200, answer.text
        [segment] = httpx.get(f"{url}/sessions/resumed/trajectory").json()["segments"]
        httpx.post(f"{url}/sessions/resumed/finish")
        export = httpx.get(f"{url}/export", params={"mode": "stepwise"})
        [step] = [orjson.loads(line) for line in export.content.splitlines() if line]
    sampled = kept + rest
    assert answer.json()["choices"][0]["message"]["content"] == qwen_tokenizer.decode(sampled[:-1])
    assert answer.json()["usage"]["completion_tokens"] == len(sampled)
    # The continuation is the prompt plus the output already held.
    first, second = vllm.requests
    assert second["token_ids"] == first["token_ids"] + kept
    assert second["sampling_params"]["max_tokens"] == first["sampling_params"]["max_tokens"] - 3
    assert segment["response_ids"] == sampled
    assert segment["loss_mask"] == [1] * len(sampled)
    [call] = _calls(tmp_path / "proxy.db")
    assert call["weight_version"] == "v1"  # its first token's: the version it was dispatched under
    assert call["engine_meta"]["resumed"] == 1
    spans = [{"version": "v1", "start": 0, "end": 3}, {"version": "v2", "start": 3, "end": len(sampled)}]
    assert call["engine_meta"]["weight_versions"] == spans
    assert step["weight_version_spans"] == spans  # per-token version spans are exported
    assert step["rollout_logprobs"] == [*vllm_logprobs(kept, 0), *vllm_logprobs(rest, 0)]


def test_output_cut_under_penalties_or_a_grammar_is_not_continued(
    vllm: FakeVLLM,  # noqa: F811
    vllm_proxy: VLLMProxy,  # noqa: F811
    qwen_tokenizer: Tokenizer,
    tmp_path: Path,
) -> None:
    """A continuation would sample under other rules than the request's: presence and frequency
    penalties count output tokens only, and a grammar would start afresh after the held output. The
    call ends aborted (never a training sample) rather than recorded as what was asked."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    formats = {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}
    asks: list[dict[str, Any]] = [
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"response_format": formats},
    ]
    with vllm_proxy() as url:
        for n, ask in enumerate(asks):
            vllm.abort_at.append(3)
            _resumed_outputs(vllm, qwen_tokenizer)
            answer = _chat(url, f"cut{n}", **ask)
            assert answer.status_code >= 500, answer.text
            vllm.script.clear()
        # Cut before any token, a generation is continued exactly whatever its rules.
        vllm.abort_at.append(0)
        _resumed_outputs(vllm, qwen_tokenizer)
        assert _chat(url, "early", presence_penalty=0.5).status_code == 200
    assert [call["status"] for call in _calls(tmp_path / "proxy.db")] == ["aborted"] * len(asks) + ["ok"]
    assert len(vllm.requests) == len(asks) + 2


def test_a_stream_aborted_by_a_paused_sync_resumes_after_it(
    vllm: FakeVLLM,  # noqa: F811
    vllm_proxy: VLLMProxy,  # noqa: F811
    qwen_tokenizer: Tokenizer,
    tmp_path: Path,
) -> None:
    vllm.weight_version = "v1"
    vllm.chunk_delay_s = 0.05
    ids = [*qwen_tokenizer.encode(" one two three four five six seven eight", add_special_tokens=False).ids]
    # Long enough (6 s of chunks) that the pause's abort lands mid-stream on a busy machine too.
    first = ids * 15
    vllm.push([*first, token_id(qwen_tokenizer, "<|im_end|>")])
    vllm.push([*ids, token_id(qwen_tokenizer, "<|im_end|>")])  # what the continuation samples
    with vllm_proxy() as url:
        events: list[dict[str, Any]] = []
        thread, answers = _in_thread(lambda: stream_chat(url, "st", events))
        _until(lambda: len(events) >= 3)
        paused = httpx.post(f"{url}/admin/pause", json={"abort_in_flight": True}).json()
        assert paused["in_flight"] == 1
        _until(lambda: len(vllm.requests) == 1 and bool(vllm.aborted))
        vllm.weight_version = "v2"  # the trainer's weight update
        time.sleep(0.2)
        assert len(vllm.requests) == 1  # nothing continues while paused
        httpx.post(f"{url}/admin/resume")
        thread.join(timeout=30)
        assert answers[0].status_code == 200
    message = assemble_stream(events)
    assert message["finish_reason"] == "stop"
    [call] = _calls(tmp_path / "proxy.db")
    assert call["status"] == "ok"
    spans = call["engine_meta"]["weight_versions"]
    assert [s["version"] for s in spans] == ["v1", "v2"]
    held = spans[0]["end"]
    assert 3 <= held < len(first)
    assert vllm.requests[1]["token_ids"][-held:] == first[:held]
    assert message["content"] == qwen_tokenizer.decode([*first[:held], *ids])


def test_paused_since_carries_its_zone(proxy_url: str) -> None:
    """As every time the proxy returns (issue #15)."""
    assert httpx.get(f"{proxy_url}/admin/state").json()["paused_since"] is None
    before = datetime.now(UTC)
    assert httpx.post(f"{proxy_url}/admin/pause", json={}).status_code == 200
    since = datetime.fromisoformat(httpx.get(f"{proxy_url}/admin/state").json()["paused_since"])
    assert since.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= since <= datetime.now(UTC)
    assert httpx.post(f"{proxy_url}/admin/resume", json={}).status_code == 200
