"""Chat messages as plain dicts: the shape templates read, and the canonical form that matching compares."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import orjson

from proxy.errors import JsonNestingTooDeep
from proxy.json_limits import MAX_JSON_DEPTH, too_deep
from proxy.kept_json import kept_dumps

Message = dict[str, Any]

# Set by a dialect on an echoed assistant message whose reasoning carries a seal we did not issue
# (an Anthropic thinking signature, a Responses encrypted_content).
UNVERIFIED_REASONING = "reasoning_unverified"


def parse_arguments(arguments: Any) -> Any:
    """Tool-call arguments as a value: OpenAI sends a JSON string, templates want the object.
    Text that is not JSON stays text; JSON nested past the cap is refused (matching and rendering
    walk it)."""
    if isinstance(arguments, str):
        try:
            value = orjson.loads(arguments)
        except orjson.JSONDecodeError as exc:
            if "depth limit" in str(exc):
                raise _too_deep() from exc
            return arguments
        # Depth is at most the count of opening brackets: most arguments need no walk at all.
        if arguments.count("[") + arguments.count("{") > MAX_JSON_DEPTH and too_deep(value):
            raise _too_deep()
        return value
    return arguments


def _too_deep() -> JsonNestingTooDeep:
    return JsonNestingTooDeep(
        f"tool-call arguments are nested deeper than {MAX_JSON_DEPTH} levels", param="messages"
    )


CallsOnlyContent = Literal["none", "empty", "absent"]


def for_template(
    message: Mapping[str, Any],
    *,
    arguments_as: str = "object",
    calls_only_content: CallsOnlyContent = "none",
) -> Message:
    """The message in the shape the served template expects (the probe finds it): arguments as
    objects, as SGLang and vLLM pass them, unless the template concatenates them as text (DeepSeek);
    the content of an assistant turn that only called tools as the template needs it to render the
    calls (None for DeepSeek, which renders calls only when content is none; "" where None would
    print "None" or fail). Keys holding None are dropped first, as transformers does."""
    out = {k: v for k, v in message.items() if v is not None}
    calls = message.get("tool_calls")
    if out.get("role") == "assistant" and out.get("content") in (None, ""):
        if not calls:
            # "" and None are the same message (decision 2); Qwen3 and others fail on a missing content.
            out["content"] = ""
        elif calls_only_content == "none":
            out["content"] = None
        elif calls_only_content == "empty":
            out["content"] = ""
        else:
            out.pop("content", None)
    if calls:
        out["tool_calls"] = [
            {
                "id": call.get("id"),
                "type": "function",
                "function": {
                    "name": call["function"]["name"],
                    "arguments": parse_arguments(call["function"].get("arguments"))
                    if arguments_as == "object"
                    else _arguments_text(call["function"].get("arguments")),
                },
            }
            for call in calls
        ]
    return out


def _arguments_text(arguments: Any) -> str:
    # The client's own string is kept; an object is written as Python's json.dumps writes it.
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _canonical_call(call: Mapping[str, Any]) -> list[Any]:
    function = call.get("function") or {}
    return [call.get("id"), function.get("name"), parse_arguments(function.get("arguments"))]


def canonical(message: Mapping[str, Any]) -> list[Any]:
    """What makes two messages "the same" (decision 2): role, content ("" == None), tool calls with
    arguments compared as parsed JSON, tool_call_id, name. Reasoning is compared separately."""
    content = message.get("content")
    return [
        message.get("role"),
        content if content else None,
        [_canonical_call(c) for c in message.get("tool_calls") or []],
        message.get("tool_call_id"),
        message.get("name"),
    ]


def history_key(
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    """A digest of a conversation under the matching rules, plus what else shapes its render."""
    return key_of_canonical([canonical(m) for m in messages], tools, template_kwargs)


def key_of_canonical(
    canonical_messages: Sequence[list[Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    """history_key of messages already in canonical form: a turn keys its request and its reply."""
    payload = [list(canonical_messages), list(tools or []), dict(template_kwargs or {})]
    return hashlib.sha256(orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)).hexdigest()


def canonical_json(message: Mapping[str, Any]) -> bytes:
    """A message's canonical form as history keys write it; a request's unchanged history keeps its
    own (proxy/api/message_prefix.py), so a key costs one hash, not a walk of every message."""
    # Kept for the session's next request (message_prefix.py): copied to its own length.
    return kept_dumps(canonical(message), option=orjson.OPT_SORT_KEYS)


def key_of_json(
    canonical_parts: Sequence[bytes],
    tools: Sequence[Mapping[str, Any]] | None,
    template_kwargs: Mapping[str, Any] | None,
) -> str:
    """key_of_canonical from each message's canonical_json: the same bytes are hashed (orjson writes
    a list as its items' own texts joined by commas, without spaces)."""
    digest = hashlib.sha256(b"[[")
    digest.update(b",".join(canonical_parts))
    return _closed_key(digest, tools, template_kwargs)


