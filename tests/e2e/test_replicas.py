"""Replicas: two `serve` processes on one PostgreSQL, a session's turns alternating between them; its
trajectory is exact and complete, a retry on the other replica is answered from the record, and what
the trainer sets on one replica holds on the other."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests import postgres_server
from tests.fakes.sglang import FakeSGLang, ScriptedOutput
from tests.invariants import assert_invariants
from tests.support import assemble_stream, serve, spawn_proxy, token_id


class Replicas:
    """Two proxies on one database and one engine stand-in; `[turn]` picks A, B, A, B, ..."""

    def __init__(self, urls: tuple[str, str], engine: FakeSGLang, tokenizer: Tokenizer) -> None:
        self.urls = urls
        self.engine = engine
        self.tokenizer = tokenizer
        self.im_end = token_id(tokenizer, "<|im_end|>")

    def __getitem__(self, turn: int) -> str:
        return self.urls[turn % 2]

    def push(self, text: str) -> ScriptedOutput:
        """The next sample: `text`, then the close."""
        ids = [*self.tokenizer.encode(text, add_special_tokens=False).ids, self.im_end]
        return self.engine.push(ids)

    def fresh(self) -> None:
        self.engine.script.clear()
        self.engine.requests.clear()
        self.engine.fault = None


@pytest.fixture(scope="module")
def replicas(
    postgres_server_url: str,
    qwen_dir: Path,
    qwen_tokenizer: Tokenizer,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Replicas]:
    """Started once for the module (each start is seconds); every test uses its own sessions."""
    logs = tmp_path_factory.mktemp("replicas")
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    engine = FakeSGLang(
        tokenizer=qwen_tokenizer,
        eos_ids=(im_end, token_id(qwen_tokenizer, "<|endoftext|>")),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
    )
    database = postgres_server.new_database(postgres_server_url)
    args = ["--tokenizer", str(qwen_dir)]
    with serve(engine.app()) as engine_url:
        # No TITO_REASONING_SECRET: the replicas must agree on one through the database.
        env = {"TITO_DB": database, "TITO_ENGINE_URL": engine_url}
        with (
            spawn_proxy(args, env, logs / "a.log") as (_, a),
            spawn_proxy(args, env, logs / "b.log") as (_, b),
        ):
            yield Replicas((a, b), engine, qwen_tokenizer)
    assert not engine.crashed, "a proxy sent an id outside the vocabulary"


def _chat(url: str, session: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    headers = {"idempotency-key": key} if key else {}
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, headers=headers, timeout=60)


def _finished_export(url: str, session: str) -> list[dict[str, Any]]:
    assert httpx.post(f"{url}/sessions/{session}/finish").status_code == 200
    lines = httpx.get(
        f"{url}/export", params={"session_ids": session, "branches": "all"}, timeout=60
    ).text.splitlines()
    return [orjson.loads(line) for line in lines]


def _answer(url: str, session: str, body: dict[str, Any], key: str) -> tuple[str, bool]:
    """The assistant's text of one turn, plain or streamed as `body` says, and whether it was replayed."""
    if not body.get("stream"):
        reply = _chat(url, session, body, key)
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"], "x-tito-replayed" in reply.headers
    with httpx.stream(
        "POST",
        f"{url}/sessions/{session}/v1/chat/completions",
        json=body,
        headers={"idempotency-key": key},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        replayed = "x-tito-replayed" in response.headers
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]
    events = [orjson.loads(line) for line in lines]
    return assemble_stream(events)["content"], replayed


def test_turns_alternating_between_replicas_record_one_exact_trajectory(replicas: Replicas) -> None:
    """A/B/A/B, plain and streamed turns, each turn retried with its key on the other replica."""
    replicas.fresh()
    session, outputs = "alternating", []
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    for turn in range(8):
        outputs.append(replicas.push(f"step {turn}"))
        body = {"model": "m", "messages": messages, "max_tokens": 16, "stream": turn % 4 >= 2}
        key = f"turn-{turn}"
        content, replayed = _answer(replicas[turn], session, body, key)
        assert (content, replayed) == (f"step {turn}", False)
        # The same request again, as a client whose answer was lost sends it: the other replica
        # answers it from the record, the engine is not called again.
        assert _answer(replicas[turn + 1], session, body, key) == (content, True)
        assert len(replicas.engine.requests) == turn + 1
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "next"}]
    rows = _finished_export(replicas[0], session)
    assert [(row["num_calls"], row["branch"]) for row in rows] == [(8, "final")]
    assert_invariants(rows[0], replicas.engine.requests, outputs)


async def _both_at_once(replicas: Replicas, session: str, body: dict[str, Any]) -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=60) as client:
        sends = [
            client.post(
                f"{replicas[copy]}/sessions/{session}/v1/chat/completions",
                json=body,
                headers={"idempotency-key": "once"},
            )
            for copy in range(6)
        ]
        return list(await asyncio.gather(*sends))


def test_duplicates_sent_to_both_replicas_at_once_are_sampled_once(replicas: Replicas) -> None:
    replicas.fresh()
    replicas.push("the only answer")
    replicas.push("a second sample")
    # The original is still sampling when its copies reach the other replica.
    replicas.engine.fault, replicas.engine.hang_s = "hang", 0.5
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    replies = asyncio.run(_both_at_once(replicas, "duplicates", body))
    replicas.engine.fault = None
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"the only answer"}
    assert [r.headers.get("x-tito-replayed") for r in replies].count(None) == 1
    assert len(replicas.engine.requests) == 1
    assert len(_finished_export(replicas[0], "duplicates")) == 1


