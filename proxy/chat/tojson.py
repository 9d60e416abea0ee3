"""The chat templates' `tojson` filter: plain json.dumps, with the dumps of dicts and lists cached.

A template dumps the request's tool list, tool by tool, on every render that holds it, and an RL run
sends the same list with every request. A dump depends only on the value and the arguments, so it is
kept under their pickle, which tells apart every value and type json.dumps does (1, 1.0 and True;
NaN and None; key order). Strings and numbers are dumped directly: that is cheaper than a key.
"""

from __future__ import annotations

import json
import pickle
from typing import Any

from proxy.chat.bounded_texts import BoundedTexts

MAX_ENTRIES = 4096
MAX_CHARS = 4 * 1024 * 1024


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
        self._dumps = BoundedTexts(max_entries=max_entries, max_chars=max_chars)

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
        found = self._dumps.get(key)
        if found is not None:
            return found
        text = tojson(value, *arguments)
        self._dumps.put(key, text)
        return text

    def clear(self) -> None:
        """Forget every dump (bench.rerender times cold renders with it)."""
        self._dumps.clear()

    def cached(self) -> tuple[int, int]:
        """Entries and characters (key bytes plus text) held now."""
        return self._dumps.cached()
