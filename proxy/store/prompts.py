"""Full token contexts of recorded calls, rebuilt from stored deltas and kept in a bounded cache.

A call stores only the ids it added to its parent's prompt + output. The context a child extends
(prompt + output of its parent) is rebuilt by walking the segment once, then cached; a cached
context is dropped when a child takes over, so memory holds about one context per live branch.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from proxy.store.codec import IdArray, unpack_ids
from proxy.store.models import CallRow


class ContextCache:
    def __init__(self, max_tokens: int = 64_000_000) -> None:
        self._max_tokens = max_tokens
        self._tokens = 0
        self._contexts: OrderedDict[int, IdArray] = OrderedDict()

    def get(self, call_id: int) -> IdArray | None:
        found = self._contexts.get(call_id)
        if found is not None:
            self._contexts.move_to_end(call_id)
        return found

    def put(self, call_id: int, context: IdArray, *, replaces: int | None = None) -> None:
        if replaces is not None:
            self._drop(replaces)
        self._drop(call_id)
        self._contexts[call_id] = context
        self._tokens += len(context)
        while self._tokens > self._max_tokens and len(self._contexts) > 1:
            oldest = next(iter(self._contexts))
            self._drop(oldest)

    def _drop(self, call_id: int) -> None:
        old = self._contexts.pop(call_id, None)
        if old is not None:
            self._tokens -= len(old)


def rebuild_context(rows: Sequence[CallRow], call_id: int) -> IdArray:
    """prompt + output of `call_id`, from the stored deltas of its segment's calls."""
    by_id = {row.id: row for row in rows}
    chain: list[CallRow] = []
    current: int | None = call_id
    while current is not None:
        row = by_id[current]
        chain.append(row)
        current = row.parent_id
    pieces: list[IdArray] = []
    for row in reversed(chain):
        pieces.append(unpack_ids(row.prompt_added))
        pieces.append(unpack_ids(row.output_ids))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
