"""Weight versions in their natural order: numbers compare as numbers ("9" < "10", "step-9" < "step-10")."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

_RUNS = re.compile(r"(\d+)")
VersionKey = tuple[tuple[int, float | str], ...]


def version_key(version: str) -> VersionKey:
    """A sort key: a plain number is compared by value; otherwise digit runs by value, text as text."""
    try:
        number = float(version)
    except ValueError:
        number = math.nan
    if not math.isnan(number):
        return ((0, number),)
    return tuple((0, int(run)) if run.isdigit() else (1, run) for run in _RUNS.split(version) if run)


def sorted_versions(versions: Iterable[str | None]) -> list[str]:
    """The known versions, oldest first."""
    return sorted((v for v in versions if v is not None), key=version_key)


def at_least(version: str | None, minimum: str) -> bool:
    """Whether `version` is `minimum` or newer; an unknown version is not known to be fresh."""
    return version is not None and version_key(version) >= version_key(minimum)
