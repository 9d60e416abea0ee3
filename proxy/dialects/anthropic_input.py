"""Anthropic Messages input -> chat messages and tools, the shape the turn core renders and matches.

An assistant turn's blocks (thinking, text, tool_use) are one assistant message; a user turn's
tool_result blocks are tool messages, its text a user message. A thinking block continues the
segment only when its signature is one we issued for that text; any other is an edit.
"""

from __future__ import annotations

import json
from typing import Any

from proxy.chat.messages import UNVERIFIED_REASONING, Message
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest, UnsupportedParameter


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def blocks_text(content: Any, param: str) -> str:
    """Text blocks (or a plain string) as one text; the two shapes of the same text are equal."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param)
    texts = []
    for block in content:
        if _block_type(block) != "text" or not isinstance(block.get("text"), str):
            raise UnsupportedParameter(
                f"content blocks of type {_block_type(block)!r} are not supported here", param=param
            )
        texts.append(block["text"])
    return "\n".join(texts)


def _assistant(content: Any, sealer: Sealer, param: str) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: Message = {"role": "assistant", "content": None}
    texts: list[str] = []
    thoughts: list[str] = []
    verified = True
    for block in content or []:
        kind = _block_type(block)
        if kind == "text":
            texts.append(block.get("text", ""))
        elif kind == "thinking":
            thoughts.append(block.get("thinking", ""))
            verified = verified and sealer.verifies(
                block.get("thinking", ""), str(block.get("signature", ""))
            )
        elif kind == "redacted_thinking":
            verified = False  # we never redact: this is not reasoning we sampled
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append(
                {
                    "id": block.get("id"),
                    "type": "function",
                    "function": {
                        "name": block.get("name"),
                        "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False),
                    },
                }
            )
        else:
            raise UnsupportedParameter(f"assistant blocks of type {kind!r} are not supported", param=param)
    if texts:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if not verified:
        message[UNVERIFIED_REASONING] = True
    return message


def _user(content: Any, param: str) -> list[Message]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    found: list[Message] = []
    texts: list[str] = []
    for block in content or []:
        kind = _block_type(block)
        if kind == "tool_result":
            result = block.get("content")
            text = "" if result is None else blocks_text(result, param)
            found.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": text})
        elif kind == "text":
            texts.append(block.get("text", ""))
        else:
            raise UnsupportedParameter(f"user blocks of type {kind!r} are not supported", param=param)
    if texts:
        found.append({"role": "user", "content": "\n".join(texts)})
    return found


def anthropic_messages(system: Any, messages: list[dict[str, Any]], sealer: Sealer) -> list[Message]:
    """The conversation of a Messages request: system first, then every turn."""
    found: list[Message] = []
    if system:
        found.append({"role": "system", "content": blocks_text(system, "system")})
    for index, message in enumerate(messages):
        role = message.get("role")
        param = f"messages[{index}].content"
        if role == "assistant":
            found.append(_assistant(message.get("content"), sealer, param))
        elif role == "user":
            found.extend(_user(message.get("content"), param))
        elif role == "system":
            # Claude Code puts system messages mid-conversation, as blocks or as a string.
            found.append({"role": "system", "content": blocks_text(message.get("content"), param)})
        else:
            raise InvalidRequest(f"unknown role {role!r}", param=f"messages[{index}].role")
    return found


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    found = []
    for index, tool in enumerate(tools or []):
        if tool.get("type") not in (None, "custom"):
            raise UnsupportedParameter(
                f"tools of type {tool.get('type')!r} are not supported (custom tools with an input_schema)",
                param=f"tools[{index}]",
            )
        function: dict[str, Any] = {"name": tool.get("name")}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        found.append({"type": "function", "function": function})
    return found


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None:
        return None
    if choice.get("disable_parallel_tool_use"):
        raise UnsupportedParameter(
            "disable_parallel_tool_use cannot be enforced", param="tool_choice.disable_parallel_tool_use"
        )
    kind = choice.get("type")
    if kind in ("auto", "none"):
        return str(kind)
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest(f"unknown tool_choice type {kind!r}", param="tool_choice")
