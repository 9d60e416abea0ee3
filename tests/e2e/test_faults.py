"""Engine faults and concurrency: the right 5xx in OpenAI's envelope, nothing half-recorded, and
parallel requests on one session each recorded whole."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import segments, token_id

USER = [{"role": "user", "content": "hi"}]


def _nothing_recorded(url: str, session: str) -> None:
    assert httpx.get(f"{url}/sessions/{session}/trajectory").status_code == 404


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        ("http500", (502, "bad_gateway", "CUDA error")),
        ("malformed_json", (502, "bad_gateway", "malformed JSON")),
        ("hang", (504, "engine_timeout", "in time")),
    ],
)
def test_engine_faults_answer_in_the_envelope_and_record_nothing(
    start_proxy: ProxyFactory,
    engine: FakeSGLang,
    fault: str,
    expected: tuple[int, str, str],
    stream: bool,
) -> None:
    status, code, message = expected
    engine.fault, engine.hang_s = fault, 3.0
    with start_proxy(engine_timeout_s=0.5) as url:
        body = {"model": "m", "messages": USER, "stream": stream}
        response = httpx.post(f"{url}/sessions/f/v1/chat/completions", json=body, timeout=30)
        # Faults found before the first byte is sent are HTTP errors, streamed or not.
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code", "request_id"}
        assert error["type"] == "engine_error"
        assert error["code"] == code
        assert message in error["message"]
        _nothing_recorded(url, "f")
    if fault == "hang":
        # The proxy stopped waiting: the engine must stop generating what nobody will read.
        assert len(engine.aborted) == 1
        assert engine.requests[0]["rid"].startswith(engine.aborted[0])


@pytest.mark.parametrize("stream", [False, True])
def test_an_engine_timeout_on_the_anthropic_route_is_its_timeout_error(
    start_proxy: ProxyFactory, engine: FakeSGLang, stream: bool
) -> None:
    """Anthropic's 504 is a `timeout_error` (its SDK's GatewayTimeoutError), not an api_error."""
    engine.fault, engine.hang_s = "hang", 3.0
    with start_proxy(engine_timeout_s=0.5) as url:
        body = {"model": "m", "max_tokens": 16, "messages": USER, "stream": stream}
        response = httpx.post(f"{url}/sessions/t/v1/messages", json=body, timeout=30)
        assert response.status_code == 504, response.text
        assert response.json()["error"]["type"] == "timeout_error"
        _nothing_recorded(url, "t")


def test_a_stream_cut_by_the_engine_ends_with_an_error_and_is_never_exported_as_complete(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.fault = "cut_stream"
    engine.push([*qwen_tokenizer.encode(" word" * 20).ids, token_id(qwen_tokenizer, "<|im_end|>")])
    body = {"model": "m", "messages": USER, "stream": True}
    response = httpx.post(f"{proxy_url}/sessions/cut/v1/chat/completions", json=body, timeout=30)
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["type"] == "engine_error"
    assert not any('"finish_reason":"stop"' in e or '"finish_reason": "stop"' in e for e in events)
    # The partial turn is kept as aborted: visible to an operator, never a training sample.
    assert segments(proxy_url, "cut") == []
    calls = httpx.get(f"{proxy_url}/sessions/cut").json()
    assert calls["num_calls"] == 1
    assert calls["calls_by_status"] == {"aborted": 1}


def test_parallel_requests_on_one_session_are_each_recorded_whole(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    first = httpx.post(
        f"{proxy_url}/sessions/par/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30
    ).json()["choices"][0]["message"]
    history = [*USER, {"role": "assistant", "content": first["content"]}]
    for i in range(24):
        engine.push([*qwen_tokenizer.encode(f"answer {i}").ids, im_end])

    def branch(i: int) -> dict[str, Any]:
        # Half continue the shared turn (siblings), half open conversations of their own.
        messages = (
            [*history, {"role": "user", "content": f"q{i}"}]
            if i % 2
            else [{"role": "user", "content": f"q{i}"}]
        )
        response = httpx.post(
            f"{proxy_url}/sessions/par/v1/chat/completions",
            json={"model": "m", "messages": messages},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        result: dict[str, Any] = response.json()
        return result

    with ThreadPoolExecutor(max_workers=12) as pool:
        answers = list(pool.map(branch, range(24)))
    assert len({a["id"] for a in answers}) == 24
    found = segments(proxy_url, "par")
    # 12 new conversations, and 12 siblings continuing the first turn.
    assert sorted(s["num_calls"] for s in found) == [1] * 12 + [2] * 12
    sent = {tuple(r["input_ids"]) for r in engine.requests}
    for segment in found:
        # What each branch recorded is exactly what the engine was sent and sampled (I6).
        stream = segment["prompt_ids"] + segment["response_ids"]
        last_prompt_len = len(stream) - sum(1 for _ in _last_output(segment))
        assert tuple(stream[:last_prompt_len]) in sent


def _last_output(segment: dict[str, Any]) -> list[int]:
    """The trailing run of sampled ids (mask 1): the last call's output."""
    tail: list[int] = []
    for token, mask in zip(reversed(segment["response_ids"]), reversed(segment["loss_mask"]), strict=True):
        if mask != 1:
            break
        tail.append(token)
    return tail


