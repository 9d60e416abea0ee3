"""An SDK retry (x-stainless-retry-count >= 1, the same body) that arrives while its original is still
sampling waits for it and is answered from its record: one engine call, one recorded turn, the
original's ids, on every turn route, with or without a session."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import segments, token_id

BODIES: dict[str, dict[str, Any]] = {
    "chat/completions": {"model": "m", "messages": [{"role": "user", "content": "race"}], "max_tokens": 16},
    "completions": {"model": "m", "prompt": "race", "max_tokens": 16},
    "responses": {"model": "m", "input": "race", "max_output_tokens": 16},
    "messages": {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "race"}]},
}


def _wait_for_engine_calls(engine: FakeSGLang, count: int) -> None:
    deadline = time.monotonic() + 20
    while len(engine.requests) < count:
        assert time.monotonic() < deadline, "the original never reached the engine"
        time.sleep(0.01)


def _original_then_retry(url: str, engine: FakeSGLang, body: dict[str, Any]) -> list[httpx.Response]:
    """The original (retry count 0) and, once it is sampling, its SDK retry (count 1)."""
    answers: dict[str, httpx.Response] = {}

    def send(name: str, count: str) -> None:
        answers[name] = httpx.post(url, json=body, headers={"x-stainless-retry-count": count}, timeout=60)

    original = threading.Thread(target=send, args=("original", "0"))
    original.start()
    _wait_for_engine_calls(engine, 1)
    retry = threading.Thread(target=send, args=("retry", "1"))
    retry.start()
    original.join()
    retry.join()
    return [answers["original"], answers["retry"]]


@pytest.mark.parametrize("session", [None, "named"])
@pytest.mark.parametrize("route", list(BODIES))
def test_an_sdk_retry_sent_while_its_original_samples_is_answered_from_its_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, route: str, session: str | None
) -> None:
    engine.fault, engine.hang_s = "hang", 1.5  # a slow engine: the retry arrives mid-sample
    engine.push([*qwen_tokenizer.encode("only once").ids, token_id(qwen_tokenizer, "<|im_end|>")])
    prefix = proxy_url if session is None else f"{proxy_url}/sessions/{session}-{route.replace('/', '-')}"
    first, retry = _original_then_retry(f"{prefix}/v1/{route}", engine, BODIES[route])
    assert first.status_code == retry.status_code == 200, (first.text, retry.text)
    assert len(engine.requests) == 1  # the retry was not sampled again
    assert retry.headers["x-tito-replayed"] == "true"
    assert retry.headers["x-session-id"] == first.headers["x-session-id"]
    assert retry.headers["x-tito-call-ids"] == first.headers["x-tito-call-ids"]
    assert retry.json()["id"] == first.json()["id"]  # chatcmpl-, cmpl-, resp_, msg_: the original's
    [segment] = segments(proxy_url, first.headers["x-session-id"])
    assert segment["num_calls"] == 1


def test_a_streamed_sdk_retry_without_a_session_waits_for_its_streamed_original(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.fault, engine.hang_s = "hang", 1.5
    engine.push([*qwen_tokenizer.encode("only once").ids, token_id(qwen_tokenizer, "<|im_end|>")])
    body = {**BODIES["chat/completions"], "stream": True}
    first, retry = _original_then_retry(f"{proxy_url}/v1/chat/completions", engine, body)
    assert first.status_code == retry.status_code == 200, (first.text, retry.text)
    assert len(engine.requests) == 1
    assert retry.headers["x-tito-replayed"] == "true"
    assert retry.headers["x-session-id"] == first.headers["x-session-id"]
    ids = {line.split('"id":"')[1].split('"')[0] for line in first.text.splitlines() if '"id":"' in line}
    [answer_id] = ids  # every chunk names the answer
    assert answer_id in retry.text
    [segment] = segments(proxy_url, first.headers["x-session-id"])
    assert segment["num_calls"] == 1


def test_a_retry_whose_original_was_aborted_is_sampled_afresh(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """The SDK's timeout: the original's client hangs up, the proxy aborts it (recorded aborted), and
    the retry, which waited for that outcome if it was still under way, samples anew."""
    engine.fault, engine.hang_s = "hang", 30.0  # samples until aborted
    url = f"{proxy_url}/v1/chat/completions"
    body = BODIES["chat/completions"]
    left: list[BaseException] = []

    def leave_early() -> None:
        try:
            httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"}, timeout=1.0)
        except httpx.ReadTimeout as exc:
            left.append(exc)

    original = threading.Thread(target=leave_early)
    original.start()
    _wait_for_engine_calls(engine, 1)
    original.join()
    assert left, "the original was answered before its client left"
    engine.fault = None
    retry = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=30)
    assert retry.status_code == 200, retry.text
    assert "x-tito-replayed" not in retry.headers  # never answered from an aborted record
    assert len(engine.requests) == 2
    assert retry.json()["choices"][0]["message"]["content"] == "ok"


@pytest.mark.parametrize("route", ["chat/completions", "messages"])
def test_a_retry_whose_own_original_failed_is_not_answered_with_an_identical_earlier_request(
    proxy_url: str, engine: FakeSGLang, route: str
) -> None:
    """Two rollouts send the same first request without a session: A is answered; B's first attempt
    gets a 502 (nothing recorded) and its SDK retries. B is a rollout of its own: sampled, in a
    session of its own, not handed A's recorded answer (the two would train as one)."""
    url, body = f"{proxy_url}/v1/{route}", BODIES[route]
    a = httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"}, timeout=30)
    assert a.status_code == 200, a.text
    engine.fault = "http500"
    failed = httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"}, timeout=30)
    assert failed.status_code == 502, failed.text
    engine.fault = None
    b = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"}, timeout=30)
    assert b.status_code == 200, b.text
    assert "x-tito-replayed" not in b.headers
    assert b.headers["x-session-id"] != a.headers["x-session-id"]
    assert b.json()["id"] != a.json()["id"]