def test_reasoning_sealed_by_one_replica_is_recognised_by_the_other(replicas: Replicas) -> None:
    """An Anthropic thinking block signed by A and echoed to B continues the segment."""
    replicas.fresh()
    outputs = [replicas.push("<think>\nplan\n</think>\n\nfirst"), replicas.push("second")]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    for turn in range(2):
        reply = httpx.post(
            f"{replicas[turn]}/sessions/sealed/v1/messages",
            json={"model": "m", "max_tokens": 32, "messages": messages},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        content = reply.json()["content"]
        if turn == 0:
            assert content[0]["type"] == "thinking"
            assert content[0]["signature"]
        messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "more"}]
    rows = _finished_export(replicas[0], "sealed")
    assert [row["num_calls"] for row in rows] == [2], "B did not recognise A's seal: a new segment"
    assert_invariants(rows[0], replicas.engine.requests, outputs)


def test_a_weight_version_set_on_one_replica_is_recorded_by_the_other(replicas: Replicas) -> None:
    replicas.fresh()
    replicas.engine.weight_version = None  # the engine names none
    try:
        url_a, url_b = replicas.urls
        # B has served (and read the version) before A's is set.
        replicas.push("before")
        assert _chat(
            url_b, "versions", {"model": "m", "messages": [{"role": "user", "content": "a"}]}
        ).is_success
        assert httpx.post(f"{url_a}/admin/weight_version", json={"weight_version": "step-7"}).is_success
        assert httpx.get(f"{url_b}/admin/weight_version").json() == {"weight_version": "step-7"}
        replicas.push("after")
        assert _chat(
            url_b, "versions", {"model": "m", "messages": [{"role": "user", "content": "b"}]}
        ).is_success
    finally:
        replicas.engine.weight_version = "v0"
    steps = httpx.get(
        f"{url_b}/export",
        params={"session_ids": "versions", "status": "all", "mode": "stepwise", "branches": "all"},
    ).text.splitlines()
    assert [orjson.loads(line)["weight_version"] for line in steps][-1] == "step-7"


def test_a_session_deleted_on_one_replica_and_recreated_starts_afresh_on_the_other(
    replicas: Replicas,
) -> None:
    """A holds the session's contexts and validated messages in memory; B deletes the session; the
    same history resent to A under the same id must not continue the deleted record: a first render,
    in which Qwen3's template drops the earlier turn's reasoning, one call in one segment."""
    replicas.fresh()
    session = "recreated"
    replicas.push("<think>\nsecret plan\n</think>\n\nfirst")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    body = {"model": "m", "messages": messages, "max_tokens": 32}
    first = _chat(replicas[0], session, body).json()["choices"][0]["message"]
    messages += [{"role": "assistant", "content": first["content"], "reasoning_content": "secret plan"}]
    messages += [{"role": "user", "content": "next"}]
    assert httpx.delete(f"{replicas[1]}/sessions/{session}").status_code in (200, 204)
    output = replicas.push("second")
    assert _chat(replicas[0], session, {**body, "messages": messages}).status_code == 200
    prompt = replicas.tokenizer.decode(replicas.engine.requests[-1]["input_ids"], skip_special_tokens=False)
    assert "secret plan" not in prompt  # a fresh render, not the deleted record's ids
    rows = _finished_export(replicas[1], session)
    assert [row["num_calls"] for row in rows] == [1]
    assert_invariants(rows[0], replicas.engine.requests[-1:], [output])


DIALECT_BODIES: dict[str, dict[str, Any]] = {
    "responses": {"model": "m", "input": "hi", "max_output_tokens": 16},
    "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_dialect_retry_on_the_other_replica_is_answered_from_the_record(
    replicas: Replicas, route: str, stream: bool
) -> None:
    """Idempotency-Key on Responses and Anthropic: the copy sent to B replays A's answer, ids and
    all, and the engine samples once."""
    replicas.fresh()
    replicas.push("only once")
    session, url = f"retry-{route}-{stream}", "/sessions/{}/v1/" + route
    body = {**DIALECT_BODIES[route], "stream": stream}
    answers = []
    for turn in range(2):
        reply = httpx.post(
            replicas[turn] + url.format(session), json=body, headers={"idempotency-key": "k"}, timeout=60
        )
        assert reply.status_code == 200, reply.text
        answers.append((reply.text, reply.headers.get("x-tito-replayed")))
    assert len(replicas.engine.requests) == 1
    assert answers[1][1] == "true"
    assert answers[0][1] is None
    assert "only once" in answers[1][0]
    if not stream:
        assert orjson.loads(answers[0][0])["id"] == orjson.loads(answers[1][0])["id"]


def test_both_replicas_report_the_stored_pause_and_when_it_began(replicas: Replicas) -> None:
    """/admin/state reports the stored pause: its start as the replica told of it stored it, not
    when the other noticed it."""
    a, b = replicas.urls
    assert httpx.post(f"{a}/admin/pause", json={}).status_code == 200
    try:
        deadline = time.monotonic() + 10
        while not httpx.get(f"{b}/admin/state").json()["paused"]:
            assert time.monotonic() < deadline, "the other replica never followed the pause"
            time.sleep(0.05)
        told, follower = (httpx.get(f"{url}/admin/state").json()["paused_since"] for url in (a, b))
        assert told is not None
        assert follower == told
    finally:
        httpx.post(f"{a}/admin/resume", json={})
