"""The checks every engine answer passes (proxy/engines/checked.py), on answers no JSON engine can
send (NaN, infinities) and on the shapes an in-process engine could get wrong."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from typing import Any

import pytest

from proxy.engines.base import (
    ContextLimits,
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.engines.checked import CheckedEngine
from proxy.errors import EngineError, InvalidEngineAnswer

VOCAB = 1000
STOP = FinishReason("stop", matched_token=7)
PARAMS = SamplingParams(max_new_tokens=8, stop_token_ids=(7,))
TOP_PARAMS = SamplingParams(max_new_tokens=8, stop_token_ids=(7,), top_logprobs=2)


class ScriptedEngine:
    """Answers what it is given, checked by nothing."""

    name = "scripted"
    supports_constraints = False
    limits = ContextLimits()

    def __init__(self, answer: Generation | None = None, chunks: list[StreamChunk] | None = None) -> None:
        self.answer = answer
        self.chunks = chunks or []
        self.closed = False

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        assert self.answer is not None
        return self.answer

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        return self._chunks()

    async def _chunks(self) -> AsyncIterator[StreamChunk]:
        try:
            for chunk in self.chunks:
                yield chunk
        finally:
            self.closed = True

    async def abort(self, request_id: str) -> None:
        return None

    async def info(self) -> EngineInfo:
        return EngineInfo(model="scripted", context_length=None)

    async def ready(self) -> bool:
        return True

    async def aclose(self) -> None:
        return None


def _generate(answer: Generation, params: SamplingParams = PARAMS) -> Generation:
    return asyncio.run(CheckedEngine(ScriptedEngine(answer), vocab_size=VOCAB).generate([1], params))


def _stream(chunks: list[StreamChunk], params: SamplingParams = PARAMS) -> list[StreamChunk]:
    async def read() -> list[StreamChunk]:
        engine = CheckedEngine(ScriptedEngine(chunks=chunks), vocab_size=VOCAB)
        return [chunk async for chunk in await engine.stream([1], params, "r")]

    return asyncio.run(read())


def test_a_well_formed_answer_passes_unchanged() -> None:
    answer = Generation([5, 7], [-0.5, 0.0], STOP, top_logprobs=[[(5, -0.5), (6, -1.0)], [(7, 0.0)]])
    assert _generate(answer, TOP_PARAMS) is answer


@pytest.mark.parametrize(
    ("ids", "logprobs"),
    [
        ([5, 7], [math.nan, -0.1]),
        ([5, 7], [-0.1, -math.inf]),
        ([5, 7], [-0.1, math.inf]),
        ([5, VOCAB], [-0.1, -0.1]),
        ([-1, 7], [-0.1, -0.1]),
        ([5.0, 7], [-0.1, -0.1]),
        ([False, 7], [-0.1, -0.1]),
        ([5, 7], [-0.1, None]),
        ([5, True], [-0.1, -0.1]),
        ([5, 7], [True, -0.1]),
        ([5, 7], [-0.1, "-0.1"]),
        ([5, "7"], [-0.1, -0.1]),
    ],
)
def test_ids_and_logprobs_that_cannot_be_recorded_are_refused(ids: list[Any], logprobs: list[Any]) -> None:
    with pytest.raises(InvalidEngineAnswer):
        _generate(Generation(ids, logprobs, STOP))


@pytest.mark.parametrize(
    "top",
    [
        None,  # asked for, not given
        [[(5, -0.5)]],  # one position for two ids
        [[(5, -0.5)], [(VOCAB + 3, -1.0)]],
        [[(5, -0.5)], [(7, math.nan)]],
        [[(5, -0.5)], [(7.0, -1.0)]],
        [[(5, -0.5)], [(7, -1.0, "x")]],
    ],
)
def test_malformed_top_logprobs_are_refused(top: Any) -> None:
    answer = Generation.__new__(Generation)  # past the dataclass's own alignment check, as a bad engine
    object.__setattr__(answer, "output_ids", [5, 7])
    object.__setattr__(answer, "logprobs", [-0.5, -1.0])
    object.__setattr__(answer, "finish", STOP)
    object.__setattr__(answer, "top_logprobs", top)
    with pytest.raises(InvalidEngineAnswer):
        _generate(answer, TOP_PARAMS)


def test_an_unknown_finish_reason_is_refused() -> None:
    with pytest.raises(InvalidEngineAnswer, match="finish reason"):
        _generate(Generation([5], [-0.1], FinishReason("timeout")))  # type: ignore[arg-type]


def test_a_stream_is_checked_chunk_by_chunk() -> None:
    good = StreamChunk([5], [-0.5])
    with pytest.raises(InvalidEngineAnswer):
        _stream([good, StreamChunk([5], [math.nan])])
    with pytest.raises(InvalidEngineAnswer):
        _stream([good, StreamChunk([], [], FinishReason("done"))])  # type: ignore[arg-type]
    assert _stream([good, StreamChunk([7], [0.0], STOP)]) == [good, StreamChunk([7], [0.0], STOP)]


def test_a_stream_that_ends_without_a_finish_reason_is_an_engine_error_after_its_chunks() -> None:
    received: list[StreamChunk] = []

    async def read() -> None:
        scripted = ScriptedEngine(chunks=[StreamChunk([5], [-0.5]), StreamChunk([6], [-0.5])])
        engine = CheckedEngine(scripted, vocab_size=VOCAB)
        async for chunk in await engine.stream([1], PARAMS, "r"):
            received.append(chunk)

    with pytest.raises(EngineError, match="without a finish reason") as raised:
        asyncio.run(read())
    # Not an invalid answer: what arrived was checked and is kept, as an aborted turn.
    assert not isinstance(raised.value, InvalidEngineAnswer)
    assert [c.output_ids for c in received] == [[5], [6]]


def test_nothing_after_the_finish_reason_is_read_and_the_engine_stream_is_closed() -> None:
    scripted = ScriptedEngine(chunks=[StreamChunk([7], [0.0], STOP), StreamChunk([VOCAB], [0.0])])

    async def read() -> list[StreamChunk]:
        engine = CheckedEngine(scripted, vocab_size=VOCAB)
        return [chunk async for chunk in await engine.stream([1], PARAMS, "r")]

    assert len(asyncio.run(read())) == 1
    assert scripted.closed


@pytest.mark.parametrize(
    ("ids", "finish"),
    [
        ([5, 6], STOP),  # a stop on a token the output does not end with
        ([5, 7, 8], STOP),  # tokens after the stop token
        ([5, 9], FinishReason("stop", matched_token=9)),  # a token nothing stops on
        ([5, 6], FinishReason("stop", matched_text="zzz")),  # a string the request did not ask for
        ([1] * 9, FinishReason("length")),  # more tokens than max_new_tokens
    ],
)
def test_an_answer_past_what_was_asked_is_refused_plain_or_streamed(
    ids: list[int], finish: FinishReason
) -> None:
    """Recorded, such an answer would train tokens the engine never sampled, or drop one it did."""
    with pytest.raises(InvalidEngineAnswer):
        _generate(Generation(ids, [-0.5] * len(ids), finish))
    chunks = [StreamChunk(ids[:1], [-0.5]), StreamChunk(ids[1:], [-0.5] * (len(ids) - 1), finish)]
    with pytest.raises(InvalidEngineAnswer):
        _stream(chunks)


def test_a_stop_on_an_end_of_sequence_token_or_an_asked_string_passes() -> None:
    end_of_sequence = FinishReason("stop", matched_token=3)
    engine = CheckedEngine(
        ScriptedEngine(Generation([5, 3], [-0.5, -0.1], end_of_sequence)),
        vocab_size=VOCAB,
        stop_ids=frozenset({3}),
    )
    assert asyncio.run(engine.generate([1], PARAMS)).output_ids == [5, 3]
    asked = SamplingParams(max_new_tokens=8, stop=("zzz",))
    assert _generate(
        Generation([5, 6], [-0.5, -0.1], FinishReason("stop", matched_text="zzz")), asked
    ).output_ids == [5, 6]
