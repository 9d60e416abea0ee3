"""Texts under exact byte keys, least recently used out first, bounded by entries and characters."""

from __future__ import annotations

import threading
from collections import OrderedDict

# A text larger than this share of the bound (a long history rendered afresh) is not kept: it would
# push out many small ones that come back far more often.
_LARGEST_SHARE = 8


class BoundedTexts:
    """An LRU map of bytes keys to texts, within `max_entries` entries and `max_chars` characters
    (key bytes plus text). Thread-safe: renders of large requests run on worker threads."""

    def __init__(self, *, max_entries: int, max_chars: int) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._texts: OrderedDict[bytes, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def get(self, key: bytes) -> str | None:
        with self._lock:
            text = self._texts.get(key)
            if text is not None:
                self._texts.move_to_end(key)
            return text

    def put(self, key: bytes, text: str) -> None:
        size = len(key) + len(text)
        if size * _LARGEST_SHARE > self.max_chars:
            return
        with self._lock:
            if key in self._texts:
                return
            while self._texts and (
                len(self._texts) >= self.max_entries or self._chars + size > self.max_chars
            ):
                old_key, old_text = self._texts.popitem(last=False)
                self._chars -= len(old_key) + len(old_text)
            self._texts[key] = text
            self._chars += size

    def clear(self) -> None:
        """Forget every text (bench.rerender times cold renders with it)."""
        with self._lock:
            self._texts.clear()
            self._chars = 0

    def cached(self) -> tuple[int, int]:
        """Entries and characters (key bytes plus text) held now."""
        with self._lock:
            return len(self._texts), self._chars
