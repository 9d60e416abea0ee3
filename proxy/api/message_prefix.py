"""Chat bodies that resend a session's history: the messages it already sent are not validated again.

An agent resends its whole conversation on every turn; validating ~130 messages, then deriving their
plain and canonical forms, made a turn's cost grow with its history. Per session, the raw messages of
its last request are kept as orjson writes them: when a new body's first messages write the very same
bytes (types included: `1` is not `1.0` nor `true`), their validated models are reused and only the
new messages are validated. A tool list written the very same as the last request's is reused the
same way, with its plain form (a harness resends tens of KB of tool schemas every turn). Anything
else, an error included, takes FastAPI's full validation, so a bad body is answered exactly as before.

A body whose message list is written as orjson writes it (compact JSON: orjson, httpx, the OpenAI
SDK) is not even parsed whole: its bytes through the last known message are kept, and a next body
that starts with the very same bytes, then a comma, holds the same messages (a JSON parser reads the
same bytes the same way), so only the rest is parsed: the body with those messages cut out.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any

import orjson
from pydantic import ValidationError

from proxy.api.schemas import ChatCompletionRequest
from proxy.kept_json import own_length
from proxy.recent_entries import RecentEntries

# What an entry holds, per byte of its request's JSON and per message: the validated models, the
# plain and canonical forms and the messages' text take ~2-4x the JSON of a long history and ~1.5-2 KiB
# a message in a short one (tests/unit/test_message_prefix.py measures them with tracemalloc).
_COST_PER_BODY_BYTE = 3
_COST_PER_MESSAGE = 2048
_COST_PER_ENTRY = 4096


_MESSAGES_KEY = b'"messages":'
# Put where a resent body's known messages are cut out: the list the parser then reads as the body's
# messages must begin with this number, which no client can know (and messages are objects anyway).
_MARKER = secrets.randbits(62)
_MARKER_TEXT = b"%d" % _MARKER


@dataclass(frozen=True)
class _Known:
    # orjson's text of the raw message list; with `list_at`, the request body through its last
    # message (the list's "]" left out), whose message list opens at `list_at`.
    text: bytes
    list_at: int | None
    body: ChatCompletionRequest  # the request that sent them, validated
    tools: bytes | None  # orjson's text of its raw tool list (None: none sent, or not writable)

    @property
    def written(self) -> bytes:
        """orjson's text of the raw message list (written out from the head: a copy)."""
        if self.list_at is None:
            return self.text
        # A join, not `+`: concatenating a slice of ~100 KB took ~40 us, the join ~2.
        return b"".join((memoryview(self.text)[self.list_at :], b"]"))

    @property
    def written_size(self) -> int:
        """The length of `written`, without writing it out."""
        return len(self.text) if self.list_at is None else len(self.text) - self.list_at + 1


