"""An Anthropic or Responses request that resends its session's last input first converts only what
follows it (proxy/dialects/converted_history.py), and gives exactly what converting it whole gives:
the messages, their canonical forms, the history keys, the deferred tools its tool results loaded,
and the same error for a bad item, whatever edits, context changes or unsettled tails come between."""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from proxy.chat.messages import canonical_json, key_of_json
from proxy.dialects.anthropic import MessagesRequest, message_forms
from proxy.dialects.anthropic_input import anthropic_messages
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.converted_history import ConvertedHistories, Forms
from proxy.dialects.responses import ResponsesRequest, input_forms
from proxy.dialects.responses_input import input_messages
from proxy.dialects.seals import Sealer
from proxy.errors import ProxyError

SEALER = Sealer(SecretStr("deployment secret"))
SESSION = ("s1", False)
KWARGS = {"enable_thinking": True}


def _tools(description: str) -> list[dict[str, Any]]:
    schema = {"type": "object", "properties": {"path": {"type": "string"}}}
    return [
        {"name": "read_file", "input_schema": schema},
        {"name": "grep", "description": description, "input_schema": schema, "defer_loading": True},
    ]


ANTHROPIC_MESSAGES = st.sampled_from(
    [
        {"role": "user", "content": "Fix the bug."},
        {"role": "user", "content": [{"type": "text", "text": "Fix"}, {"type": "text", "text": "it."}]},
        {"role": "system", "content": "Mid-conversation note."},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "Look first.", "signature": SEALER.signature("Look first.")},
                {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.py"}},
            ],
        },
        {
            "role": "assistant",
            "content": [{"type": "thinking", "thinking": "Look first.", "signature": "forged"}],
        },
        # Equal in Python, written differently: their calls' arguments differ.
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t2", "name": "grep", "input": {"n": 1}}],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t2", "name": "grep", "input": {"n": 1.0}}],
        },
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "t2", "name": "grep", "input": {"n": True}}],
        },
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}]},
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "t1",
                    "content": [{"type": "tool_reference", "tool_name": "grep"}],
                }
            ],
        },
        {"role": "user", "content": [{"type": "image", "source": {}}]},  # refused
        {"role": "user", "content": [{"type": "tool_reference", "tool_name": "nope"}]},  # refused
    ]
)

RESPONSES_ITEMS = st.sampled_from(
    [
        {"role": "user", "content": "Go"},
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Sys"}]},
        {"type": "reasoning", "summary": [], "encrypted_content": SEALER.envelope("Plan.")},
        {"type": "reasoning", "summary": [], "encrypted_content": "forged.seal"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "Plan."}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Ok"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}", "namespace": "ns"},
        {"type": "function_call_output", "call_id": "c1", "output": "r1"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "r2"}]},
        {"type": "web_search_call"},  # refused
    ]
)

# What a harness does between two requests of a session: goes on, edits or drops its history, or
# changes what the conversion reads besides the items; then it may go on (0-2 items) in the same one.
EDITS = st.tuples(
    st.one_of(
        st.tuples(st.just("append"), st.integers(1, 3)),
        st.tuples(st.just("replace"), st.integers(0, 40)),
        st.tuples(st.just("drop"), st.integers(1, 3)),
        st.tuples(st.just("context"), st.integers(0, 1)),
        st.tuples(st.just("tools"), st.integers(0, 1)),
    ),
    st.integers(0, 2),
)


def _outcome(convert: Any, *args: Any) -> tuple[Any, ...]:
    try:
        return ("ok", convert(*args))
    except ProxyError as exc:
        return ("error", type(exc), str(exc), exc.param)


def _checked(forms: Forms, tools: list[dict[str, Any]] | None) -> tuple[Any, ...]:
    """What the turn core reads of the forms: every history key checked against key_of_json."""
    assert forms.canonical == [canonical_json(m) for m in forms.messages]
    for count in (len(forms.canonical), max(0, len(forms.canonical) - 1)):
        for tail in (None, b'{"role":"assistant"}'):
            expected = key_of_json([*forms.canonical[:count], *([tail] if tail else [])], tools, KWARGS)
            assert forms.hash.key(count, tail, tools, KWARGS) == expected
    return (forms.messages, forms.canonical)


