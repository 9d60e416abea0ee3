"""Turns racing a trainer that finishes, exports and acks their session: each turn is either recorded
and delivered, or answered 409 (an error event in a stream) and absent. None is recorded unseen."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang

TURNS = 20
ANSWERED_FIRST = 5
SESSION = "race"


def _turn(url: str, index: int, stream: bool) -> tuple[str, Any]:
    """('ok', call id or None) for an answered turn, ('refused', error) for one that lost the race."""
    time.sleep(
        0.05 * index
    )  # staggered: some end before the trainer finishes, some are in flight, some after
    body = {"model": "m", "messages": [{"role": "user", "content": f"q{index}"}], "max_tokens": 8}
    address = f"{url}/sessions/{SESSION}/v1/chat/completions"
    if not stream:
        response = httpx.post(address, json=body, timeout=60)
        if response.status_code == 200:
            return "ok", int(response.headers["X-Tito-Call-Ids"])
        assert response.status_code == 409, response.text
        return "refused", response.json()["error"]
    with httpx.stream("POST", address, json={**body, "stream": True}, timeout=60) as response:
        if response.status_code != 200:
            response.read()
            assert response.status_code == 409, response.text
            return "refused", response.json()["error"]
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
    errors = [event["error"] for event in events if "error" in event]
    finishes = [c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]]
    if errors:
        assert not finishes, events  # a stream that lost the race ends with an error, never a finish
        return "refused", errors[0]
    assert finishes == ["stop"], events
    return "ok", None


def _delivered(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params={"mode": "stepwise", "consumer": "trainer"}, timeout=60)
    assert response.status_code == 200, response.text
    return [json.loads(line) for line in response.text.splitlines() if line]


def _wait_until(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, "the turns did not get under way"
        time.sleep(0.01)


def _race(url: str, engine: FakeSGLang, stream: bool) -> None:
    assert httpx.post(f"{url}/sessions", json={"id": SESSION}).status_code == 201
    engine.fault, engine.hang_s = "hang", 0.0
    ended: list[str] = []

    def turn(index: int) -> tuple[str, Any]:
        outcome = _turn(url, index, stream)
        ended.append(outcome[0])
        return outcome

    with ThreadPoolExecutor(TURNS) as pool:
        # Driven by what happened, not by sleeps (the machine may be slow): the first turns are
        # answered at once; the later ones are held in the engine, so the finish lands while some
        # are in flight and before others start.
        outcomes = [pool.submit(turn, index) for index in range(ANSWERED_FIRST)]
        _wait_until(lambda: len(ended) == ANSWERED_FIRST)
        engine.hang_s = 2.0
        outcomes += [pool.submit(turn, index) for index in range(ANSWERED_FIRST, TURNS)]
        _wait_until(lambda: len(engine.requests) >= ANSWERED_FIRST + 3)
        assert httpx.post(f"{url}/sessions/{SESSION}/finish", timeout=60).status_code == 200
        delivered = _delivered(url)
        acked = httpx.post(f"{url}/export/ack", json={"consumer": "trainer", "session_ids": [SESSION]})
        assert acked.status_code == 200, acked.text
        results = [outcome.result() for outcome in outcomes]
    answered = [value for kind, value in results if kind == "ok"]
    refused = [value for kind, value in results if kind == "refused"]
    assert len(answered) >= 3
    assert len(refused) >= 3
    for error in refused:
        assert error["type"] == "conflict_error"
        assert error["code"] == "session_finished"
        assert "finished" in error["message"]
    # Every answered turn was delivered with the export that followed the finish, and only those.
    assert len(delivered) == len(answered)
    if not stream:
        assert sorted(row["call_id"] for row in delivered) == sorted(answered)
    # Nothing recorded after the finish, not even as aborted; nothing left to deliver later.
    session = httpx.get(f"{url}/sessions/{SESSION}").json()
    assert session["status"] == "finished"
    assert session["calls_by_status"] == {"ok": len(answered)}
    assert _delivered(url) == []


@pytest.mark.parametrize("stream", [False, True])
def test_turns_racing_finish_are_delivered_or_refused_on_sqlite(
    start_proxy: ProxyFactory, engine: FakeSGLang, stream: bool
) -> None:
    with start_proxy() as url:
        _race(url, engine, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_turns_racing_finish_are_delivered_or_refused_on_postgresql(
    start_proxy: ProxyFactory, engine: FakeSGLang, postgres_url: str, stream: bool
) -> None:
    with start_proxy(db=postgres_url) as url:
        _race(url, engine, stream)


def test_the_idle_sweep_finishes_no_session_with_a_turn_in_flight(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.fault, engine.hang_s = "hang", 2.5  # longer than the idle timeout and a sweep interval
    with start_proxy(session_idle_timeout_s=1.0) as url:
        body = {"model": "m", "messages": [{"role": "user", "content": "slow"}], "max_tokens": 8}
        assert httpx.post(f"{url}/sessions", json={"id": "slow"}).status_code == 201
        outcome: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: outcome.append(
                httpx.post(f"{url}/sessions/slow/v1/chat/completions", json=body, timeout=60)
            )
        )
        worker.start()
        worker.join()
        # The session went idle while its turn was in the engine (several sweeps): it stayed open.
        assert outcome[0].status_code == 200, outcome[0].text
        time.sleep(1.5)
        finished = httpx.get(f"{url}/sessions/slow").json()
        assert finished["status"] == "finished"  # idle again afterwards: the next sweep finishes it
        assert finished["calls_by_status"] == {"ok": 1}
