"""A five-turn tool-using conversation through the proxy, checked token for token (I1-I6)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

from tests.fakes.sglang import FakeSGLang, ScriptedOutput
from tests.invariants import assert_invariants
from tests.support import token_id

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather of a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Local time",
            "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]},
        },
    },
]


def _call(name: str, arguments: dict[str, Any]) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        + "\n</tool_call>"
    )


# Each turn: what the model "samples", and the tool results the harness sends back after it.
TURNS: list[tuple[str, list[str]]] = [
    (
        "<think>\nI need the weather first.\n</think>\n\n" + _call("get_weather", {"city": "Paris"}),
        ["  Sunny, 21°C\n"],
    ),
    (
        "<think>\nNow Tokyo, both at once.\n</think>\n\n"
        + _call("get_time", {"tz": "Asia/Tokyo"})
        + "\n"
        + _call("get_weather", {"city": "Tokyo"}),
        ["09:00", "\nRain 🌧\n\n"],
    ),
    ("<think>\nAnd the time in Paris.\n</think>\n\n" + _call("get_time", {"tz": "Europe/Paris"}), ["02:00"]),
    (
        "<think>\nBerlin too, to compare.\n</think>\n\nLet me also check Berlin.\n"
        + _call("get_weather", {"city": "Berlin"}),
        ['{"temp": 18, "sky": "cloudy"}'],
    ),
    (
        "<think>\nI have everything.\n</think>\n\n"
        "Paris: sunny, 21°C, 02:00. Tokyo: rain, 09:00. Berlin: 18°C.",
        [],
    ),
]


def _ids(tokenizer: Tokenizer, text: str, *, canonical: bool) -> list[int]:
    if canonical:
        return list(tokenizer.encode(text, add_special_tokens=False).ids)
    # Re-tokenize in 3-character pieces: the same text, ids a re-tokenizer would never produce.
    ids: list[int] = []
    for piece in _pieces(text):
        ids.extend(tokenizer.encode(piece, add_special_tokens=False).ids)
    return ids


def _pieces(text: str) -> list[str]:
    out: list[str] = []
    for part in text.replace("<think>", "\0<think>\0").replace("</think>", "\0</think>\0").split("\0"):
        if part in ("<think>", "</think>") or "<tool_call>" in part:
            out.append(part)
        else:
            out.extend(part[i : i + 3] for i in range(0, len(part), 3))
    return [p for p in out if p]


def run_conversation(
    url: str, engine: FakeSGLang, tokenizer: Tokenizer, *, canonical: bool, echo_reasoning: bool
) -> tuple[list[dict[str, Any]], list[ScriptedOutput]]:
    im_end = token_id(tokenizer, "<|im_end|>")
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a weather agent."},
        {"role": "user", "content": "Weather and time in Paris and Tokyo?"},
    ]
    outputs = []
    with httpx.Client(base_url=url, timeout=30) as client:
        for text, results in TURNS:
            outputs.append(engine.push([*_ids(tokenizer, text, canonical=canonical), im_end]))
            reply = client.post(
                "/sessions/agent-1/v1/chat/completions",
                json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 512},
            )
            assert reply.status_code == 200, reply.text
            message = reply.json()["choices"][0]["message"]
            if not echo_reasoning:
                message.pop("reasoning_content", None)
            messages.append(message)
            calls = message.get("tool_calls") or []
            assert len(calls) == len(results)
            messages.extend(
                {"role": "tool", "tool_call_id": call["id"], "content": result}
                for call, result in zip(calls, results, strict=True)
            )
    return messages, outputs


def _segment(url: str) -> dict[str, Any]:
    trajectory = httpx.get(f"{url}/sessions/agent-1/trajectory").json()
    assert len(trajectory["segments"]) == 1
    segment: dict[str, Any] = trajectory["segments"][0]
    assert segment["num_calls"] == len(TURNS)
    return segment


def _reference_render(qwen_dir: Path, messages: list[dict[str, Any]], reasoning: list[str]) -> list[int]:
    """The real transformers render of the whole conversation, reasoning included."""
    hf = AutoTokenizer.from_pretrained(str(qwen_dir))
    assistants = iter(reasoning)
    full = []
    for original in messages:
        message = dict(original)
        if message["role"] == "assistant":
            message["reasoning_content"] = next(assistants)
            message["content"] = message.get("content") or ""
            for call in message.get("tool_calls") or []:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        full.append(message)
    tools: list[dict[str, Any]] = list(TOOLS)
    ids = hf.apply_chat_template(full, tools=tools, tokenize=True, return_dict=False)  # type: ignore[arg-type]
    assert isinstance(ids, list)
    assert all(isinstance(i, int) for i in ids)
    return ids  # type: ignore[return-value]


def _checked_stream_and_render(
    url: str,
    engine: FakeSGLang,
    tokenizer: Tokenizer,
    qwen_dir: Path,
    *,
    canonical: bool,
    echo_reasoning: bool,
) -> tuple[list[int], list[int]]:
    """Run the conversation, check I1-I6 on its one segment; return its stream and the reference render."""
    messages, outputs = run_conversation(
        url, engine, tokenizer, canonical=canonical, echo_reasoning=echo_reasoning
    )
    segment = _segment(url)
    assert_invariants(segment, engine.requests, outputs)
    reasoning = [text.split("</think>")[0].removeprefix("<think>\n").rstrip("\n") for text, _ in TURNS]
    return segment["prompt_ids"] + segment["response_ids"], _reference_render(qwen_dir, messages, reasoning)


@pytest.mark.parametrize("echo_reasoning", [True, False])
def test_canonical_outputs_match_the_full_render_token_for_token(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, qwen_dir: Path, echo_reasoning: bool
) -> None:
    stream, render = _checked_stream_and_render(
        proxy_url, engine, qwen_tokenizer, qwen_dir, canonical=True, echo_reasoning=echo_reasoning
    )
    # Only difference: the separator after the last turn's close, which the engine never samples.
    assert stream == render[:-1]
    assert render[-1:] == qwen_tokenizer.encode("\n", add_special_tokens=False).ids


def test_sampled_ids_are_kept_when_they_differ_from_a_retokenization(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, qwen_dir: Path
) -> None:
    stream, render = _checked_stream_and_render(
        proxy_url, engine, qwen_tokenizer, qwen_dir, canonical=False, echo_reasoning=False
    )
    assert stream != render[:-1], "the scripted ids should differ from a canonical tokenization"
    # Same text: the only differences are inside sampled assistant tokens (assistant_bpe drift).
    assert qwen_tokenizer.decode(stream, skip_special_tokens=False) == qwen_tokenizer.decode(
        render[:-1], skip_special_tokens=False
    )
