"""The trainer's pause for a weight sync: while paused, new engine calls wait (bounded) or are refused
with 429 and Retry-After; in-flight calls finish, or are aborted and later resumed."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from proxy.errors import Paused

PauseMode = Literal["wait", "reject"]


@dataclass
class PauseGate:
    mode: PauseMode = "wait"
    max_wait_s: float = 300.0
    retry_after_s: float = 5.0

    def __post_init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self.paused_since: float | None = None
        self.pauses = 0  # how many pauses began: an attempt that saw one was aborted by a sync
        # Pauses and resumes so far: a value read while this is unchanged was read since the last one.
        self.changes = 0
        self.in_flight = 0
        self.waiting = 0
        self.resumed_generations = 0

    @property
    def paused(self) -> bool:
        return not self._open.is_set()

    def pause(self) -> None:
        if not self.paused:
            self.pauses += 1
            self.changes += 1
            self.paused_since = time.time()
            self._open.clear()

    def resume(self) -> None:
        if self.paused:
            self.changes += 1
        self.paused_since = None
        self._open.set()

    async def admit(self) -> None:
        """Return once generation is open; a paused gate waits up to max_wait_s or refuses at once."""
        if not self.paused:
            return
        if self.mode == "reject":
            raise Paused(
                "generation is paused for a weight update; retry later", retry_after_s=self.retry_after_s
            )
        await self.wait_open(self.max_wait_s)

    async def wait_open(self, limit_s: float) -> None:
        self.waiting += 1
        try:
            await asyncio.wait_for(self._open.wait(), timeout=limit_s)
        except TimeoutError as exc:
            raise Paused(
                f"generation stayed paused for a weight update longer than {limit_s:g} s; retry later",
                retry_after_s=self.retry_after_s,
            ) from exc
        finally:
            self.waiting -= 1

    def state(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            # Every time the proxy returns carries its zone.
            "paused_since": (
                datetime.fromtimestamp(self.paused_since, UTC).isoformat()
                if self.paused_since is not None
                else None
            ),
            "mode": self.mode,
            "max_wait_s": self.max_wait_s,
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "resumed_generations": self.resumed_generations,
        }
