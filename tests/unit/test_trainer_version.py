"""The trainer-set version a call goes out under: a value read since the last pause or resume is
current; an older one is read again at dispatch."""

from __future__ import annotations

import asyncio

from proxy.trainer_version import TrainerVersion
from proxy.weight_sync import PauseGate


class StoredVersion:
    """The database's setting, counting its reads."""

    def __init__(self, value: str | None) -> None:
        self.value = value
        self.reads = 0

    async def read(self) -> str | None:
        self.reads += 1
        return self.value


def _versions(value: str | None) -> tuple[TrainerVersion, StoredVersion, PauseGate]:
    stored, gate = StoredVersion(value), PauseGate()
    return TrainerVersion(stored.read, gate), stored, gate


def test_a_value_read_since_the_last_pause_is_used_without_another_read() -> None:
    versions, stored, _ = _versions("step-1")
    versions.note("step-1", versions.epoch())
    assert asyncio.run(versions.at_dispatch()) == "step-1"
    assert stored.reads == 0


def test_a_sync_between_a_turns_start_and_its_dispatch_is_read_again() -> None:
    """The turn read step-1 at its start; the trainer paused, set step-2 and resumed while it was
    planned: it goes out under step-2."""
    versions, stored, gate = _versions("step-1")
    versions.note("step-1", versions.epoch())
    gate.pause()
    stored.value = "step-2"
    gate.resume()
    assert asyncio.run(versions.at_dispatch()) == "step-2"
    assert stored.reads == 1
    assert asyncio.run(versions.at_dispatch()) == "step-2"
    assert stored.reads == 1  # read once for the epoch


def test_a_value_read_during_the_pause_is_stale_after_the_resume() -> None:
    """A turn that starts while paused reads the old version; the trainer sets the new one before
    resuming, so the read during the pause cannot stand for a call dispatched after it."""
    versions, stored, gate = _versions("step-1")
    gate.pause()
    versions.note("step-1", versions.epoch())
    stored.value = "step-2"
    gate.resume()
    assert asyncio.run(versions.at_dispatch()) == "step-2"


def test_a_read_that_began_before_a_change_does_not_replace_a_newer_one() -> None:
    versions, stored, gate = _versions("step-2")
    started = versions.epoch()
    gate.pause()
    gate.resume()
    versions.note("step-2", versions.epoch())
    versions.note("step-1", started)  # slower, older read
    assert asyncio.run(versions.at_dispatch()) == "step-2"
    assert stored.reads == 0


def test_without_a_trainer_version_the_engines_at_start_is_the_fallback() -> None:
    versions, _, _ = _versions(None)
    versions.fallback = "engine-v0"
    assert asyncio.run(versions.at_dispatch()) == "engine-v0"
    versions.note("step-3", versions.epoch())
    assert asyncio.run(versions.at_dispatch()) == "step-3"


def test_the_gate_counts_pauses_and_resumes_not_repeats() -> None:
    gate = PauseGate()
    gate.resume()
    assert gate.changes == 0
    gate.pause()
    gate.pause()
    gate.resume()
    gate.resume()
    assert gate.changes == 2
