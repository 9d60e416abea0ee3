"""The shared pause's poll never undoes a pause or resume this process was just told of."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from proxy.engines.resuming import ResumingEngine
from proxy.shared_pause import SharedPause
from proxy.weight_sync import PauseGate


class _Engine:
    """What SharedPause uses of a ResumingEngine."""

    def __init__(self) -> None:
        self.gate = PauseGate()

    async def abort_in_flight(self) -> None:
        return None

    async def refresh_version(self) -> None:
        return None


class _HeldReads(SharedPause):
    """The stored pause in memory; a read returns what was stored when it began, once let go."""

    stored: dict[str, Any]
    release: asyncio.Event

    async def _stored(self) -> dict[str, Any]:
        value = dict(self.stored)
        await self.release.wait()
        return value

    async def publish(self, *, paused: bool, abort: bool = False) -> None:
        await asyncio.sleep(0)  # a commit yields to the loop, as the database's does
        self.stored = {"paused": paused, "since": None, "abort_epoch": 0}


def _shared() -> _HeldReads:
    shared = _HeldReads(db_sessions=cast(Any, None), engine=cast(ResumingEngine, _Engine()))
    shared.stored = {"paused": False, "since": None, "abort_epoch": 0}
    shared.release = asyncio.Event()
    return shared


async def _told_pause(shared: SharedPause) -> None:
    """What POST /admin/pause does on the process it reaches."""
    async with shared.told():
        shared.engine.gate.pause()
        await asyncio.sleep(0)  # an abort of what runs, awaited before publishing
        await shared.publish(paused=True)


def test_a_poll_that_read_before_a_pause_told_here_does_not_resume() -> None:
    async def scenario() -> bool:
        shared = _shared()
        poll = asyncio.create_task(shared.follow_once())
        await asyncio.sleep(0)  # the poll's read has begun: it holds "not paused"
        await _told_pause(shared)
        shared.release.set()
        await poll
        return shared.engine.gate.paused

    assert asyncio.run(scenario())


def test_a_poll_that_begins_while_a_pause_is_told_leaves_it_to_the_next() -> None:
    async def scenario() -> tuple[bool, bool]:
        shared = _shared()
        shared.release.set()
        async with shared.told():
            shared.engine.gate.pause()
            await shared.follow_once()  # the stored value still says "not paused"
            during = shared.engine.gate.paused
            await shared.publish(paused=True)
        await shared.follow_once()
        return during, shared.engine.gate.paused

    assert asyncio.run(scenario()) == (True, True)


def test_a_pause_stored_by_another_process_is_followed() -> None:
    async def scenario() -> tuple[bool, bool]:
        shared = _shared()
        shared.release.set()
        shared.stored = {"paused": True, "since": 1.0, "abort_epoch": 0}
        await shared.follow_once()
        paused = shared.engine.gate.paused
        shared.stored = {"paused": False, "since": None, "abort_epoch": 0}
        await shared.follow_once()
        return paused, shared.engine.gate.paused

    assert asyncio.run(scenario()) == (True, False)
