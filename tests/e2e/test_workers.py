"""`serve --workers N`: processes on one port sharing only the database, a session's turns landing on
any of them, its trajectory exact."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.invariants import assert_invariants
from tests.support import spawn_proxy, token_id


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'workers.db'}"
    url: str = request.getfixturevalue("postgres_url")
    return url


def test_a_conversation_whose_turns_land_on_two_workers_records_one_exact_trajectory(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    outputs, workers = [], []
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        for turn in range(40):
            text = f"step {turn}"
            outputs.append(engine.push([*qwen_tokenizer.encode(text, add_special_tokens=False).ids, im_end]))
            # A new connection per turn: the kernel hands it to either worker.
            reply = httpx.post(
                f"{url}/sessions/spread/v1/chat/completions",
                json={"model": "m", "messages": messages, "max_tokens": 16},
                headers={"connection": "close"},
                timeout=60,
            )
            assert reply.status_code == 200, reply.text
            workers.append(reply.headers["x-tito-worker"])
            messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": "next"}]
            if turn >= 5 and len(set(workers)) == 2:
                break
        assert len(set(workers)) == 2, f"every turn landed on one worker: {workers}"
        assert httpx.post(f"{url}/sessions/spread/finish").status_code == 200
        rows = httpx.get(f"{url}/export", timeout=60).json()
    assert (rows["num_calls"], rows["branch"]) == (len(workers), "final")
    assert_invariants(rows, engine.requests, outputs)


# Requests on fresh connections until both workers answered one: the kernel hands a new connection
# to whichever worker accepts first, and a busy CI host handed a dozen in a row to the same one.
BOTH_WORKERS_TRIES = 200


def _wait_for_two_workers(url: str) -> None:
    """serve is healthy once one worker is; the test needs both listening."""
    seen: set[str] = set()
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only workers {seen} answered"
        seen.add(httpx.get(f"{url}/health", headers={"connection": "close"}).headers["x-tito-worker"])


async def _send_all(url: str, session: str, body: dict[str, Any], copies: int) -> list[httpx.Response]:
    # Each copy on its own connection, so that both workers get some.
    async def one() -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            return await client.post(
                f"{url}/sessions/{session}/v1/chat/completions",
                json=body,
                headers={"idempotency-key": "turn-1"},
            )

    return list(await asyncio.gather(*(one() for _ in range(copies))))


def _duplicates_round(
    url: str, session: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> list[httpx.Response]:
    """24 copies of one request in one session, the original still sampling when the others arrive."""
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    engine.script.clear()
    engine.requests.clear()
    engine.push([*qwen_tokenizer.encode("the only answer", add_special_tokens=False).ids, im_end])
    engine.push([*qwen_tokenizer.encode("a second sample", add_special_tokens=False).ids, im_end])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    return asyncio.run(_send_all(url, session, body, 24))


def test_concurrent_duplicates_on_two_workers_are_answered_once(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    engine.fault, engine.hang_s = "hang", 0.5
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        # The kernel need not spread one burst over both workers (on a busy host one may accept them
        # all): rounds in fresh sessions until one does.
        for round_ in range(20):
            session = f"dup{round_}"
            replies = _duplicates_round(url, session, engine, qwen_tokenizer)
            assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
            if len({r.headers["x-tito-worker"] for r in replies}) == 2:
                break
        assert len({r.headers["x-tito-worker"] for r in replies}) == 2, "all copies went to one worker"
        assert {r.json()["choices"][0]["message"]["content"] for r in replies} == {"the only answer"}
        assert [r.headers.get("x-tito-replayed") for r in replies].count(None) == 1
        assert len(engine.requests) == 1
        assert httpx.post(f"{url}/sessions/{session}/finish").status_code == 200
        steps = httpx.get(f"{url}/export", params={"mode": "stepwise", "branches": "all"}).text.splitlines()
    assert len([line for line in steps if orjson.loads(line)["session_id"] == session]) == 1


async def _sessionless_race(
    url: str, body: dict[str, Any], engine: FakeSGLang, retries: int
) -> list[httpx.Response]:
    """An SDK's original at /v1 (no session) and, while it samples, `retries` copies of its retry,
    each on its own connection: the original first, then the retries."""

    async def send(count: str) -> httpx.Response:
        async with httpx.AsyncClient(timeout=60) as client:
            headers = {"x-stainless-retry-count": count}
            return await client.post(f"{url}/v1/chat/completions", json=body, headers=headers)

    original = asyncio.ensure_future(send("0"))
    for _ in range(2000):  # the engine serves from another thread: polled, up to 20 s
        if engine.requests:
            break
        await asyncio.sleep(0.01)
    copies = await asyncio.gather(*(send("1") for _ in range(retries)))
    return [await original, *copies]


def test_sessionless_sdk_retries_on_either_worker_wait_for_their_running_original(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """A retry that names no session finds its original's session by the original's retry claim
    while it samples (nothing is recorded yet), on whichever worker it lands, and waits for it."""
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    engine.fault, engine.hang_s = "hang", 1.0
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        for round_ in range(10):  # until the copies land on both workers
            engine.requests.clear()
            engine.push([*qwen_tokenizer.encode("only once", add_special_tokens=False).ids, im_end])
            body = {
                "model": "m",
                "messages": [{"role": "user", "content": f"race {round_}"}],
                "max_tokens": 8,
            }
            original, *retries = asyncio.run(_sessionless_race(url, body, engine, 6))
            assert all(r.status_code == 200 for r in [original, *retries]), [r.text for r in retries]
            assert len(engine.requests) == 1
            assert {r.headers.get("x-tito-replayed") for r in retries} == {"true"}
            assert {r.headers["x-session-id"] for r in retries} == {original.headers["x-session-id"]}
            assert {r.json()["id"] for r in retries} == {original.json()["id"]}
            if len({r.headers["x-tito-worker"] for r in [original, *retries]}) == 2:
                break
        assert len({r.headers["x-tito-worker"] for r in [original, *retries]}) == 2, "one worker took all"
        calls = httpx.get(f"{url}/sessions/{original.headers['x-session-id']}").json()["calls_by_status"]
    assert calls == {"ok": 1}


def _on_every_worker(url: str, request: Any) -> dict[str, httpx.Response]:
    """`request()` on new connections until both workers have answered it: worker -> its answer."""
    answers: dict[str, httpx.Response] = {}
    deadline = time.monotonic() + 60
    while len(answers) < 2:
        assert time.monotonic() < deadline, f"only workers {set(answers)} answered"
        reply = request()
        answers.setdefault(reply.headers["x-tito-worker"], reply)
    return answers


def test_a_pause_sent_to_one_worker_holds_on_every_worker(
    engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    env = {
        "TITO_DB": f"sqlite:///{tmp_path / 'paused.db'}",
        "TITO_ENGINE_URL": engine.url,  # type: ignore[attr-defined]
        "TITO_PAUSE_MODE": "reject",
    }
    close = {"connection": "close"}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

    def turn() -> httpx.Response:
        return httpx.post(f"{url}/v1/chat/completions", json=body, headers=close, timeout=30)

    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        paused = httpx.post(f"{url}/admin/pause", headers=close)
        assert paused.json()["paused"] is True
        states = _on_every_worker(url, lambda: httpx.get(f"{url}/admin/state", headers=close))
        assert {worker: r.json()["paused"] for worker, r in states.items()} == dict.fromkeys(states, True)
        time.sleep(0.5)  # past the followers' poll: every worker refuses from now on
        refused = _on_every_worker(url, turn)
        assert {r.status_code for r in refused.values()} == {429}
        assert all(r.headers["retry-after"] for r in refused.values())
        assert engine.requests == []  # nothing sampled while paused

        resumed = httpx.post(f"{url}/admin/resume", headers=close)
        assert resumed.json()["paused"] is False
        time.sleep(0.5)
        for _ in range(2):
            engine.push(
                [
                    *qwen_tokenizer.encode("ok", add_special_tokens=False).ids,
                    token_id(qwen_tokenizer, "<|im_end|>"),
                ]
            )
        served = _on_every_worker(url, turn)
        assert {r.status_code for r in served.values()} == {200}, [r.text for r in served.values()]


def test_a_session_deleted_and_recreated_across_workers_never_continues_its_old_record(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """Rounds of: a turn, the session deleted, the same history and a new message under the same id,
    each request on a fresh connection (either worker). Whichever worker held the old record's
    context and validated messages, the re-created session's turn is a first render (Qwen3's
    template drops the earlier reasoning, the deleted record's ids keep it): one call, exact."""
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    close = {"connection": "close"}
    chat = "{}/sessions/again/v1/chat/completions"
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        for _ in range(6):
            engine.push([*qwen_tokenizer.encode("<think>\nold plan\n</think>\n\nfirst").ids, im_end])
            messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
            body = {"model": "m", "messages": messages, "max_tokens": 32}
            first = httpx.post(chat.format(url), json=body, headers=close, timeout=60)
            assert first.status_code == 200, first.text
            messages += [first.json()["choices"][0]["message"], {"role": "user", "content": "next"}]
            assert httpx.delete(f"{url}/sessions/again", headers=close).status_code in (200, 204)
            output = engine.push([*qwen_tokenizer.encode("second").ids, im_end])
            again = httpx.post(
                chat.format(url), json={**body, "messages": messages}, headers=close, timeout=60
            )
            assert again.status_code == 200, again.text
            prompt = qwen_tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)
            assert "old plan" not in prompt
            assert httpx.post(f"{url}/sessions/again/finish", headers=close).status_code == 200
            answer = httpx.get(f"{url}/sessions/again/samples", params={"mode": "merged"}, timeout=60)
            rows = answer.json()["samples"]
            assert len(rows) == 1, rows
            assert rows[0]["num_calls"] == 1
            assert_invariants(rows[0], engine.requests[-1:], [output])
            assert httpx.delete(f"{url}/sessions/again", headers=close).status_code in (200, 204)


