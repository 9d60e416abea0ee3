"""The chat templates' `tojson` filter: plain json.dumps, with the dumps of dicts and lists cached.

A template dumps the request's tool list, tool by tool, on every render that holds it, and an RL run
sends the same list with every request. A dump depends only on the value and the arguments, so it is
kept under their pickle, which tells apart every value and type json.dumps does (1, 1.0 and True;
NaN and None; key order). Strings and numbers are dumped directly: that is cheaper than a key.
"""

from __future__ import annotations

import json
import pickle
import threading
from collections import OrderedDict
from typing import Any

MAX_ENTRIES = 4096
MAX_CHARS = 4 * 1024 * 1024
# A dump larger than this share of MAX_CHARS is not kept.
_LARGEST_SHARE = 8


def tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters; chat templates expect plain json.dumps.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class CachedToJson:
    """`tojson` with its dumps of dicts and lists kept, bounded by entries and characters."""

    def __init__(self, *, max_entries: int = MAX_ENTRIES, max_chars: int = MAX_CHARS) -> None:
        self.max_entries, self.max_chars = max_entries, max_chars
        self._dumps: OrderedDict[bytes, str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()  # renders of large requests run on worker threads

    def __call__(
        self,
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: tuple[str, str] | None = None,
        sort_keys: bool = False,
    ) -> str:
        arguments = (ensure_ascii, indent, separators, sort_keys)
        if type(value) is not dict and type(value) is not list:
            return tojson(value, *arguments)
        try:
            key = pickle.dumps((value, arguments), protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError, RecursionError):
            return tojson(value, *arguments)
        with self._lock:
            found = self._dumps.get(key)
            if found is not None:
                self._dumps.move_to_end(key)
                return found
        text = tojson(value, *arguments)
        self._keep(key, text)
        return text

    def _keep(self, key: bytes, text: str) -> None:
        size = len(key) + len(text)
        if size * _LARGEST_SHARE > self.max_chars:
            return
        with self._lock:
            if key in self._dumps:
                return
            while self._dumps and (
                len(self._dumps) >= self.max_entries or self._chars + size > self.max_chars
            ):
                old_key, old_text = self._dumps.popitem(last=False)
                self._chars -= len(old_key) + len(old_text)
            self._dumps[key] = text
            self._chars += size

    def clear(self) -> None:
        """Forget every dump (bench.rerender times cold renders with it)."""
        with self._lock:
            self._dumps.clear()
            self._chars = 0

    def cached(self) -> tuple[int, int]:
        """Entries and characters (key bytes plus text) held now."""
        with self._lock:
            return len(self._dumps), self._chars
