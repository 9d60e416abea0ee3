"""Values under keys, least recently used out first, within a count and an estimated cost: the
bookkeeping the per-session and per-call caches share."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class RecentEntries(Generic[K, V]):
    """An LRU map of values with their estimated costs (bytes), within `max_entries` entries and
    `max_bytes` of cost; a value costing more than `max_bytes // largest_share` is not kept (it would
    push out many that come back more often). Putting a key again makes it the most recent."""

    def __init__(self, max_entries: int, max_bytes: int, *, largest_share: int = 1) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._largest = max_bytes // largest_share
        self.bytes = 0  # the kept values' summed cost
        self._entries: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: K, *, touch: bool = False) -> V | None:
        """The value under `key`; with `touch`, it becomes the most recent."""
        found = self.entry(key, touch=touch)
        return None if found is None else found[0]

    def entry(self, key: K, *, touch: bool = False) -> tuple[V, int] | None:
        """The value under `key` and its cost."""
        found = self._entries.get(key)
        if found is not None and touch:
            self._entries.move_to_end(key)
        return found

    def costs(self) -> list[int]:
        return [cost for _, cost in self._entries.values()]

    def put(self, key: K, value: V, cost: int) -> None:
        """Keep `value` under `key` (in place of any before it), the oldest out past the bounds."""
        self.drop(key)
        if cost > self._largest:
            return
        self._entries[key] = (value, cost)
        self.bytes += cost
        while self.bytes > self.max_bytes or len(self._entries) > self.max_entries:
            self.drop(next(iter(self._entries)))

    def drop(self, key: K) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old[1]
