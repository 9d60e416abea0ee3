"""A session's last input, converted: a next request that resends the same items first converts only
the items after them (the Anthropic and Responses dialects).

Claude Code and Codex resend their whole conversation on every turn. Converting ~130 items to the
turn core's messages, then writing each message's canonical form, made a turn's cost grow with its
history (~0.45 ms at turn 64). Items count as the same when orjson writes them to the very same bytes
(types included: `1` is not `1.0` nor `true`), and so does the request's context: whatever the
conversion reads besides the items (the system text before them). The conversion of an item is a
function of the item, the context and the state the items before it left (the dialect's `carry`),
so the known items' messages are theirs again; the dialect decides where a conversion is settled
(no later item can change a message made so far) and keeps it only there.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.chat.messages import HistoryHash, Message, canonical_json
from proxy.kept_json import own_length

# What an entry holds besides its items' text, estimated high (the messages share their strings
# with the request that made them; the canonical forms are about the items' size again).
_COST_PER_ITEM_BYTE = 3
_COST_PER_MESSAGE = 1024
_COST_PER_ENTRY = 4096


@dataclass(frozen=True)
class Converted:
    """The first `count` items of a session's last request, converted."""

    context: bytes  # orjson's text of what the conversion read besides the items
    items: bytes  # orjson's text of those items (a list)
    count: int
    messages: list[Message]  # the turn core's messages they make, the context's first
    canonical: list[bytes]  # each message's canonical_json
    # The running hash over `canonical`, when they were all of the request's messages: a request
    # that resends them starts its history hash from it (HistoryHash's `start`).
    hash: HistoryHash | None
    carry: Any  # the dialect's conversion state after these items
    cost: int


@dataclass(frozen=True)
class Forms:
    """A request's messages with their canonical forms and running hash, as TurnRequest takes them
    (None: derived by the turn core)."""

    messages: list[Message]
    canonical: list[bytes] | None
    hash: HistoryHash | None


def forms_of(messages: list[Message], known: Converted | None) -> Forms:
    """`messages`' forms; the first ones, when they are `known`'s, are not written again."""
    if known is None:
        canonical = [canonical_json(m) for m in messages]
        return Forms(messages, canonical, HistoryHash(canonical))
    added = (canonical_json(m) for m in messages[len(known.messages) :])
    canonical = [*known.canonical, *added]
    return Forms(messages, canonical, HistoryHash(canonical, start=known.hash))


class ConvertedHistories:
    """The last request's conversion of recent sessions, least recently used out first, within
    `max_entries` sessions and about `max_bytes` of memory (`bytes`: the entries' estimated cost)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 128 * 1024 * 1024) -> None:
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[str, Converted] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def find(self, session_id: str | None, context: bytes, items: list[Any]) -> Converted | None:
        """The session's known conversion when `items` start with its items, written the very same,
        and more follow, under the same context; else None (convert them all)."""
        known = self._entries.get(session_id) if session_id is not None else None
        if known is None or known.count >= len(items) or known.context != context:
            return None
        if written(items[: known.count]) != known.items:
            return None
        return known

    def keep(
        self,
        session_id: str | None,
        context: bytes,
        items: list[Any],
        forms: Forms,
        settled: tuple[int, int, Any],
    ) -> None:
        """Remember the request's conversion up to `settled`: (items, messages, carry) at the last
        point no later item can change (all of them, for a request whose conversion ended settled)."""
        if session_id is None:
            return
        self.drop(session_id)
        count, made, carry = settled
        text = written(items[:count]) if count else None
        if text is None:
            return
        if forms.canonical is None:
            return
        whole = made == len(forms.messages)
        cost = _COST_PER_ITEM_BYTE * (len(text) + len(context)) + _COST_PER_MESSAGE * made + _COST_PER_ENTRY
        if cost > self._max_bytes // 4:
            return
        entry = Converted(
            own_length(context),
            own_length(text),
            count,
            forms.messages[:made],
            forms.canonical[:made],
            forms.hash if whole else None,
            carry,
            cost,
        )
        self._entries[session_id] = entry
        self.bytes += cost
        while self.bytes > self._max_bytes or len(self._entries) > self._max_entries:
            self.drop(next(iter(self._entries)))

    def drop(self, session_id: str) -> None:
        old = self._entries.pop(session_id, None)
        if old is not None:
            self.bytes -= old.cost


def written(value: Any) -> bytes | None:
    """orjson's text of a request's value; None for what orjson cannot write (an integer past 64 bits:
    never reused)."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return None