class MessagePrefixes(RecentEntries[str, _Known]):
    """The last request's messages of recent sessions, least recently used out first, within
    `max_entries` sessions and about `max_bytes` of memory (`bytes`: the entries' estimated cost)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 128 * 1024 * 1024) -> None:
        super().__init__(max_entries, max_bytes, largest_share=4)

    def read(self, session_id: str | None, raw: bytes) -> Any:
        """The JSON body `raw` validated (a ChatCompletionRequest), reusing the session's known
        messages, else parsed, for FastAPI to validate (and answer its errors)."""
        resent = self._resent(session_id, raw)
        if resent is not None:
            return resent
        data = orjson.loads(raw)
        validated = self.validate(session_id, data, len(raw), raw=raw)
        return data if validated is None else validated

    def _resent(self, session_id: str | None, raw: bytes) -> ChatCompletionRequest | None:
        """The body validated from its new messages alone, when it starts with the very bytes of the
        session's known ones and more messages follow; None to parse it whole."""
        known = self.get(session_id) if session_id is not None else None
        if known is None or known.list_at is None:
            return None
        end = len(known.text)
        if raw[end : end + 1] != b"," or not raw.startswith(known.text):
            return None
        # The body with the known messages cut out, a marker in their place: the parser must read
        # the marker as the list's first item, or the list cut is not the body's messages (a nested
        # one, or one of duplicate keys, of which the parser keeps the last).
        cut = b"".join((known.text[: known.list_at + 1], _MARKER_TEXT, raw[end:]))
        try:
            rest = orjson.loads(cut)
        except orjson.JSONDecodeError:
            return None  # malformed after the known messages: parsed whole, answered as before
        added = rest.get("messages") if isinstance(rest, dict) else None
        if type(added) is not list or len(added) < 2 or added[0] != _MARKER:
            return None
        rest["messages"] = added[1:]
        return self.validate(session_id, rest, len(raw), raw=raw, resent=known)

    def validate(
        self,
        session_id: str | None,
        data: Any,
        body_bytes: int = 0,
        *,
        raw: bytes | None = None,
        resent: _Known | None = None,
    ) -> ChatCompletionRequest | None:
        """The body validated, reusing the session's known messages; None when FastAPI must validate
        it (no session named, not an object with a message list, or anything invalid). `body_bytes`:
        the length of the JSON `data` was read from (what the kept request holds besides messages);
        `raw`: that JSON; `resent`: the known entry whose messages `raw` starts with (`data` then
        holds only the messages after them)."""
        messages = data.get("messages") if isinstance(data, dict) else None
        if session_id is None or type(messages) is not list or not messages:
            return None
        known = resent or self.get(session_id)
        written: bytes | None = None  # a resent body's known text: written out only if needed
        if resent is not None:
            start, added = len(resent.body.messages), messages
        else:
            start, written = _known_prefix(known, messages)
            added = messages[start:]
        tools, same_tools = _tools_written(data, known)
        unread: dict[str, Any] = {"messages": added} if start else {}
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
        self._remember(
            session_id, added, written, body=body, tools=tools, body_bytes=body_bytes, source=(raw, resent)
        )
        return body

    def _remember(
        self,
        session_id: str,
        added: list[Any],
        prefix: bytes | None,
        *,
        body: ChatCompletionRequest,
        tools: bytes | None,
        body_bytes: int,
        source: tuple[bytes | None, _Known | None],
    ) -> None:
        """Keep the body's messages: `prefix`, the known ones' text (b"" for none; None: those of
        `source`'s known entry), then `added`; `source`: the JSON it was read from, and the known
        entry it starts with, if it does."""
        tail = _written(added)
        self.drop(session_id)
        if tail is None:
            return
        text, resent = source
        known_size = len(prefix) if prefix is not None else resent.written_size if resent else 0
        # orjson writes a list as "[" + its items joined by "," + "]".
        size = known_size + len(tail) if known_size else len(tail)
        cost = (
            _COST_PER_BODY_BYTE * max(body_bytes, size)
            + len(tools or b"")
            + _COST_PER_MESSAGE * len(body.messages)
            + _COST_PER_ENTRY
        )
        if cost > self.max_bytes // 4:
            return  # not kept (RecentEntries would refuse it too): spares writing its text out
        kept = _resent_head(text, tail, resent) if text is not None and resent is not None else None
        if kept is None:
            if prefix is None:
                prefix = resent.written if resent is not None else b""
            # A join is a new object of its own length; orjson's own result is not (kept_json.py).
            written = (
                b"".join((memoryview(prefix)[:-1], b",", memoryview(tail)[1:]))
                if prefix
                else own_length(tail)
            )
            kept = _head(text, written) if text is not None else None
            kept = kept or (written, None)
        self.put(session_id, _Known(kept[0], kept[1], body, tools), cost)


def _tools_written(data: dict[str, Any], known: _Known | None) -> tuple[bytes | None, bool]:
    """The body's tool list as orjson writes it, and whether it is the known request's, written the
    same (not validated again then). A known list keeps the text already kept for it; a new one is
    copied to its own length (orjson's result is not: kept_json.py)."""
    raw_tools = data.get("tools")
    tools = _written(raw_tools) if type(raw_tools) is list and raw_tools else None
    if known is not None and tools is not None and tools == known.tools:
        return known.tools, True
    return (own_length(tools) if tools is not None else None), False


def _known_prefix(known: _Known | None, messages: list[Any]) -> tuple[int, bytes]:
    """How many of `messages` are the known entry's, written the very same, and their text."""
    if known is None or len(known.body.messages) >= len(messages):
        return 0, b""
    prefix = _written(messages[: len(known.body.messages)])
    if prefix is None or prefix != known.written:
        return 0, b""
    return len(known.body.messages), prefix


def _resent_head(raw: bytes, tail: bytes, resent: _Known) -> tuple[bytes, int | None] | None:
    """The body `raw`, which starts with `resent`'s head and a comma, through its last message, when
    its new messages are written as orjson writes them (`tail`)."""
    end = len(resent.text) + len(tail) - 1
    if raw[len(resent.text) + 1 : end] != tail[1:-1] or raw[end : end + 1] != b"]":
        return None
    return raw[:end], resent.list_at


def _head(raw: bytes, written: bytes) -> tuple[bytes, int | None] | None:
    """The body `raw` through its last message, and where its message list opens, when a "messages"
    key in it holds the list as orjson writes it (`written`); None otherwise (the next body is then
    parsed whole). Should that key be another than the one the parser read (nested, or one of
    duplicates), the next body's marker tells (_resent)."""
    at = raw.find(b"".join((_MESSAGES_KEY, memoryview(written)[:-1])))
    list_at = at + len(_MESSAGES_KEY)
    end = list_at + len(written) - 1
    if at < 0 or raw[end : end + 1] != b"]":
        return None
    return raw[:end], list_at


def _written(value: list[Any]) -> bytes | None:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson cannot write (an integer past 64 bits) is never reused
        return None
