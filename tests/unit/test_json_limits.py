"""The JSON nesting cap: deeply nested sampled tool calls are text, never a crash; the walker is exact."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.chat.messages import canonical
from proxy.chat.parsing import parse_output
from proxy.errors import InvalidRequest
from proxy.json_limits import MAX_JSON_DEPTH, JsonTooDeep, loads_bounded, too_deep


def _nested(depth: int) -> Any:
    value: Any = 1
    for level in range(depth):
        value = {"a": value} if level % 2 else [value]
    return value


def _ds(name: str) -> str:
    """A DeepSeek V3 marker: full-width bars around words joined by U+2581."""
    return "<\uff5c" + name.replace(" ", "\u2581") + "\uff5c>"


@pytest.mark.parametrize("depth", [300, 5000])
@pytest.mark.parametrize(
    ("parser", "template"),
    [
        ("hermes", '<tool_call>\n{{"name": "f", "arguments": {args}}}\n</tool_call>'),
        ("mistral", '[TOOL_CALLS][{{"name": "f", "arguments": {args}}}]'),
        ("llama3_json", '{{"name": "f", "parameters": {args}}}'),
        (
            "deepseek_v3",
            _ds("tool calls begin")
            + _ds("tool call begin")
            + "function"
            + _ds("tool sep")
            + "f\n```json\n{args}\n```"
            + _ds("tool call end")
            + _ds("tool calls end"),
        ),
        (
            "kimi_k2",
            "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{args}"
            "<|tool_call_end|><|tool_calls_section_end|>",
        ),
        (
            "qwen3_coder",
            "<tool_call>\n<function=f>\n<parameter=a>\n{args}\n</parameter>\n</function>\n</tool_call>",
        ),
        ("gpt_oss", "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{args}<|call|>"),
    ],
)
def test_deeply_nested_sampled_arguments_are_text_not_a_crash(parser: str, template: str, depth: int) -> None:
    text = template.format(args='{"a": ' + "[" * depth + "]" * depth + "}")
    parsed = parse_output(text, parse_reasoning=False, parser=parser)
    for call in parsed.tool_calls:  # an XML value too deep stays the text it was
        assert not too_deep(json.loads(call["function"]["arguments"]))
    if parser != "qwen3_coder":
        assert parsed.tool_calls == []
        assert parsed.content


def test_the_walker_counts_levels_exactly() -> None:
    assert not too_deep(1)
    assert not too_deep(_nested(MAX_JSON_DEPTH))
    assert too_deep(_nested(MAX_JSON_DEPTH + 1))
    assert not too_deep([[], {"a": [1, 2]}], limit=3)
    assert too_deep([[], {"a": [1, {"b": 2}]}], limit=3)


def test_loads_bounded_refuses_deep_text_as_a_value_error() -> None:
    for depth in (MAX_JSON_DEPTH + 1, 100_000):
        with pytest.raises(JsonTooDeep):
            loads_bounded("[" * depth + "]" * depth)
    assert loads_bounded('{"a": [1]}') == {"a": [1]}


def test_canonical_refuses_deep_argument_text_with_a_400() -> None:
    call = {"id": "c", "function": {"name": "f", "arguments": json.dumps(_nested(300))}}
    with pytest.raises(InvalidRequest) as caught:
        canonical({"role": "assistant", "content": None, "tool_calls": [call]})
    assert caught.value.code == "json_too_deep"
