"""JSON text that outlives its request, copied to its own length before it is kept.

orjson hands back each result in the buffer it wrote into, which it does not shrink: ~4 KiB for a
two-key object, ~10x the text for a few KB. A cache of such results holds ten times what it counts,
so text that is kept (a session's messages, their canonical forms) is copied once to its exact size.
"""

from __future__ import annotations

from typing import Any

import orjson


def kept_dumps(value: Any, option: int | None = None) -> bytes:
    """orjson.dumps(value, option=option) in a bytes object of exactly its length."""
    return own_length(orjson.dumps(value, option=option))


def own_length(text: bytes) -> bytes:
    """`text` copied into a bytes object of exactly its length (bytes(text) would be text itself)."""
    return bytes(memoryview(text))
