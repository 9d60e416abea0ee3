"""Decision 2: when an echoed message is the one we produced."""

from __future__ import annotations

from proxy.chat.messages import history_key, reasoning_consistent

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
