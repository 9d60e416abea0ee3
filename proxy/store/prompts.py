"""What a recorded call extends: its full token context and its conversation, rebuilt from the
deltas calls store, and kept in a bounded cache.

A call stores only the ids it added to its parent's prompt + output, only the messages it appended
to its parent's conversation, and its tools only where they are not its parent's (an agent's tool
list is tens of KB, sent again on every turn). All are rebuilt by walking the segment once, then cached;
a cached entry is dropped when a child takes over, so memory holds about one per live branch, and
the cache as a whole stays within 128 MiB and 50,000 entries (least recently used out first).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import orjson

from proxy.recent_entries import RecentEntries
from proxy.store.codec import IdArray, unpack_ids


class StoredCall(Protocol):
    """What rebuilding reads of a recorded call: an ORM row, or the turn path's lighter copy."""

    @property
    def id(self) -> int: ...
    @property
    def parent_id(self) -> int | None: ...
    @property
    def prompt_added(self) -> bytes: ...
    @property
    def output_ids(self) -> bytes: ...
    @property
    def request(self) -> dict[str, Any]: ...
    @property
    def response_message(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Recorded:
    """A call's prompt + output ids, and its conversation: the messages through its own reply."""

    ids: IdArray
    conversation: list[dict[str, Any]]
    # The ids' JSON items (b"1,2,3"), when the turn that recorded them wrote them: the next turn's
    # request body starts with them (proxy/engines/prompt_json.py).
    items: bytes | None = None
    # A digest of the JSON of the tools the call was sent with (its own, or its parent's:
    # chain_tools), which its child compares its own with: 16 bytes, where an agent's list is tens of KB.
    tools_key: bytes | None = None

    @property
    def nbytes(self) -> int:
        """The bytes of its ids and their JSON items (what the cache counts besides the texts)."""
        return self.ids.nbytes + (len(self.items) if self.items is not None else 0)


def call_messages(call: StoredCall, parent_conversation: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The request messages of `call` as recorded: a root stores them all, a continuation its appends."""
    if call.parent_id is None or "messages_added" not in call.request:
        return list(call.request["messages"])  # calls recorded before 0.1.0's delta storage hold them all
    return [*parent_conversation, *call.request["messages_added"]]


def chain_tools(chain: Sequence[StoredCall]) -> list[dict[str, Any]] | None:
    """The tools the last call of a root-to-leaf chain was sent with: the last ones stored (a
    continuation sent with its parent's stores none)."""
    tools: list[dict[str, Any]] | None = None
    for call in chain:
        tools = call.request.get("tools", tools)
    return tools


def chain_conversation(chain: Sequence[StoredCall]) -> list[dict[str, Any]]:
    """The recorded conversation of the last call of a root-to-leaf chain, its reply included."""
    conversation: list[dict[str, Any]] = []
    for call in chain:
        conversation = [*call_messages(call, conversation), call.response_message]
    return conversation


class ContextCache:
    """Recorded contexts by call id, least recently used first out, within `max_entries` entries and
    about `max_bytes` bytes: the ids, plus the characters of the conversation's texts (a message a
    child shares with its parent is counted in both, so the estimate errs high). An evicted context
    is rebuilt from the database when its branch continues."""

    def __init__(self, max_bytes: int = 128 * 1024 * 1024, max_entries: int = 50_000) -> None:
        self._entries: RecentEntries[int, Recorded] = RecentEntries(max_entries, max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def bytes(self) -> int:
        return self._entries.bytes

    def sizes(self) -> list[int]:
        return self._entries.costs()

    def get(self, call_id: int) -> Recorded | None:
        """The context recorded for the call, now the most recent."""
        return self._entries.get(call_id, touch=True)

    def put(self, call_id: int, recorded: Recorded, *, extends: int | None = None) -> None:
        """Keep `recorded`; `extends`: a cached call whose conversation it continues, so that only
        the new messages are measured (a turn then costs the same at turn 1 and turn 100)."""
        base = self._entries.entry(extends) if extends is not None else None
        if base is not None and len(recorded.conversation) >= len(base[0].conversation):
            known = len(base[0].conversation)
            size = base[1] - base[0].nbytes + recorded.nbytes
            size += text_chars(recorded.conversation[known:])
        else:
            size = recorded.nbytes + text_chars(recorded.conversation)
        self._entries.put(call_id, recorded, size)  # larger than the whole budget: not kept

    def drop(self, call_id: int) -> None:
        self._entries.drop(call_id)


def text_chars(messages: Sequence[dict[str, Any]]) -> int:
    """The characters of the messages' texts: with the ids, what an entry holds (object headers aside)."""
    size = 0
    for message in messages:
        for key in ("content", "reasoning_content"):
            value = message.get(key)
            if isinstance(value, str):
                size += len(value)
        for call in message.get("tool_calls") or ():
            size += len(str((call.get("function") or {}).get("arguments", "")))
    return size


def rebuild(rows: Sequence[StoredCall], call_id: int) -> Recorded:
    """`call_id`'s context and conversation, from the stored deltas of its segment's calls."""
    by_id = {row.id: row for row in rows}
    chain: list[StoredCall] = []
    current: int | None = call_id
    while current is not None:
        row = by_id[current]
        chain.append(row)
        current = row.parent_id
    chain.reverse()
    return extend(None, chain)


def extend(base: Recorded | None, chain: Sequence[StoredCall]) -> Recorded:
    """The context and conversation of the chain's last call: `base` (its first call's parent's,
    None when the chain starts at the segment's root), then each call's stored deltas."""
    pieces: list[IdArray] = [base.ids] if base is not None else []
    conversation = list(base.conversation) if base is not None else []
    tools_key = base.tools_key if base is not None else None
    for row in chain:
        pieces.append(unpack_ids(row.prompt_added))
        pieces.append(unpack_ids(row.output_ids))
        conversation = [*call_messages(row, conversation), row.response_message]
        if "tools" in row.request:
            tools_key = tools_key_of(row.request["tools"])
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
    return Recorded(ids=ids, conversation=conversation, tools_key=tools_key)


def tools_key_of(tools: list[dict[str, Any]] | None) -> bytes | None:
    """A digest of a tool list's JSON as orjson writes it (key order kept), which a continuation's
    must equal to inherit its parent's; None for a list it cannot write (an integer past 64 bits):
    never inherited."""
    try:
        return hashlib.blake2b(orjson.dumps(tools), digest_size=16).digest()
    except TypeError:
        return None
