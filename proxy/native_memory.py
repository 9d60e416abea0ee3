"""Giving freed memory back to the OS after large requests (glibc only; elsewhere nothing happens).

Measured with bench/memory_soak.py: the proxy's Python objects stay small and bounded, but glibc
keeps what large bodies and the tokenizer's buffers freed in its heaps and per-thread arenas, and
its mmap threshold rises after each large free, so the next large buffers come from the heap too.
A fixed threshold keeps large buffers mmapped (returned on free); a trim after a large request
returns what the heaps hold free.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from typing import Any

log = logging.getLogger("tito_proxy.memory")

_M_MMAP_THRESHOLD = -3  # mallopt's parameter number in glibc's malloc.h
MMAP_THRESHOLD = 256 * 1024
# A trim walks the heaps under their locks: at most one a second.
_TRIM_INTERVAL_S = 1.0


def _glibc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.malloc_trim  # noqa: B018 - present only in glibc
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()
_last_trim = [0.0]  # when the last trim ran (monotonic seconds)


def fix_mmap_threshold() -> None:
    """Allocations of MMAP_THRESHOLD or more are mmapped, whatever was freed before."""
    if _LIBC is not None and not _LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        log.warning("mallopt(M_MMAP_THRESHOLD) was refused; large buffers may stay in the heap")


def trim() -> None:
    """Return free heap memory to the OS (blocking: call it on a worker thread)."""
    now = time.monotonic()
    if _LIBC is None or now - _last_trim[0] < _TRIM_INTERVAL_S:
        return
    _last_trim[0] = now
    _LIBC.malloc_trim(0)
