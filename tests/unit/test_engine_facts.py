"""The engine's facts asked again after a failed start: one question at a time, shared by the turns
that wait for it, and a turn waits a bounded time."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.api import engine_facts
from proxy.api.engine_facts import EngineFacts
from proxy.engines.base import EngineInfo
from proxy.errors import EngineUnavailable


class SlowEngine:
    """info() takes `delay_s`, then fails until `up` is set."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s
        self.asked = 0
        self.up = False

    async def info(self) -> EngineInfo:
        self.asked += 1
        await asyncio.sleep(self.delay_s)
        if not self.up:
            raise EngineUnavailable("down")
        return EngineInfo(model="m", context_length=64)


def test_concurrent_turns_share_one_question() -> None:
    async def scenario() -> tuple[list[bool], int]:
        engine = SlowEngine(0.2)
        facts = EngineFacts(engine, lambda info: None)  # type: ignore[arg-type]
        known = await asyncio.gather(*(facts.learn() for _ in range(5)))
        return known, engine.asked

    # One question for all five (before, each waited for the one before it, then asked again).
    assert asyncio.run(scenario()) == ([False] * 5, 1)


def test_a_turn_waits_at_most_its_bound_and_the_facts_apply_once_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(engine_facts, "TURN_WAIT_S", 0.1)
    applied: list[EngineInfo] = []

    async def scenario() -> tuple[float, bool]:
        engine = SlowEngine(1.0)
        facts = EngineFacts(engine, applied.append)  # type: ignore[arg-type]
        started = time.monotonic()
        await facts.before_turn()
        waited = time.monotonic() - started
        engine.up, engine.delay_s = True, 0.0
        await asyncio.sleep(1.0)  # the first question fails; the next one is answered
        return waited, await facts.learn()

    waited, known = asyncio.run(scenario())
    assert waited < 0.9  # not the engine's whole second
    assert known
    assert applied == [EngineInfo(model="m", context_length=64)]