def _streamed_text(stream: str) -> str:
    """The text deltas of a Responses or Anthropic stream, joined."""
    events = [orjson.loads(line[6:]) for line in stream.splitlines() if line.startswith("data: ")]
    pieces = [e.get("delta") for e in events if e["type"] == "response.output_text.delta"]
    pieces += [e["delta"].get("text") for e in events if e["type"] == "content_block_delta"]
    return "".join(piece for piece in pieces if isinstance(piece, str))


DIALECT_BODIES: dict[str, dict[str, Any]] = {
    "responses": {"model": "m", "input": "hi", "max_output_tokens": 16},
    "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]},
}


def test_dialect_retries_on_either_worker_are_answered_from_the_record(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """An Idempotency-Key retry of a Responses or Anthropic turn, plain or streamed, sent again on
    fresh connections until both workers answered it: sampled once, replayed with the same answer."""
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        for route in ("responses", "messages"):
            for stream in (False, True):
                engine.requests.clear()
                engine.push([*qwen_tokenizer.encode("only once").ids, im_end])
                path = f"{url}/sessions/retry-{route}-{stream}/v1/{route}"
                body = {**DIALECT_BODIES[route], "stream": stream}
                headers = {"idempotency-key": "k", "connection": "close"}
                workers: set[str] = set()
                texts: list[Any] = []
                replayed: list[str | None] = []
                for _ in range(BOTH_WORKERS_TRIES):
                    reply = httpx.post(path, json=body, headers=headers, timeout=60)
                    assert reply.status_code == 200, reply.text
                    workers.add(reply.headers["x-tito-worker"])
                    replayed.append(reply.headers.get("x-tito-replayed"))
                    texts.append(_streamed_text(reply.text) if stream else orjson.loads(reply.text))
                    if len(workers) == 2 and len(texts) >= 3:
                        break
                assert len(workers) == 2, (route, stream)
                assert len(engine.requests) == 1, (route, stream)
                assert replayed[0] is None
                assert set(replayed[1:]) == {"true"}
                assert all("only once" in str(text) for text in texts), (route, stream, texts)
                if not stream:
                    assert len({str(text["id"]) for text in texts}) == 1


def test_a_weight_version_set_on_one_worker_is_recorded_by_both(
    database_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    """The engine names no version: each turn records the trainer's, whichever worker set it and
    whichever answers, after both have served turns under the previous one (no cached version)."""
    env = {"TITO_DB": database_url, "TITO_ENGINE_URL": engine.url}  # type: ignore[attr-defined]
    engine.weight_version = None
    close = {"connection": "close"}
    with spawn_proxy(["--tokenizer", str(qwen_dir), "--workers", "2"], env, tmp_path / "serve.log") as (
        _,
        url,
    ):
        _wait_for_two_workers(url)
        for version in ("step-1", "step-2", "step-3"):
            set_version = {"weight_version": version}
            assert httpx.post(f"{url}/admin/weight_version", json=set_version, headers=close).is_success
            workers: set[str] = set()
            for turn in range(BOTH_WORKERS_TRIES):
                body = {"model": "m", "messages": [{"role": "user", "content": f"{version} {turn}"}]}
                reply = httpx.post(f"{url}/v1/chat/completions", json=body, headers=close, timeout=60)
                assert reply.status_code == 200, reply.text
                workers.add(reply.headers["x-tito-worker"])
                session = reply.headers["x-session-id"]
                answer = httpx.get(f"{url}/sessions/{session}/samples", headers=close, timeout=60)
                [row] = answer.json()["samples"]
                assert row["weight_version"] == version, (version, reply.headers["x-tito-worker"])
                if len(workers) == 2 and turn >= 2:
                    break
            assert len(workers) == 2, version
