"""A session's last input, converted: its next request converts only the items it did not send the
very same (the Anthropic and Responses dialects).

Claude Code and Codex resend their whole conversation on every turn. Converting ~130 items to the
turn core's messages, then writing each message's canonical form, made a turn's cost grow with its
history (~0.5 ms at turn 64). An item counts as the same when orjson writes it to the very same bytes
(types included: `1` is not `1.0` nor `true`) at the same position. Not all of a history need be:
Claude Code moves its `cache_control` markers from message to message between turns, and sends one
mid-conversation system message as blocks on one turn and as a string on the next; only the items
that changed are converted again. Which converted items a dialect may take again is its own rule:
an Anthropic message that read the tool list (a tool_reference) is always converted again; Responses
items, which join the assistant turn before them, only as the leading run the previous request sent
the same, back to the last item after which no assistant turn was open. The history's running hash
goes on from the previous request's when the canonical forms start with all of its.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.chat.messages import HistoryHash, Message, canonical_json
from proxy.kept_json import own_length
from proxy.recent_entries import RecentEntries

# What an entry holds besides its items' text, estimated high (the messages share their strings
# with the request that made them; the canonical forms are about the items' size again).
_COST_PER_ITEM_BYTE = 3
_COST_PER_MESSAGE = 1024
_COST_PER_ENTRY = 4096


@dataclass(frozen=True)
class Converted:
    """A session's last request, converted."""

    context: bytes  # the dialect and what its conversion read besides the items
    texts: list[bytes | None]  # each item as orjson writes it (None: it cannot be written)
    # Per item, the index of its first message, and after the last item the messages' count; None
    # where no message starts with the item (it joined an open assistant turn).
    starts: list[int | None]
    reusable: list[bool]  # per item, whether its messages may be taken again for the same item
    messages: list[Message]  # the turn core's messages (the context's first)
    canonical: list[bytes]  # each message's canonical_json
    hash: HistoryHash  # the running hash over `canonical` the request keyed its history with


@dataclass(frozen=True)
class Forms:
    """A request's messages with their canonical forms and running hash, as TurnRequest takes them."""

    messages: list[Message]
    canonical: list[bytes]
    hash: HistoryHash


def item_texts(items: Sequence[Any]) -> list[bytes | None]:
    """Each item as orjson writes it; None for one orjson cannot write (an integer past 64 bits),
    which is then never taken again."""
    try:
        return list(map(orjson.dumps, items))
    except TypeError:
        return [_text(item) for item in items]


def _text(item: Any) -> bytes | None:
    try:
        return orjson.dumps(item)
    except TypeError:
        return None


class ItemByItem:
    """A conversion where each item makes its own messages, taking again those of the items the known
    request sent the very same at the same place (where the dialect allows it)."""

    def __init__(self, known: Converted | None, texts: list[bytes | None], first: list[Message]) -> None:
        self.known, self.texts = known, texts
        self.messages = list(first)
        self.canonical: list[bytes | None] = [None] * len(first)
        self.starts: list[int | None] = []
        self.reusable: list[bool] = []
        self.kept: list[bytes | None] = []  # each item's text as the next entry keeps it

    def take_again(self, index: int) -> int:
        """How many items from `index` on are the known request's, written the very same, with
        messages that may be taken again; their messages are added (a run at once: a turn-64
        history is ~130 items)."""
        known = self.known
        if known is None:
            return 0
        texts, last = self.texts, index
        end = min(len(texts), len(known.texts))
        while (
            last < end
            and known.reusable[last]
            and texts[last] is not None
            and texts[last] == known.texts[last]
        ):
            last += 1
        if last == index:
            return 0
        first, after = known.starts[index], known.starts[last]
        assert first is not None  # an item-by-item conversion knows where each item starts
        assert after is not None
        shift = len(self.messages) - first
        self.starts += [start + shift if start is not None else None for start in known.starts[index:last]]
        self.reusable += known.reusable[index:last]
        self.kept += known.texts[index:last]
        self.messages += known.messages[first:after]
        self.canonical += known.canonical[first:after]
        return last - index

    def add(self, index: int, made: list[Message], *, reusable: bool) -> None:
        """The messages item `index` (the next one) made (`reusable`: its next sending may take them
        again)."""
        assert index == len(self.starts)
        text = self.texts[index]
        self.starts.append(len(self.messages))
        self.reusable.append(reusable and text is not None)
        self.kept.append(own_length(text) if text is not None else None)
        self.messages += made
        self.canonical += [None] * len(made)

    def finished(self, context: bytes) -> tuple[Forms, Converted]:
        """The request's forms, and its conversion as the session's next request may use it."""
        forms = forms_of(self.messages, self.canonical, self.known)
        starts = [*self.starts, len(self.messages)]
        made = Converted(
            context, self.kept, starts, self.reusable, forms.messages, forms.canonical, forms.hash
        )
        return forms, made


def converted(
    forms: Forms,
    context: bytes,
    known: Converted | None,
    texts: list[bytes | None],
    *,
    taken: int,
    starts: list[int | None],
) -> Converted:
    """The conversion a session's next request may take items from: `forms` with each item's text
    (the first `taken` are the known request's own; the rest kept to their own length) and where
    its messages start."""
    kept = [
        *(known.texts[:taken] if known is not None else []),
        *(own_length(t) if t is not None else None for t in texts[taken:]),
    ]
    # Never one by one: items join the assistant turn before them (only a leading run is taken).
    reusable = [False] * len(texts)
    return Converted(context, kept, starts, reusable, forms.messages, forms.canonical, forms.hash)


def forms_of(messages: list[Message], canonical: list[bytes | None], known: Converted | None) -> Forms:
    """The messages' forms, `canonical` holding those already known (None for the rest); the history
    hash goes on from the known request's when its messages' forms are the first of these."""
    written = [
        part if part is not None else canonical_json(m) for part, m in zip(canonical, messages, strict=True)
    ]
    start = known.hash if known is not None and _starts_with(written, known.canonical) else None
    return Forms(messages, written, HistoryHash(written, start=start))


def _starts_with(parts: list[bytes], prefix: list[bytes]) -> bool:
    # Taken-again parts are the very objects: `is` settles most of them without comparing bytes.
    return len(parts) >= len(prefix) and all(a is b or a == b for a, b in zip(parts, prefix, strict=False))


class ConvertedHistories(RecentEntries[str, Converted]):
    """The last request's conversion of recent sessions, least recently used out first, within
    `max_entries` sessions and about `max_bytes` of memory (`bytes`: the entries' estimated cost)."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 128 * 1024 * 1024) -> None:
        super().__init__(max_entries, max_bytes, largest_share=4)

    def find(self, session_id: str | None, context: bytes) -> Converted | None:
        """The session's last conversion, if it was made under the same context."""
        found = self.get(session_id) if session_id is not None else None
        return found if found is not None and found.context == context else None

    def keep(self, session_id: str | None, converted: Converted) -> None:
        """Remember the session's request's conversion (none for a session never named again)."""
        if session_id is None:
            return
        size = len(converted.context) + sum(len(text) for text in converted.texts if text is not None)
        cost = _COST_PER_ITEM_BYTE * size + _COST_PER_MESSAGE * len(converted.messages) + _COST_PER_ENTRY
        self.put(session_id, converted, cost)