def _edited(items: list[Any], edit: tuple[tuple[str, int], int], draw: Any) -> list[Any]:
    (kind, amount), then = edit
    if kind == "append":
        items = [*items, *(draw() for _ in range(amount))]
    elif kind == "replace" and items:
        at = amount % len(items)
        items = [*items[:at], draw(), *items[at + 1 :]]
    elif kind == "drop":
        items = items[: max(1, len(items) - amount)]
    return [*items, *(draw() for _ in range(then))]


def test_a_history_cut_after_a_tool_use_is_refused_though_its_items_were_sent_before() -> None:
    """Every item sent again the very same is taken again, yet the cut leaves the last tool use
    without its result: the pairs are checked at the end of the history too (hypothesis found it)."""
    histories = ConvertedHistories()
    use = {"type": "tool_use", "id": "t1", "name": "read_file", "input": {"path": "a.py"}}
    turns: list[Any] = [
        {"role": "user", "content": "Fix the bug."},
        {"role": "assistant", "content": [use]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}]},
    ]

    def converted(messages: list[Any]) -> tuple[Any, ...]:
        body = MessagesRequest.model_validate(
            {"model": "m", "max_tokens": 8, "messages": messages, "tools": _tools("Search files.")}
        )
        return _outcome(message_forms, histories, SEALER, SESSION, body, AnthropicTools.of(body.tools))

    assert converted(turns)[0] == "ok"
    refused = converted(turns[:2])
    assert refused[0] == "error"
    assert "t1" in refused[2]


@settings(max_examples=150, deadline=None)
@given(data=st.data(), edits=st.lists(EDITS, min_size=2, max_size=12))
def test_anthropic_messages_resent_convert_as_a_whole_conversion(data: Any, edits: list[Any]) -> None:
    histories = ConvertedHistories()
    messages: list[Any] = [{"role": "user", "content": "Start."}]
    system, description = "You are a coding agent.", "Search files."
    for edit in edits:
        messages = _edited(messages, edit, lambda: data.draw(ANTHROPIC_MESSAGES))
        (kind, amount), _ = edit
        if kind == "context":
            system = ["You are a coding agent.", [{"type": "text", "text": "Be brief."}]][amount]
        if kind == "tools":
            description = ["Search files.", "Search files fast."][amount]
        body = MessagesRequest.model_validate(
            {
                "model": "m",
                "max_tokens": 8,
                "system": system,
                "messages": messages,
                "tools": _tools(description),
            }
        )
        tools, fresh_tools = AnthropicTools.of(body.tools), AnthropicTools.of(body.tools)
        got = _outcome(message_forms, histories, SEALER, SESSION, body, tools)
        whole = _outcome(anthropic_messages, body.system, body.messages, SEALER, fresh_tools)
        assert got[0] == whole[0]
        if got[0] == "error":
            assert got == whole
            continue
        assert _checked(got[1], tools.declared)[0] == whole[1]
        assert tools.callable() == fresh_tools.callable()


@settings(max_examples=150, deadline=None)
@given(data=st.data(), edits=st.lists(EDITS, min_size=2, max_size=12))
def test_responses_items_resent_convert_as_a_whole_conversion(data: Any, edits: list[Any]) -> None:
    histories = ConvertedHistories()
    items: list[Any] = [{"role": "user", "content": "Start."}]
    instructions: str | None = "You are a coding agent."
    for edit in edits:
        items = _edited(items, edit, lambda: data.draw(RESPONSES_ITEMS))
        (kind, amount), _ = edit
        if kind == "context":
            instructions = ["You are a coding agent.", None][amount]
        body = ResponsesRequest.model_validate({"model": "m", "instructions": instructions, "input": items})
        got = _outcome(input_forms, histories, SEALER, SESSION, body)
        whole = _outcome(input_messages, body.instructions, items, SEALER)
        assert got[0] == whole[0]
        if got[0] == "error":
            assert got == whole
            continue
        assert _checked(got[1], None)[0] == whole[1]


