"""Trajectories for trainers: lifecycle, rewards, weight versions, export shapes, exactly-once delivery."""

from __future__ import annotations

import io
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

from proxy.client import TitoClient, to_batch
from proxy.export.samples import merge_steps
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang, ScriptedOutput
from tests.invariants import assert_invariants
from tests.support import chat, token_id

CALL = '<tool_call>\n{"name": "run", "arguments": {"n": %d}}\n</tool_call>'
TOOLS = [
    {"type": "function", "function": {"name": "run", "parameters": {"type": "object", "properties": {}}}}
]


def _tool_conversation(
    url: str, engine: FakeSGLang, tok: Tokenizer, session: str, turns: int
) -> list[ScriptedOutput]:
    """A tool loop of `turns` calls, each output re-tokenized in 2-char pieces (not canonical ids)."""
    im_end = token_id(tok, "<|im_end|>")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "work"}]
    outputs = []
    with httpx.Client(base_url=url, timeout=60) as client:
        for turn in range(turns):
            text = CALL % turn if turn < turns - 1 else "all done"
            ids = [
                i
                for k in range(0, len(text), 2)
                for i in tok.encode(text[k : k + 2], add_special_tokens=False).ids
            ]
            outputs.append(engine.push([*ids, im_end]))
            reply = client.post(
                f"/sessions/{session}/v1/chat/completions",
                json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256},
            )
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            messages.append(message)
            for call in message.get("tool_calls") or []:
                messages.append({"role": "tool", "tool_call_id": call["id"], "content": f"result {turn}\n"})
    return outputs


def _export(url: str, **params: Any) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params=params, timeout=60)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def test_session_lifecycle(proxy_url: str, engine: FakeSGLang) -> None:
    with TitoClient(proxy_url) as client:
        sid = client.create_session("rollout-1", metadata={"task": "t1"})
        assert sid == "rollout-1"
        duplicate = httpx.post(f"{proxy_url}/sessions", json={"id": "rollout-1"})
        assert duplicate.status_code == 409
        assert duplicate.json()["error"]["type"] == "conflict_error"
        for n in range(3):
            client.create_session(f"page-{n}")
        first = httpx.get(f"{proxy_url}/sessions", params={"status": "active", "limit": 2}).json()
        rest = httpx.get(
            f"{proxy_url}/sessions", params={"status": "active", "after": first["next_cursor"]}
        ).json()
        assert [s["id"] for s in first["data"] + rest["data"]] == ["page-0", "page-1", "page-2", "rollout-1"]
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
        assert httpx.post(f"{proxy_url}/sessions/rollout-1/v1/chat/completions", json=body).status_code == 200
        client.reward("rollout-1", 0.5, call_rewards={1: 0.25})
        client.finish("rollout-1")
        info = client.session("rollout-1")
        assert (info["status"], info["reward"], info["num_calls"], info["metadata"]) == (
            "finished",
            0.5,
            1,
            {"task": "t1"},
        )
        late = httpx.post(f"{proxy_url}/sessions/rollout-1/v1/chat/completions", json=body)
        assert late.status_code == 409
        bad = httpx.post(f"{proxy_url}/sessions/rollout-1/reward", json={"call_rewards": {"99": 1.0}})
        assert bad.status_code == 400
        assert (
            httpx.get(f"{proxy_url}/sessions", params={"status": "finished"}).json()["data"][0]["id"]
            == "rollout-1"
        )
        assert httpx.delete(f"{proxy_url}/sessions/rollout-1").status_code == 204
        assert httpx.get(f"{proxy_url}/sessions/rollout-1").status_code == 404


def test_idle_sessions_are_finished(start_proxy: ProxyFactory) -> None:
    with start_proxy(session_idle_timeout_s=0.3) as url:
        httpx.post(f"{url}/sessions", json={"id": "idle"})
        deadline = time.monotonic() + 10
        while httpx.get(f"{url}/sessions/idle").json()["status"] != "finished":
            assert time.monotonic() < deadline, "the idle session was not finished"
            time.sleep(0.1)


