"""Fresh random ids for requests, turns and tool calls, as hex digits from the OS's random source."""

from __future__ import annotations

import os
from collections import deque

# Ids of up to 16 bytes are cut from 32-digit pieces of one os.urandom read of this many bytes: a
# turn takes 3-4 ids, and a syscall each (which also gave up the GIL, so the event loop then waited
# for the writer thread to hand it back) cost more than the rest of making them.
_BATCH_BYTES = 4096
_PIECE_DIGITS = 32
# Each piece is handed out once: deque.popleft is atomic, so threads never share one.
_ready: deque[str] = deque()
# A forked child must not hand out the pieces its parent also holds.
os.register_at_fork(after_in_child=_ready.clear)


def _refill() -> str:
    digits = os.urandom(_BATCH_BYTES).hex()
    _ready.extend(digits[at : at + _PIECE_DIGITS] for at in range(_PIECE_DIGITS, len(digits), _PIECE_DIGITS))
    return digits[:_PIECE_DIGITS]


def random_hex(n_bytes: int = 16) -> str:
    """2 * n_bytes random hex digits (16 bytes: as uuid4().hex reads them, without a UUID object)."""
    if 2 * n_bytes > _PIECE_DIGITS:
        return os.urandom(n_bytes).hex()
    try:
        piece = _ready.popleft()
    except IndexError:
        piece = _refill()
    return piece if 2 * n_bytes == _PIECE_DIGITS else piece[: 2 * n_bytes]
