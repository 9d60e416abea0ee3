"""The nesting cap on JSON the proxy walks: request values, parsed tool arguments, sampled calls.

Deeper values are refused where they enter (a 400, or a sampled call read as text), because every
later step that walks JSON has its own recursion limit: orjson writes 254 levels, the standard
library's parser stops near 1,000, Jinja's `tojson` at Python's recursion limit. 128 levels is far
beyond any real tool schema or argument object and leaves room for the levels the proxy wraps
around a value when it records or exports it.
"""

from __future__ import annotations

import json
from typing import Any

import orjson

MAX_JSON_DEPTH = 128


class JsonTooDeep(ValueError):
    """A JSON value nested deeper than MAX_JSON_DEPTH."""

    def __init__(self, limit: int = MAX_JSON_DEPTH) -> None:
        super().__init__(f"JSON nested deeper than {limit} levels is not accepted")


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` has more than `limit` levels of arrays and objects (a scalar has none)."""
    if not isinstance(value, (dict, list)):
        return False  # most values checked are strings (tool arguments as OpenAI sends them)
    try:
        text = orjson.dumps(value)
    except TypeError:
        pass  # deeper than orjson writes, or not writable by it: measured below
    else:
        # Depth is at most the count of opening brackets (strings may hold some too): a tool list
        # is cleared by one write and two counts, without building the wrapper below.
        if text.count(b"[") + text.count(b"{") <= limit:
            return False
    padding = _ORJSON_DEPTH - limit
    if padding >= 0:
        # orjson refuses to write more than _ORJSON_DEPTH levels, in C: wrapped in `padding` lists,
        # the value is written exactly when it has at most `limit` levels. A tool list costs ~10 us.
        wrapped = value
        for _ in range(padding):
            wrapped = [wrapped]
        try:
            orjson.dumps(wrapped)
            return False
        except TypeError as exc:
            if "ecursion" in str(exc):
                return True
    return _walk_too_deep(value, limit)  # what orjson cannot write (integers past 64 bits)


def _walk_too_deep(value: Any, limit: int) -> bool:
    """too_deep in Python, level by level without recursion, so no value can exhaust the stack."""
    level = [value] if isinstance(value, (dict, list)) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            return True
        deeper: list[Any] = []
        for container in level:
            items = container.values() if isinstance(container, dict) else container
            deeper.extend(item for item in items if isinstance(item, (dict, list)))
        level = deeper
    return False


def _orjson_write_limit() -> int:
    """The deepest list orjson writes (254 in orjson 3), measured once rather than assumed."""
    value: list[Any] = []
    depth = 1
    while depth < 4096:
        try:
            orjson.dumps([value])
        except TypeError:
            return depth
        value = [value]
        depth += 1
    return depth


_ORJSON_DEPTH = _orjson_write_limit()


def bounded(value: Any, limit: int = MAX_JSON_DEPTH) -> Any:
    """`value`, or JsonTooDeep."""
    if too_deep(value, limit):
        raise JsonTooDeep(limit)
    return value


def loads_bounded(text: str) -> Any:
    """json.loads for text the proxy did not write (sampled tool calls): too deep is a ValueError,
    as malformed JSON is, never a RecursionError."""
    try:
        return bounded(json.loads(text))
    except RecursionError as exc:
        raise JsonTooDeep() from exc
