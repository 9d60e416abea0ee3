"""The decisions of chat-templates.md section 4, each on a real template over HTTP."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.families import FAMILIES, build_tokenizer_dir
from tests.support import reply, segments, token_id

TOOL_A = {"type": "function", "function": {"name": "a", "parameters": {"type": "object", "properties": {}}}}
TOOL_B = {"type": "function", "function": {"name": "b", "parameters": {"type": "object", "properties": {}}}}


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return [*tokenizer.encode(text, add_special_tokens=False).ids, token_id(tokenizer, "<|im_end|>")]


def _chat(url: str, messages: list[dict[str, Any]], session: str = "d", **extra: Any) -> dict[str, Any]:
    return reply(url, messages, session, **extra)


def _segments(url: str, session: str = "d") -> list[dict[str, Any]]:
    return segments(url, session)


def test_changed_tool_list_starts_a_new_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(_ids(qwen_tokenizer, "first"))
    messages = [{"role": "user", "content": "go"}]
    messages += [_chat(proxy_url, messages, tools=[TOOL_A]), {"role": "user", "content": "more"}]
    engine.push(_ids(qwen_tokenizer, "second"))
    _chat(proxy_url, messages, tools=[TOOL_A, TOOL_B])
    assert [s["num_calls"] for s in _segments(proxy_url)] == [1, 1]


def test_template_kwargs_are_rendered_and_part_of_the_history(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(_ids(qwen_tokenizer, "first"))
    messages = [{"role": "user", "content": "go"}]
    kwargs = {"enable_thinking": False}
    messages += [_chat(proxy_url, messages, chat_template_kwargs=kwargs), {"role": "user", "content": "more"}]
    prompt = qwen_tokenizer.decode(engine.requests[0]["input_ids"], skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    engine.push(_ids(qwen_tokenizer, "second"))
    _chat(proxy_url, messages, chat_template_kwargs=kwargs)
    engine.push(_ids(qwen_tokenizer, "third"))
    _chat(proxy_url, [*messages[:2], {"role": "user", "content": "more"}])  # kwargs dropped: another render
    assert [s["num_calls"] for s in _segments(proxy_url)] == [2, 1]


def test_system_message_appended_mid_conversation_continues_on_qwen(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(_ids(qwen_tokenizer, "first"))
    messages = [{"role": "user", "content": "go"}]
    messages += [
        _chat(proxy_url, messages),
        {"role": "system", "content": "Be terse now."},
        {"role": "user", "content": "more"},
    ]
    engine.push(_ids(qwen_tokenizer, "second"))
    _chat(proxy_url, messages)
    [segment] = _segments(proxy_url)
    assert "<|im_start|>system\nBe terse now.<|im_end|>" in qwen_tokenizer.decode(
        segment["response_ids"], skip_special_tokens=False
    )
    assert segment["drift"]["unclassified"] == 0


def test_template_history_mode_renders_fresh_when_the_template_strips_reasoning(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    with start_proxy(history_mode="template") as url:
        engine.push(_ids(qwen_tokenizer, "<think>\nplan\n</think>\n\nanswer"))
        messages = [{"role": "user", "content": "q1"}]
        reply = _chat(url, messages)
        assert reply["reasoning_content"] == "plan"
        # A new user query: Qwen3 drops the earlier reasoning, so a fresh render differs from the stream.
        messages += [reply, {"role": "user", "content": "q2"}]
        engine.push(_ids(qwen_tokenizer, "done"))
        _chat(url, messages)
        segments = _segments(url)
    assert [s["num_calls"] for s in segments] == [1, 1]
    second_prompt = qwen_tokenizer.decode(engine.requests[1]["input_ids"], skip_special_tokens=False)
    assert "plan" not in second_prompt


def test_exact_history_mode_keeps_the_reasoning_and_names_the_drift(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(_ids(qwen_tokenizer, "<think>\nplan\n</think>\n\nanswer"))
    messages = [{"role": "user", "content": "q1"}]
    messages += [_chat(proxy_url, messages), {"role": "user", "content": "q2"}]
    engine.push(_ids(qwen_tokenizer, "done"))
    _chat(proxy_url, messages)
    [segment] = _segments(proxy_url)
    assert "plan" in qwen_tokenizer.decode(engine.requests[1]["input_ids"])
    assert segment["drift"]["counts"]["history_reasoning_stripped"] == 1


def test_edited_reasoning_is_not_append_only(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.push(_ids(qwen_tokenizer, "<think>\nplan\n</think>\n\nanswer"))
    messages = [{"role": "user", "content": "q1"}]
    reply = _chat(proxy_url, messages)
    messages += [{**reply, "reasoning_content": "another plan"}, {"role": "user", "content": "q2"}]
    engine.push(_ids(qwen_tokenizer, "done"))
    _chat(proxy_url, messages)
    assert [s["num_calls"] for s in _segments(proxy_url)] == [1, 1]


def test_qwen25_default_system_prompt_appears_once(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    directory = build_tokenizer_dir(FAMILIES["qwen2_5"], tmp_path / "qwen2_5")
    with start_proxy(tokenizer=directory) as url:
        engine.push(_ids(qwen_tokenizer, "hello"))
        messages = [{"role": "user", "content": "hi"}]
        messages += [_chat(url, messages), {"role": "user", "content": "again"}]
        engine.push(_ids(qwen_tokenizer, "hello again"))
        _chat(url, messages)
        [segment] = _segments(url)
    stream = qwen_tokenizer.decode(segment["prompt_ids"] + segment["response_ids"], skip_special_tokens=False)
    assert stream.count("You are Qwen, created by Alibaba Cloud") == 1


def test_the_date_is_pinned_per_session(
    start_proxy: ProxyFactory, engine: FakeSGLang, tmp_path: Path
) -> None:
    directory = build_tokenizer_dir(FAMILIES["llama3_2"], tmp_path / "llama3_2")
    db = tmp_path / "dated.db"
    with start_proxy(tokenizer=directory, db=db) as url:
        # A session first seen on 3 March 2021 keeps rendering that date.
        with sqlite3.connect(db) as connection:
            connection.execute(
                "insert into sessions (id, status, created_at, updated_at, template_now) values "
                "('dated', 'active', '2021-03-03 10:00:00', '2021-03-03 10:00:00', '2021-03-03 10:00:00')"
            )
        llama = Tokenizer.from_file(str(directory / "tokenizer.json"))
        engine.tokenizer, engine.vocab_size = llama, llama.get_vocab_size(with_added_tokens=True)
        engine.eos_ids = (token_id(llama, "<|eot_id|>"),)
        engine.push([*llama.encode("hi", add_special_tokens=False).ids, token_id(llama, "<|eot_id|>")])
        _chat(url, [{"role": "user", "content": "date?"}], session="dated")
    prompt = llama.decode(engine.requests[0]["input_ids"], skip_special_tokens=False)
    assert "Today Date: 03 Mar 2021" in prompt


def test_template_verdict_is_served(proxy_url: str) -> None:
    verdict = httpx.get(f"{proxy_url}/v1/template").json()
    assert verdict["close_tokens"] == ["<|im_end|>"]
    assert verdict["sampled_stop_tokens"] == ["<|im_end|>"]
    assert verdict["separator"] == "\n"
    assert all(v["continues"] for v in verdict["appends"].values())
