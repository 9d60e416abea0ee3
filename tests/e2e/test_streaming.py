"""stream: true, read as a client reads it: incremental deltas that reassemble to the record."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import assemble_stream, stream_events, token_id

REPLY = (
    "<think>\nLet me think ü 🌍.\n</think>\n\nI will call a tool.\n"
    '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls -la"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "read", "arguments": {"path": "a.py"}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {"type": "object", "properties": {}}}}
    for n in ("run", "read")
]


@pytest.mark.parametrize("incremental", [False, True])
def test_stream_reassembles_to_the_non_streaming_answer(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, incremental: bool
) -> None:
    engine.incremental = incremental
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    # Two-character pieces: multi-byte characters are split across tokens, and so across chunks.
    ids = [i for k in range(0, len(REPLY), 2) for i in qwen_tokenizer.encode(REPLY[k : k + 2]).ids] + [im_end]
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "tools": TOOLS, "max_tokens": 500}
    engine.push(ids)
    plain = httpx.post(f"{proxy_url}/sessions/plain/v1/chat/completions", json=body).json()
    engine.push(ids)
    events, raw = stream_events(
        proxy_url, {**body, "stream": True, "stream_options": {"include_usage": True}}, "s"
    )
    assert raw[-1] == "data: [DONE]"
    streamed = assemble_stream(events)
    expected = plain["choices"][0]["message"]
    assert streamed["content"] == expected["content"]
    assert streamed["reasoning_content"] == expected["reasoning_content"]
    calls = [streamed["tool_calls"][i] for i in sorted(streamed["tool_calls"])]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in expected["tool_calls"]
    ]
    assert streamed["finish_reason"] == "tool_calls"
    assert events[-1]["usage"] == plain["usage"]
    # OpenAI: "All other chunks will also include a usage field, but with a null value."
    assert all("usage" in e and e["usage"] is None for e in events[:-1])
    content_events = [e for e in events if e["choices"] and e["choices"][0]["delta"].get("reasoning_content")]
    assert len(content_events) > 3, "reasoning must arrive in several deltas, not at the end"
    # The record of the streamed turn is token for token the record of the plain one.
    plain_segment = httpx.get(f"{proxy_url}/sessions/plain/trajectory").json()["segments"][0]
    stream_segment = httpx.get(f"{proxy_url}/sessions/s/trajectory").json()["segments"][0]
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs"):
        assert stream_segment[key] == plain_segment[key]


def test_streamed_turn_is_continued_like_a_plain_one(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    engine.push([*qwen_tokenizer.encode("first answer").ids, im_end])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "go"}]
    events, _ = stream_events(proxy_url, {"model": "m", "messages": messages, "stream": True}, "c")
    streamed = assemble_stream(events)
    messages += [{"role": "assistant", "content": streamed["content"]}, {"role": "user", "content": "more"}]
    engine.push([*qwen_tokenizer.encode("second").ids, im_end])
    stream_events(proxy_url, {"model": "m", "messages": messages, "stream": True}, "c")
    [segment] = httpx.get(f"{proxy_url}/sessions/c/trajectory").json()["segments"]
    assert segment["num_calls"] == 2


def test_keepalive_comments_during_silence(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.chunk_delay_s = 0.3
    engine.push([*qwen_tokenizer.encode("a slow answer").ids, token_id(qwen_tokenizer, "<|im_end|>")])
    with start_proxy(stream_keepalive_s=0.1) as url:
        _, raw = stream_events(
            url, {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True}, "k"
        )
    assert ": keepalive" in raw


def test_client_disconnect_aborts_the_engine_and_records_the_turn_as_aborted(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.chunk_delay_s = 0.05
    engine.push(qwen_tokenizer.encode(" word" * 200).ids)
    body = {"model": "m", "messages": [{"role": "user", "content": "go"}], "stream": True, "max_tokens": 300}
    with httpx.stream(
        "POST", f"{proxy_url}/sessions/gone/v1/chat/completions", json=body, timeout=30
    ) as response:
        for line in response.iter_lines():
            if '"content": " word"' in line or '"content":" word"' in line:
                break
    deadline = time.monotonic() + 10
    while not engine.aborted:
        assert time.monotonic() < deadline, "the engine request was not aborted"
        time.sleep(0.05)
    assert engine.aborted == [engine.requests[-1]["rid"]]
    info = httpx.get(f"{proxy_url}/sessions/gone").json()
    assert info["num_calls"] == 1
    assert (
        httpx.get(f"{proxy_url}/sessions/gone/trajectory").json()["segments"] == []
    )  # aborted: not exported


def test_engine_refusal_before_the_stream_is_a_normal_error(start_proxy: ProxyFactory) -> None:
    with start_proxy(engine_url="http://127.0.0.1:9", context_length=4096) as url:
        response = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True},
        )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"


@pytest.mark.parametrize("incremental", [False, True])
def test_text_in_the_last_chunk_is_streamed(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, incremental: bool
) -> None:
    """A turn cut by max_tokens ends on a text token: it must reach the client, once."""
    engine.incremental = incremental
    ids = qwen_tokenizer.encode("one two three four five six").ids
    body = {"model": "m", "messages": [{"role": "user", "content": "count"}], "max_tokens": 4}
    engine.push(ids)
    plain = httpx.post(f"{proxy_url}/sessions/p4/v1/chat/completions", json=body).json()
    engine.push(ids)
    events, _ = stream_events(proxy_url, {**body, "stream": True}, "s4")
    streamed = assemble_stream(events)
    assert plain["choices"][0]["message"]["content"] == qwen_tokenizer.decode(ids[:4])
    assert streamed["content"] == plain["choices"][0]["message"]["content"]
    assert streamed["finish_reason"] == "length"


def test_a_stop_string_split_across_chunks_is_never_streamed(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    pieces = ["alpha", " beta", " ST", "OP", " gamma"]
    ids = [i for piece in pieces for i in qwen_tokenizer.encode(piece).ids]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": ["STOP"]}
    engine.push(ids)
    events, _ = stream_events(proxy_url, {**body, "stream": True}, "stop")
    streamed = assemble_stream(events)
    assert streamed["content"] == "alpha beta "
    assert not any("ST" in (e["choices"][0]["delta"].get("content") or "") for e in events if e["choices"])


def test_an_error_event_ends_the_stream_of_every_choice(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """n=2: choice 1's engine aborts while choice 0 still samples. Nothing follows the error event
    (OpenAI sends nothing after one, and an SDK raises at it), and choice 0 is stopped and recorded
    aborted: before, it went on, finished `ok` and was exported though no SDK client read it."""
    engine.chunk_delay_s = 0.05
    long = qwen_tokenizer.encode(" word" * 40, add_special_tokens=False).ids
    engine.push([*long, token_id(qwen_tokenizer, "<|im_end|>")])
    for _ in range(2):  # an abort before any token is tried once more
        engine.push([], finish={"type": "abort", "message": "Abort by /abort_request"})
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 2, "stream": True}
    events, _ = stream_events(proxy_url, body, "n2-error")
    errors = [n for n, event in enumerate(events) if "error" in event]
    assert errors == [len(events) - 1], events[-3:]  # the error event is the last one
    assert not any(choice.get("finish_reason") for e in events for choice in e.get("choices") or [])
    exported = httpx.get(f"{proxy_url}/sessions/n2-error/samples", params={"mode": "stepwise"}).json()
    assert exported["samples"] == []  # neither choice is a sample: both ended aborted