def _anthropic(messages: list[Any], session: tuple[str, bool] = SESSION, **body: Any) -> MessagesRequest:
    return MessagesRequest.model_validate({"model": "m", "max_tokens": 8, "messages": messages, **body})


TURN: list[dict[str, Any]] = [
    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "read_file", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}]},
]


def test_a_resent_history_reuses_its_conversion_and_an_edited_one_does_not() -> None:
    histories = ConvertedHistories()
    first = [{"role": "user", "content": "Go"}, *TURN]
    body = _anthropic(first)
    made = message_forms(histories, SEALER, SESSION, body, AnthropicTools.of(None))
    again = message_forms(histories, SEALER, SESSION, _anthropic([*first, *TURN]), AnthropicTools.of(None))
    # The known messages are the very objects converted before; only the new ones are new.
    assert all(a is b for a, b in zip(again.messages, made.messages, strict=False))
    assert again.canonical[: len(made.canonical)] == made.canonical
    edited = [{"role": "user", "content": "Go!"}, *TURN, *TURN]
    redone = message_forms(histories, SEALER, SESSION, _anthropic(edited), AnthropicTools.of(None))
    assert redone.messages[0] is not made.messages[0]
    assert redone.messages[0]["content"] == "Go!"


def test_new_sessions_keep_nothing_and_unwritable_items_are_converted_again() -> None:
    histories = ConvertedHistories()
    message_forms(histories, SEALER, ("new", True), _anthropic(TURN), AnthropicTools.of(None))
    assert len(histories) == 0
    huge = {"role": "assistant", "content": [{**TURN[0]["content"][0], "input": {"n": 2**70}}]}
    first = message_forms(histories, SEALER, SESSION, _anthropic([huge, *TURN[1:]]), AnthropicTools.of(None))
    again = message_forms(
        histories, SEALER, SESSION, _anthropic([huge, *TURN[1:], *TURN]), AnthropicTools.of(None)
    )
    assert again.messages[0] == first.messages[0]
    assert again.messages[0] is not first.messages[0]


def test_claude_codes_moving_cache_markers_and_system_shapes_convert_only_what_changed() -> None:
    """Claude Code moves its cache_control marker to the newest message every turn, and sends a
    mid-conversation system message as blocks on one turn and as a string on the next."""
    histories = ConvertedHistories()
    marker = {"cache_control": {"type": "ephemeral"}}
    note = {"role": "system", "content": [{"type": "text", "text": "Reminder."}]}
    result = {"type": "tool_result", "tool_use_id": "t1", "content": "x = 1"}
    first = [
        {"role": "user", "content": "Go"},
        note,
        TURN[0],
        {"role": "user", "content": [{**result, **marker}]},
    ]
    made = message_forms(
        histories, SEALER, SESSION, _anthropic(first, system="Be brief."), AnthropicTools.of(None)
    )
    second = [
        first[0],
        {"role": "system", "content": "Reminder."},
        TURN[0],
        {"role": "user", "content": [result]},
        TURN[0],
        {"role": "user", "content": [{**result, **marker}]},
    ]
    body = _anthropic(second, system="Be brief.")
    again = message_forms(histories, SEALER, SESSION, body, AnthropicTools.of(None))
    assert again.messages == anthropic_messages(body.system, body.messages, SEALER)
    # The system text and the unchanged messages are taken again; the changed ones are made anew.
    taken = [a is b for a, b in zip(again.messages, made.messages, strict=False)]
    assert taken == [False, True, False, True, False]
    assert again.canonical[: len(made.canonical)] == made.canonical
    _checked(again, None)


