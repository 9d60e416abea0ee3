"""Which tool-call parser reads the served template's call format, checked on the template itself.

The probe's tool-calling turn is rendered with the template and handed to the parsers: a parser
reads the format when it gets that one call back, name and arguments. With `--tool-parser auto`
the parser named by the template's markers is kept if it reads the format, else one that does;
where none does (or the template writes no calls at all), the start-up log warns and
GET /v1/template says so, instead of tool calls silently coming back as text.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

from proxy.chat.parsing import PARSER_NAMES, OutputParser, detect_parser
from proxy.chat.probe import ANSWER, PROBE_FUNCTION, conversation, shows_call
from proxy.errors import TemplateError

if TYPE_CHECKING:
    from proxy.chat.renderer import Renderer


@dataclass(frozen=True)
class ToolParserReport:
    """The chosen parser and what the check found; part of GET /v1/template."""

    name: str
    chosen_by: Literal["flag", "template"]
    template_call: str | None  # what the template writes for a turn that calls one tool
    matches_template: bool | None  # None: the template renders no tool calls to check against
    parsers_matching: list[str]
    warning: str | None

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def template_call_text(renderer: Renderer) -> str | None:
    """The text a model of this template samples for a turn that calls the probe's tool (what the
    full render puts after the generation prompt, up to the turn's close), or None if the template
    does not render such a turn."""
    # No system message: Mistral's templates move it into the last user message, so the prompt
    # would not be a prefix of the render.
    messages = conversation(system=False, tool_cycle=False, call=True, calls_only=True)
    try:
        prompt = renderer.render_text(messages[:-1], add_generation_prompt=True)
        full = renderer.render_text(messages)
    except TemplateError:
        return None
    if not shows_call(full):
        return None
    start = 0
    while start < min(len(prompt), len(full)) and prompt[start] == full[start]:
        start += 1
    for special in renderer.special_texts:
        # Never start inside a special token (DeepSeek's `<think>` against its calls opener).
        at = full.find(special, max(0, start - len(special) + 1))
        if 0 <= at < start:
            start = at
    after = full.rfind(ANSWER) + len(ANSWER)
    ends = [at for close in renderer.verdict.close_tokens if (at := full.find(close, after)) >= 0]
    return full[start : min(ends, default=len(full))]


def _reads(parser: OutputParser, text: str) -> bool:
    calls = parser.parse(text).tool_calls
    if len(calls) != 1 or calls[0]["function"]["name"] != PROBE_FUNCTION:
        return False
    try:
        return bool(json.loads(calls[0]["function"]["arguments"]) == {"key": ANSWER})
    except ValueError:
        return False


def choose_parser(renderer: Renderer, requested: str = "auto") -> tuple[OutputParser, ToolParserReport]:
    """The parser for `requested` ("auto": the template's), checked against the template's calls."""
    template = renderer.files.chat_template
    if requested != "auto" and requested not in PARSER_NAMES:
        raise ValueError(f"unknown tool parser {requested!r}; choose one of auto, {', '.join(PARSER_NAMES)}")

    def parser(name: str) -> OutputParser:
        return OutputParser(
            name,
            parse_reasoning="<think>" in template or "</think>" in template,
            special_texts=renderer.special_texts,
            call_id_style=renderer.verdict.call_id_style,
        )

    call = template_call_text(renderer)
    matching = [name for name in PARSER_NAMES if call is not None and _reads(parser(name), call)]
    name = requested
    if requested == "auto":
        detected = detect_parser(template)
        name = matching[0] if matching and detected not in matching else detected
    warning = None
    if call is None:
        warning = (
            f"the chat template renders no tool calls; tool calls are parsed as {name} but cannot be checked"
        )
    elif name not in matching:
        found = f" ({', '.join(matching)} would)" if matching else ""
        warning = (
            f"the {name} tool parser does not read the chat template's own call format{found}: "
            f"the template writes a call as {call!r}; such calls come back as text"
        )
    report = ToolParserReport(
        name=name,
        chosen_by="template" if requested == "auto" else "flag",
        template_call=call,
        matches_template=None if call is None else name in matching,
        parsers_matching=matching,
        warning=warning,
    )
    return parser(name), report
