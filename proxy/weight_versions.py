"""Weight versions compared as versions: numbers as numbers, digit runs inside labels as numbers."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, cast

_NUMBER = re.compile(r"^[+-]?\d+(\.\d+)?$")
_DIGITS = re.compile(r"(\d+)")


def version_key(version: str) -> tuple[object, ...]:
    """Sort key: by the numbers a version holds, whatever text is around them. `9` < `10`, `step-9` <
    `step-10`, `v1.2` < `v1.10`, `v0` < `1` < `step-2`; a label without a number (`initial`, SGLang's
    default) before every numbered one (it names the weights before the first update). A plain
    number is one number (`1.5`); versions of the same numbers are ordered by their text."""
    if _NUMBER.match(version):
        return ((float(version),), version)
    return (tuple(int(p) for p in _DIGITS.findall(version)), version)


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


# vLLM's label for weights loaded without a name: it names no version.
UNNAMED = "default"


def named(version: object) -> str | None:
    """A version label as recorded: None where the engine named none."""
    return None if version is None or version == UNNAMED else str(version)


def labelled(spans: list[dict[str, object]], label: str | None) -> list[dict[str, object]]:
    """`spans` with the versions the engine left unnamed given `label` (the trainer's at the
    dispatch that sampled them), and neighbours of one version joined."""
    joined: list[dict[str, object]] = []
    for span in spans:
        version = named(span.get("version")) or label
        last = joined[-1] if joined else None
        if last is not None and last["version"] == version and last["end"] == span["start"]:
            last["end"] = span["end"]
        elif span["end"] != span["start"]:
            joined.append({"version": version, "start": span["start"], "end": span["end"]})
    return joined


def version_spans(engine_spans: object, recorded: str | None, length: int) -> list[dict[str, object]]:
    """Per-token version spans `[start, end)` over a call's output: the engine's own (a resumed call's
    spans every attempt), with labels left unnamed (vLLM's "default"; the proxy names them when it
    records, older records did not) read as the call's recorded version; one span of the recorded
    version where the engine gave none that covers the output."""
    spans = covering(engine_spans, length)
    if spans is None:
        return [{"version": recorded, "start": 0, "end": length}] if length else []
    return labelled(spans, recorded)


def covering(engine_spans: object, length: int) -> list[dict[str, object]] | None:
    """The engine's spans when they are spans that cover an output of `length` tokens, else None
    (an empty output has no token to give a version)."""
    spans = engine_spans if isinstance(engine_spans, list) and length else []
    valid = all(
        isinstance(s, dict) and isinstance(s.get("start"), int) and isinstance(s.get("end"), int)
        for s in spans
    )
    if not spans or not valid or spans[0]["start"] != 0 or spans[-1]["end"] != length:
        return None
    return spans


def span_versions(spans: Sequence[dict[str, object]]) -> list[str | None]:
    """The versions of a call's spans, in token order."""
    return [cast(str | None, span["version"]) for span in spans]


def row_versions(row: Mapping[str, Any]) -> list[str | None]:
    """Every version an exported row's tokens were sampled with: its calls' (`weight_versions`, or
    a step's `weight_version`), their spans' (`weight_version_spans`), and the oldest and newest
    (`weight_version_min`/`_max`, which count the spans of a merged row's calls)."""
    found: list[str | None] = list(row.get("weight_versions") or [])
    if "weight_version" in row:
        found.append(row["weight_version"])
    found += [row[key] for key in ("weight_version_min", "weight_version_max") if row.get(key) is not None]
    found += [span.get("version") for span in row.get("weight_version_spans") or []]
    return found
