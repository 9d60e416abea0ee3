"""Prompt ids that carry their JSON text: a long context is written out once, and each later turn's
request body only appends its new ids to it (a 33k-token prompt took ~0.2 ms to write every turn).

The planner writes a prompt's items (b"1,2,3") from its recorded context's and its new ids', the
recorder a context's from its prompt's and the sampled ids'. The engine call gets the prompt as an
array that carries them (an ndarray subclass), so every wrapper between the turn core and the wire
passes them on untouched; an array derived from it in any way (a slice, a concatenation) carries
none, and is written from its values as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson

from proxy.store.codec import IdArray


class WrittenIds(np.ndarray):
    """int32 ids with `items`: their JSON array's items, without its brackets (b"1,2,3")."""

    items: bytes | None = None

    def __array_finalize__(self, obj: Any) -> None:
        # A view or slice of written ids is other ids: it never inherits their text.
        self.items = None


def items_of(ids: Sequence[int] | IdArray) -> bytes:
    """The JSON items of `ids` (b"1,2,3"; b"" when empty): the carried text, else written now."""
    if isinstance(ids, WrittenIds):
        if ids.items is not None:
            return ids.items
        ids = ids.view(np.ndarray)
    return orjson.dumps(np.ascontiguousarray(ids, dtype=np.int32), option=orjson.OPT_SERIALIZE_NUMPY)[1:-1]


def joined(head: bytes, tail: bytes) -> bytes:
    """Two arrays' JSON items as one array's."""
    if not head:
        return tail
    if not tail:
        return head
    return b"".join((head, b",", tail))


def with_items(ids: IdArray, items: bytes | None) -> IdArray:
    """`ids` carrying `items`, which must be their JSON items (the callers build both from the same
    parts); `ids` as they are without."""
    if items is None:
        return ids
    written: WrittenIds = np.asarray(ids, dtype=np.int32).view(WrittenIds)
    written.items = items
    return written


def json_value(ids: Any) -> Any:
    """What a request body holds for these ids: their carried text as a ready JSON fragment, else the
    ids themselves, for the body's serializer (which takes a plain ndarray, not a subclass)."""
    if isinstance(ids, WrittenIds):
        if ids.items is not None:
            return orjson.Fragment(b"".join((b"[", ids.items, b"]")))
        return ids.view(np.ndarray)
    return ids
