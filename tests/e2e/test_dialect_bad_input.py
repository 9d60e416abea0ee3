"""Malformed Responses and Anthropic bodies: a 400 in the dialect's own error shape naming what is
wrong, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

USER = [{"role": "user", "content": "hi"}]
ANTHROPIC: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": USER}
RESPONSES: dict[str, Any] = {"model": "m", "input": "hi"}
CHAT: dict[str, Any] = {"model": "m", "messages": USER, "max_tokens": 4}
COMPLETION: dict[str, Any] = {"model": "m", "prompt": "hi", "max_tokens": 4}


def _turns(*assistant: Any, result: Any = None) -> list[dict[str, Any]]:
    """A user turn, an assistant turn of `assistant` blocks, then a user turn of `result` blocks."""
    follow = result if result is not None else "next"
    return [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": list(assistant)},
        {"role": "user", "content": follow},
    ]


USE = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
RESULT = {"type": "tool_result", "tool_use_id": "t1", "content": "r"}
THOUGHT = {"type": "thinking", "thinking": "plan", "signature": "sig"}


BAD_MESSAGES: list[tuple[str, dict[str, Any]]] = [
    ("user content a number", {"messages": [{"role": "user", "content": 5}]}),
    ("user content empty", {"messages": [{"role": "user", "content": ""}]}),
    ("user content no blocks", {"messages": [{"role": "user", "content": []}]}),
    ("empty text block", {"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]}),
    ("user content missing", {"messages": [{"role": "user"}]}),
    ("text block without text", {"messages": [{"role": "user", "content": [{"type": "text"}]}]}),
    ("text block text a number", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}),
    (
        "assistant content a number",
        {"messages": [USER[0], {"role": "assistant", "content": 5}, USER[0]]},
    ),
    ("assistant text a number", {"messages": _turns({"type": "text", "text": 5})}),
    ("thinking a number", {"messages": _turns({"type": "thinking", "thinking": 5, "signature": "s"})}),
    (
        "tool_use without name",
        {
            "messages": _turns(
                {"type": "tool_use", "id": "t1", "input": {}},
                result=[{"type": "tool_result", "tool_use_id": "t1", "content": "r"}],
            )
        },
    ),
    (
        "tool_use without id",
        {"messages": _turns({"type": "tool_use", "name": "f", "input": {}})},
    ),
    (
        "tool_use input not an object",
        {
            "messages": _turns(
                {"type": "tool_use", "id": "t1", "name": "f", "input": "text"},
                result=[{"type": "tool_result", "tool_use_id": "t1", "content": "r"}],
            )
        },
    ),
    (
        "tool_result without tool_use_id",
        {"messages": [{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]},
    ),
    ("system a block list of numbers", {"system": [5]}),
    ("tool without name", {"tools": [{"input_schema": {"type": "object"}}]}),
    ("tool schema not an object", {"tools": [{"name": "f", "input_schema": 5}]}),
    ("empty stop sequence", {"stop_sequences": [""]}),
    ("output format not an object", {"output_config": {"format": "json"}}),
    ("output effort a number", {"output_config": {"effort": 7}}),
    ("context edits not a list", {"context_management": {"edits": "x"}}),
    ("context edit not an object", {"context_management": {"edits": [5]}}),
    ("defer_loading a string", {"tools": [{"name": "f", "defer_loading": "yes"}]}),
    (
        "tool_reference naming no tool",
        {
            "tools": [{"name": "f"}, {"name": "g", "defer_loading": True}],
            "messages": _turns(
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                result=[
                    {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "tool_reference"}]}
                ],
            ),
        },
    ),
    (
        "tool_reference to a tool not sent",
        {
            "tools": [{"name": "f"}],
            "messages": _turns(
                {"type": "tool_use", "id": "t1", "name": "f", "input": {}},
                result=[
                    {
                        "type": "tool_result",
                        "tool_use_id": "t1",
                        "content": [{"type": "tool_reference", "tool_name": "g"}],
                    }
                ],
            ),
        },
    ),
]


BAD_MESSAGES += [
    (
        "is_error a string",
        {"messages": _turns(USE, result=[{"type": "tool_result", "tool_use_id": "t1", "is_error": "yes"}])},
    ),
    ("a tool_use left unanswered", {"messages": _turns(USE)}),
    (
        "a tool_result answering no tool_use",
        {
            "messages": _turns(
                {"type": "text", "text": "x"}, result=[{"type": "tool_result", "tool_use_id": "t9"}]
            )
        },
    ),
    (
        "a tool_result answering another tool_use",
        {"messages": _turns(USE, result=[{"type": "tool_result", "tool_use_id": "t2"}])},
    ),
    ("metadata a string", {"metadata": "x"}),
    ("metadata with another key", {"metadata": {"user_id": "u", "foo": 1}}),
    ("thinking budget a string", {"thinking": {"type": "enabled", "budget_tokens": "x"}}),
    ("thinking display unknown", {"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "full"}}),
    ("thinking enabled without a budget", {"max_tokens": 4096, "thinking": {"type": "enabled"}}),
    (
        "thinking budget below 1,024",
        {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 1023}},
    ),
    (
        "thinking budget not below max_tokens",
        {"max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 2048}},
    ),
    ("a tool name with spaces", {"tools": [{"name": "bad name!", "input_schema": {"type": "object"}}]}),
    (
        "two tools of one name",
        {"tools": [{"name": "f", "input_schema": {}}, {"name": "f", "input_schema": {}}]},
    ),
    ("a tool description a number", {"tools": [{"name": "f", "description": 5, "input_schema": {}}]}),
    ("tool_choice tool without a name", {"tool_choice": {"type": "tool"}}),
    # Blocks a chat template cannot render in their place, and pairs Anthropic refuses.
    (
        "assistant text after a tool_use",
        {"messages": _turns(USE, {"type": "text", "text": "more"}, result=[RESULT])},
    ),
    (
        "thinking after a tool_use",
        {
            "messages": _turns(
                THOUGHT, USE, THOUGHT, {**USE, "id": "t2"}, result=[RESULT, {**RESULT, "tool_use_id": "t2"}]
            )
        },
    ),
    ("a tool_result after text", {"messages": _turns(USE, result=[{"type": "text", "text": "x"}, RESULT])}),
    ("two tool_uses of one id", {"messages": _turns(USE, USE, result=[RESULT])}),
    ("two tool_results for one tool_use", {"messages": _turns(USE, result=[RESULT, RESULT])}),
    # Keys Anthropic's types do not hold, at any depth.
    ("a message with a name", {"messages": [{"role": "user", "content": "hi", "name": "me"}]}),
    (
        "a text block with another key",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "x": 1}]}]},
    ),
    ("a tool_use with text", {"messages": _turns({**USE, "text": "hidden"}, result=[RESULT])}),
    ("a tool_result with another key", {"messages": _turns(USE, result=[{**RESULT, "x": 1}])}),
    ("a tool with another key", {"tools": [{"name": "f", "input_schema": {}, "frob": 1}]}),
    ("tool_choice with another key", {"tool_choice": {"type": "auto", "frob": 1}}),
    ("thinking with another key", {"thinking": {"type": "disabled", "frob": 1}}),
    ("thinking disabled with a budget", {"thinking": {"type": "disabled", "budget_tokens": 2000}}),
    # Values outside Anthropic's types.
    ("output effort unknown", {"output_config": {"effort": "ultra"}}),
    ("service_tier unknown", {"service_tier": "bogus"}),
    ("speed unknown", {"speed": "bogus"}),
    ("inference_geo a number", {"inference_geo": 5}),
    (
        "cache_control ttl unknown",
        {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]},
    ),
    (
        "cache_control type unknown",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "hi", "cache_control": {"type": "bogus"}}],
                }
            ]
        },
    ),
    ("user content of whitespace", {"messages": [{"role": "user", "content": "   "}]}),
    (
        "a text block of whitespace",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": " \n"}]}]},
    ),
    (
        "an empty assistant turn mid-conversation",
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "assistant", "content": []},
                {"role": "user", "content": "b"},
            ]
        },
    ),
    (
        "redacted_thinking without data",
        {"messages": _turns({"type": "redacted_thinking"}, {"type": "text", "text": "x"})},
    ),
    (
        "thinking without a signature",
        {"messages": _turns({"type": "thinking", "thinking": "t"}, {"type": "text", "text": "x"})},
    ),
    ("output format without a schema", {"output_config": {"format": {"type": "json_schema"}}}),
]


@pytest.mark.parametrize(("name", "change"), BAD_MESSAGES, ids=[n for n, _ in BAD_MESSAGES])
def test_a_malformed_messages_body_is_an_anthropic_400(
    proxy_url: str, name: str, change: dict[str, Any]
) -> None:
    answer = httpx.post(f"{proxy_url}/sessions/bad/v1/messages", json={**ANTHROPIC, **change}, timeout=30)
    assert answer.status_code == 400, (name, answer.text)
    body = answer.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"]
    # Anthropic's own wording, never chat's (response_format, {'type': 'function', ...}).
    assert "response_format" not in body["error"]["message"]
    assert "'function'" not in body["error"]["message"]


def test_a_tool_loop_whose_results_answer_its_uses_is_served(proxy_url: str) -> None:
    """The pairing rules refuse nothing that answers every tool_use, also across a mid-conversation
    system message (Claude Code sends one)."""
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": [USE, {**USE, "id": "t2"}]},
        {"role": "system", "content": "Reminder."},
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t2", "content": "r2"},
                {"type": "tool_result", "tool_use_id": "t1", "content": "r1"},
                {"type": "text", "text": "go on"},
            ],
        },
    ]
    answer = httpx.post(f"{proxy_url}/sessions/pairs/v1/messages", json={**ANTHROPIC, "messages": messages})
    assert answer.status_code == 200, answer.text


def test_a_thinking_budget_anthropic_takes_is_served(proxy_url: str) -> None:
    """A budget of 1,024 or more below max_tokens; at or above it under the interleaved-thinking
    beta, where the budget spans the whole turn (Anthropic's rules)."""
    url = f"{proxy_url}/sessions/budget/v1/messages"
    below = {**ANTHROPIC, "max_tokens": 2048, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert httpx.post(url, json=below, timeout=30).status_code == 200
    above = {**below, "thinking": {"type": "enabled", "budget_tokens": 8192}}
    assert httpx.post(url, json=above, timeout=30).status_code == 400
    beta = {"anthropic-beta": "fine-grained-tool-streaming-2025-05-14,interleaved-thinking-2025-05-14"}
    answer = httpx.post(url, json=above, headers=beta, timeout=30)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(("name", "change"), BAD_MESSAGES[:4], ids=[n for n, _ in BAD_MESSAGES[:4]])
def test_count_tokens_refuses_what_messages_refuses(
    proxy_url: str, name: str, change: dict[str, Any]
) -> None:
    body = {"model": "m", "messages": USER, **change}
    answer = httpx.post(f"{proxy_url}/v1/messages/count_tokens", json=body, timeout=30)
    assert answer.status_code == 400, (name, answer.text)
    assert answer.json()["error"]["type"] == "invalid_request_error"


BAD_RESPONSES: list[tuple[str, dict[str, Any], str]] = [
    ("text.format a string", {"text": {"format": "json"}}, "text.format"),
    (
        "namespace holding a number",
        {"tools": [{"type": "namespace", "name": "ns", "tools": [5]}]},
        "tools[0]",
    ),
    (
        "function_call arguments an object",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "name": "f", "call_id": "c1", "arguments": {"a": 1}},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
            ]
        },
        "input[1].arguments",
    ),
    (
        "function_call_output without call_id",
        {"input": [{"role": "user", "content": "hi"}, {"type": "function_call_output", "output": "r"}]},
        "input[1].call_id",
    ),
    ("reasoning effort a number", {"reasoning": {"effort": 5}}, "reasoning.effort"),
    (
        "a deferred function (no tool search here)",
        {"tools": [{"type": "function", "name": "f", "parameters": {}, "defer_loading": True}]},
        "tools[0].defer_loading",
    ),
    ("metadata with a number", {"metadata": {"k": 1}}, "metadata.k"),
    ("metadata of 17 pairs", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("metadata with a long value", {"metadata": {"k": "v" * 513}}, "metadata.k"),
    ("service_tier unknown", {"service_tier": "fastest"}, "service_tier"),
    ("reasoning effort unknown", {"reasoning": {"effort": "bogus"}}, "reasoning.effort"),
    ("reasoning summary a number", {"reasoning": {"summary": 5}}, "reasoning.summary"),
    ("reasoning with another key", {"reasoning": {"effort": "low", "depth": 3}}, "reasoning"),
    (
        "a function description a number",
        {"tools": [{"type": "function", "name": "f", "description": 5, "parameters": {}}]},
        "tools[0].description",
    ),
    (
        "a function strict a string",
        {"tools": [{"type": "function", "name": "f", "strict": "yes", "parameters": {}}]},
        "tools[0].strict",
    ),
    (
        "a function name with spaces",
        {"tools": [{"type": "function", "name": "bad name!", "parameters": {}}]},
        "tools[0].name",
    ),
    (
        "a json_schema format without a name",
        {"text": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
        "text.format.name",
    ),
    (
        "a content part of chat's type",
        {"input": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
        "input[0].content",
    ),
    ("truncation unknown", {"truncation": "sometimes"}, "truncation"),
    (
        "a function_call_output answering no function_call",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call_output", "call_id": "c9", "output": "r"},
            ]
        },
        "input",
    ),
    (
        "a function_call left unanswered",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "name": "f", "call_id": "c1", "arguments": "{}"},
                {"role": "user", "content": "go on"},
            ]
        },
        "input",
    ),
    (
        "a function_call_output sent twice",
        {
            "input": [
                {"role": "user", "content": "hi"},
                {"type": "function_call", "name": "f", "call_id": "c1", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
                {"type": "function_call_output", "call_id": "c1", "output": "r"},
            ]
        },
        "input",
    ),
]


