"""Sampled ids to an OpenAI assistant message: content, reasoning_content and tool_calls.

Text is derived from the ids for the harness; the ids stay the record. This module holds the
Hermes/Qwen format: optional `<think>...</think>`, then `<tool_call>{"name", "arguments"}</tool_call>`.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.chat.messages import Message

_TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]

    def as_message(self) -> Message:
        message: Message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def new_tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def split_reasoning(text: str) -> tuple[str | None, str]:
    """Reasoning and the rest; handles reasoning opened by the generation prompt (no `<think>` sampled)."""
    if "</think>" in text:
        reasoning, _, rest = text.partition("</think>")
        reasoning = reasoning.split("<think>", 1)[-1]
        return reasoning.strip("\n"), rest.lstrip("\n")
    if text.lstrip().startswith("<think>"):
        # Cut off (length) while still reasoning: all of it is reasoning.
        return text.lstrip().removeprefix("<think>").strip("\n"), ""
    return None, text


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """Content before the calls and the calls; None when the text holds a malformed or unclosed call."""
    if "<tool_call>" not in text:
        return text, []
    calls: list[dict[str, Any]] = []
    for body in _TOOL_CALL.findall(text):
        try:
            payload = orjson.loads(body)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        arguments = payload.get("arguments", {})
        calls.append(
            {
                "id": new_tool_call_id(),
                "type": "function",
                "function": {
                    "name": payload["name"],
                    "arguments": orjson.dumps(arguments).decode()
                    if not isinstance(arguments, str)
                    else arguments,
                },
            }
        )
    opened = text.count("<tool_call>")
    if not calls or opened != len(calls) or text.count("</tool_call>") != opened:
        return None
    before = text[: text.index("<tool_call>")]
    after = text[text.rindex("</tool_call>") + len("</tool_call>") :]
    return (before.strip() + ("\n" + after.strip() if after.strip() else "")).strip(), calls


def parse_output(text: str, *, parse_reasoning: bool) -> ParsedOutput:
    reasoning, rest = split_reasoning(text) if parse_reasoning else (None, text)
    parsed = parse_tool_calls(rest)
    if parsed is None:
        # A malformed tool call is returned as content, never as an error.
        return ParsedOutput(content=rest, reasoning_content=reasoning, tool_calls=[])
    content, calls = parsed
    return ParsedOutput(
        content=content if content or not calls else None, reasoning_content=reasoning, tool_calls=calls
    )
