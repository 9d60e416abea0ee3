"""A client that goes away before its (non-streamed) answer: the engine request is aborted, the turn
is recorded as aborted and never exported, and a retry of it samples afresh."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.fakes.sglang import FakeSGLang

USER = [{"role": "user", "content": "hi"}]


def _leave_early(url: str, session: str, headers: dict[str, str] | None = None) -> None:
    """Send a turn and hang up before the engine answers."""
    body = {"model": "m", "messages": USER, "max_tokens": 8}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=1.0, headers=headers)


def _calls_by_status(url: str, session: str, expected: dict[str, int]) -> None:
    deadline = time.monotonic() + 20
    while True:
        found = httpx.get(f"{url}/sessions/{session}")
        if found.status_code == 200 and found.json()["calls_by_status"] == expected:
            return
        assert time.monotonic() < deadline, found.text
        time.sleep(0.05)


def test_a_client_that_leaves_aborts_the_engine_and_its_turn_is_recorded_aborted(
    proxy_url: str, engine: FakeSGLang
) -> None:
    engine.fault, engine.hang_s = "hang", 30.0  # the engine samples until it is aborted
    _leave_early(proxy_url, "gone")
    _calls_by_status(proxy_url, "gone", {"aborted": 1})
    [request] = engine.requests
    assert engine.aborted == [request["rid"]]  # aborted by the rid the proxy sampled with
    assert httpx.post(f"{proxy_url}/sessions/gone/finish").status_code == 200
    exported = httpx.get(f"{proxy_url}/export", params={"mode": "stepwise"})
    assert exported.status_code == 200
    assert exported.text == ""  # nobody saw that turn: it is never trained on


def test_a_retry_of_a_request_whose_client_left_is_sampled_again(proxy_url: str, engine: FakeSGLang) -> None:
    engine.fault, engine.hang_s = "hang", 30.0
    key = {"Idempotency-Key": "turn-1"}
    _leave_early(proxy_url, "retried", key)
    _calls_by_status(proxy_url, "retried", {"aborted": 1})
    engine.fault = None
    body = {"model": "m", "messages": USER, "max_tokens": 8}
    retry = httpx.post(
        f"{proxy_url}/sessions/retried/v1/chat/completions", json=body, headers=key, timeout=30
    )
    assert retry.status_code == 200, retry.text
    assert "x-tito-replayed" not in retry.headers  # not answered from the aborted record
    assert retry.json()["choices"][0]["message"]["content"] == "ok"
    _calls_by_status(proxy_url, "retried", {"aborted": 1, "ok": 1})
    # The answered retry is now what a further retry gets.
    again = httpx.post(
        f"{proxy_url}/sessions/retried/v1/chat/completions", json=body, headers=key, timeout=30
    )
    assert again.headers["x-tito-replayed"] == "true"
    assert again.json()["id"] == retry.json()["id"]
