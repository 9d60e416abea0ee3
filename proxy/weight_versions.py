"""Weight versions compared as versions: numbers as numbers, digit runs inside labels as numbers."""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")
_DIGITS = re.compile(r"(\d+)")


def version_key(version: str) -> tuple[object, ...]:
    """Sort key: `9` < `10`, `step-9` < `step-10`, `v1.2` < `v1.10`; plain numbers before labels."""
    if _NUMBER.match(version):
        return (0, float(version), version)
    parts = tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in _DIGITS.split(version) if p)
    return (1, parts, version)


def version_range(versions: Iterable[str | None]) -> tuple[str | None, str | None]:
    """The lowest and highest of the known versions (None when no call has one)."""
    known = sorted((v for v in versions if v is not None), key=version_key)
    return (known[0], known[-1]) if known else (None, None)