def _closed_key(
    digest: Any, tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any] | None
) -> str:
    """The key from a digest of `[[` and the messages' parts: the list closed, tools and kwargs added."""
    digest.update(b"],")
    digest.update(orjson.dumps(list(tools or []), option=orjson.OPT_SORT_KEYS))
    digest.update(b",")
    digest.update(orjson.dumps(dict(template_kwargs or {}), option=orjson.OPT_SORT_KEYS))
    digest.update(b"]")
    return str(digest.hexdigest())


class HistoryHash:
    """key_of_json over a request's canonical parts, each part hashed once and the running digest
    handed on: a session's next request, which resends these parts first, starts from it rather than
    hash its whole history (~100 KB by turn 64) twice a turn."""

    def __init__(self, parts: Sequence[bytes], start: HistoryHash | None = None) -> None:
        """`start`: the hash of an earlier request whose parts are the first of `parts`."""
        self.parts = parts
        self._count, self._state = 0, hashlib.sha256(b"[[")
        # The text that closes a key: the tools and kwargs it was last written for (the very same
        # objects: a request keys its history and its call with them, and a session's next request
        # resends the same tool list, which proxy/api/message_prefix.py hands on as it is).
        self._closing: tuple[object, object, bytes] | None = None
        if start is not None:
            self._closing = start._closing
            if start._count <= len(parts):
                self._count, self._state = start._count, start._state.copy()

    def key(
        self,
        count: int,
        tail: bytes | None,
        tools: Sequence[Mapping[str, Any]] | None,
        template_kwargs: Mapping[str, Any] | None,
    ) -> str:
        """key_of_json of the first `count` parts, then `tail` (a reply's canonical_json) if given."""
        if count < self._count:  # behind the running digest (never on a continued turn)
            return key_of_json(
                [*self.parts[:count], *([tail] if tail is not None else [])], tools, template_kwargs
            )
        for part in self.parts[self._count : count]:
            if self._count:
                self._state.update(b",")
            self._state.update(part)
            self._count += 1
        digest = self._state.copy()
        if tail is not None:
            digest.update(b"," + tail if count else tail)
        digest.update(self._closing_text(tools, template_kwargs))
        return str(digest.hexdigest())

    def _closing_text(
        self, tools: Sequence[Mapping[str, Any]] | None, template_kwargs: Mapping[str, Any] | None
    ) -> bytes:
        """What _closed_key adds after the messages, written once for the same tools and kwargs."""
        known = self._closing
        if known is not None and known[0] is tools and known[1] is template_kwargs:
            return known[2]
        text = b"".join(
            (
                b"],",
                orjson.dumps(list(tools or []), option=orjson.OPT_SORT_KEYS),
                b",",
                orjson.dumps(dict(template_kwargs or {}), option=orjson.OPT_SORT_KEYS),
                b"]",
            )
        )
        self._closing = (tools, template_kwargs, text)
        return text


def reasoning_consistent(echoed: Mapping[str, Any], recorded: Mapping[str, Any]) -> bool:
    """A missing reasoning_content counts as unchanged (clients drop it); a present one must be ours."""
    if echoed.get(UNVERIFIED_REASONING):
        return False  # a dialect could not prove this reasoning is what we sampled: an edit
    sent = echoed.get("reasoning_content")
    if sent is None:
        return True
    return bool(sent == (recorded.get("reasoning_content") or ""))
