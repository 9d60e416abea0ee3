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


def sorted_versions(versions: Iterable[str | None]) -> list[str]:
    """The known versions, oldest first."""
    return sorted((v for v in versions if v is not None), key=version_key)


def at_least(version: str | None, minimum: str) -> bool:
    """Whether `version` is `minimum` or newer; an unknown version is not known to be fresh."""
    return version is not None and version_key(version) >= version_key(minimum)


def version_range(versions: Iterable[str | None]) -> tuple[str | None, str | None]:
    """The lowest and highest of the known versions (None when no call has one)."""
    known = sorted_versions(versions)
    return (known[0], known[-1]) if known else (None, None)


def version_spans(engine_spans: object, recorded: str | None, length: int) -> list[dict[str, object]]:
    """Per-token version spans `[start, end)` over a call's output: the engine's own (a resumed call's
    spans every attempt), with unnamed labels (vLLM's "default") read as the call's recorded version;
    one span of the recorded version where the engine gave none that covers the output."""
    spans = engine_spans if isinstance(engine_spans, list) else []
    valid = all(
        isinstance(s, dict) and isinstance(s.get("start"), int) and isinstance(s.get("end"), int)
        for s in spans
    )
    if not spans or not valid or spans[0]["start"] != 0 or spans[-1]["end"] != length:
        return [{"version": recorded, "start": 0, "end": length}] if length else []
    return [
        {
            "version": recorded if s.get("version") in (None, "default") else str(s["version"]),
            "start": s["start"],
            "end": s["end"],
        }
        for s in spans
    ]