def test_weight_versions_engine_first_then_trainer(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    httpx.post(f"{proxy_url}/admin/weight_version", json={"weight_version": "step-7"})
    engine.weight_version = "engine-3"
    httpx.post(f"{proxy_url}/sessions/w/v1/chat/completions", json=body)
    engine.weight_version = None
    messages = [
        *body["messages"],
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "more"},
    ]  # type: ignore[misc]
    httpx.post(f"{proxy_url}/sessions/w/v1/chat/completions", json={**body, "messages": messages})
    httpx.post(f"{proxy_url}/sessions/w/finish")
    [row] = _export(proxy_url)
    assert row["weight_versions"] == ["engine-3", "step-7"]
    assert (row["weight_version_min"], row["weight_version_max"]) == ("engine-3", "step-7")
    assert [s["weight_version"] for s in _export(proxy_url, mode="stepwise")] == ["engine-3", "step-7"]


def test_stepwise_and_merged_exports_of_a_64_turn_trajectory(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    outputs = _tool_conversation(proxy_url, engine, qwen_tokenizer, "long", 64)
    with TitoClient(proxy_url) as client:
        client.reward("long", 1.0)
        client.finish("long")
    [merged] = _export(proxy_url, mode="merged")
    assert merged["num_calls"] == 64
    assert merged["reward"] == 1.0
    assert_invariants(merged, engine.requests, outputs)
    steps = _export(proxy_url, mode="stepwise")
    assert [s["step"] for s in steps] == list(range(64))
    for step, request, output in zip(steps, engine.requests, outputs, strict=True):
        assert step["prompt_ids"] == request["input_ids"]  # exactly the engine's prompt
        assert step["response_ids"] == output.ids  # exactly what it sampled
        assert step["loss_mask"] == [1] * len(output.ids)
    assert [s["is_last_step"] for s in steps] == [False] * 63 + [True]
    assert steps[-1]["token_rewards"][-1] == 1.0
    assert sum(steps[-1]["token_rewards"]) == 1.0
    assert all(s["reward"] == 0.0 for s in steps[:-1])
    [rebuilt] = merge_steps(steps)
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
        assert rebuilt[key] == merged[key]


def test_a_summary_in_the_middle_gives_two_segments_but_one_step_per_call(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    for text in ("first", "second", "third"):
        engine.push([*qwen_tokenizer.encode(text, add_special_tokens=False).ids, im_end])
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for _ in range(2):
        reply = httpx.post(
            f"{proxy_url}/sessions/sum/v1/chat/completions", json={"model": "m", "messages": history}
        ).json()["choices"][0]["message"]
        history += [reply, {"role": "user", "content": "next"}]
    summary = [
        {"role": "user", "content": "Summary of the work so far."},
        {"role": "user", "content": "next"},
    ]
    httpx.post(f"{proxy_url}/sessions/sum/v1/chat/completions", json={"model": "m", "messages": summary})
    httpx.post(f"{proxy_url}/sessions/sum/finish")
    assert [r["num_calls"] for r in _export(proxy_url, mode="merged")] == [2, 1]
    steps = _export(proxy_url, mode="stepwise")
    assert len(steps) == 3
    assert [len(m["steps"]) for m in merge_steps(steps)] == [2, 1]


def test_export_is_delivered_once_per_consumer_across_restarts(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path
) -> None:
    db = tmp_path / "export.db"
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    with start_proxy(db=db) as url:
        for n in range(3):
            httpx.post(f"{url}/sessions/s{n}/v1/chat/completions", json=body)
            httpx.post(f"{url}/sessions/s{n}/finish")
        rows = _export(url, consumer="a")
        assert [r["session_id"] for r in rows] == ["s0", "s1", "s2"]
        assert [r["session_id"] for r in _export(url, after=rows[0]["cursor"])] == ["s1", "s2"]
        ack = httpx.post(f"{url}/export/ack", json={"consumer": "a", "cursor": rows[1]["cursor"]}).json()
        assert ack["acked"] == 2
    with start_proxy(db=db) as url:
        assert [r["session_id"] for r in _export(url, consumer="a")] == ["s2"]
        with TitoClient(url) as client:
            assert [r["session_id"] for r in client.iter_samples(consumer="a", ack=True)] == ["s2"]
            assert list(client.iter_samples(consumer="a")) == []
            assert [r["session_id"] for r in client.iter_samples(consumer="b")] == ["s0", "s1", "s2"]


def test_parquet_export_loads_with_pyarrow(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _tool_conversation(proxy_url, engine, qwen_tokenizer, "pq", 3)
    httpx.post(f"{proxy_url}/sessions/pq/finish")
    for mode in ("merged", "stepwise"):
        response = httpx.get(f"{proxy_url}/export", params={"mode": mode, "format": "parquet"})
        assert response.status_code == 200
        table = pq.read_table(io.BytesIO(response.content))
        json_rows = _export(proxy_url, mode=mode)
        assert table.num_rows == len(json_rows)
        assert table.column("response_ids").to_pylist() == [r["response_ids"] for r in json_rows]
        assert table.column("loss_mask").to_pylist() == [r["loss_mask"] for r in json_rows]
        token_columns = ["prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"]
        if mode == "stepwise":
            token_columns.append("token_rewards")
        for name in token_columns:  # never null, nor any item: the schema says so
            field = table.schema.field(name)
            assert (field.nullable, field.type.value_field.nullable) == (False, False), name


def test_client_batches_are_padded_and_aligned(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _tool_conversation(proxy_url, engine, qwen_tokenizer, "b1", 2)
    _tool_conversation(proxy_url, engine, qwen_tokenizer, "b2", 3)
    for sid in ("b1", "b2"):
        httpx.post(f"{proxy_url}/sessions/{sid}/finish")
    with TitoClient(proxy_url) as client:
        samples = list(client.iter_samples())
    batch = to_batch(samples, pad_id=-1)
    lengths = [len(s["prompt_ids"]) + len(s["response_ids"]) for s in samples]
    assert batch["input_ids"].shape == (2, max(lengths))
    for row, sample in enumerate(samples):
        start, end = len(sample["prompt_ids"]), lengths[row]
        assert batch["attention_mask"][row].sum() == end
        assert batch["loss_mask"][row, :start].sum() == 0
        assert batch["loss_mask"][row, start:end].tolist() == sample["loss_mask"]
        assert (batch["input_ids"][row, end:] == -1).all()
    with pytest.raises(ValueError, match="max_length"):
        to_batch(samples, max_length=3)


def test_export_command_writes_parquet_and_acks(proxy_url: str, engine: FakeSGLang, tmp_path: Path) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    httpx.post(f"{proxy_url}/sessions/cli/v1/chat/completions", json=body)
    httpx.post(f"{proxy_url}/sessions/cli/finish")
    out = tmp_path / "rows.parquet"
    command = [
        sys.executable,
        "-m",
        "proxy",
        "export",
        "--url",
        proxy_url,
        "--format",
        "parquet",
        "--out",
        str(out),
        "--consumer",
        "cli",
        "--ack",
    ]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert pq.read_table(out).column("session_id").to_pylist() == ["cli"]
    assert "acked 1 sessions" in result.stdout
    assert _export(proxy_url, consumer="cli") == []


def _say(engine: FakeSGLang, tok: Tokenizer, text: str) -> ScriptedOutput:
    return engine.push([*tok.encode(text, add_special_tokens=False).ids, token_id(tok, "<|im_end|>")])


def _turn(url: str, session: str, messages: list[dict[str, Any]], **extra: Any) -> list[dict[str, Any]]:
    body = {"model": "m", "messages": messages, "max_tokens": 32, **extra}
    response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return [c["message"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]


def _text(row: dict[str, Any], tok: Tokenizer) -> str:
    return tok.decode(row["response_ids"], skip_special_tokens=False)


def test_a_retried_turn_is_exported_once_with_the_abandoned_attempt_only_on_request(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    outputs = [_say(engine, qwen_tokenizer, "turn one")]
    history += [*_turn(proxy_url, "retry", history), {"role": "user", "content": "next"}]
    outputs.append(_say(engine, qwen_tokenizer, "attempt A"))
    _turn(proxy_url, "retry", history)  # the harness drops this answer and sends the turn again
    outputs.append(_say(engine, qwen_tokenizer, "attempt B"))
    history += [*_turn(proxy_url, "retry", history), {"role": "user", "content": "more"}]
    outputs.append(_say(engine, qwen_tokenizer, "the end"))
    _turn(proxy_url, "retry", history)
    with TitoClient(proxy_url) as client:
        client.reward("retry", 1.0)
        client.finish("retry")
        [kept] = _export(proxy_url)
        assert (kept["branch"], kept["num_calls"]) == ("final", 3)
        assert "attempt B" in _text(kept, qwen_tokenizer)
        assert "attempt A" not in _text(kept, qwen_tokenizer)
        sent = [engine.requests[k] for k in (0, 2, 3)]
        assert_invariants(kept, sent, [outputs[k] for k in (0, 2, 3)])
        every = _export(proxy_url, branches="all")
        assert [(r["branch"], r["num_calls"]) for r in every] == [("abandoned", 2), ("final", 3)]
        assert "attempt A" in _text(every[0], qwen_tokenizer)
        assert every[1] == kept
        assert [r["branch"] for r in client.iter_samples(branches="all")] == ["abandoned", "final"]
        # Step-wise keeps the same calls: the abandoned attempt's step only on request.
        steps = _export(proxy_url, mode="stepwise")
        assert [s["call_id"] for s in steps] == kept["call_ids"]
        assert [s["is_last_step"] for s in steps] == [False, False, True]
        all_steps = _export(proxy_url, mode="stepwise", branches="all")
        assert [s["branch"] for s in all_steps] == ["final", "abandoned", "final", "final"]
        [rebuilt] = merge_steps(steps)
        for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "call_ids", "branch"):
            assert rebuilt[key] == kept[key]
        trajectory = client.trajectory("retry")
        assert [s["branch"] for s in trajectory["segments"]] == ["final"]
        assert [s["branch"] for s in client.trajectory("retry", branches="all")["segments"]] == [
            "abandoned",
            "final",
        ]
    bad = httpx.get(f"{proxy_url}/export", params={"branches": "some"})
    assert bad.status_code == 400, bad.text
    out = tmp_path / "rows.jsonl"
    command = [sys.executable, "-m", "proxy", "export", "--url", proxy_url, "--out", str(out)]
    for extra, expected in (([], ["final"]), (["--branches", "all"], ["abandoned", "final"])):
        result = subprocess.run([*command, *extra], capture_output=True, text=True, timeout=120, check=False)
        assert result.returncode == 0, result.stderr
        assert [orjson.loads(line)["branch"] for line in out.read_bytes().splitlines()] == expected
    table = pq.read_table(
        io.BytesIO(httpx.get(f"{proxy_url}/export", params={"format": "parquet", "branches": "all"}).content)
    )
    assert table.column("branch").to_pylist() == ["abandoned", "final"]


def test_n_choices_are_all_exported_as_samples_beside_the_continued_one(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    history: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    _say(engine, qwen_tokenizer, "option one")
    _say(engine, qwen_tokenizer, "option two")
    choices = _turn(proxy_url, "n2", history, n=2)
    kept = next(c for c in choices if c["content"] == "option two")
    _say(engine, qwen_tokenizer, "went on")
    _turn(proxy_url, "n2", [*history, kept, {"role": "user", "content": "more"}])
    # The last turn has two choices too, neither continued: the first is the final one.
    _say(engine, qwen_tokenizer, "solo")
    history = [{"role": "user", "content": "alone"}]
    _say(engine, qwen_tokenizer, "solo")
    _turn(proxy_url, "n2-last", history, n=2)
    for sid in ("n2", "n2-last"):
        httpx.post(f"{proxy_url}/sessions/{sid}/finish")
    rows = _export(proxy_url)
    assert _export(proxy_url, branches="all") == rows  # no abandoned branch: samples are kept
    first = [r for r in rows if r["session_id"] == "n2"]
    assert sorted((r["branch"], r["num_calls"]) for r in first) == [("final", 2), ("sample", 1)]
    final = next(r for r in first if r["branch"] == "final")
    assert "option two" in _text(final, qwen_tokenizer)
    assert [r["branch"] for r in rows if r["session_id"] == "n2-last"] == ["final", "sample"]
    steps = _export(proxy_url, mode="stepwise")
    assert sorted(s["branch"] for s in steps if s["session_id"] == "n2") == ["final", "final", "sample"]


def test_a_session_is_created_by_a_post_without_a_body(proxy_url: str) -> None:
    """Every field of POST /sessions is optional, so a bare POST (no body at all) creates one."""
    for request in (
        httpx.post(f"{proxy_url}/sessions"),
        httpx.post(f"{proxy_url}/sessions", headers={"content-type": "application/json"}),
    ):
        assert request.status_code == 201, request.text
        created = request.json()
        assert (created["status"], created["metadata"]) == ("active", {})
        assert httpx.get(f"{proxy_url}/sessions/{created['id']}").status_code == 200


@pytest.mark.parametrize(
    "path",
    ["/sessions?statsu=finished", "/sessions/s/trajectory?branch=all", "/sessions/s/samples?mod=merged"],
)
def test_a_misspelled_query_parameter_is_refused(proxy_url: str, path: str) -> None:
    """As on /export: a misspelled filter must not silently answer something else than was asked."""
    assert httpx.post(f"{proxy_url}/sessions", json={"id": "s"}).status_code == 201
    response = httpx.get(f"{proxy_url}{path}")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == path.split("?")[1].split("=", maxsplit=1)[0]


def test_stepwise_rewards_sit_where_merged_rows_end(proxy_url: str) -> None:
    """n=3 at the last turn: the final branch's last step and each sample's carry the session's
    reward, as each merged row does, so merge_steps gives the merged rows' rewards; a session with
    no reward has null there, as its merged rows do."""
    for session, reward in (("rewarded", 2.0), ("unrewarded", None)):
        first = chat(proxy_url, [{"role": "user", "content": "go"}], session)["choices"][0]["message"]
        history = [{"role": "user", "content": "go"}, first, {"role": "user", "content": "again"}]
        chat(proxy_url, history, session, n=3)
        if reward is not None:
            httpx.post(f"{proxy_url}/sessions/{session}/reward", json={"reward": reward}).raise_for_status()
        httpx.post(f"{proxy_url}/sessions/{session}/finish").raise_for_status()
        merged = _export(proxy_url, mode="merged", session_ids=session)
        steps = _export(proxy_url, mode="stepwise", session_ids=session)
        assert sorted(r["branch"] for r in merged) == ["final", "sample", "sample"]
        assert {r["reward"] for r in merged} == {reward}
        ends = {r["call_ids"][-1] for r in merged}
        assert [s["reward"] for s in steps] == [reward if s["call_id"] in ends else 0.0 for s in steps]
        assert [s["token_rewards"][-1] for s in steps] == [
            (reward or 0.0) if s["call_id"] in ends else 0.0 for s in steps
        ]
        runs = merge_steps(steps)
        # A sample's run holds its own step (the shared ones are its prompt); it ends where its row does.
        assert {r["call_ids"][-1]: r["reward"] for r in runs} == {
            r["call_ids"][-1]: r["reward"] for r in merged
        }
