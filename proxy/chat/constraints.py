"""Grammars for SGLang's structured generation: forced tool calls and JSON response formats.

A forced call is constrained in the family's own call format (a structural tag around the
function's JSON schema), so the sampled tokens are the ones the template renders back into history;
a bare-JSON constraint would record tokens the model never writes in that position.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.engines.base import ConstraintKind
from proxy.errors import InvalidRequest, UnsupportedParameter


@dataclass(frozen=True)
class CallFormat:
    trigger: str
    begin: str  # with {name} for the function name
    end: str


# Output formats whose calls are one fixed text, the arguments object, then a fixed end.
CALL_FORMATS = {
    "hermes": CallFormat("<tool_call>", '<tool_call>\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "llama3_json": CallFormat('{"name": ', '{{"name": "{name}", "parameters": ', "}"),
}


def _tag(call_format: CallFormat, tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    schema = function.get("parameters") or {"type": "object"}
    return {
        "type": "tag",
        "begin": call_format.begin.format(name=function["name"]),
        "content": {"type": "json_schema", "json_schema": schema},
        "end": call_format.end,
    }


def tool_choice_constraint(
    tool_choice: str | dict[str, Any] | None,
    tools: list[dict[str, Any]] | None,
    parser_name: str,
    *,
    one_call: bool | None = None,
) -> tuple[ConstraintKind, str] | None:
    """The grammar that makes the model call a tool ("required") or one named function; None for
    "auto" and "none", which need no grammar."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise InvalidRequest("tool_choice needs tools", param="tool_choice")
    if tool_choice == "required":
        chosen = tools
    elif isinstance(tool_choice, dict) and isinstance((tool_choice.get("function") or {}).get("name"), str):
        name = tool_choice["function"]["name"]
        chosen = [t for t in tools if t["function"]["name"] == name]
        if not chosen:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among tools", param="tool_choice")
    else:
        raise InvalidRequest(
            "tool_choice is 'auto', 'none', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    call_format = CALL_FORMATS.get(parser_name)
    if call_format is None:
        raise UnsupportedParameter(
            f"forcing a tool call is not supported for the {parser_name!r} call format "
            f"(supported: {', '.join(CALL_FORMATS)}); use tool_choice 'auto'",
            param="tool_choice",
        )
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": [call_format.trigger],
            "tags": [_tag(call_format, t) for t in chosen],
            "at_least_one": True,
            # A named function is called once; "required" allows parallel calls (chat's rules);
            # `one_call` says otherwise where the dialect does (Anthropic's disable_parallel_tool_use).
            "stop_after_first": tool_choice != "required" if one_call is None else one_call,
        },
    }
    return "structural_tag", orjson.dumps(tag).decode()


def response_format_constraint(response_format: dict[str, Any] | None) -> tuple[ConstraintKind, str] | None:
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise UnsupportedParameter(
                "response_format json_schema needs json_schema.schema (an object)", param="response_format"
            )
        return "json_schema", orjson.dumps(schema).decode()
    raise UnsupportedParameter(
        "response_format type must be 'text', 'json_object' or 'json_schema'", param="response_format"
    )