def test_a_session_deleted_while_its_turn_runs_gets_a_conflict_and_nothing_of_the_turn(
    proxy_url: str, engine: FakeSGLang
) -> None:
    first = httpx.post(
        f"{proxy_url}/sessions/gone/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30
    )
    reply = first.json()["choices"][0]["message"]
    engine.fault, engine.hang_s = "hang", 1.0  # the next turn waits a second in the engine, then answers
    body = {"model": "m", "messages": [*USER, reply, {"role": "user", "content": "more"}]}
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            httpx.post, f"{proxy_url}/sessions/gone/v1/chat/completions", json=body, timeout=30
        )
        deadline = time.monotonic() + 10
        while len(engine.requests) < 2 and time.monotonic() < deadline:  # the second turn is in the engine
            time.sleep(0.01)
        assert httpx.delete(f"{proxy_url}/sessions/gone").status_code == 204
        response = pending.result()
    assert response.status_code == 409, response.text
    error = response.json()["error"]
    assert error["code"] == "conflict"
    assert "deleted" in error["message"]
    _nothing_recorded(proxy_url, "gone")


def _stream_lines(url: str, session: str, **extra: Any) -> tuple[int, list[str]]:
    """A streamed chat turn: its HTTP status and its data lines (an error answer's body if not 200)."""
    body = {"model": "m", "messages": USER, "stream": True, **extra}
    with httpx.stream(
        "POST", f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=30
    ) as response:
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
        if response.status_code != 200:
            return response.status_code, [response.read().decode()]
    return 200, lines


def _calls_by_status(url: str, session: str) -> dict[str, int]:
    response = httpx.get(f"{url}/sessions/{session}")
    if response.status_code == 404:
        return {}
    found: dict[str, int] = response.json()["calls_by_status"]
    return found


# Each answer is wrong in one way an engine could get wrong: (ids, logprobs, finish override).
BAD_ANSWERS: dict[str, tuple[list[Any], list[Any], dict[str, Any] | None]] = {
    "id_past_the_vocabulary": ([9707, 151669], [-0.5, -0.5], None),
    "negative_id": ([9707, -3], [-0.5, -0.5], None),
    "id_past_int32": ([9707, 2**40], [-0.5, -0.5], None),
    "float_id": ([9707, 11.0], [-0.5, -0.5], None),
    "bool_id": ([9707, True], [-0.5, -0.5], None),
    "bool_logprob": ([9707, 11], [-0.5, False], None),
    "string_logprob": ([9707, 11], [-0.5, "-0.5"], None),
    "unknown_finish_reason": ([9707, 11], [-0.5, -0.5], {"type": "timeout"}),
    "finish_reason_not_an_object": ([9707, 11], [-0.5, -0.5], "stop"),  # type: ignore[dict-item]
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("case", sorted(BAD_ANSWERS))
def test_a_bad_engine_answer_is_a_502_and_nothing_is_recorded(
    proxy_url: str, engine: FakeSGLang, case: str, stream: bool
) -> None:
    ids, logprobs, finish = BAD_ANSWERS[case]
    engine.push(ids, logprobs, finish=finish)
    if stream:
        status, lines = _stream_lines(proxy_url, "bad")
        if status == 200:  # found after the first byte: an error event, then [DONE]
            assert lines[-1] == "[DONE]"
            error = json.loads(lines[-2])["error"]
            assert not any('"finish_reason":"' in line for line in lines)
        else:
            assert status == 502
            error = json.loads(lines[0])["error"]
    else:
        response = httpx.post(
            f"{proxy_url}/sessions/bad/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30
        )
        assert response.status_code == 502, response.text
        error = response.json()["error"]
    assert error["type"] == "engine_error"
    assert error["code"] == "bad_gateway"
    # Nothing of a bad answer is recorded, so nothing of it is exported or continued.
    _nothing_recorded(proxy_url, "bad")


def test_a_bad_id_deep_in_a_stream_is_an_error_event_and_nothing_is_recorded(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push([*qwen_tokenizer.encode(" word" * 6).ids, 151669 + 7, token_id(qwen_tokenizer, "<|im_end|>")])
    status, lines = _stream_lines(proxy_url, "deep")
    assert status == 200
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert (error["type"], error["code"]) == ("engine_error", "bad_gateway")
    assert "vocabulary" in error["message"]
    _nothing_recorded(proxy_url, "deep")


@pytest.mark.parametrize("incremental", [False, True])
def test_a_stream_ending_without_a_finish_reason_is_an_error_and_kept_as_aborted(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, incremental: bool
) -> None:
    engine.fault, engine.incremental = "no_finish", incremental
    engine.push(qwen_tokenizer.encode(" word" * 5).ids)
    status, lines = _stream_lines(proxy_url, "nofin")
    assert status == 200
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert error["type"] == "engine_error"
    assert "finish reason" in error["message"]
    assert not any('"finish_reason":"' in line for line in lines)
    # Like every other stream fault: the partial turn is kept as aborted, never exported.
    assert _calls_by_status(proxy_url, "nofin") == {"aborted": 1}
    assert segments(proxy_url, "nofin") == []


def test_a_plain_answer_without_a_finish_reason_is_a_502(proxy_url: str, engine: FakeSGLang) -> None:
    engine.fault = "no_finish"
    response = httpx.post(
        f"{proxy_url}/sessions/nofin/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30
    )
    assert response.status_code == 502, response.text
    assert "finish" in response.json()["error"]["message"]
    _nothing_recorded(proxy_url, "nofin")
