"""The trainer-set weight version an engine call goes out under: read with each turn's start, read
again when the call is dispatched after a pause or a resume.

The trainer's weight sync is: pause, update the engine's weights, POST /admin/weight_version, resume.
A turn that started before the resume but reaches the engine after it was sampled by the new
weights, so the version it read at its start is stale. Every value read is kept with the pause
gate's count of changes at the moment of the read; at dispatch a value read since the last pause or
resume is current (the trainer sets the version while paused), and an older one is read again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from proxy.weight_sync import PauseGate

# The key of a Generation's (or a stream's first and last chunk's) meta under which the engine
# wrapper reports the trainer version its first attempt went out under.
DISPATCHED_VERSION = "dispatched_version"


class TrainerVersion:
    """The newest trainer-set version this process read, and when (in the gate's changes)."""

    def __init__(self, read: Callable[[], Awaitable[str | None]], gate: PauseGate) -> None:
        self._read = read
        self._gate = gate
        self._known: str | None = None
        self._known_at = -1
        # Recorded when the engine reports no version and the trainer set none: the engine's at start.
        self.fallback: str | None = None

    def epoch(self) -> int:
        """Take before a read whose value goes to `note`."""
        return self._gate.changes

    def note(self, version: str | None, epoch: int) -> None:
        """A value read (with a turn's start) after `epoch` began."""
        if epoch >= self._known_at:
            self._known, self._known_at = version, epoch

    async def at_dispatch(self) -> str | None:
        """The version a call going out now is sampled under, as far as the trainer said."""
        epoch = self._gate.changes
        if self._known_at != epoch:
            self.note(await self._read(), epoch)
        return self._known or self.fallback
