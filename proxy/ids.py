"""Fresh random ids for requests, turns and tool calls, as hex digits from the OS's random source."""

from __future__ import annotations

import os


def random_hex(n_bytes: int = 16) -> str:
    """2 * n_bytes random hex digits: 16 bytes read as uuid4().hex does, without building a UUID
    object (a few microseconds each, several times a turn)."""
    return os.urandom(n_bytes).hex()
