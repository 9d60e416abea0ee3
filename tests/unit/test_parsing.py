from __future__ import annotations

import json

from proxy.chat.parsing import parse_output, split_reasoning


def test_reasoning_and_tool_calls() -> None:
    text = (
        '<think>\nplan\n</think>\n\nLooking.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    )
    parsed = parse_output(text, parse_reasoning=True)
    assert parsed.reasoning_content == "plan"
    assert parsed.content == "Looking."
    [call] = parsed.tool_calls
    assert call["function"]["name"] == "f"
    assert json.loads(call["function"]["arguments"]) == {"a": 1}
    assert call["id"].startswith("call_")


def test_two_calls_and_no_content() -> None:
    call = '<tool_call>\n{{"name": "{}", "arguments": {{}}}}\n</tool_call>'
    text = call.format("f") + "\n" + call.format("g")
    parsed = parse_output(text, parse_reasoning=True)
    assert parsed.content is None
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["f", "g"]
    assert len({c["id"] for c in parsed.tool_calls}) == 2


def test_malformed_tool_call_is_content() -> None:
    for text in ('<tool_call>\n{"name": "f", "arguments": \n</tool_call>', '<tool_call>\n{"name": "f"'):
        parsed = parse_output(text, parse_reasoning=True)
        assert parsed.tool_calls == []
        assert parsed.content == text


def test_reasoning_opened_by_the_generation_prompt() -> None:
    assert split_reasoning("thinking\n</think>\n\nanswer", opened=True) == ("thinking", "answer")
    assert split_reasoning("thinking\n</think>\n\nanswer") == (None, "thinking\n</think>\n\nanswer")
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning("plain") == (None, "plain")
