"""Decision 2: when an echoed message is the one we produced."""

from __future__ import annotations

from typing import Any

from proxy.chat.messages import HistoryHash, canonical_json, history_key, key_of_json, reasoning_consistent

CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1, "b": [1, 2]}'}}


def _key(*messages: dict[str, object]) -> str:
    return history_key(list(messages), None, None)


def test_empty_content_equals_none() -> None:
    assert _key({"role": "assistant", "content": ""}) == _key({"role": "assistant", "content": None})


def test_arguments_compare_as_parsed_json_and_wire_keys_are_ignored() -> None:
    echoed = {
        "index": 0,
        "id": "call_1",
        "type": "function",
        "function": {"name": "f", "arguments": '{"b":[1,2],"a":1}'},
    }
    assert _key({"role": "assistant", "content": None, "tool_calls": [CALL]}) == _key(
        {"role": "assistant", "content": None, "tool_calls": [echoed]}
    )


def test_changed_content_ids_or_tools_do_not_match() -> None:
    base = _key({"role": "assistant", "content": "x", "tool_calls": [CALL]})
    assert base != _key({"role": "assistant", "content": "y", "tool_calls": [CALL]})
    renamed = {**CALL, "id": "call_2"}
    assert base != _key({"role": "assistant", "content": "x", "tool_calls": [renamed]})
    tools = [{"type": "function", "function": {"name": "f"}}]
    assert history_key([{"role": "user", "content": "q"}], tools, None) != history_key(
        [{"role": "user", "content": "q"}], None, None
    )
    assert history_key([{"role": "user", "content": "q"}], None, {"enable_thinking": False}) != history_key(
        [{"role": "user", "content": "q"}], None, None
    )


def test_missing_reasoning_counts_as_unchanged_but_edited_reasoning_does_not() -> None:
    recorded = {"role": "assistant", "content": "a", "reasoning_content": "plan"}
    assert reasoning_consistent({"role": "assistant", "content": "a"}, recorded)
    assert reasoning_consistent({"role": "assistant", "content": "a", "reasoning_content": "plan"}, recorded)
    assert not reasoning_consistent(
        {"role": "assistant", "content": "a", "reasoning_content": "other"}, recorded
    )


def test_key_from_each_message_json_is_the_stored_history_key() -> None:
    """Keys are stored: the per-message form (a known history is not walked again) hashes the same bytes."""
    conversation: list[dict[str, Any]] = [
        {"role": "system", "content": "s"},
        {"role": "user", "content": "q \u00e9 \u6f22"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": ""},
    ]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"b": 1, "a": [2]}}}]
    cases: list[tuple[list[dict[str, Any]], Any, Any]] = [
        (conversation, tools, {"z": 1, "a": None}),
        (conversation[:1], None, None),
        ([], [], {}),
    ]
    for messages, listed, kwargs in cases:
        parts = [canonical_json(m) for m in messages]
        assert key_of_json(parts, listed, kwargs) == history_key(messages, listed, kwargs)


def test_a_running_history_hash_gives_the_same_keys() -> None:
    """A request's keys from the running digest its session's previous request handed on."""
    parts = [canonical_json({"role": "user", "content": f"m{i}"}) for i in range(6)]
    reply = canonical_json({"role": "assistant", "content": "r"})
    tools = [{"type": "function", "function": {"name": "f"}}]
    earlier = HistoryHash(parts[:3])
    assert earlier.key(3, reply, tools, None) == key_of_json([*parts[:3], reply], tools, None)
    later = HistoryHash(parts, start=earlier)
    for count in (6, 4, 3, 1, 0):  # forward, then behind the running digest
        for tail in (None, reply):
            expected = key_of_json([*parts[:count], *([tail] if tail else [])], tools, {"k": 1})
            assert later.key(count, tail, tools, {"k": 1}) == expected
    assert HistoryHash(parts).key(0, None, None, None) == key_of_json([], None, None)


def test_keys_follow_the_tools_and_kwargs_they_are_given() -> None:
    """The closing text written once per tools and kwargs is never another request's."""
    parts = [canonical_json({"role": "user", "content": f"m{i}"}) for i in range(3)]
    tools = [{"type": "function", "function": {"name": "f"}}]
    other_tools = [{"type": "function", "function": {"name": "g"}}]
    hashed = HistoryHash(parts)
    for given_tools, kwargs in [
        (tools, None),
        (tools, None),
        (other_tools, None),
        (tools, {"k": 1}),
        ([dict(tools[0])], {"k": 1}),
        (None, None),
        (tools, {"k": 2}),
    ]:
        assert hashed.key(3, None, given_tools, kwargs) == key_of_json(parts, given_tools, kwargs)
        handed_on = HistoryHash([*parts, parts[0]], start=hashed)
        assert handed_on.key(4, None, other_tools, kwargs) == key_of_json(
            [*parts, parts[0]], other_tools, kwargs
        )
        assert handed_on.key(4, None, given_tools, kwargs) == key_of_json(
            [*parts, parts[0]], given_tools, kwargs
        )
