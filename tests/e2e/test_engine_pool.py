"""Several engines behind one proxy: sessions stick to an engine, new ones balance, a lost engine's
sessions move without a token changing, engines are added and drained at run time, and behind
sglang-router the routing key keeps a session on one worker and aborts reach the worker."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from proxy.config import Settings
from proxy.engines.base import SamplingParams
from proxy.engines.detect import identify
from proxy.engines.setup import open_pool
from proxy.engines.sglang import SGLangEngine
from proxy.errors import EngineMismatch
from tests.conftest import ProxyFactory
from tests.fakes.router import FakeRouter
from tests.fakes.sglang import FakeSGLang
from tests.fakes.vllm import FakeVLLM
from tests.support import assemble_stream, free_port, serve, spawn_proxy, stream_events, token_id

MakeEngine = Callable[..., FakeSGLang]


@pytest.fixture
def make_engine(qwen_tokenizer: Tokenizer) -> Iterator[MakeEngine]:
    """Start more SGLang stand-ins (each a real server); `stop(fake)` takes one down mid-test."""
    with ExitStack() as stack:

        def make(**overrides: Any) -> FakeSGLang:
            fake = FakeSGLang(
                tokenizer=qwen_tokenizer,
                eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"),),
                vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
                **overrides,
            )
            server = ExitStack()
            fake.url = server.enter_context(serve(fake.app()))  # type: ignore[attr-defined]
            fake.stop = server.close  # type: ignore[attr-defined]
            stack.callback(server.close)
            return fake

        yield make


def _turn(url: str, session: str, messages: list[dict[str, Any]], **headers: str) -> dict[str, Any]:
    reply = httpx.post(
        f"{url}/sessions/{session}/v1/chat/completions",
        json={"model": "m", "messages": messages, "max_tokens": 16},
        headers=headers,
        timeout=30,
    )
    assert reply.status_code == 200, reply.text
    message: dict[str, Any] = reply.json()["choices"][0]["message"]
    return message


def _conversation(url: str, session: str, turns: int = 2) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello from {session}"}]
    for turn in range(turns):
        messages += [_turn(url, session, messages), {"role": "user", "content": f"turn {turn + 1}"}]
    return messages


def _served(fakes: list[FakeSGLang], tokenizer: Tokenizer, session: str) -> list[int]:
    """Which engine (by index) got each call of the session, in order."""
    marker = f"hello from {session}<"
    calls = [
        (index, request)
        for index, fake in enumerate(fakes)
        for request in fake.requests
        if marker in tokenizer.decode(request["input_ids"], skip_special_tokens=False)
    ]
    calls.sort(key=lambda call: len(call[1]["input_ids"]))  # a session's prompts only grow
    return [index for index, _ in calls]


def test_one_engine_stores_no_assignments(start_proxy: ProxyFactory, tmp_path: Path) -> None:
    """With one engine there is nothing to choose: a new session costs no extra database write."""
    with start_proxy(db=tmp_path / "one.db") as url:
        _turn(url, "solo", [{"role": "user", "content": "hello"}])
    with closing(sqlite3.connect(tmp_path / "one.db")) as db:
        assert db.execute("select count(*) from engine_affinity").fetchone() == (0,)
        assert db.execute("select count(*) from calls").fetchone() == (1,)


def test_sessions_stick_to_an_engine_and_new_sessions_balance(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    fakes = [engine, make_engine(), make_engine()]
    urls = ",".join(fake.url for fake in fakes)  # type: ignore[attr-defined]
    with start_proxy(engine_url=urls) as url:
        for index in range(6):
            _conversation(url, f"s{index}", turns=3)
        listed = httpx.get(f"{url}/admin/engines").json()["engines"]
    placed = {f"s{i}": _served(fakes, qwen_tokenizer, f"s{i}") for i in range(6)}
    assert all(len(set(calls)) == 1 and len(calls) == 3 for calls in placed.values()), placed
    per_engine = [sum(calls[0] == index for calls in placed.values()) for index in range(3)]
    assert per_engine == [2, 2, 2]
    assert [(e["id"], e["url"], e["kind"], e["healthy"], e["in_flight"], e["sessions"]) for e in listed] == [
        (f"engine-{i}", fake.url, "sglang", True, 0, 2)  # type: ignore[attr-defined]
        for i, fake in enumerate(fakes)
    ]


def test_a_new_session_goes_to_the_engine_with_the_fewest_turns_in_flight(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    fakes = [engine, make_engine(), make_engine()]
    urls = ",".join(fake.url for fake in fakes)  # type: ignore[attr-defined]
    with start_proxy(engine_url=urls) as url:
        for name in ("a", "b", "c"):  # one session each: engine-0, engine-1, engine-2
            _turn(url, name, [{"role": "user", "content": f"hello from {name}"}])
        for busy in fakes[:2]:
            busy.fault, busy.hang_s = "hang", 2.0  # a and b's next turns stay in flight a while
        slow = [
            threading.Thread(
                target=_turn, args=(url, name, [{"role": "user", "content": f"hello from {name}"}])
            )
            for name in ("a", "b")
        ]
        for thread in slow:
            thread.start()
        while len(fakes[0].requests) + len(fakes[1].requests) < 4:
            time.sleep(0.01)
        in_flight = [e["in_flight"] for e in httpx.get(f"{url}/admin/engines").json()["engines"]]
        _turn(url, "d", [{"role": "user", "content": "hello from d"}])
        for thread in slow:
            thread.join()
    assert in_flight == [1, 1, 0]
    assert _served(fakes, qwen_tokenizer, "d") == [2]  # not engine-0, first among equals by sessions


def test_new_sessions_starting_together_spread_over_the_engines(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine
) -> None:
    """A batch of rollouts whose first turns arrive at once: each placement counts the ones made
    before it, though their assignments are still being written (all went to one engine before)."""
    fakes = [engine, make_engine(), make_engine()]
    for fake in fakes:
        fake.fault, fake.hang_s = "hang", 1.0  # every first turn stays in flight a while
    urls = ",".join(fake.url for fake in fakes)  # type: ignore[attr-defined]
    with start_proxy(engine_url=urls) as url:
        batch = [
            threading.Thread(target=_turn, args=(url, f"b{i}", [{"role": "user", "content": f"hello {i}"}]))
            for i in range(12)
        ]
        for thread in batch:
            thread.start()
        for thread in batch:
            thread.join()
        placed = [e["sessions"] for e in httpx.get(f"{url}/admin/engines").json()["engines"]]
    assert placed == [4, 4, 4]
    assert [len(fake.requests) for fake in fakes] == [4, 4, 4]


def test_an_engine_down_at_start_that_comes_up_serving_another_model_takes_no_call(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """Its model could not be compared at start (nothing listened): it is compared once the engine
    answers, and one serving another model stays out (its tokens would be recorded as this model's)."""
    port = free_port()
    late = FakeSGLang(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"),),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
        model_name="another-model",
    )
    urls = f"{engine.url},http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    with start_proxy(engine_url=urls, engine_health_interval_s=0.1) as url, serve(late.app(), port=port):

        def late_engine() -> dict[str, Any]:
            listed: dict[str, Any] = httpx.get(f"{url}/admin/engines").json()["engines"][1]
            return listed

        deadline = time.monotonic() + 10
        while "another-model" not in str(late_engine()["last_error"]):
            assert time.monotonic() < deadline, late_engine()
            time.sleep(0.05)
        for index in range(4):
            _turn(url, f"m{index}", [{"role": "user", "content": "hello"}])
        assert not late_engine()["healthy"]
        late.model_name = engine.model_name  # the same model now: it takes calls again
        while not late_engine()["healthy"]:
            assert time.monotonic() < deadline + 10, late_engine()
            time.sleep(0.05)
        for index in range(4):
            _turn(url, f"n{index}", [{"role": "user", "content": "hello"}])
    assert len(engine.requests) == 4  # every session while the late engine served another model
    assert len(late.requests) == 4  # the new sessions after: it had none, the least loaded


def test_a_lost_engines_sessions_move_and_render_the_same_ids(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine
) -> None:
    doomed = make_engine()
    urls = f"{engine.url},{doomed.url}"  # type: ignore[attr-defined]
    first: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
    with start_proxy(engine_url=urls, engine_health_interval_s=0.2) as url:
        # The same conversation twice: "control" whole on engine-0, "moved" begun on engine-1.
        second = [*first, _turn(url, "control", first), {"role": "user", "content": "and then?"}]
        _turn(url, "control", second)
        _turn(url, "moved", first)
        assert (len(engine.requests), len(doomed.requests)) == (2, 1)
        doomed.stop()  # type: ignore[attr-defined]
        _turn(url, "moved", second)
        listed = {e["id"]: e for e in httpx.get(f"{url}/admin/engines").json()["engines"]}
    assert len(engine.requests) == 3
    # Its next turn went to the healthy engine with exactly the ids the lost one would have got.
    assert doomed.requests[0]["input_ids"] == engine.requests[0]["input_ids"]
    assert engine.requests[2]["input_ids"] == engine.requests[1]["input_ids"]
    assert not listed["engine-1"]["healthy"]
    assert listed["engine-1"]["last_error"]
    assert listed["engine-0"]["healthy"]


def test_an_engine_failing_its_health_check_is_taken_out_until_it_passes(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    ailing = make_engine()
    fakes = [engine, ailing]

    def healthy(url: str) -> list[bool]:
        return [e["healthy"] for e in httpx.get(f"{url}/admin/engines").json()["engines"]]

    def wait_for(url: str, wanted: list[bool]) -> None:
        deadline = time.monotonic() + 5
        while healthy(url) != wanted:
            assert time.monotonic() < deadline, healthy(url)
            time.sleep(0.05)

    with start_proxy(engine_url=f"{engine.url},{ailing.url}", engine_health_interval_s=0.1) as url:  # type: ignore[attr-defined]
        first = [{"role": "user", "content": "hello from s"}]
        second = [*first, _turn(url, "s", first), {"role": "user", "content": "more"}]
        _turn(url, "t", [{"role": "user", "content": "hello from t"}])  # engine-1
        ailing.healthy = False  # /ready answers 503, though it would still generate
        wait_for(url, [True, False])
        _turn(url, "t", [{"role": "user", "content": "hello from t"}, *second[1:]])
        _turn(url, "u", [{"role": "user", "content": "hello from u"}])  # a new session: engine-0
        ailing.healthy = True
        wait_for(url, [True, True])
        _turn(url, "v", [{"role": "user", "content": "hello from v"}])  # back in: the least loaded
    assert _served(fakes, qwen_tokenizer, "t") == [1, 0]
    assert _served(fakes, qwen_tokenizer, "u") == [0]
    assert _served(fakes, qwen_tokenizer, "v") == [1]


def test_a_stream_cut_by_a_lost_engine_is_continued_on_another(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    doomed = make_engine()
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    words = qwen_tokenizer.encode(" word" * 8, add_special_tokens=False).ids
    rest = [*qwen_tokenizer.encode(" done", add_special_tokens=False).ids, im_end]
    urls = f"{engine.url},{doomed.url}"  # type: ignore[attr-defined]
    with start_proxy(engine_url=urls, engine_restart_wait_s=5, engine_health_interval_s=60) as url:
        _turn(url, "warm", [{"role": "user", "content": "hi"}])  # engine-0; the next session: engine-1
        doomed.push([*words, im_end])
        doomed.fault, doomed.healthy = "cut_stream", False  # it dies mid-stream
        engine.push(rest)
        body = {
            "model": "m",
            "messages": [{"role": "user", "content": "go"}],
            "stream": True,
            "max_tokens": 64,
        }
        events, _ = stream_events(url, body, "cut")
        [segment] = httpx.get(f"{url}/sessions/cut/trajectory").json()["segments"]
    [lost] = doomed.requests
    moved = engine.requests[-1]
    # Continued from the prompt plus the tokens the lost engine had streamed.
    kept = moved["input_ids"][len(lost["input_ids"]) :]
    assert moved["input_ids"][: len(lost["input_ids"])] == lost["input_ids"]
    assert 0 < len(kept) < len(words)
    assert kept == words[: len(kept)]
    assert assemble_stream(events)["content"] == qwen_tokenizer.decode(kept + rest[:-1])
    assert segment["response_ids"] == kept + rest


def test_engines_are_added_listed_and_drained_behind_the_admin_key(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    admin = {"authorization": "Bearer admin-key"}
    harness = {"authorization": "Bearer harness-key"}
    other_model = make_engine(model_name="another-model")
    added = make_engine()
    vllm = FakeVLLM(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"),),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
    )
    with (
        serve(vllm.app()) as vllm_url,
        start_proxy(api_key="harness-key", admin_key="admin-key") as url,
    ):
        assert httpx.get(f"{url}/admin/engines").status_code == 401
        assert httpx.get(f"{url}/admin/engines", headers=harness).status_code == 403
        refused = httpx.post(f"{url}/admin/engines", json={"url": added.url}, headers=harness)  # type: ignore[attr-defined]
        assert refused.status_code == 403

        def add(body: dict[str, Any]) -> httpx.Response:
            return httpx.post(f"{url}/admin/engines", json=body, headers=admin, timeout=30)

        wrong = add({"url": vllm_url})
        assert (wrong.status_code, wrong.json()["error"]["code"]) == (400, "engine_mismatch")
        assert "vllm" in wrong.json()["error"]["message"]
        different = add({"url": other_model.url})  # type: ignore[attr-defined]
        assert (different.status_code, different.json()["error"]["code"]) == (400, "engine_model_mismatch")
        assert "another-model" in different.json()["error"]["message"]
        gone = add({"url": "http://127.0.0.1:9"})
        assert (gone.status_code, gone.json()["error"]["code"]) == (400, "engine_unreachable")
        assert add({"url": "not a url"}).status_code == 400
        created = add({"url": added.url, "id": "fresh"})  # type: ignore[attr-defined]
        assert created.status_code == 201, created.text
        assert created.json() | {"last_error": None} == {
            "id": "fresh",
            "url": added.url,  # type: ignore[attr-defined]
            "kind": "sglang",
            "healthy": True,
            "draining": False,
            "in_flight": 0,
            "sessions": 0,
            "last_error": None,
        }
        duplicate = add({"url": engine.url, "id": "fresh"})  # type: ignore[attr-defined]
        assert (duplicate.status_code, duplicate.json()["error"]["code"]) == (409, "engine_exists")

        _turn(url, "a", [{"role": "user", "content": "hello from a"}], **admin)
        _turn(url, "b", [{"role": "user", "content": "hello from b"}], **admin)
        fakes = [engine, added]
        assert (_served(fakes, qwen_tokenizer, "a"), _served(fakes, qwen_tokenizer, "b")) == ([0], [1])
        listed = httpx.get(f"{url}/admin/engines", headers=admin).json()["engines"]
        assert [(e["id"], e["sessions"]) for e in listed] == [("engine-0", 1), ("fresh", 1)]

        missing = httpx.delete(f"{url}/admin/engines/nope", headers=admin)
        assert (missing.status_code, missing.json()["error"]["code"]) == (404, "engine_not_found")
        removed = httpx.delete(f"{url}/admin/engines/fresh", headers=admin, timeout=30)
        assert (removed.status_code, removed.json()["removed"]) == (200, True)
        last = httpx.delete(f"{url}/admin/engines/engine-0", headers=admin)
        assert (last.status_code, last.json()["error"]["code"]) == (409, "last_engine")
        # b's next turn runs on the engine left.
        b = [{"role": "user", "content": "hello from b"}, {"role": "assistant", "content": "ok"}]
        _turn(url, "b", [*b, {"role": "user", "content": "again"}], **admin)
        assert _served(fakes, qwen_tokenizer, "b") == [1, 0]
        assert [e["id"] for e in httpx.get(f"{url}/admin/engines", headers=admin).json()["engines"]] == [
            "engine-0"
        ]


def _start_error(settings: Settings) -> str:
    """Why the engines of these settings stop the start ("" when they do not)."""

    async def check() -> str:
        try:
            pool = await open_pool(settings)
        except EngineMismatch as exc:
            return exc.message
        await pool.aclose()
        return ""

    return asyncio.run(check())


def test_a_drained_engine_finishes_its_turns_in_flight(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    leaving = make_engine()
    fakes = [engine, leaving]
    with start_proxy(engine_url=f"{engine.url},{leaving.url}") as url:  # type: ignore[attr-defined]
        _turn(url, "a", [{"role": "user", "content": "hello from a"}])  # engine-0
        leaving.fault, leaving.hang_s = "hang", 1.5
        answers: list[dict[str, Any]] = []
        slow = threading.Thread(
            target=lambda: answers.append(_turn(url, "b", [{"role": "user", "content": "hello from b"}]))
        )
        slow.start()
        while not leaving.requests:
            time.sleep(0.01)
        asked = time.monotonic()
        removed = httpx.delete(f"{url}/admin/engines/engine-1", timeout=30)
        waited = time.monotonic() - asked
        slow.join()
        assert removed.status_code == 200
        assert waited > 1.0, "the drain returned before the engine's call in flight had finished"
        assert len(answers) == 1  # and that turn was answered
        _turn(
            url,
            "b",
            [{"role": "user", "content": "hello from b"}, *answers, {"role": "user", "content": "on"}],
        )
    assert _served(fakes, qwen_tokenizer, "b") == [1, 0]


def test_every_engine_of_a_list_is_identified_and_all_serve_one_model(
    engine: FakeSGLang, make_engine: MakeEngine, qwen_dir: Path, qwen_tokenizer: Tokenizer
) -> None:
    other = make_engine(model_name="another-model")
    same = make_engine()
    urls = [engine.url, same.url]  # type: ignore[attr-defined]
    assert _start_error(Settings(engine_url=[*urls, other.url], tokenizer=qwen_dir)) == (  # type: ignore[attr-defined]
        f"the engine at {other.url} serves 'another-model', not 'fake-model' as this proxy's engines do"  # type: ignore[attr-defined]
    )
    vllm = FakeVLLM(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"),),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
    )
    with serve(vllm.app()) as vllm_url:
        message = _start_error(Settings(engine_url=",".join([*urls, vllm_url]), tokenizer=qwen_dir))
    assert message.startswith(f"the engine URL {vllm_url} speaks vllm, not sglang")
    assert _start_error(Settings(engine_url=" , ".join(urls), tokenizer=qwen_dir)) == ""


def test_behind_sglang_router_a_session_stays_on_one_worker(
    start_proxy: ProxyFactory, engine: FakeSGLang, make_engine: MakeEngine, qwen_tokenizer: Tokenizer
) -> None:
    workers = [engine, make_engine()]
    router = FakeRouter([w.url for w in workers])  # type: ignore[attr-defined]
    with serve(router.app()) as router_url, start_proxy(engine_url=router_url) as url:
        for index in range(6):
            _conversation(url, f"r{index}", turns=3)
    for index in range(6):
        calls = _served(workers, qwen_tokenizer, f"r{index}")
        assert (len(calls), len(set(calls))) == (3, 1), calls
    keys = {key for key, _ in router.routed}
    assert keys == {f"r{index}" for index in range(6)}  # every call carried its session's key


def test_an_abort_through_sglang_router_reaches_the_worker_running_the_request(
    engine: FakeSGLang, make_engine: MakeEngine
) -> None:
    workers = [engine, make_engine()]
    for worker in workers:
        worker.fault, worker.hang_s = "hang", 20.0
    router = FakeRouter([w.url for w in workers])  # type: ignore[attr-defined]

    async def run(router_url: str) -> None:
        identity = await identify(router_url)
        assert (identity.kind, identity.router) == ("sglang", True), identity
        client = SGLangEngine(router_url, timeout_s=30, router=identity.router)
        rid = "a" * 32
        running = asyncio.ensure_future(
            client.generate([1, 2, 3], SamplingParams(max_new_tokens=4), rid, affinity="session-x")
        )
        await asyncio.sleep(0.3)  # routed, and held by its worker (hanging until aborted)
        assert router.routed
        await client.abort(rid)
        generation = await asyncio.wait_for(running, 10)
        await client.aclose()
        assert generation.finish.kind == "abort"

    with serve(router.app()) as router_url:
        asyncio.run(run(router_url))
    (key, worker_url), *_ = router.routed
    running_worker = next(w for w in workers if w.url == worker_url)  # type: ignore[attr-defined]
    assert key == "session-x"
    assert running_worker.aborted == ["a" * 32]


def _on_both_workers(url: str, call: Callable[[], httpx.Response]) -> dict[str, httpx.Response]:
    """The answers of `call` as each of two worker processes gives it (new connections until both
    have answered)."""
    answers: dict[str, httpx.Response] = {}
    for _ in range(200):
        answer = call()
        answers.setdefault(answer.headers["x-tito-worker"], answer)
        if len(answers) == 2:
            return answers
    raise AssertionError("every call landed on one worker")


def test_affinity_and_registration_hold_across_worker_processes(
    engine: FakeSGLang, make_engine: MakeEngine, qwen_dir: Path, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    second, third = make_engine(), make_engine()
    fakes = [engine, second, third]
    env = {
        "TITO_DB": f"sqlite:///{tmp_path / 'workers.db'}",
        "TITO_ENGINE_URL": f"{engine.url},{second.url}",  # type: ignore[attr-defined]
        "TITO_ENGINE_HEALTH_INTERVAL_S": "0.2",
    }
    close = {"connection": "close"}  # a new connection per call: the kernel hands it to either worker
    args = ["--tokenizer", str(qwen_dir), "--workers", "2"]
    with spawn_proxy(args, env, tmp_path / "serve.log") as (_, url):
        seen: set[str] = set()
        # The kernel need not spread new connections over both workers (a busy host may hand one
        # all of them): sessions until both have served, four at least.
        sessions = 0
        while sessions < 4 or (len(seen) < 2 and sessions < 20):
            index, sessions = sessions, sessions + 1
            messages: list[dict[str, Any]] = [{"role": "user", "content": f"hello from w{index}"}]
            for turn in range(3):
                reply = httpx.post(
                    f"{url}/sessions/w{index}/v1/chat/completions",
                    json={"model": "m", "messages": messages, "max_tokens": 16},
                    headers=close,
                    timeout=30,
                )
                assert reply.status_code == 200, reply.text
                seen.add(reply.headers["x-tito-worker"])
                messages += [reply.json()["choices"][0]["message"], {"role": "user", "content": f"t{turn}"}]
        assert len(seen) == 2, "every turn landed on one worker"
        for index in range(sessions):
            calls = _served(fakes, qwen_tokenizer, f"w{index}")
            assert (len(calls), len(set(calls))) == (3, 1), calls

        added = httpx.post(f"{url}/admin/engines", json={"url": third.url, "id": "third"}, timeout=30)  # type: ignore[attr-defined]
        assert added.status_code == 201, added.text
        again = httpx.post(f"{url}/admin/engines", json={"url": third.url, "id": "third"}, timeout=30)  # type: ignore[attr-defined]
        assert again.status_code == 409
        time.sleep(0.6)  # a few health rounds: the other worker follows the registration
        listings = _on_both_workers(url, lambda: httpx.get(f"{url}/admin/engines", headers=close))
        for listing in listings.values():
            assert [e["id"] for e in listing.json()["engines"]] == ["engine-0", "engine-1", "third"]
