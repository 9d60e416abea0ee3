"""What the counters count, path by path: a turn once (ok/aborted per recorded call, error per refused
turn), a segment per call that opens one, an error answer wherever it is answered."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang

USER = [{"role": "user", "content": "hi"}]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

# Per dialect: its route and a body of `n` choices (Responses and Anthropic take one).
ROUTES: dict[str, tuple[str, Any]] = {
    "chat": ("chat/completions", lambda n: {"model": "m", "messages": USER, "max_tokens": 8, "n": n}),
    "completions": ("completions", lambda n: {"model": "m", "prompt": "hi", "max_tokens": 8, "n": n}),
    "responses": ("responses", lambda _: {"model": "m", "input": "hi", "max_output_tokens": 8}),
    "anthropic": ("messages", lambda _: {"model": "m", "messages": USER, "max_tokens": 8}),
}
CHOICES = {"chat": 2, "completions": 2, "responses": 1, "anthropic": 1}


def _scrape(url: str) -> Samples:
    found = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            found[sample.name, tuple(sorted(sample.labels.items()))] = sample.value
    return found


def _turns(samples: Samples, dialect: str, status: str) -> float:
    return samples.get(("tito_turns_total", (("dialect", dialect), ("status", status))), 0.0)


def _segments(samples: Samples) -> float:
    """tito_segments_opened_total over every reason (a text prompt opens one as token_prompt)."""
    return sum(value for (name, _), value in samples.items() if name == "tito_segments_opened_total")


def _errors(samples: Samples) -> dict[tuple[str, str], float]:
    """tito_errors_total by (status, code), the label sets counted at least once."""
    return {
        (dict(labels)["status"], dict(labels)["code"]): value
        for (name, labels), value in samples.items()
        if name == "tito_errors_total" and value
    }


def _settled(url: str, dialect: str, aborted: int) -> Samples:
    """The metrics once `aborted` calls are counted, and a moment later (whatever the request that
    recorded them counts next is counted by then)."""
    deadline = time.monotonic() + 20
    while _turns(_scrape(url), dialect, "aborted") < aborted:
        assert time.monotonic() < deadline, _scrape(url)
        time.sleep(0.05)
    time.sleep(0.3)
    return _scrape(url)


@pytest.mark.parametrize("dialect", list(ROUTES))
def test_a_plain_turn_whose_client_hangs_up_counts_once_as_aborted(
    proxy_url: str, engine: FakeSGLang, dialect: str
) -> None:
    """Its calls are recorded aborted; the 499 raised after that is answered to nobody, so it is no
    refused turn and no error answer (a stream whose client leaves counts the same: next test)."""
    engine.fault, engine.hang_s = "hang", 30.0  # the engine samples until it is aborted
    route, body = ROUTES[dialect]
    choices = CHOICES[dialect]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{proxy_url}/sessions/gone/v1/{route}", json=body(choices), timeout=1.0)
    got = _settled(proxy_url, dialect, choices)
    assert httpx.get(f"{proxy_url}/sessions/gone").json()["calls_by_status"] == {"aborted": choices}
    assert _turns(got, dialect, "aborted") == choices
    assert _turns(got, dialect, "error") == 0
    assert _turns(got, dialect, "ok") == 0
    assert _errors(got) == {}
    assert _segments(got) == choices  # each aborted call opened its own segment


def test_a_stream_whose_client_hangs_up_counts_once_as_aborted(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.chunk_delay_s = 0.05
    for _ in range(2):
        engine.push(qwen_tokenizer.encode(" word" * 200).ids)
    body = {"model": "m", "messages": USER, "stream": True, "max_tokens": 300, "n": 2}
    with httpx.stream("POST", f"{proxy_url}/sessions/gone/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if "word" in line:
                break
    got = _settled(proxy_url, "chat", 2)
    assert (_turns(got, "chat", "aborted"), _turns(got, "chat", "error")) == (2, 0)
    assert _errors(got) == {}
    assert _segments(got) == 2


def test_a_turn_the_engine_aborts_counts_once_as_aborted(proxy_url: str, engine: FakeSGLang) -> None:
    """Recorded aborted and answered with an error (plain) or an error event (streamed): one turn."""
    for stream in (False, True):
        for _ in range(2):  # an abort before any token is retried once
            engine.push([], finish={"type": "abort", "message": "Abort by /abort_request"})
        body = {"model": "m", "messages": USER, "stream": stream}
        answer = httpx.post(f"{proxy_url}/sessions/s{stream}/v1/chat/completions", json=body, timeout=30)
        assert "engine_aborted" in answer.text
    got = _scrape(proxy_url)
    assert (_turns(got, "chat", "aborted"), _turns(got, "chat", "error")) == (2, 0)
    assert _errors(got).get(("502", "engine_aborted")) == 2  # the error answer and the error event


def test_every_segment_opened_is_counted_plain_or_streamed(proxy_url: str) -> None:
    opened = 0
    for dialect, choices in (("chat", 3), ("completions", 2), ("responses", 1), ("anthropic", 1)):
        route, body = ROUTES[dialect]
        for stream in (False, True):
            session = f"{dialect}-{stream}"
            answer = httpx.post(
                f"{proxy_url}/sessions/{session}/v1/{route}", json={**body(choices), "stream": stream}
            )
            assert answer.status_code == 200, answer.text
            assert httpx.get(f"{proxy_url}/sessions/{session}").json()["num_segments"] == choices
            opened += choices
            assert _segments(_scrape(proxy_url)) == opened, (dialect, stream)


@pytest.fixture
def small_limit_url(start_proxy: ProxyFactory) -> Iterator[str]:
    with start_proxy(max_body_bytes=4096) as url:
        yield url


def _in_chunks(body: bytes) -> Iterator[bytes]:
    for start in range(0, len(body), 1000):
        yield body[start : start + 1000]


def test_a_body_over_the_limit_is_counted_as_every_refusal_is(small_limit_url: str) -> None:
    """By Content-Length or as a chunked body passes the limit; a turn route's as a refused turn."""
    big = b'{"model": "m", "messages": [{"role": "user", "content": "' + b"x" * 10_000 + b'"}]}'
    json_type = {"content-type": "application/json"}
    for path, content in (
        ("/sessions/big/v1/chat/completions", big),
        ("/v1/messages", _in_chunks(big)),
        ("/sessions", big),  # no turn route
    ):
        answer = httpx.post(f"{small_limit_url}{path}", content=content, headers=json_type)
        assert answer.status_code == 413, answer.text
    got = _scrape(small_limit_url)
    assert _errors(got) == {("413", "request_too_large"): 3}
    assert _turns(got, "chat", "error") == 1
    assert _turns(got, "anthropic", "error") == 1
    # Counted as the handlers count a refusal: a 400 on the same routes moves the same counters.
    httpx.post(f"{small_limit_url}/sessions/big/v1/chat/completions", json={"model": "m"})
    got = _scrape(small_limit_url)
    assert _errors(got) == {("413", "request_too_large"): 3, ("400", "invalid_value"): 1}
    assert _turns(got, "chat", "error") == 2
