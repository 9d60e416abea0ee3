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
from proxy.dialects.anthropic_checks import TOOL_CHOICE_KEYS, check_keys, check_tool_pairs
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest, UnsupportedParameter


def _block_type(block: Any) -> str | None:
    return block.get("type") if isinstance(block, dict) else None


# The keys Anthropic's API takes on each block it can hold here; any other is its 400 "Extra inputs
# are not permitted" (a key this proxy would drop from the prompt and the record alike).
_BLOCK_KEYS: dict[str | None, frozenset[str]] = {
    "text": frozenset({"type", "text", "cache_control", "citations"}),
    "thinking": frozenset({"type", "thinking", "signature"}),
    "redacted_thinking": frozenset({"type", "data"}),
    # toolset_name: the MCP toolset a tool came from, which the SDKs echo back; the tool's name is
    # what a template renders.
    "tool_use": frozenset({"type", "id", "name", "input", "cache_control", "caller", "toolset_name"}),
    "tool_result": frozenset({"type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"}),
    "tool_reference": frozenset({"type", "tool_name", "cache_control"}),
}
_MESSAGE_KEYS = frozenset({"role", "content"})
_CACHE_TTLS = ("5m", "1h")
_WHITESPACE_ONLY = "messages: text content blocks must contain non-whitespace text"


def check_cache_control(holder: dict[str, Any], param: str) -> None:
    """`cache_control` (a hint: accepted and recorded) as Anthropic types it: ephemeral, 5m or 1h."""
    control = holder.get("cache_control")
    if control is None:
        return
    if not isinstance(control, dict) or control.get("type") != "ephemeral":
        raise InvalidRequest(f"{param}.cache_control.type: Input should be 'ephemeral'", param=param)
    if control.get("ttl") is not None and control["ttl"] not in _CACHE_TTLS:
        raise InvalidRequest(f"{param}.cache_control.ttl: Input should be '5m' or '1h'", param=param)


def _checked_block(block: Any, param: str) -> Any:
    """A block with known keys only (its type's own checks come where it is read)."""
    if isinstance(block, dict) and (known := _BLOCK_KEYS.get(block.get("type"))) is not None:
        check_keys(block, known, param)
        check_cache_control(block, param)
        if block.get("toolset_name") is not None and not isinstance(block["toolset_name"], str):
            raise InvalidRequest(f"{param}.toolset_name: Input should be a valid string", param=param)
    return block


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
    return [_checked_block(block, param) for block in content]


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
        texts.append(_string(_checked_block(block, param), "text", param))
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
    signature = _string(block, "signature", param)  # Anthropic requires it, empty or not
    if sealer.verifies(thought, signature):
        return thought, True
    carried = sealer.opened(signature) if thought == "" else None
    return (carried, True) if carried is not None else (thought, False)


# The order a chat template renders an assistant turn in: its reasoning, its text, its calls.
_PLACES = {"thinking": 0, "redacted_thinking": 0, "text": 1, "tool_use": 2}


def _assistant(content: Any, sealer: Sealer, param: str) -> Message:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    message: Message = {"role": "assistant", "content": None}
    texts: list[str] = []
    thoughts: list[str] = []
    verified = True
    place, last = 0, "thinking"
    for block in _blocks(content, param):
        kind = _block_type(block)
        if kind not in _PLACES:
            raise UnsupportedParameter(f"assistant blocks of type {kind!r} are not supported", param=param)
        if _PLACES[kind] < place:
            # One message holds one reasoning, one text and the calls, rendered in that order.
            raise UnsupportedParameter(
                f"a {kind} block after a {last} block cannot be rendered in its place: an assistant "
                "turn renders its thinking, then its text, then its tool uses",
                param=param,
            )
        place, last = _PLACES[kind], kind
        if kind == "text":
            texts.append(_string(block, "text", param))
        elif kind == "thinking":
            thought, sealed = _thinking(block, sealer, param)
            thoughts.append(thought)
            verified = verified and sealed
        elif kind == "redacted_thinking":
            _string(block, "data", param)
            verified = False  # we never redact: this is not reasoning we sampled
        else:
            message.setdefault("tool_calls", []).append(_tool_use(block, param))
    ids = [call["id"] for call in message.get("tool_calls", [])]
    if len(set(ids)) != len(ids):
        raise InvalidRequest(f"{param}: tool_use ids must be unique", param=param)
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
        if not content.strip():
            raise InvalidRequest(_WHITESPACE_ONLY, param=param)
        return [{"role": "user", "content": content}]
    found: list[Message] = []
    texts: list[str] = []
    for block in _blocks(content, param):
        kind = _block_type(block)
        if kind == "tool_result" and texts:
            raise InvalidRequest(
                f"{param}: tool_result blocks must come first in a message, before any text",
                param=param,
            )
        if kind == "tool_result":
            if not isinstance(block.get("is_error", False), bool):
                raise InvalidRequest("tool_result.is_error must be a boolean", param=param)
            text = _result_text(block.get("content"), tools, param)
            call_id = _string(block, "tool_use_id", param)
            found.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "text":
            if _string(block, "text", param) == "":
                raise InvalidRequest("text content blocks must be non-empty", param=param)
            if not block["text"].strip():
                raise InvalidRequest(_WHITESPACE_ONLY, param=param)
            texts.append(block["text"])
        else:
            raise UnsupportedParameter(f"user blocks of type {kind!r} are not supported", param=param)
    answered = [message["tool_call_id"] for message in found]
    if len(set(answered)) != len(answered):
        raise InvalidRequest(f"{param}: each tool_use is answered by one tool_result", param=param)
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
    check_keys(message, _MESSAGE_KEYS, f"messages[{index}]")
    if role == "assistant":
        if message.get("content") == []:
            raise InvalidRequest(
                f"messages[{index}]: all messages must have non-empty content except for the "
                "optional final assistant message",
                param=param,
            )
        return [_assistant(message.get("content"), sealer, param)]
    if role == "user":
        return _user(message.get("content"), tools, param)
    if role == "system":
        # Claude Code puts system messages mid-conversation, as blocks or as a string.
        return [{"role": "system", "content": blocks_text(message.get("content"), param)}]
    raise InvalidRequest(f"unknown role {role!r}", param=f"messages[{index}].role")


def one_call(choice: dict[str, Any] | None) -> bool | None:
    """Whether a forced call is one call: Anthropic allows parallel uses unless
    disable_parallel_tool_use (for `tool` too, where chat's named function is called once)."""
    if choice is None or choice.get("type") not in ("any", "tool"):
        return None
    flag = choice.get("disable_parallel_tool_use", False)
    if not isinstance(flag, bool):
        raise InvalidRequest(
            "tool_choice.disable_parallel_tool_use must be a boolean",
            param="tool_choice.disable_parallel_tool_use",
        )
    return flag


def chat_tool_choice(choice: dict[str, Any] | None) -> str | dict[str, Any] | None:
    """Anthropic's tool_choice as chat's: auto and none as they are, any as required, a tool by name."""
    if choice is None:
        return None
    check_keys(choice, TOOL_CHOICE_KEYS, "tool_choice")
    kind = choice.get("type")
    if choice.get("disable_parallel_tool_use") and kind not in ("any", "tool"):
        # Only a forced call has a grammar to stop after the first call; a free turn has none.
        raise UnsupportedParameter(
            "disable_parallel_tool_use can be enforced with tool_choice any or tool only",
            param="tool_choice.disable_parallel_tool_use",
        )
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
