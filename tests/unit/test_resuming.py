"""The resuming wrapper on a scripted in-process engine: what it continues, and what it does not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import numpy as np

from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.engines.resuming import ResumingEngine
from proxy.engines.routed_experts import ExpertsAsk, RoutedExperts
from proxy.weight_sync import PauseGate


class ScriptedEngine:
    """Answers each call with the next scripted generation and remembers the prompts it got."""

    name = "scripted"
    supports_constraints = False
    limits = ContextLimits()

    def __init__(self, answers: list[Generation]) -> None:
        self.answers = answers
        self.prompts: list[list[int]] = []

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        self.prompts.append([int(t) for t in input_ids])
        return self.answers.pop(0)

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        answer = await self.generate(input_ids, params)

        async def chunks() -> AsyncIterator[StreamChunk]:
            for i, token in enumerate(answer.output_ids):
                last = i == len(answer.output_ids) - 1
                yield StreamChunk(
                    [token], [answer.logprobs[i]], answer.finish if last else None, answer.weight_version
                )
            if not answer.output_ids:
                yield StreamChunk([], [], answer.finish)

        return chunks()

    async def abort(self, request_id: str) -> None:
        pass

    async def info(self) -> EngineInfo:
        return EngineInfo("m", None)

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        pass


def _gen(ids: list[int], kind: Any, version: str) -> Generation:
    return Generation(ids, [-0.1 * t for t in ids], FinishReason(kind), weight_version=version)


PARAMS = SamplingParams(max_new_tokens=10)


def test_an_abort_after_tokens_is_continued_from_them() -> None:
    inner = ScriptedEngine([_gen([1, 2], "abort", "a"), _gen([3, 4], "stop", "b")])
    result = asyncio.run(ResumingEngine(inner, PauseGate()).generate([9], PARAMS))
    assert inner.prompts == [[9], [9, 1, 2]]
    assert result.output_ids == [1, 2, 3, 4]
    assert result.logprobs == [-0.1, -0.2, -0.30000000000000004, -0.4]
    assert result.meta["weight_versions"] == [
        {"version": "a", "start": 0, "end": 2},
        {"version": "b", "start": 2, "end": 4},
    ]


def test_an_abort_before_any_token_without_a_pause_is_retried_once_only() -> None:
    inner = ScriptedEngine([_gen([], "abort", "a"), _gen([], "abort", "a"), _gen([5], "stop", "a")])
    result = asyncio.run(ResumingEngine(inner, PauseGate()).generate([9], PARAMS))
    assert len(inner.prompts) == 2
    assert result.finish.kind == "abort"


def test_a_streamed_abort_is_continued_without_a_finish_in_between() -> None:
    inner = ScriptedEngine([_gen([1, 2], "abort", "a"), _gen([3], "stop", "a")])

    async def run() -> list[StreamChunk]:
        engine = ResumingEngine(inner, PauseGate())
        return [chunk async for chunk in await engine.stream([9], PARAMS, "r")]

    chunks = asyncio.run(run())
    assert [c.output_ids for c in chunks] == [[1], [2], [3]]
    assert [c.finish for c in chunks[:-1]] == [None, None]
    assert chunks[-1].finish == FinishReason("stop")
    assert chunks[-1].meta["resumed"] == 1


class HeldEngine(ScriptedEngine):
    """Holds each generation until it is aborted, then answers the scripted abort with its tokens."""

    def __init__(self, answers: list[Generation]) -> None:
        super().__init__(answers)
        self.aborted: list[str] = []
        self.released = asyncio.Event()
        self.started = asyncio.Event()

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        self.prompts.append([int(t) for t in input_ids])
        self.started.set()
        await self.released.wait()
        return self.answers.pop(0)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.released.set()


def test_an_abort_the_proxy_asked_for_is_never_continued() -> None:
    # The client left: the proxy aborts by the request id it sampled with, and that generation ends
    # there with what it sampled, though a weight sync's abort of the same shape would be continued.
    inner = HeldEngine([_gen([1, 2], "abort", "a"), _gen([3], "stop", "a")])

    async def run() -> Generation:
        engine = ResumingEngine(inner, PauseGate())
        sampling = asyncio.ensure_future(engine.generate([9], PARAMS, "rid-1"))
        await inner.started.wait()
        await engine.abort("rid-1")
        return await sampling

    result = asyncio.run(run())
    assert inner.aborted == ["rid-1"]
    assert inner.prompts == [[9]]
    assert result.finish.kind == "abort"
    assert result.output_ids == [1, 2]


def _routed(start: int, count: int) -> RoutedExperts:
    return RoutedExperts(start, np.arange(count * 2).reshape(count, 1, 2) + 10 * start)


def test_routed_experts_of_the_attempts_are_joined_or_dropped_whole() -> None:
    asked = SamplingParams(max_new_tokens=10, routed_experts=ExpertsAsk(0, (1, 2)))
    # Prompt [9]: the first attempt covers positions [0, 2), the continuation asks from 2 on.
    first = replace(_gen([1, 2], "abort", "a"), routed_experts=_routed(0, 2))
    second = replace(_gen([3, 4], "stop", "a"), routed_experts=_routed(2, 2))
    result = asyncio.run(ResumingEngine(ScriptedEngine([first, second]), PauseGate()).generate([9], asked))
    assert result.routed_experts is not None
    assert (result.routed_experts.start, result.routed_experts.end) == (0, 4)
    assert result.routed_experts.rows.tolist() == [*_routed(0, 2).rows.tolist(), *_routed(2, 2).rows.tolist()]
    # Routings that do not meet (an engine that ignored the start) are dropped, never misaligned.
    gap = replace(_gen([3, 4], "stop", "a"), routed_experts=_routed(3, 2))
    first = replace(_gen([1, 2], "abort", "a"), routed_experts=_routed(0, 2))
    result = asyncio.run(ResumingEngine(ScriptedEngine([first, gap]), PauseGate()).generate([9], asked))
    assert result.output_ids == [1, 2, 3, 4]
    assert result.routed_experts is None


def test_one_finished_attempt_is_answered_as_the_engine_sampled_it() -> None:
    experts = RoutedExperts(0, np.zeros((2, 1, 1), dtype=np.int64))
    asked = replace(PARAMS, routed_experts=ExpertsAsk(0, (1, 1)))
    plain = _gen([1, 2], "stop", "a")
    cases = [
        (plain, PARAMS, plain),
        (replace(plain, top_logprobs=[[(1, -0.1)], [(2, -0.2)]], meta={"id": "x"}), PARAMS, None),
        (replace(plain, finish=FinishReason("length")), PARAMS, None),
        (replace(plain, routed_experts=experts), asked, None),
        (plain, asked, None),  # asked for, none sent: none recorded
        # Sent without being asked for: not kept, as an attempt's experts are only kept when asked.
        (replace(plain, routed_experts=experts), PARAMS, plain),
    ]
    for answer, params, expected in cases:
        result = asyncio.run(ResumingEngine(ScriptedEngine([answer]), PauseGate()).generate([9], params))
        assert result == (answer if expected is None else expected)
