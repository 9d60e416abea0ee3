"""Dialect translations without a server: seals, Responses items and Anthropic blocks -> messages."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import SecretStr

from proxy.chat.messages import UNVERIFIED_REASONING, reasoning_consistent
from proxy.dialects.anthropic_input import anthropic_messages, chat_tool_choice
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.responses import session_of
from proxy.dialects.responses_input import chat_tools, input_messages
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest, NotFound, UnsupportedParameter

SEALER = Sealer(SecretStr("deployment secret"))


def test_seals_verify_only_what_this_deployment_signed() -> None:
    signature = SEALER.signature("I think.")
    assert SEALER.verifies("I think.", signature)
    assert not SEALER.verifies("I think!", signature)
    assert not Sealer(SecretStr("another")).verifies("I think.", signature)
    envelope = SEALER.envelope("Ünïcode\nreasoning")
    assert SEALER.opened(envelope) == "Ünïcode\nreasoning"
    for forged in ("", "garbage", "a.b", envelope + "x", "!!!." + envelope.split(".")[1]):
        assert SEALER.opened(forged) is None


def test_responses_items_group_into_one_assistant_turn() -> None:
    items: list[dict[str, Any]] = [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sys"}]},
        {"role": "user", "content": "Go"},
        {"type": "reasoning", "id": "x1", "summary": [], "encrypted_content": SEALER.envelope("Plan.")},
        {
            "type": "message",
            "role": "assistant",
            "id": "x2",
            "content": [{"type": "output_text", "text": "Ok"}],
        },
        {"type": "function_call", "id": "x3", "call_id": "c1", "name": "f", "arguments": "{}"},
        {
            "type": "function_call",
            "id": "x4",
            "call_id": "c2",
            "name": "g",
            "arguments": "{}",
            "namespace": "ns",
        },
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Done"}]},
    ]
    messages = input_messages("Instr", items, SEALER)
    assert [m["role"] for m in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
        "tool",
        "assistant",
    ]
    turn = messages[3]
    assert turn["reasoning_content"] == "Plan."
    assert turn["content"] == "Ok"
    assert [c["function"]["name"] for c in turn["tool_calls"]] == ["f", "ns.g"]
    assert UNVERIFIED_REASONING not in turn
    assert messages[5]["content"] == "r2"


def test_a_foreign_seal_marks_the_reasoning_as_an_edit() -> None:
    items: list[dict[str, Any]] = [
        {"role": "user", "content": "Go"},
        {
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": "Plan."}],
            "encrypted_content": Sealer(SecretStr("other")).envelope("Plan."),
        },
        {"type": "message", "role": "assistant", "content": "Ok"},
    ]
    turn = input_messages(None, items, SEALER)[1]
    assert turn[UNVERIFIED_REASONING]
    assert not reasoning_consistent(
        turn, {"role": "assistant", "content": "Ok", "reasoning_content": "Plan."}
    )


def test_anthropic_blocks_become_chat_messages() -> None:
    messages = anthropic_messages(
        [
            {"type": "text", "text": "A"},
            {"type": "text", "text": "B", "cache_control": {"type": "ephemeral"}},
        ],
        [
            {"role": "user", "content": "Go"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Hm.", "signature": SEALER.signature("Hm.")},
                    {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "1"}]},
                    {"type": "text", "text": "More"},
                ],
            },
            {"role": "system", "content": [{"type": "text", "text": "Note"}]},
        ],
        SEALER,
    )
    assert messages[0] == {"role": "system", "content": "A\nB"}
    assert messages[2]["reasoning_content"] == "Hm."
    assert UNVERIFIED_REASONING not in messages[2]
    assert messages[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert messages[3:] == [
        {"role": "tool", "tool_call_id": "t1", "content": "1"},
        {"role": "user", "content": "More"},
        {"role": "system", "content": "Note"},
    ]
    # The same system text as a string is the same message (Claude Code switches shapes).
    assert anthropic_messages(None, [{"role": "system", "content": "Note"}], SEALER) == [messages[-1]]


def test_redacted_or_foreign_thinking_is_an_edit() -> None:
    for block in (
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "thinking", "thinking": "Hm.", "signature": "not ours"},
    ):
        [_, turn] = anthropic_messages(
            None, [{"role": "user", "content": "Go"}, {"role": "assistant", "content": [block]}], SEALER
        )
        assert turn[UNVERIFIED_REASONING]


def test_deferred_tools_are_callable_once_a_tool_reference_loads_them() -> None:
    tools = AnthropicTools.of(
        [
            {"name": "search", "input_schema": {"type": "object"}},
            {"name": "cron", "description": "Jobs ✓", "defer_loading": True},
            {"name": "edit", "defer_loading": True},
        ]
    )
    assert [t["function"]["name"] for t in tools.declared] == ["search"]
    result = [
        {"type": "tool_reference", "tool_name": "cron"},
        {"type": "text", "text": "and"},
        {"type": "tool_reference", "tool_name": "search"},
    ]
    turns: list[dict[str, Any]] = [
        {"role": "user", "content": "Go"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": result}]},
    ]
    [_, _, loaded] = anthropic_messages(None, turns, SEALER, tools)
    assert loaded["content"] == (
        "<functions>\n"
        '<function>{"description": "Jobs ✓", "name": "cron", '
        '"parameters": {"type": "object", "properties": {}}}</function>\n</functions>\nand\n'
        '<functions>\n<function>{"name": "search", "parameters": {"type": "object"}}</function>\n</functions>'
    )
    # A declared tool referenced again is no new tool; a deferred one not referenced stays out.
    assert [t["function"]["name"] for t in tools.callable()] == ["search", "cron"]
    with pytest.raises(InvalidRequest):
        anthropic_messages(None, turns, SEALER)  # no tools: the reference names none of them


def test_tool_types_and_choices_we_cannot_honour_are_refused() -> None:
    assert chat_tools([{"type": "web_search"}]) == []
    with pytest.raises(UnsupportedParameter):
        chat_tools([{"type": "file_search"}])
    with pytest.raises(UnsupportedParameter):
        chat_tool_choice({"type": "auto", "disable_parallel_tool_use": True})
    assert chat_tool_choice({"type": "any"}) == "required"


def test_response_ids_name_their_session() -> None:
    assert session_of("resp_" + "a" * 32 + "_my-session") == "my-session"
    for bad in ("resp_x", "chatcmpl-1", "resp_" + "a" * 32 + "-s"):
        with pytest.raises(NotFound):
            session_of(bad)