BAD_CHAT: list[tuple[str, dict[str, Any], str]] = [
    ("metadata with a number", {"metadata": {"k": 1}}, "metadata.k"),
    ("service_tier unknown", {"service_tier": "fastest"}, "service_tier"),
    (
        "a function name with spaces",
        {"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
        "tools[0].function.name",
    ),
    (
        "a function strict a string",
        {"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
        "tools[0].function.strict",
    ),
    (
        "a json_schema format without a name",
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
    ),
]


BAD_OPENAI = [("chat/completions", CHAT, *case) for case in BAD_CHAT] + [
    ("responses", RESPONSES, *case) for case in BAD_RESPONSES
]


@pytest.mark.parametrize(
    ("route", "base", "name", "change", "param"), BAD_OPENAI, ids=[f"{r}:{n}" for r, _, n, _, _ in BAD_OPENAI]
)
def test_a_malformed_openai_body_is_an_openai_400_naming_the_field(
    proxy_url: str, *, route: str, base: dict[str, Any], name: str, change: dict[str, Any], param: str
) -> None:
    answer = httpx.post(f"{proxy_url}/sessions/bad/v1/{route}", json={**base, **change}, timeout=30)
    assert answer.status_code == 400, (name, answer.text)
    error = answer.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"max_output_tokens": 10**9}, "max_output_tokens"),
        ({"input": "word " * 40_000}, "input"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ],
)
def test_responses_errors_name_the_responses_field(
    proxy_url: str, change: dict[str, Any], param: str
) -> None:
    """Errors the turn core raises in chat's terms name the field a Responses client sent."""
    for stream in (False, True):
        body = {**RESPONSES, **change, "stream": stream}
        answer = httpx.post(f"{proxy_url}/sessions/names/v1/responses", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == param


def _nested(levels: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(levels):
        value = {"a": value}
    return value


DEEP = _nested(300)
TOO_DEEP: list[tuple[str, str, dict[str, Any]]] = [
    ("responses", "tool schema", {"tools": [{"type": "function", "name": "f", "parameters": DEEP}]}),
    ("responses", "metadata", {"metadata": DEEP}),
    ("responses", "client_metadata", {"client_metadata": DEEP}),
    ("responses", "text schema", {"text": {"format": {"type": "json_schema", "name": "x", "schema": DEEP}}}),
    ("responses", "reasoning", {"reasoning": {"effort": "low", "x": DEEP}}),
    ("messages", "tool schema", {"tools": [{"name": "f", "input_schema": DEEP}]}),
    ("messages", "metadata", {"metadata": DEEP}),
    ("messages", "diagnostics", {"diagnostics": DEEP}),
    ("messages", "thinking", {"thinking": {"type": "enabled", "x": DEEP}}),
    ("messages", "output format", {"output_config": {"format": {"type": "json_schema", "schema": DEEP}}}),
    ("messages/count_tokens", "tool schema", {"tools": [{"name": "f", "input_schema": DEEP}]}),
]


@pytest.mark.parametrize(("route", "name", "change"), TOO_DEEP, ids=[f"{r}:{n}" for r, n, _ in TOO_DEEP])
def test_json_nested_too_deep_is_a_400_on_the_dialect_routes(
    proxy_url: str, route: str, name: str, change: dict[str, Any]
) -> None:
    """As on chat (issue #12): past 128 levels a free-form value is refused where it enters."""
    base = RESPONSES if route == "responses" else ANTHROPIC
    if route.endswith("count_tokens"):
        base = {"model": "m", "messages": USER}
    answer = httpx.post(f"{proxy_url}/sessions/deep/v1/{route}", json={**base, **change}, timeout=30)
    assert answer.status_code == 400, (name, answer.text)
    if route == "responses":
        assert answer.json()["error"]["code"] == "json_too_deep"
    else:
        assert answer.json()["error"]["type"] == "invalid_request_error"
        assert "128" in answer.json()["error"]["message"]


# (route, base body, field, a value of the wrong JSON type): lax parsing would sample what was never
# asked for ("32" as 32, true as 1 token), where OpenAI's and Anthropic's APIs answer a 400.
WRONG_TYPES: list[tuple[str, dict[str, Any], str, Any]] = [
    ("chat/completions", CHAT, "max_tokens", "32"),
    ("chat/completions", CHAT, "max_tokens", True),
    ("chat/completions", CHAT, "max_completion_tokens", 4.0),
    ("chat/completions", CHAT, "temperature", "0.5"),
    ("chat/completions", CHAT, "temperature", True),
    ("chat/completions", CHAT, "n", "1"),
    ("chat/completions", CHAT, "seed", "7"),
    ("chat/completions", CHAT, "logprobs", 1),
    ("chat/completions", CHAT, "top_logprobs", "2"),
    ("chat/completions", CHAT, "store", "yes"),
    ("chat/completions", CHAT, "user", 5),
    ("chat/completions", CHAT, "metadata", ["a"]),
    ("completions", COMPLETION, "user", 5),
    ("completions", COMPLETION, "max_tokens", "4"),
    ("completions", COMPLETION, "temperature", "1"),
    ("responses", RESPONSES, "max_output_tokens", "32"),
    ("responses", RESPONSES, "temperature", "1"),
    ("responses", RESPONSES, "stream", "yes"),
    ("responses", RESPONSES, "parallel_tool_calls", "true"),
    ("responses", RESPONSES, "store", "yes"),
    ("responses", RESPONSES, "user", 5),
    ("responses", RESPONSES, "prompt_cache_key", 5),
    ("responses", RESPONSES, "safety_identifier", 5),
    ("responses", RESPONSES, "metadata", ["a"]),
    ("messages", ANTHROPIC, "max_tokens", "32"),
    ("messages", ANTHROPIC, "max_tokens", True),
    ("messages", ANTHROPIC, "stream", "yes"),
    ("messages", ANTHROPIC, "temperature", "0.5"),
    ("messages", ANTHROPIC, "top_k", "5"),
]


@pytest.mark.parametrize(
    ("route", "base", "field", "value"),
    WRONG_TYPES,
    ids=[f"{r}:{f}={v!r}" for r, _, f, v in WRONG_TYPES],
)
def test_a_value_of_the_wrong_json_type_is_refused_not_converted(
    proxy_url: str, route: str, base: dict[str, Any], field: str, value: Any
) -> None:
    answer = httpx.post(f"{proxy_url}/sessions/types/v1/{route}", json={**base, field: value}, timeout=30)
    assert answer.status_code == 400, (field, value, answer.text)
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error"
    if route != "messages":
        assert error["param"] == field
    else:
        assert field in error["message"]


@pytest.mark.parametrize(
    ("tool_choice", "param"),
    [
        ({"type": "function", "function": {"name": "f"}}, "tool_choice.name"),  # chat's shape
        ({"type": "function"}, "tool_choice.name"),
        ("sometimes", "tool_choice"),
        ({"type": "allowed_tools", "tools": []}, "tool_choice"),
    ],
)
def test_a_responses_tool_choice_error_speaks_responses(proxy_url: str, tool_choice: Any, param: str) -> None:
    tools = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
    body = {**RESPONSES, "tools": tools, "tool_choice": tool_choice}
    answer = httpx.post(f"{proxy_url}/sessions/tc/v1/responses", json=body, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == param
    assert "'function': {" not in error["message"]  # never chat's shape as the advice


def test_a_history_refused_for_its_tool_pairs_is_refused_again_when_resent_longer(proxy_url: str) -> None:
    """A session's resent messages are not converted again; one refused is never kept unchecked."""
    refused = _turns(USE)  # the tool_use is answered by text, not a tool_result
    url = f"{proxy_url}/sessions/pairs-again/v1/messages"
    for messages in (
        refused,
        [*refused, {"role": "assistant", "content": "ok"}, {"role": "user", "content": "b"}],
    ):
        answer = httpx.post(url, json={**ANTHROPIC, "messages": messages}, timeout=30)
        assert answer.status_code == 400, answer.text
        assert "tool_use ids were found without tool_result" in answer.json()["error"]["message"]


def test_a_refused_tool_list_is_refused_again_when_resent(proxy_url: str) -> None:
    """A session's resent tool list is not checked again once it passed; one that was refused is."""
    body = {**CHAT, "tools": [{"type": "function", "function": {"name": "bad name!"}}]}
    for _ in range(2):
        answer = httpx.post(f"{proxy_url}/sessions/tools-again/v1/chat/completions", json=body, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"] == "tools[0].function.name"
