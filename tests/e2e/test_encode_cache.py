"""Through the served proxy, prompts encoded from the chunk cache are the ids transformers gives: the same
first prompt sent by many rollouts, other tasks behind the same system prompt and tools, and the
continuation after each; GET /v1/template reports the cache's proof."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.fakes.sglang import FakeSGLang

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file — données 漢字",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
SYSTEM = {"role": "system", "content": "You are a coding agent.\n\n  Answer briefly. "}


def test_cached_encodes_record_the_ids_transformers_renders(
    proxy_url: str, engine: FakeSGLang, qwen_dir: Path, qwen_tokenizer: Tokenizer
) -> None:
    report = httpx.get(f"{proxy_url}/v1/template").json()["encode_cache"]
    assert report["proven"] is True
    assert report["split_tokens"] > 0
    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    for task in range(3):
        messages: list[dict[str, Any]] = [
            SYSTEM,
            {"role": "user", "content": f"Fix bug {task} in  main.py\n"},
        ]
        expected = hf.apply_chat_template(
            messages,
            tools=list[Any](TOOLS),
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for rollout in range(3):  # a group's rollouts send the same first prompt
            session = f"task{task}-rollout{rollout}"
            url = f"{proxy_url}/sessions/{session}/v1/chat/completions"
            body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 8}
            first = httpx.post(url, json=body)
            assert first.status_code == 200, first.text
            first_ids = engine.requests[-1]["input_ids"]
            assert first_ids == expected
            follow_up = [
                *messages,
                {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "next é"},
            ]
            second = httpx.post(url, json={**body, "messages": follow_up})
            assert second.status_code == 200, second.text
            tail = "ok<|im_end|>\n<|im_start|>user\nnext é<|im_end|>\n<|im_start|>assistant\n"
            plain = qwen_tokenizer.encode(tail, add_special_tokens=False).ids
            assert engine.requests[-1]["input_ids"] == [*first_ids, *plain]
            segments = httpx.get(f"{proxy_url}/sessions/{session}/trajectory").json()["segments"]
            assert len(segments) == 1
            assert segments[0]["prompt_ids"] == expected


def _tool_conversation(proxy_url: str, engine: FakeSGLang, session: str) -> list[list[int]]:
    """A coding agent's turns with tool results (ASCII code and logs, one with non-ASCII text): the
    prompt ids the engine received for each."""
    url = f"{proxy_url}/sessions/{session}/v1/chat/completions"
    messages: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": "Fix the failing test."}]
    results = [
        "def f(x):\n    return x+1  # it's fine\n\n\tprint('ok')\r\n" * 20,
        'Traceback (most recent call last):\n  File "a.py", line 3\nValueError: 12345 != 0x1F\n' * 10,
        "données: 漢字 🙂 and ASCII after\n" * 5,
        "   \n\n    trailing spaces   \n" + "-" * 80,
    ]
    sent: list[list[int]] = []
    for n, result in enumerate(results):
        answer = httpx.post(url, json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 8})
        assert answer.status_code == 200, answer.text
        sent.append(engine.requests[-1]["input_ids"])
        reply = answer.json()["choices"][0]["message"]
        call = {"id": f"call_{n}", "type": "function", "function": {"name": "read_file", "arguments": "{}"}}
        messages += [
            {"role": "assistant", "content": reply["content"], "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{n}", "content": result},
        ]
    return sent


def test_tiktoken_proven_at_start_up_sends_the_ids_the_tokenizer_gives(
    start_proxy: Any, engine: FakeSGLang
) -> None:
    sent = {}
    for after in (0, -1):  # proven at start-up, and never used
        with start_proxy(fast_bpe_after_tokens=after) as url:
            fast = httpx.get(f"{url}/v1/template").json()["encode_cache"]["fast_bpe"]
            assert fast["state"] == ("proven" if after == 0 else "off"), fast
            sent[after] = _tool_conversation(url, engine, f"agent-{after}")
    assert sent[0] == sent[-1]
    assert len(sent[0][-1]) > len(sent[0][0]) + 500  # the tool results went into the prompts