def test_a_loaded_deferred_tool_stays_loaded_and_its_definitions_follow_the_tool_list() -> None:
    histories = ConvertedHistories()
    load = {
        "role": "user",
        "content": [
            {
                "type": "tool_result",
                "tool_use_id": "t1",
                "content": [{"type": "tool_reference", "tool_name": "grep"}],
            }
        ],
    }
    first = [{"role": "user", "content": "Go"}, TURN[0], load]
    tools = AnthropicTools.of(_tools("Search files."))
    message_forms(histories, SEALER, SESSION, _anthropic(first, tools=_tools("Search files.")), tools)
    later = AnthropicTools.of(_tools("Search files."))
    body = _anthropic([*first, *TURN], tools=_tools("Search files."))
    message_forms(histories, SEALER, SESSION, body, later)
    assert [t["function"]["name"] for t in later.callable()] == ["read_file", "grep"]
    # Another description: the loaded definitions in the earlier tool result are written anew.
    changed = AnthropicTools.of(_tools("Search fast."))
    body = _anthropic([*first, *TURN, *TURN], tools=_tools("Search fast."))
    forms = message_forms(histories, SEALER, SESSION, body, changed)
    assert "Search fast." in forms.messages[2]["content"]


@pytest.mark.parametrize("budget", [1, 3])
def test_entries_stay_within_their_count(budget: int) -> None:
    histories = ConvertedHistories(max_entries=budget)
    for n in range(5):
        message_forms(histories, SEALER, (f"s{n}", False), _anthropic(TURN), AnthropicTools.of(None))
    assert len(histories) == budget
    assert histories.bytes > 0
    for n in range(5):
        histories.drop(f"s{n}")
    assert histories.bytes == 0


@pytest.mark.parametrize("resent", [1.0, True])
def test_items_equal_in_python_but_written_otherwise_are_converted_again(resent: object) -> None:
    histories = ConvertedHistories()
    call: dict[str, Any] = {
        "role": "assistant",
        "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"n": 1}}],
    }
    message_forms(histories, SEALER, SESSION, _anthropic([call, *TURN[1:]]), AnthropicTools.of(None))
    edited = {"role": "assistant", "content": [{**call["content"][0], "input": {"n": resent}}]}
    assert edited == call  # Python's equality cannot tell them apart
    forms = message_forms(
        histories, SEALER, SESSION, _anthropic([edited, *TURN[1:]]), AnthropicTools.of(None)
    )
    arguments = forms.messages[0]["tool_calls"][0]["function"]["arguments"]
    assert (
        arguments
        == anthropic_messages(None, [edited, *TURN[1:]], SEALER)[0]["tool_calls"][0]["function"]["arguments"]
    )
    assert arguments != '{"n": 1}'


@pytest.mark.parametrize(("turns", "result"), [(64, "x = compute(y)\n" * 40), (64, ""), (2, "ok")])
def test_an_entrys_estimated_cost_covers_the_memory_it_holds(turns: int, result: str) -> None:
    messages: list[Any] = [{"role": "user", "content": "Fix the bug."}]
    for turn in range(turns):
        use = {"type": "tool_use", "id": f"t{turn}", "name": "read_file", "input": {"path": f"{turn}.py"}}
        messages += [
            {"role": "assistant", "content": [{"type": "text", "text": "Let me look."}, use]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": f"t{turn}", "content": result}],
            },
        ]
    raw = orjson.dumps({"model": "m", "max_tokens": 8, "system": "Be brief.", "messages": messages})
    histories = ConvertedHistories()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        body = MessagesRequest.model_validate(orjson.loads(raw))
        message_forms(histories, SEALER, SESSION, body, AnthropicTools.of(None))
        del body  # what the request held goes; the entry's messages stay
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert held <= histories.bytes <= 3 * held


def test_a_session_sent_in_both_dialects_never_takes_the_others_conversion() -> None:
    histories = ConvertedHistories()
    messages: list[Any] = [{"role": "user", "content": "Go"}, *TURN]
    items: list[Any] = [{"role": "user", "content": "Go"}, {"role": "user", "content": "On"}]
    for _ in range(2):
        body = _anthropic(messages)
        forms = message_forms(histories, SEALER, SESSION, body, AnthropicTools.of(None))
        assert forms.messages == anthropic_messages(None, messages, SEALER)
        request = ResponsesRequest.model_validate({"model": "m", "input": items})
        assert input_forms(histories, SEALER, SESSION, request).messages == input_messages(
            None, items, SEALER
        )
        messages, items = [*messages, *TURN], [*items, {"role": "user", "content": "More"}]
