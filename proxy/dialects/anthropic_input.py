"""Anthropic Messages input -> chat messages and tools, the shape the turn core renders and matches.

An assistant turn's blocks (thinking, text, tool_use) are one assistant message; a user turn's
tool_result blocks are tool messages, its text a user message. A thinking block continues the
segment only when its signature is one we issued for that text; any other is an edit. A tool
result's tool_reference blocks load deferred tools (proxy/dialects/anthropic_tools.py).
"""

from __future__ import annotations

import json
from typing import Any

from proxy.chat.messages import UNVERIFIED_REASONING, Message
from proxy.dialects.anthropic_checks import check_tool_pairs
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest, UnsupportedParameter


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


def _string(block: dict[str, Any], key: str, param: str) -> str:
    """A block's field that must be text (Anthropic refuses anything else too)."""
    value = block.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(f"{_block_type(block)} blocks need {key} as a string", param=param)
    return value


def _blocks(content: Any, param: str) -> list[Any]:
    """A message's content as blocks: a string is one text block; anything else is refused."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param)
    return content


def blocks_text(content: Any, param: str) -> str:
    """Text blocks (or a plain string) as one text; the two shapes of the same text are equal."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of blocks", param=param)
    texts = []
    for block in content:
        if _block_type(block) != "text":
            raise UnsupportedParameter(
                f"content blocks of type {_block_type(block)!r} are not supported here", param=param
            )
        texts.append(_string(block, "text", param))
    return "\n".join(texts)


def _tool_use(block: dict[str, Any], param: str) -> dict[str, Any]:
    arguments = block.get("input", {})
    if not isinstance(arguments, dict):
        raise InvalidRequest("tool_use blocks need input as an object", param=param)
    return {
        "id": _string(block, "id", param),
        "type": "function",
        "function": {
            "name": _string(block, "name", param),
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


def _thinking(block: dict[str, Any], sealer: Sealer, param: str) -> tuple[str, bool]:
    """A thinking block's reasoning and whether we issued it: its signature seals its text, or
    (thinking.display "omitted", the text left out) carries it."""
    thought = _string(block, "thinking", param)
    signature = str(block.get("signature", ""))
    if sealer.verifies(thought, signature):
        return thought, True
    carried = sealer.opened(signature) if thought == "" else None
    return (carried, True) if carried is not None else (thought, False)


def _assistant(content: Any, sealer: Sealer, param: str) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: Message = {"role": "assistant", "content": None}
    texts: list[str] = []
    thoughts: list[str] = []
    verified = True
    for block in _blocks(content, param):
        kind = _block_type(block)
        if kind == "text":
            texts.append(_string(block, "text", param))
        elif kind == "thinking":
            thought, sealed = _thinking(block, sealer, param)
            thoughts.append(thought)
            verified = verified and sealed
        elif kind == "redacted_thinking":
            verified = False  # we never redact: this is not reasoning we sampled
        elif kind == "tool_use":
            message.setdefault("tool_calls", []).append(_tool_use(block, param))
        else:
            raise UnsupportedParameter(f"assistant blocks of type {kind!r} are not supported", param=param)
    if texts:
        message["content"] = "".join(texts)
    if thoughts:
        message["reasoning_content"] = "".join(thoughts)
    if not verified:
        message[UNVERIFIED_REASONING] = True
    return message


def _result_text(content: Any, tools: AnthropicTools, param: str) -> str:
    """A tool result's text; a run of tool_reference blocks is the definitions of the tools it loads."""
    if not isinstance(content, list):
        return "" if content is None else blocks_text(content, param)
    parts: list[str] = []
    names: list[str] = []
    for block in content:
        if _block_type(block) == "tool_reference":
            names.append(tools.reference(block, param))
            continue
        if names:
            parts.append(tools.definitions(names))
            names = []
        parts.append(blocks_text([block], param))
    if names:
        parts.append(tools.definitions(names))
    return "\n".join(parts)


def _user(content: Any, tools: AnthropicTools, param: str) -> list[Message]:
    if content in ("", []):
        raise InvalidRequest(
            f"{param.removesuffix('.content')}: all messages must have non-empty content except for "
            "the optional final assistant message",
            param=param,
        )
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    found: list[Message] = []
    texts: list[str] = []
    for block in _blocks(content, param):
        kind = _block_type(block)
        if kind == "tool_result":
            if not isinstance(block.get("is_error", False), bool):
                raise InvalidRequest("tool_result.is_error must be a boolean", param=param)
            text = _result_text(block.get("content"), tools, param)
            call_id = _string(block, "tool_use_id", param)
            found.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "text":
            if _string(block, "text", param) == "":
                raise InvalidRequest("text content blocks must be non-empty", param=param)
            texts.append(block["text"])
        else:
            raise UnsupportedParameter(f"user blocks of type {kind!r} are not supported", param=param)
    if texts:
        found.append({"role": "user", "content": "\n".join(texts)})
    return found


def anthropic_messages(
    system: Any, messages: list[dict[str, Any]], sealer: Sealer, tools: AnthropicTools | None = None
) -> list[Message]:
    """The conversation of a Messages request: system first, then every turn; the deferred tools its
    tool results load are marked loaded in `tools`."""
    tools = AnthropicTools.of(None) if tools is None else tools
    found = system_messages(system)
    for index, message in enumerate(messages):
        found += anthropic_message(message, index, sealer, tools)
    check_tool_pairs(messages, list(range(len(messages))))
    return found


def system_messages(system: Any) -> list[Message]:
    """The request's system text as the conversation's first message (none without one)."""
    return [{"role": "system", "content": blocks_text(system, "system")}] if system else []


def anthropic_message(
    message: dict[str, Any], index: int, sealer: Sealer, tools: AnthropicTools
) -> list[Message]:
    """The messages `message`, the request's `index`th, makes; a tool result's tool_reference blocks
    load deferred tools in `tools` (the only way a message depends on the ones before it)."""
    role = message.get("role")
    param = f"messages[{index}].content"
    if role == "assistant":
        return [_assistant(message.get("content"), sealer, param)]
    if role == "user":
        return _user(message.get("content"), tools, param)
    if role == "system":
        # Claude Code puts system messages mid-conversation, as blocks or as a string.
        return [{"role": "system", "content": blocks_text(message.get("content"), param)}]
    raise InvalidRequest(f"unknown role {role!r}", param=f"messages[{index}].role")


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice as chat's: auto and none as they are, any as required, a tool by name."""
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
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("tool_choice of type 'tool' needs the tool's name", param="tool_choice.name")
        return {"type": "function", "function": {"name": name}}
    raise InvalidRequest(
        f"tool_choice.type is 'auto', 'any', 'tool' or 'none', not {kind!r}", param="tool_choice.type"
    )
