"""A resent chat history is validated once: reused only when its messages are written the same."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import orjson
import pytest

from proxy.api.message_prefix import MessagePrefixes
from proxy.api.schemas import ChatCompletionRequest
from proxy.chat.messages import canonical_json


def _call(arguments: Any) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}],
    }


def _body(*messages: dict[str, Any]) -> dict[str, Any]:
    return {"model": "m", "messages": list(messages), "max_tokens": 8}


USER = {"role": "user", "content": "hi"}
TOOL = {"role": "tool", "tool_call_id": "c1", "content": "ok"}


def test_known_history_is_reused_and_equals_a_full_validation() -> None:
    prefixes = MessagePrefixes()
    first = prefixes.validate("s", _body(USER, _call({"a": 1})))
    assert first is not None
    plain, canonical = first.message_forms()
    first.history_hash().key(2, None, None, None)  # as its turn keyed it: the running hash is at 2
    second = prefixes.validate("s", _body(USER, _call({"a": 1}), TOOL))
    assert second is not None
    assert second.messages[0] is first.messages[0]
    assert second.messages[1] is first.messages[1]
    assert second.message_forms()[0][1] is plain[1]
    assert second.message_forms()[1][:2] == canonical
    full = ChatCompletionRequest.model_validate(_body(USER, _call({"a": 1}), TOOL))
    assert second.message_forms() == full.message_forms()
    # Keys from the running hash the first request handed on, as a fresh request computes them.
    assert second._cached().reused_hash is first.history_hash()
    for count in (3, 2):
        assert second.history_hash().key(count, b'"x"', None, None) == full.history_hash().key(
            count, b'"x"', None, None
        )


def test_a_history_written_differently_is_validated_again() -> None:
    prefixes = MessagePrefixes()
    first = prefixes.validate("s", _body(USER, _call({"a": 1})))
    # `true == 1` in Python, but it is another argument value: nothing of the old request is reused.
    second = prefixes.validate("s", _body(USER, _call({"a": True}), TOOL))
    assert first is not None
    assert second is not None
    assert second.messages[1] is not first.messages[1]
    assert second.message_forms()[0][1]["tool_calls"][0]["function"]["arguments"] == '{"a":true}'
    other_session = prefixes.validate("t", _body(USER, _call({"a": 1}), TOOL))
    assert other_session is not None
    assert other_session.messages[0] is not first.messages[0]


def test_anything_invalid_is_left_to_the_full_validation() -> None:
    prefixes = MessagePrefixes()
    assert prefixes.validate("s", _body(USER)) is not None
    assert prefixes.validate("s", _body(USER, {"role": "robot", "content": "x"})) is None
    assert prefixes.validate("s", _body({"role": "user"}, USER)) is not None  # content is optional
    assert prefixes.validate("s", _body({"role": "user", "content": 3}, USER, USER)) is None
    assert prefixes.validate("s", {"model": "m", "messages": []}) is None
    assert prefixes.validate("s", ["not", "an", "object"]) is None
    assert prefixes.validate(None, _body(USER)) is None


def test_memory_is_bounded() -> None:
    prefixes = MessagePrefixes(max_entries=2, max_bytes=1 << 20)
    for session in "abc":
        prefixes.validate(session, _body(USER))
    assert len(prefixes) == 2
    prefixes = MessagePrefixes(max_entries=100, max_bytes=40_000)
    for n in range(10):
        prefixes.validate(f"s{n}", _body({"role": "user", "content": "x" * 1000}))
    assert 2 <= len(prefixes) < 10
    assert prefixes.bytes <= 40_000
    prefixes.validate("big", _body({"role": "user", "content": "x" * 20_000}))  # > a quarter: not kept
    assert prefixes.validate("big", _body({"role": "user", "content": "x" * 20_000})) is not None
    assert "big" not in prefixes._entries


def _conversation(turns: int, result: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": "You are a coding agent."}, USER]
    for turn in range(turns):
        messages.append(_call('{"path": "src/main.py"}') | {"tool_calls": [_tool_call(turn)]})
        messages.append({"role": "tool", "tool_call_id": f"c{turn}", "content": result})
    return messages


def _tool_call(turn: int) -> dict[str, Any]:
    return {"id": f"c{turn}", "type": "function", "function": {"name": "read", "arguments": "{}"}}


MANY_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{n}",
            "description": "Reads a file of the repository. " * 8,
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
    for n in range(12)
]


@pytest.mark.parametrize(
    ("turns", "result_chars", "tools"),
    [(1, 2, None), (8, 40, MANY_TOOLS), (8, 1200, None), (64, 1200, MANY_TOOLS), (3, 30_000, None)],
)
def test_the_counted_bytes_cover_what_the_entries_hold(
    turns: int, result_chars: int, tools: list[dict[str, Any]] | None
) -> None:
    """The bound is on memory, not on text: what 40 sessions' entries hold (their models, plain and
    canonical forms, as a turn derives them) is at most what the cache counts, and not far below."""
    bodies = [
        {"model": "m", "messages": _conversation(turns, f"{n} " + "x" * result_chars), "max_tokens": 8}
        | ({"tools": tools} if tools else {})
        for n in range(40)
    ]
    sizes = [len(orjson.dumps(body)) for body in bodies]
    prefixes = MessagePrefixes(max_entries=1000, max_bytes=1 << 40)
    gc.collect()
    tracemalloc.start()
    try:
        for n, (body, size) in enumerate(zip(bodies, sizes, strict=True)):
            validated = prefixes.validate(f"s{n}", body, size)
            assert validated is not None
            validated.history_hash().key(len(validated.messages), None, None, None)
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held <= prefixes.bytes <= 4 * held


def test_canonical_forms_are_kept_at_their_own_length() -> None:
    """orjson leaves each result in a buffer ~10x its text; what the cache keeps is copied to size."""
    message = {"role": "tool", "tool_call_id": "c1", "content": "x" * 3000}
    tracemalloc.start()
    try:
        kept = [canonical_json(message) for _ in range(20)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 20 * 2 * len(kept[0])


TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "read", "parameters": {"type": "object", "properties": {}}}},
    {"type": "function", "function": {"name": "write", "description": None, "strict": True}},
]


def test_a_resent_tool_list_is_reused_and_equals_a_full_validation() -> None:
    prefixes = MessagePrefixes()
    first = prefixes.validate("s", {**_body(USER), "tools": TOOLS})
    assert first is not None
    plain = first.plain_tools()
    assert plain == [tool.model_dump(exclude_none=True) for tool in first.tools or []]
    second = prefixes.validate("s", {**_body(USER, _call({"a": 1}), TOOL), "tools": TOOLS})
    assert second is not None
    assert second.tools is first.tools
    assert second.plain_tools() is plain
    full = ChatCompletionRequest.model_validate({**_body(USER, _call({"a": 1}), TOOL), "tools": TOOLS})
    assert second.tools == full.tools
    assert second.plain_tools() == full.plain_tools()
    assert second.model_dump() == full.model_dump()
    assert second.model_fields_set == full.model_fields_set


def test_a_tool_list_written_differently_or_invalid_is_validated_again() -> None:
    prefixes = MessagePrefixes()
    first = prefixes.validate("s", {**_body(USER), "tools": TOOLS})
    assert first is not None
    renamed = [TOOLS[0], {**TOOLS[1], "function": {**TOOLS[1]["function"], "strict": 1}}]
    second = prefixes.validate("s", {**_body(USER), "tools": renamed})
    assert second is not None
    assert second.tools is not first.tools
    assert second.plain_tools() == [
        TOOLS[0] | {},
        {"type": "function", "function": {"name": "write", "strict": 1}},
    ]
    # Refused as a full validation refuses it (None: FastAPI validates and answers).
    assert prefixes.validate("s", {**_body(USER), "tools": [{"type": "other"}]}) is None
    assert prefixes.validate("s", {**_body(USER), "tools": TOOLS}) is not None
    without = prefixes.validate("s", _body(USER))
    assert without is not None
    assert without.tools is None
    assert without.plain_tools() is None
