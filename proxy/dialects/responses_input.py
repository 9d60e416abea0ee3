"""Responses API input -> chat messages and tools, the shape the turn core renders and matches.

Consecutive assistant-side items (reasoning, an assistant message, function calls) are one assistant
turn, as the proxy answered it; item ids are ignored (Codex makes its own), calls match by
`call_id`. Echoed reasoning is ours when its encrypted_content opens under our seal; one we did not
seal is an edit (a new segment).
"""

from __future__ import annotations

from typing import Any

from proxy.chat.messages import UNVERIFIED_REASONING, Message
from proxy.dialects.openai_checks import check_function_fields, check_name
from proxy.dialects.seals import Sealer
from proxy.errors import InvalidRequest, UnsupportedParameter

# Hosted tools run by OpenAI's servers: there is no executor behind this proxy, so they are not
# offered to the model (its prompt is what it would be without them); accepted and recorded.
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26", "web_search_preview_2025_03_11")


def _text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content must be a string or a list of text parts", param=param)
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
            raise UnsupportedParameter(
                f"content parts of type {kind!r} are not supported; send input_text (or output_text) parts",
                param=param,
            )
        texts.append(part["text"])
    return "\n".join(texts)


def _reasoning_text(item: dict[str, Any], sealer: Sealer) -> tuple[str | None, bool]:
    """The reasoning an echoed item carries, and whether it is provably what we sampled."""
    parts = item.get("content") or []
    texts = [p.get("text", "") for p in parts if isinstance(p, dict)]
    shown = "".join(texts) if texts else None
    sealed = item.get("encrypted_content")
    if isinstance(sealed, str):
        opened = sealer.opened(sealed)
        return (opened, True) if opened is not None else (shown, False)
    # Without a seal the text is compared with the record, as chat compares reasoning_content; a
    # reasoning item without text counts as unchanged, like a chat client that dropped it.
    return shown, True


