from __future__ import annotations

import json

from proxy.chat.parsing import OutputParser, detect_parser, parse_output, split_reasoning, text_arguments
from proxy.chat.streaming import StreamedMessage


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


def test_a_call_whose_arguments_are_no_object_is_content() -> None:
    """No function takes an array or a number (OpenAI's parameters and Anthropic's input are
    objects): the text stays as sampled, so every dialect answers it alike and its echo continues."""
    for arguments in ("[1, 2]", "7", '"text"', "null"):
        text = f'<tool_call>\n{{"name": "f", "arguments": {arguments}}}\n</tool_call>'
        parsed = parse_output(text, parse_reasoning=True)
        assert parsed.tool_calls == []
        assert parsed.content == text
    # Arguments written as JSON text of an object are an object.
    quoted = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    [call] = parse_output(quoted, parse_reasoning=True).tool_calls
    assert json.loads(call["function"]["arguments"]) == {"a": 1}


def test_reasoning_opened_by_the_generation_prompt() -> None:
    assert split_reasoning("thinking\n</think>\n\nanswer", opened=True) == ("thinking", "answer")
    assert split_reasoning("thinking\n</think>\n\nanswer") == (None, "thinking\n</think>\n\nanswer")
    assert split_reasoning("<think>\nstill thinking") == ("still thinking", "")
    assert split_reasoning("plain") == (None, "plain")


KIMI_CALLS = (
    "Checking both.<|tool_calls_section_begin|>"
    '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    '<|tool_call_begin|>functions.read_file:1<|tool_call_argument_begin|>{"path": "a.py"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)


def test_kimi_k2_calls_keep_the_sampled_call_ids() -> None:
    parsed = parse_output(
        "<think>\nweather first\n</think>" + KIMI_CALLS, parse_reasoning=True, parser="kimi_k2"
    )
    assert parsed.reasoning_content == "weather first"
    assert parsed.content == "Checking both."
    # Kimi's template renders the id back into history, so it must be the sampled one.
    assert [c["id"] for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.read_file:1"]
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["get_weather", "read_file"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"city": "Paris"}


def test_kimi_k2_malformed_or_unfinished_calls_are_content() -> None:
    unfinished = KIMI_CALLS.removesuffix("<|tool_calls_section_end|>")
    bad_json = KIMI_CALLS.replace('{"city": "Paris"}', '{"city": ')
    for text in (unfinished, bad_json):
        parsed = parse_output(text, parse_reasoning=False, parser="kimi_k2")
        assert parsed.tool_calls == []
        assert parsed.content == text


def test_kimi_k2_is_detected_from_its_template() -> None:
    template = "{%- if message.tool_calls -%}<|tool_calls_section_begin|>{%- endif -%}"
    assert detect_parser(template) == "kimi_k2"


def test_streamed_kimi_content_stops_before_the_call_section() -> None:
    view = StreamedMessage(OutputParser("kimi_k2", parse_reasoning=False))
    cut = KIMI_CALLS.index("<|tool_calls_section_begin|>") + 5
    assert view.update(KIMI_CALLS[:cut]) == {"content": "Checking both."}
    assert view.update(KIMI_CALLS) == {}


def test_tool_choice_none_leaves_call_markup_in_the_content() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    parsed = OutputParser("hermes", parse_reasoning=False, tool_calls=False).parse(text)
    assert parsed.tool_calls == []
    assert parsed.content == text


def test_llama3_json_calls_one_or_several_separated_by_semicolons() -> None:
    from proxy.chat.parsing import llama3_json_calls

    one = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    two = one + '; {"name": "get_weather", "parameters": {"city": "Lyon"}}'
    for text, cities in (
        (one, ["Paris"]),
        (two, ["Paris", "Lyon"]),
        ("<|python_tag|>" + two, ["Paris", "Lyon"]),
    ):
        found = llama3_json_calls(text)
        assert found is not None
        content, calls = found
        assert content == ""
        assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
    # Anything that is not calls all through is content, whole.
    for text in (
        one + "; and that is all",
        one + ";",
        one + " trailing",
        '{"answer": 4}',
        one + '; {"answer": 4}',
        "{" * 5000 + "}" * 5000,
    ):
        assert llama3_json_calls(text) == (text, [])


def test_xml_formats_keep_string_typed_arguments_as_written() -> None:
    """qwen3_coder and glm45 write values as text: the schema's strings stay text, the rest is JSON."""
    tools = [
        {
            "type": "function",
            "function": {
                "name": "edit",
                "parameters": {"properties": {"path": {"type": "string"}, "line": {"type": "integer"}}},
            },
        },
        {"type": "function", "function": {"name": "bare"}},  # no parameters: nothing is a string
    ]
    strings = text_arguments(tools)
    assert dict(strings) == {"edit": frozenset({"path"})}
    coder = (
        "<tool_call>\n<function=edit>\n<parameter=path>\n007\n</parameter>\n"
        "<parameter=line>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    glm = (
        "<tool_call>edit\n<arg_key>path</arg_key>\n<arg_value>[1]</arg_value>\n"
        "<arg_key>line</arg_key>\n<arg_value>7</arg_value>\n</tool_call>"
    )
    for name, text, path, read in (("qwen3_coder", coder, "007", "007"), ("glm45", glm, "[1]", [1])):
        typed = OutputParser(name, parse_reasoning=False, strings=strings).parse(text)
        assert json.loads(typed.tool_calls[0]["function"]["arguments"]) == {"path": path, "line": 7}
        untyped = OutputParser(name, parse_reasoning=False).parse(text)  # no schema: JSON where it parses
        assert json.loads(untyped.tool_calls[0]["function"]["arguments"])["path"] == read


def test_a_string_typed_argument_is_any_schema_of_strings_or_null() -> None:
    """OpenAI's strict schemas type an optional string ["string", "null"], pydantic's Optional[str]
    is an anyOf with null, an enum of strings has no type; qwen3_coder reads `null` as null."""
    properties = {
        "a": {"type": ["string", "null"]},
        "b": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "c": {"enum": ["01", "02"]},
        "d": {"type": ["integer", "null"]},
        "e": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"properties": properties}}}]
    assert text_arguments(tools)["f"] == frozenset({"a", "b", "c"})
    glm = (
        "<tool_call>f\n"
        + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n"
            for k, v in (("a", "007"), ("b", "null"), ("c", "01"), ("d", "7"), ("e", "8"))
        )
        + "</tool_call>"
    )
    parsed = OutputParser("glm45", parse_reasoning=False, strings=text_arguments(tools)).parse(glm)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {
        "a": "007", "b": "null", "c": "01", "d": 7, "e": 8
    }  # fmt: skip
    coder = "<tool_call>\n<function=f>\n<parameter=b>\nnull\n</parameter>\n</function>\n</tool_call>"
    parsed = OutputParser("qwen3_coder", parse_reasoning=False, strings=text_arguments(tools)).parse(coder)
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"b": None}
