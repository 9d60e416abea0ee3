"""Anthropic tools -> chat tools: the declared tools the prompt lists, and the deferred ones
(`defer_loading`, the tool search Claude Code uses) that enter the prompt only where a tool_result's
`tool_reference` block loads them, as their definitions in a <functions> block."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from proxy.dialects.anthropic_checks import check_keys
from proxy.errors import InvalidRequest, UnsupportedParameter

# Anthropic's pattern for a tool's name.
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,128}$")


# The keys of a custom tool (those that change the prompt are read; the others are recorded).
_TOOL_KEYS = frozenset(
    {
        "type",
        "name",
        "description",
        "input_schema",
        "cache_control",
        "defer_loading",
        "strict",
        "input_examples",
        "eager_input_streaming",
        "allowed_callers",
    }
)


def _chat_tool(tool: dict[str, Any], param: str) -> dict[str, Any]:
    if tool.get("type") not in (None, "custom"):
        raise UnsupportedParameter(
            f"tools of type {tool.get('type')!r} are not supported (custom tools with an input_schema)",
            param=param,
        )
    check_keys(tool, _TOOL_KEYS, f"{param}.custom")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise InvalidRequest("a tool needs a name", param=f"{param}.name")
    if not _TOOL_NAME.match(name):
        raise InvalidRequest(
            f"a tool's name matches {_TOOL_NAME.pattern} (letters, digits, _ and -)", param=f"{param}.name"
        )
    if schema is not None and not isinstance(schema, dict):
        raise InvalidRequest("a tool's input_schema must be an object", param=f"{param}.input_schema")
    description = tool.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequest("a tool's description must be a string", param=f"{param}.description")
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    # Anthropic requires a schema; a tool sent without one is offered as taking no input.
    function["parameters"] = schema or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


@dataclass
class AnthropicTools:
    """A request's tools; `loaded` fills in as its messages are read (anthropic_messages)."""

    declared: list[dict[str, Any]]  # chat-shaped, in the template's tool list
    by_name: dict[str, dict[str, Any]]  # every tool, deferred or not
    deferred: frozenset[str]
    loaded: list[str] = field(default_factory=list)  # deferred tools a tool_reference loaded
    # tool_reference blocks read so far: a message that read one depends on the tool list.
    references: int = 0

    @classmethod
    def of(cls, tools: list[dict[str, Any]] | None) -> AnthropicTools:
        declared: list[dict[str, Any]] = []
        by_name: dict[str, dict[str, Any]] = {}
        deferred: set[str] = set()
        for index, tool in enumerate(tools or []):
            chat = _chat_tool(tool, f"tools[{index}]")
            defer = tool.get("defer_loading", False)
            if not isinstance(defer, bool):
                raise InvalidRequest("defer_loading must be a boolean", param=f"tools[{index}].defer_loading")
            name = chat["function"]["name"]
            if name in by_name:
                raise InvalidRequest(f"tool names must be unique: {name!r}", param=f"tools[{index}].name")
            by_name[name] = chat
            if defer:
                deferred.add(name)
            else:
                declared.append(chat)
        return cls(declared, by_name, frozenset(deferred))

    def reference(self, block: dict[str, Any], param: str) -> str:
        """The tool a tool_reference block names, now loaded if it was deferred."""
        name = block.get("tool_name")
        if not isinstance(name, str):
            raise InvalidRequest("tool_reference blocks need tool_name as a string", param=param)
        if name not in self.by_name:
            raise InvalidRequest(f"tool_reference names {name!r}, which is not among tools", param=param)
        self.references += 1
        if name in self.deferred and name not in self.loaded:
            self.loaded.append(name)
        return name

    def definitions(self, names: list[str]) -> str:
        """Referenced tools as the text the model reads in their tool result: the <functions> block
        Claude Code's ToolSearch tool tells the model to expect, one <function> line per tool."""
        lines = []
        for name in names:
            function = self.by_name[name]["function"]
            shown = {key: function[key] for key in ("description", "name", "parameters") if key in function}
            lines.append(f"<function>{json.dumps(shown, ensure_ascii=False)}</function>")
        return "\n".join(["<functions>", *lines, "</functions>"])

    def callable(self) -> list[dict[str, Any]]:
        """The tools the model may call at this point: the declared ones and those loaded."""
        return [*self.declared, *(self.by_name[name] for name in self.loaded)]
