"""A JSON column that SQLite holds compressed once it is long: a call's request, mostly message text."""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from typing import Any

import orjson
from sqlalchemy import JSON
from sqlalchemy.engine import Dialect
from sqlalchemy.types import TypeDecorator

# Shorter texts are kept as they are (readable with SQLite's own JSON functions): deflate's gain on
# them is small, and its start-up cost is paid per value.
PACK_FROM_BYTES = 512
# An 8 KiB window: deflate's start-up cost grows with its window (about 15 us for 8 KiB against
# 60 us for 32 KiB on this host), and a request's repeats are near each other.
_WINDOW_BITS = 13
_LEVEL = 1  # the fastest level; the higher ones gain a few percent on message text


def json_bytes(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # what orjson refuses (an integer past 64 bits), the standard library writes
        return json.dumps(value).encode()


def pack_json(value: Any) -> str | bytes:
    """JSON text, or its deflated bytes when it is long. SQLite keeps the two apart by their storage
    class (TEXT, BLOB), so reading needs no marker."""
    text = json_bytes(value)
    if len(text) < PACK_FROM_BYTES:
        return text.decode()
    packer = zlib.compressobj(_LEVEL, zlib.DEFLATED, _WINDOW_BITS)
    packed = packer.compress(text) + packer.flush()
    return packed if len(packed) < len(text) else text.decode()


def unpack_json(stored: str | bytes) -> Any:
    return orjson.loads(stored if isinstance(stored, str) else zlib.decompress(stored))


class PackedJSON(TypeDecorator[Any]):
    """JSON everywhere; on SQLite a long value is stored deflated, as a BLOB in the same column (the
    column's declared type stays JSON: rows written before, as text, read as they are). PostgreSQL
    needs none of it: it compresses a row's long values itself (TOAST)."""

    impl = JSON
    cache_ok = True

    def bind_processor(self, dialect: Dialect) -> Callable[[Any], Any] | None:
        if dialect.name == "sqlite":
            return _pack_or_none
        return super().bind_processor(dialect)

    def result_processor(self, dialect: Dialect, coltype: object) -> Callable[[Any], Any] | None:
        if dialect.name == "sqlite":
            return _unpack_or_none
        return super().result_processor(dialect, coltype)


def _pack_or_none(value: Any) -> str | bytes | None:
    return None if value is None else pack_json(value)


def _unpack_or_none(stored: str | bytes | None) -> Any:
    return None if stored is None else unpack_json(stored)
