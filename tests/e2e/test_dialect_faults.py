"""Faults in the Responses and Anthropic streams: an engine that dies mid-stream ends the stream with
the dialect's error event, a client that leaves aborts the engine; the partial turn is recorded as
aborted and never exported."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import segments, token_id

BODIES: dict[str, dict[str, Any]] = {
    "responses": {"model": "m", "input": "go", "stream": True},
    "messages": {
        "model": "m",
        "max_tokens": 300,
        "messages": [{"role": "user", "content": "go"}],
        "stream": True,
    },
}


def _data(lines: list[str]) -> list[dict[str, Any]]:
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ")]


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_stream_cut_by_the_engine_ends_with_the_dialects_error(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, route: str
) -> None:
    engine.fault = "cut_stream"
    engine.push([*qwen_tokenizer.encode(" word" * 20).ids, token_id(qwen_tokenizer, "<|im_end|>")])
    response = httpx.post(f"{proxy_url}/sessions/cut/v1/{route}", json=BODIES[route], timeout=30)
    events = _data(response.text.splitlines())
    kinds = [event["type"] for event in events]
    if route == "responses":
        assert kinds[-2:] == ["error", "response.failed"]
        assert "response.completed" not in kinds
    else:
        assert kinds[-1] == "error"
        assert "message_stop" not in kinds
    # What was sampled before the cut is kept as aborted (nothing at all when the engine client got
    # no token before the fault); never exported.
    session = httpx.get(f"{proxy_url}/sessions/cut")
    if session.status_code == 200:
        assert session.json()["calls_by_status"] == {"aborted": 1}
        assert segments(proxy_url, "cut") == []
    else:
        assert session.status_code == 404


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_client_disconnect_aborts_the_engine(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, route: str
) -> None:
    engine.chunk_delay_s = 0.05
    engine.push(qwen_tokenizer.encode(" word" * 200).ids)
    with httpx.stream(
        "POST", f"{proxy_url}/sessions/gone/v1/{route}", json=BODIES[route], timeout=30
    ) as response:
        for line in response.iter_lines():
            if "word" in line:
                break
    deadline = time.monotonic() + 10
    while not engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.05)
    assert engine.aborted == [engine.requests[-1]["rid"]]
    deadline = time.monotonic() + 10
    while httpx.get(f"{proxy_url}/sessions/gone").json().get("calls_by_status") != {"aborted": 1}:
        assert time.monotonic() < deadline, "the partial turn was not recorded as aborted"
        time.sleep(0.05)
    assert segments(proxy_url, "gone") == []


@pytest.mark.parametrize("route", ["responses", "messages"])
def test_a_streamed_error_event_names_the_request(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, route: str
) -> None:
    engine.fault = "no_finish"
    engine.push(qwen_tokenizer.encode(" word" * 4).ids)
    response = httpx.post(
        f"{proxy_url}/sessions/rid/v1/{route}",
        json=BODIES[route],
        headers={"x-request-id": "req-42"},
        timeout=30,
    )
    [error] = [event for event in _data(response.text.splitlines()) if event["type"] == "error"]
    if route == "responses":
        assert error["request_id"] == "req-42"
        assert error["code"] == "bad_gateway"
    else:
        assert error["error"]["request_id"] == "req-42"
        assert error["request_id"] == "req-42"
        assert error["error"]["type"] == "api_error"


def test_an_anthropic_stream_error_keeps_its_kind(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """An engine's length refusal after the first chunk is an invalid request, as unstreamed."""
    engine.fault = "error_mid_stream"
    engine.push(qwen_tokenizer.encode(" word" * 4).ids)
    response = httpx.post(f"{proxy_url}/sessions/kind/v1/messages", json=BODIES["messages"], timeout=30)
    [error] = [event for event in _data(response.text.splitlines()) if event["type"] == "error"]
    assert error["error"]["type"] == "invalid_request_error"


def test_a_failed_response_carries_what_was_produced(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """`response.failed` is a Response like any other: its `output` holds the items streamed before
    the fault, the one the fault cut as `incomplete` with the text the client already got."""
    engine.fault = "cut_stream"
    engine.push([*qwen_tokenizer.encode(" word" * 20).ids, token_id(qwen_tokenizer, "<|im_end|>")])
    response = httpx.post(f"{proxy_url}/sessions/cut-out/v1/responses", json=BODIES["responses"], timeout=30)
    events = _data(response.text.splitlines())
    streamed = "".join(event["delta"] for event in events if event["type"] == "response.output_text.delta")
    assert streamed, "the fault should come after some text"
    failed = events[-1]
    assert failed["type"] == "response.failed"
    [item] = failed["response"]["output"]
    assert (item["type"], item["status"]) == ("message", "incomplete")
    assert item["content"][0]["text"] == streamed
