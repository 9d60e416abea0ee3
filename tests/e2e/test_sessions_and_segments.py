"""Session resolution, segment boundaries, truncated turns and restarts, over HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.invariants import assert_invariants
from tests.support import chat, segments, token_id


def _chat(url: str, messages: list[dict[str, Any]], session: str = "s", **extra: Any) -> dict[str, Any]:
    return chat(url, messages, session, **extra)


def _segments(url: str, session: str = "s") -> list[dict[str, Any]]:
    return segments(url, session)


def _text_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def test_conversation_continued_after_restart_extends_its_segment(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    outputs = [engine.push([*_text_ids(qwen_tokenizer, "first answer"), im_end])]
    messages: list[dict[str, Any]] = [{"role": "user", "content": "one"}]
    with start_proxy(db=tmp_path / "keep.db") as url:
        messages.append(_chat(url, messages)["choices"][0]["message"])
    messages.append({"role": "user", "content": "two"})
    outputs.append(engine.push([*_text_ids(qwen_tokenizer, "second answer"), im_end]))
    with start_proxy(db=tmp_path / "keep.db") as url:
        _chat(url, messages)
        segments = _segments(url)
    assert len(segments) == 1
    assert segments[0]["num_calls"] == 2
    assert_invariants(segments[0], engine.requests, outputs)


def test_history_that_does_not_extend_starts_a_new_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    engine.push([*_text_ids(qwen_tokenizer, "long story"), im_end])
    messages: list[dict[str, Any]] = [{"role": "user", "content": "tell me"}]
    messages.append(_chat(proxy_url, messages)["choices"][0]["message"])
    # A summary replaces the assistant turn: not append-only (decision 5).
    summary = [
        {"role": "user", "content": "tell me"},
        {"role": "assistant", "content": "summary"},
        {"role": "user", "content": "go on"},
    ]
    engine.push([*_text_ids(qwen_tokenizer, "more"), im_end])
    _chat(proxy_url, summary)
    segments = _segments(proxy_url)
    assert [s["num_calls"] for s in segments] == [1, 1]
    assert segments[1]["prompt_ids"] == engine.requests[1]["input_ids"]


def test_truncated_turn_continued_gets_a_synthesized_close(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    scripted = engine.push(_text_ids(qwen_tokenizer, "one two three four five six seven"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    first = _chat(proxy_url, messages, max_tokens=3)
    assert first["choices"][0]["finish_reason"] == "length"
    messages += [first["choices"][0]["message"], {"role": "user", "content": "continue"}]
    engine.push([*_text_ids(qwen_tokenizer, "done"), im_end])
    _chat(proxy_url, messages)
    [segment] = _segments(proxy_url)
    sampled = scripted.ids[:3]
    response = segment["response_ids"]
    assert response[:4] == [*sampled, im_end]
    assert segment["loss_mask"][:4] == [1, 1, 1, 0]
    assert segment["rollout_logprobs"][3] == 0.0
    assert segment["boundary_edits"] == [
        {"kind": "truncation_close_synthesized", "position": 3, "token": im_end, "call_id": 2}
    ]


def test_stop_string_turn_is_answered_cut_and_recorded_whole(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    scripted = engine.push(_text_ids(qwen_tokenizer, "alpha beta STOP gamma"))
    reply = _chat(proxy_url, [{"role": "user", "content": "x"}], stop=["STOP"])
    assert reply["choices"][0]["message"]["content"] == "alpha beta "
    assert reply["choices"][0]["finish_reason"] == "stop"
    [segment] = _segments(proxy_url)
    recorded = segment["response_ids"]
    assert recorded == scripted.ids[: len(recorded)]
    assert "STOP" in qwen_tokenizer.decode(recorded)
    # The harness continues: the sampled tokens stay, and the close is synthesized after them.
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    messages = [
        {"role": "user", "content": "x"},
        reply["choices"][0]["message"],
        {"role": "user", "content": "y"},
    ]
    engine.push([*_text_ids(qwen_tokenizer, "fine"), im_end])
    _chat(proxy_url, messages)
    [segment] = _segments(proxy_url)
    assert segment["response_ids"][: len(recorded) + 1] == [*recorded, im_end]
    assert segment["loss_mask"][len(recorded)] == 0
    assert [e["kind"] for e in segment["boundary_edits"]] == ["truncation_close_synthesized"]
    assert segment["drift"]["unclassified"] == 0


def test_session_from_header_and_created_when_absent(proxy_url: str, engine: FakeSGLang) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    by_header = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, headers={"X-Session-Id": "hdr-1"})
    assert by_header.status_code == 200
    assert by_header.headers["x-session-id"] == "hdr-1"
    created = httpx.post(f"{proxy_url}/v1/chat/completions", json=body)
    new_id = created.headers["x-session-id"]
    assert new_id
    assert new_id != "hdr-1"
    assert len(_segments(proxy_url, new_id)) == 1
    assert len(_segments(proxy_url, "hdr-1")) == 1


def test_models_and_health(proxy_url: str) -> None:
    for path in ("/v1/models", "/sessions/abc/v1/models"):
        models = httpx.get(proxy_url + path).json()
        assert models["data"][0]["max_model_len"] == 32768
    assert httpx.get(f"{proxy_url}/health").json()["status"] == "ok"
