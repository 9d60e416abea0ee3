"""Sampled ids to an OpenAI assistant message: content, reasoning_content and tool_calls.

Text is derived from the ids (special tokens kept, so each family's markers are visible) for the
harness; the ids stay the record. One parser per output format, chosen by flag or detected from the
chat template. A malformed tool call is returned as content, never as an error.
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from proxy.chat.messages import Message
from proxy.ids import random_hex
from proxy.json_limits import bounded, loads_bounded


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None
    reasoning_content: str | None
    tool_calls: list[dict[str, Any]]

    def as_message(self) -> Message:
        message: Message = {"role": "assistant", "content": self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


CallIdStyle = Literal["openai", "alphanumeric9"]
_ALPHANUMERIC = string.ascii_letters + string.digits


def new_tool_call_id(style: CallIdStyle = "openai") -> str:
    """An id for a call the model sampled without one, in a form the served template accepts
    (Mistral's refuse any id but nine alphanumerics; the probe finds out)."""
    if style == "alphanumeric9":
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))
    return "call_" + random_hex(12)


def _call(name: str, arguments: Any, call_id: str | None = None) -> dict[str, Any]:
    """A parsed call; `call_id` is the sampled id, if the format has one (the parser names the others)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": name, "arguments": text},
    }


def _value(raw: str) -> Any:
    """An XML-style argument value: JSON when it parses (within the nesting cap), else the text itself."""
    try:
        return loads_bounded(raw)
    except ValueError:
        return raw


def split_reasoning(text: str, *, opened: bool = False) -> tuple[str | None, str]:
    """Reasoning and the rest. `opened`: the generation prompt already opened reasoning (DeepSeek R1),
    so text before `</think>` is reasoning even without a sampled `<think>`."""
    if text.lstrip().startswith("<think>") or opened:
        body = text.lstrip().removeprefix("<think>") if text.lstrip().startswith("<think>") else text
        reasoning, closed, rest = body.partition("</think>")
        # Cut off (length) while still reasoning: all of it is reasoning.
        return reasoning.strip("\n"), rest.lstrip("\n") if closed else ""
    # A `</think>` that neither the model nor the prompt opened is text: the proxy knows from the
    # prompt whether reasoning was opened, so it never guesses.
    return None, text


CallsParser = Callable[[str], tuple[str, list[dict[str, Any]]] | None]

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_JSON = json.JSONDecoder()
_LLAMA_SEPARATOR = re.compile(r"\s*;\s*")
_CODER_FUNCTION = re.compile(r"<function=([^>\n]+)>\s*(.*?)\s*</function>", re.DOTALL)
_CODER_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_GLM_CALL = re.compile(r"<tool_call>([^\n<]+)(.*?)</tool_call>", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_DEEPSEEK_CALL = re.compile(
    r"<｜tool▁call▁begin｜>(\w+)<｜tool▁sep｜>([^\n]+)\n```json\n(.*?)\n```<｜tool▁call▁end｜>",
    re.DOTALL,
)


def _around(text: str, start: str, end: str) -> tuple[str, str]:
    """Text before the first `start` and after the last `end`, joined as content. Only trailing
    whitespace is cut before a call, so that streamed content is always a prefix of this."""
    before = text[: text.index(start)]
    after = text[text.rindex(end) + len(end) :]
    return before.rstrip() + ("\n" + after.strip() if after.strip() else ""), ""


def hermes_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for body in _HERMES.findall(text):
        try:
            payload = loads_bounded(body)
        except ValueError:
            return None
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return None
        calls.append(_call(payload["name"], payload.get("arguments", {})))
    if not calls or text.count("<tool_call>") != len(calls) or text.count("</tool_call>") != len(calls):
        return None
    return _around(text, "<tool_call>", "</tool_call>")[0], calls


# Per tool name, the arguments its schema types as strings. XML call formats write every value as
# text; a string argument's is kept as written, as vLLM's glm45 and qwen3_coder parsers keep it
# ("1.50" stays "1.50", "75001" a string), and any other is read as JSON where it parses.
TextArguments = Mapping[str, frozenset[str]]
NO_TEXT_ARGUMENTS: TextArguments = MappingProxyType({})


def text_arguments(tools: list[dict[str, Any]] | None) -> TextArguments:
    """The string-typed arguments of each function among `tools` (chat-template tool dicts)."""
    found: dict[str, frozenset[str]] = {}
    for tool in tools or []:
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        if isinstance(properties, dict):
            found[function["name"]] = frozenset(
                key for key, schema in properties.items() if _is_string(schema)
            )
    return MappingProxyType(found)


def _is_string(schema: Any) -> bool:
    """A JSON schema whose values are strings, or null: `"string"`, `["string", "null"]` (OpenAI's
    strict schemas), an `anyOf`/`oneOf` of strings and null (pydantic's Optional[str]), an enum of
    strings."""
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if kind == "string" or (isinstance(kind, list) and "string" in kind and set(kind) <= {"string", "null"}):
        return True
    members = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(members, list):
        typed = [m for m in members if not (isinstance(m, dict) and m.get("type") == "null")]
        return bool(typed) and all(_is_string(m) for m in typed)
    enum = schema.get("enum")
    return kind is None and isinstance(enum, list) and bool(enum) and all(isinstance(v, str) for v in enum)


def _xml_calls(
    text: str,
    call: re.Pattern[str],
    argument: re.Pattern[str],
    strings: TextArguments,
    *,
    null_is_none: bool = False,
) -> tuple[str, list[dict[str, Any]]] | None:
    """Calls written as XML inside `<tool_call>`: a name, then key/value argument elements.
    `null_is_none`: the text `null` is null whatever the schema (vLLM's qwen3_coder reads it so)."""
    if "<tool_call>" not in text:
        return text, []
    calls = []
    for name, body in call.findall(text):
        kept = strings.get(name.strip(), frozenset())
        arguments = {
            key.strip(): None
            if null_is_none and value.strip() == "null"
            else (value if key.strip() in kept else _value(value))
            for key, value in argument.findall(body)
        }
        calls.append(_call(name.strip(), arguments))
    if not calls or text.count("<tool_call>") != len(calls) or text.count("</tool_call>") != len(calls):
        return None
    return _around(text, "<tool_call>", "</tool_call>")[0], calls


def qwen3_coder_calls(
    text: str, strings: TextArguments = NO_TEXT_ARGUMENTS
) -> tuple[str, list[dict[str, Any]]] | None:
    return _xml_calls(text, _CODER_FUNCTION, _CODER_PARAMETER, strings, null_is_none=True)


def glm45_calls(
    text: str, strings: TextArguments = NO_TEXT_ARGUMENTS
) -> tuple[str, list[dict[str, Any]]] | None:
    return _xml_calls(text, _GLM_CALL, _GLM_ARG, strings)


# The formats whose argument values are text, read by the tools' schemas.
XML_FORMATS = {"qwen3_coder": qwen3_coder_calls, "glm45": glm45_calls}


def llama3_json_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """Llama 3's JSON calls: one object, or several separated by `;` (as vLLM's llama3_json reads
    them); anything else, an object that is no call included, is content."""
    stripped = text.strip().removeprefix("<|python_tag|>").strip()
    if not stripped.startswith("{"):
        return text, []
    calls: list[dict[str, Any]] = []
    at = 0
    while True:
        try:
            payload, end = _JSON.raw_decode(stripped, at)
            bounded(payload)
        except (ValueError, RecursionError):
            return text, []  # ordinary content that happens to start with a brace
        if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
            return text, []
        calls.append(_call(payload["name"], payload.get("parameters", payload.get("arguments", {}))))
        if end == len(stripped):
            return "", calls
        separator = _LLAMA_SEPARATOR.match(stripped, end)
        if separator is None or separator.end() == len(stripped):
            return text, []
        at = separator.end()


def mistral_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    if "[TOOL_CALLS]" not in text:
        return text, []
    before, _, payload = text.partition("[TOOL_CALLS]")
    try:
        items = loads_bounded(payload)
    except ValueError:
        return None
    items = items if isinstance(items, list) else [items]
    if not items or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    # The sampled ids are kept: Mistral's template renders them back and accepts only such ids.
    calls = [_call(i["name"], i.get("arguments", {}), _sampled_id(i.get("id"))) for i in items]
    return before.rstrip(), calls


def _sampled_id(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def deepseek_v3_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    if begin not in text:
        return text, []
    calls = [_call(name.strip(), arguments) for _, name, arguments in _DEEPSEEK_CALL.findall(text)]
    # R1-distill's template ends a lone call with the call's own end token, no calls end; a text
    # cut anywhere else is a truncated call.
    if not calls or (end not in text and not text.rstrip().endswith("<｜tool▁call▁end｜>")):
        return None
    for call in calls:
        try:
            loads_bounded(call["function"]["arguments"])
        except ValueError:
            return None
    return text[: text.index(begin)].rstrip(), calls


_KIMI_SECTION = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
_KIMI_CALL = re.compile(
    r"<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL
)


def kimi_k2_calls(text: str) -> tuple[str, list[dict[str, Any]]] | None:
    """Kimi K2: the sampled call id (`functions.NAME:INDEX`) is kept, since its template renders it
    back into history."""
    begin, end = _KIMI_SECTION
    if begin not in text:
        return text, []
    if end not in text:
        return None
    calls = []
    for call_id, arguments in _KIMI_CALL.findall(text[text.index(begin) : text.index(end)]):
        name = call_id.removeprefix("functions.").rpartition(":")[0]
        try:
            loads_bounded(arguments)
        except ValueError:
            return None
        if not name:
            return None
        calls.append(_call(name, arguments.strip(), call_id))
    if not calls:
        return None
    return _around(text, begin, end)[0], calls


_HARMONY_MESSAGE = re.compile(
    r"(?:<\|start\|>assistant)?(.*?)<\|message\|>(.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL
)


def parse_harmony(text: str) -> ParsedOutput | None:
    """gpt-oss: analysis messages are reasoning, final is content, `to=functions.X` are tool calls."""
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for header, body in _HARMONY_MESSAGE.findall(text):
        recipient = re.search(r"to=functions\.([\w.-]+)", header)
        if recipient:
            try:
                loads_bounded(body)
            except ValueError:
                return None
            calls.append(_call(recipient.group(1), body))
        elif "analysis" in header:
            reasoning.append(body)
        else:
            content.append(body)
    if not (reasoning or content or calls):
        return None
    return ParsedOutput(
        content="".join(content) if content or not calls else None,
        reasoning_content="\n".join(reasoning) if reasoning else None,
        tool_calls=calls,
    )


CALL_PARSERS: dict[str, CallsParser] = {
    "hermes": hermes_calls,
    "qwen3_coder": qwen3_coder_calls,
    "glm45": glm45_calls,
    "llama3_json": llama3_json_calls,
    "deepseek_v3": deepseek_v3_calls,
    "mistral": mistral_calls,
    "kimi_k2": kimi_k2_calls,
}
PARSER_NAMES = (*CALL_PARSERS, "gpt_oss")


def detect_parser(template: str) -> str:
    """The output format a chat template teaches its model."""
    if "<|channel|>" in template:
        return "gpt_oss"
    if "<|tool_calls_section_begin|>" in template:
        return "kimi_k2"
    if "tool▁calls▁begin" in template:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<arg_key>" in template:
        return "glm45"
    if "<function=" in template:
        return "qwen3_coder"
    if "<|start_header_id|>" in template and '"parameters"' in template:
        return "llama3_json"
    return "hermes"


@dataclass(frozen=True)
class OutputParser:
    """Parses decoded output text (special tokens kept, trailing stop token removed)."""

    name: str
    parse_reasoning: bool
    special_texts: tuple[str, ...] = ()
    # False for tool_choice "none": call markup stays text, as the model wrote it.
    tool_calls: bool = True
    # How ids are made for calls sampled without one.
    call_id_style: CallIdStyle = "openai"
    # The request's string-typed arguments (text_arguments), for the XML formats.
    strings: TextArguments = field(default_factory=lambda: NO_TEXT_ARGUMENTS, compare=False)

    def _named(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**call, "id": call["id"] or new_tool_call_id(self.call_id_style)} for call in calls]

    def clean(self, text: str | None) -> str | None:
        """`text` without special-token text (which is structure, not words)."""
        if text is None:
            return None
        for special in self.special_texts:
            text = text.replace(special, "")
        return text

    def parse(self, text: str, *, reasoning_open: bool = False) -> ParsedOutput:
        if self.name == "gpt_oss":
            parsed = parse_harmony(text)
            if parsed is not None and parsed.tool_calls and not self.tool_calls:
                parsed = None
            if parsed is None:
                return ParsedOutput(content=self.clean(text), reasoning_content=None, tool_calls=[])
            return ParsedOutput(
                self.clean(parsed.content),
                self.clean(parsed.reasoning_content),
                self._named(parsed.tool_calls),
            )
        reasoning, rest = (
            split_reasoning(text, opened=reasoning_open) if self.parse_reasoning else (None, text)
        )
        found = self._calls(rest) if self.tool_calls else (rest, [])
        if found is not None and not all(_takes_arguments(call) for call in found[1]):
            found = None  # a call no function could take: the text as the model wrote it
        if found is None:
            return ParsedOutput(
                content=self.clean(rest), reasoning_content=self.clean(reasoning), tool_calls=[]
            )
        content, calls = found
        return ParsedOutput(
            content=self.clean(content) if content or not calls else None,
            reasoning_content=self.clean(reasoning),
            tool_calls=self._named(calls),
        )

    def _calls(self, text: str) -> tuple[str, list[dict[str, Any]]] | None:
        xml = XML_FORMATS.get(self.name)
        return xml(text, self.strings) if xml is not None else CALL_PARSERS[self.name](text)


def _takes_arguments(call: dict[str, Any]) -> bool:
    """Whether a parsed call's arguments are a JSON object, the one shape a function (OpenAI's
    parameters, Anthropic's input) takes; an array or a number is no call (Anthropic's answer could
    only invent an object around it)."""
    try:
        return isinstance(loads_bounded(call["function"]["arguments"]), dict)
    except ValueError:
        return False


def build_parser(name: str, template: str, special_texts: tuple[str, ...]) -> OutputParser:
    """The parser called `name`, or the one the template implies for "auto"."""
    chosen = detect_parser(template) if name == "auto" else name
    if chosen not in PARSER_NAMES:
        raise ValueError(f"unknown tool parser {name!r}; choose one of auto, {', '.join(PARSER_NAMES)}")
    return OutputParser(
        chosen, parse_reasoning="<think>" in template or "</think>" in template, special_texts=special_texts
    )


def parse_output(text: str, *, parse_reasoning: bool, parser: str = "hermes") -> ParsedOutput:
    return OutputParser(parser, parse_reasoning).parse(text)