class _Turns:
    """Builds the message list, gathering assistant-side items into one assistant message."""

    def __init__(self, sealer: Sealer) -> None:
        self.sealer = sealer
        self.messages: list[Message] = []
        self.assistant: Message | None = None

    def _open(self, *, after: str) -> Message:
        # A new assistant turn starts where this item cannot follow what the current one holds.
        current = self.assistant
        order = {"reasoning": 0, "content": 1, "tool_calls": 2}
        if current is None or any(order[k] > order[after] for k in order if current.get(k)):
            current = {"role": "assistant", "content": None}
            self.messages.append(current)
            self.assistant = current
        return current

    def other(self, message: Message) -> None:
        self.assistant = None
        self.messages.append(message)

    def reasoning(self, item: dict[str, Any]) -> None:
        text, verified = _reasoning_text(item, self.sealer)
        message = self._open(after="reasoning")
        if text is not None:
            message["reasoning_content"] = text
            message["reasoning"] = True  # marks the slot as taken for _open
        if not verified:
            message[UNVERIFIED_REASONING] = True

    def content(self, text: str) -> None:
        message = self._open(after="content")
        message["content"] = (message.get("content") or "") + text

    def call(self, item: dict[str, Any], param: str) -> None:
        arguments = item.get("arguments", "{}")
        name = item.get("name")
        if not isinstance(name, str) or not isinstance(item.get("call_id"), str):
            raise InvalidRequest("a function_call item needs name and call_id", param=param)
        if not isinstance(arguments, str):
            # The API's arguments are JSON text; an object has no one text the model sampled.
            raise InvalidRequest("function_call arguments must be a JSON string", param=f"{param}.arguments")
        if item.get("namespace"):
            name = f"{item['namespace']}.{name}"
        message = self._open(after="tool_calls")
        message.setdefault("tool_calls", []).append(
            {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
        )

    def finished(self) -> list[Message]:
        for message in self.messages:
            message.pop("reasoning", None)
        return self.messages


def check_call_pairs(messages: list[Message]) -> None:
    """OpenAI's pairing rules: a function_call_output answers a function_call before it (in the input,
    or in the previous response), and every function_call is answered. A history that breaks them
    would render a tool result the model never asked for, or a call that never got its result."""
    unanswered: dict[str, None] = {}  # call ids, in order
    for message in messages:
        for call in message.get("tool_calls") or ():
            unanswered[call["id"]] = None
        if message.get("role") == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in unanswered:
                raise InvalidRequest(
                    f"No tool call found for function call output with call_id {call_id}.", param="input"
                )
            del unanswered[call_id]
    if unanswered:
        raise InvalidRequest(
            f"No tool output found for function call {next(iter(unanswered))}.", param="input"
        )


def input_messages(
    instructions: str | None, items: str | list[dict[str, Any]], sealer: Sealer
) -> list[Message]:
    """The conversation a Responses request describes (without any stored previous response)."""
    return input_conversion(instructions, items, sealer)[0]


def input_conversion(
    instructions: str | None,
    items: str | list[dict[str, Any]],
    sealer: Sealer,
    resumed: tuple[int, list[Message]] | None = None,
) -> tuple[list[Message], list[int | None]]:
    """input_messages, and for each item read, then after the last, the index of the message it
    starts, or None where an assistant turn was open (the item may join it, and a later item may
    join whatever it made). With `resumed`, the first items' messages (made where no assistant turn
    was open after them): only the items after those are read."""
    turns = _Turns(sealer)
    first = 0
    if resumed is not None:
        first, made = resumed
        turns.messages += made
    elif instructions:
        turns.other({"role": "system", "content": instructions})
    if isinstance(items, str):
        turns.other({"role": "user", "content": items})
        return turns.finished(), []
    starts: list[int | None] = []
    for index in range(first, len(items)):
        starts.append(None if turns.assistant is not None else len(turns.messages))
        _add_item(turns, items[index], f"input[{index}]")
    starts.append(None if turns.assistant is not None else len(turns.messages))
    return turns.finished(), starts


def _add_item(turns: _Turns, item: dict[str, Any], param: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ("user", "system", "developer", "assistant"):
            raise InvalidRequest(f"unknown message role {role!r}", param=f"{param}.role")
        text = _text(item.get("content"), f"{param}.content")
        if role == "assistant":
            turns.content(text)
        else:
            # developer is the system role of open-weight templates, as in chat.
            turns.other({"role": "system" if role == "developer" else role, "content": text})
    elif kind == "reasoning":
        turns.reasoning(item)
    elif kind == "function_call":
        turns.call(item, param)
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, f"{param}.output")
        if not isinstance(item.get("call_id"), str):
            raise InvalidRequest("a function_call_output item needs its call_id", param=f"{param}.call_id")
        turns.other({"role": "tool", "tool_call_id": item["call_id"], "content": text})
    else:
        raise UnsupportedParameter(f"input items of type {kind!r} are not supported", param=param)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """Function tools in chat's shape; a namespace's functions as `namespace.name`; hosted tools
    (web search) left out of the prompt. Other tool types cannot be honoured: a 400."""
    found: list[dict[str, Any]] = []
    for index, tool in enumerate(tools or []):
        kind = tool.get("type")
        param = f"tools[{index}]"
        if kind == "function":
            found.append(_function(tool, prefix="", param=param))
        elif kind == "namespace":
            check_name(tool.get("name"), f"{param}.name", "a namespace")
            prefix = f"{tool.get('name')}."
            inner = tool.get("tools") or []
            if not isinstance(inner, list):
                raise InvalidRequest("a namespace's tools must be a list", param=f"{param}.tools")
            found.extend(_function(each, prefix=prefix, param=param) for each in inner)
        elif kind not in HOSTED_TOOLS:
            raise UnsupportedParameter(
                f"tools of type {kind!r} are not supported (function, namespace, web_search)",
                param=f"tools[{index}]",
            )
    return found


def _function(tool: Any, *, prefix: str, param: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise UnsupportedParameter("a namespace holds function tools", param=param)
    check_function_fields(tool, param)
    if not isinstance(tool.get("parameters") or {}, dict):
        raise InvalidRequest("a function tool's parameters must be an object", param=f"{param}.parameters")
    if tool.get("defer_loading"):
        # A deferred tool is loaded by a tool_search tool, a type this proxy refuses: rendered, it
        # would be in a prompt it is not in at OpenAI; left out, it could never be called.
        raise UnsupportedParameter(
            "deferred tools (defer_loading) need tool search, which is not supported",
            param=f"{param}.defer_loading",
        )
    function: dict[str, Any] = {"name": prefix + tool["name"]}
    if tool.get("description") is not None:
        function["description"] = tool["description"]
    function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> str | dict[str, Any] | None:
    """The Responses tool_choice as chat's: a mode as it is, a function by name."""
    if choice is None:
        return None
    if choice in ("auto", "none", "required"):
        return str(choice)
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest(
                "tool_choice of type 'function' names its function: {'type': 'function', 'name': ...}",
                param="tool_choice.name",
            )
        return {"type": "function", "function": {"name": name}}
    raise UnsupportedParameter(
        "tool_choice is 'auto', 'none', 'required' or {'type': 'function', 'name': ...}", param="tool_choice"
    )
