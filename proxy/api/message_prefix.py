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


@dataclass(frozen=True)
class _Known:
    written: bytes  # orjson's text of the raw message list
    body: ChatCompletionRequest  # the request that sent them, validated
    tools: bytes | None  # orjson's text of its raw tool list (None: none sent, or not writable)


class MessagePrefixes:
    """The last request's messages of recent sessions, least recently used out first, within
    `max_entries` sessions and about `max_bytes` of message text."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 * 1024 * 1024) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, _Known] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def validate(self, session_id: str | None, data: Any) -> ChatCompletionRequest | None:
        """The body validated, reusing the session's known messages; None when FastAPI must validate
        it (no session named, not an object with a message list, or anything invalid)."""
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
        self._remember(session_id, messages, start, written, body, tools=tools)
        return body

    def _remember(
        self,
        session_id: str,
        raw: list[Any],
        start: int,
        prefix: bytes,
        body: ChatCompletionRequest,
        *,
        tools: bytes | None,
    ) -> None:
        tail = _written(raw[start:])
        self.drop(session_id)
        if tail is None:
            return
        # orjson writes a list as "[" + its items joined by "," + "]".
        written = prefix[:-1] + b"," + tail[1:] if start else tail
        if len(written) + len(tools or b"") > self._max_bytes // 4:
            return
        self._entries[session_id] = _Known(written, body, tools)
        self.bytes += len(written) + len(tools or b"")
        while self.bytes > self._max_bytes or len(self._entries) > self._max_entries:
            self.drop(next(iter(self._entries)))

    def drop(self, session_id: str) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self.bytes -= len(old.written) + len(old.tools or b"")


def _written(value: list[Any]) -> bytes | None:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson cannot write (an integer past 64 bits) is never reused
        return None
