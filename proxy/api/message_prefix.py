"""Chat bodies that resend a session's history: the messages it already sent are not validated again.

An agent resends its whole conversation on every turn; validating ~130 messages, then deriving their
plain and canonical forms, made a turn's cost grow with its history. Per session, the raw messages of
its last request are kept as orjson writes them: when a new body's first messages write the very same
bytes (types included: `1` is not `1.0` nor `true`), their validated models are reused and only the
new messages are validated. A tool list written the very same as the last request's is reused the
same way, with its plain form (a harness resends tens of KB of tool schemas every turn). Anything
else, an error included, takes FastAPI's full validation, so a bad body is answered exactly as before.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from proxy.api.schemas import ChatCompletionRequest
from proxy.kept_json import own_length

# What an entry holds, per byte of its request's JSON and per message: the validated models, the
# plain and canonical forms and the messages' text take ~2-4x the JSON of a long history and ~1.5-2 KiB
# a message in a short one (tests/unit/test_message_prefix.py measures them with tracemalloc).
_COST_PER_BODY_BYTE = 3
_COST_PER_MESSAGE = 2048
_COST_PER_ENTRY = 4096


@dataclass(frozen=True)
class _Known:
    written: bytes  # orjson's text of the raw message list
    body: ChatCompletionRequest  # the request that sent them, validated
    tools: bytes | None  # orjson's text of its raw tool list (None: none sent, or not writable)
    cost: int  # the memory it holds, estimated high


class MessagePrefixes:
    """The last request's messages of recent sessions, least recently used out first, within
    `max_entries` sessions and about `max_bytes` of memory (`bytes`: the entries' estimated cost)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 128 * 1024 * 1024) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, _Known] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def validate(
        self, session_id: str | None, data: Any, body_bytes: int = 0
    ) -> ChatCompletionRequest | None:
        """The body validated, reusing the session's known messages; None when FastAPI must validate
        it (no session named, not an object with a message list, or anything invalid). `body_bytes`:
        the length of the JSON `data` was read from (what the kept request holds besides messages)."""
        messages = data.get("messages") if isinstance(data, dict) else None
        if session_id is None or type(messages) is not list or not messages:
            return None
        known = self._entries.get(session_id)
        start, written = 0, b""
        if known is not None and len(known.body.messages) < len(messages):
            prefix = _written(messages[: len(known.body.messages)])
            if prefix is not None and prefix == known.written:
                start, written = len(known.body.messages), prefix
        # The same tool list, written the same, is the previous request's: not validated again.
        raw_tools = data.get("tools")
        tools = _written(raw_tools) if type(raw_tools) is list and raw_tools else None
        same_tools = known is not None and tools is not None and tools == known.tools
        unread: dict[str, Any] = {}
        if start:
            unread["messages"] = messages[start:]
        if same_tools:
            unread["tools"] = None
        try:
            body = ChatCompletionRequest.model_validate({**data, **unread} if unread else data)
        except ValidationError:
            return None
        if start:
            assert known is not None
            body.messages = [*known.body.messages, *body.messages]
            body.reuse_forms(known.body)
        if same_tools:
            assert known is not None
            body.reuse_tools(known.body)
        # A reused tool list keeps the text already kept for it; a new one is copied to its own
        # length (orjson's result is not: kept_json.py).
        if same_tools and known is not None:
            kept_tools = known.tools
        else:
            kept_tools = own_length(tools) if tools is not None else None
        self._remember(
            session_id, messages, start, written, body=body, tools=kept_tools, body_bytes=body_bytes
        )
        return body

    def _remember(
        self,
        session_id: str,
        raw: list[Any],
        start: int,
        prefix: bytes,
        *,
        body: ChatCompletionRequest,
        tools: bytes | None,
        body_bytes: int,
    ) -> None:
        tail = _written(raw[start:])
        self.drop(session_id)
        if tail is None:
            return
        # orjson writes a list as "[" + its items joined by "," + "]". A concatenation is a new object
        # of its own length; orjson's own result is not (kept_json.py).
        written = prefix[:-1] + b"," + tail[1:] if start else own_length(tail)
        cost = (
            _COST_PER_BODY_BYTE * max(body_bytes, len(written))
            + len(tools or b"")
            + _COST_PER_MESSAGE * len(raw)
            + _COST_PER_ENTRY
        )
        if cost > self._max_bytes // 4:
            return
        self._entries[session_id] = _Known(written, body, tools, cost)
        self.bytes += cost
        while self.bytes > self._max_bytes or len(self._entries) > self._max_entries:
            self.drop(next(iter(self._entries)))

    def drop(self, session_id: str) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self.bytes -= old.cost


def _written(value: list[Any]) -> bytes | None:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson cannot write (an integer past 64 bits) is never reused
        return None
