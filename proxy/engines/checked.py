"""Every engine's answers checked before anything of them is recorded or streamed.

An engine that answers an id outside the vocabulary, a float or bool id, a missing or non-finite
logprob, malformed alternatives or no known finish reason would otherwise be recorded as sampled,
exported and fed back to it. The proxy wraps whatever engine it runs in CheckedEngine, so this is
the one place every engine's output passes through.
"""

from __future__ import annotations

import math
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

from proxy.engines.base import (
    ContextLimits,
    Engine,
    EngineInfo,
    FinishReason,
    Generation,
    PromptIds,
    SamplingParams,
    StreamChunk,
)
from proxy.errors import EngineError, InvalidEngineAnswer

_FINISH_KINDS = frozenset({"stop", "length", "abort"})


def _is_id(value: Any, vocab_size: int) -> bool:
    # bool is an int subclass, and 11.0 == 11: only a true int names a token.
    return type(value) is int and 0 <= value < vocab_size


def _is_logprob(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value)


def _all_ids(ids: list[Any], vocab_size: int) -> bool:
    """_is_id of every id, in C (a Python call per sampled token cost more than the rest of the
    check): their types are all int, and the smallest and largest are in range."""
    return not ids or (set(map(type, ids)) == {int} and min(ids) >= 0 and max(ids) < vocab_size)


def _all_logprobs(logprobs: list[Any]) -> bool:
    """_is_logprob of every logprob, in C: ints and floats only, each finite."""
    return set(map(type, logprobs)) <= {int, float} and all(map(math.isfinite, logprobs))


def check_tokens(
    ids: Sequence[Any],
    logprobs: Sequence[Any],
    top: Sequence[Any] | None,
    *,
    vocab_size: int,
    top_wanted: bool,
) -> None:
    """Ids in [0, vocab_size), one finite logprob per id, and (when asked for) well-formed
    alternatives for every position."""
    if not isinstance(ids, list) or not isinstance(logprobs, list) or len(ids) != len(logprobs):
        raise InvalidEngineAnswer("the engine answered output ids and logprobs that are not aligned")
    if not _all_ids(ids, vocab_size):
        bad = next(t for t in ids if not _is_id(t, vocab_size))
        raise InvalidEngineAnswer(
            f"the engine answered an output id that is not in the vocabulary of {vocab_size}: {bad!r}"
        )
    if not _all_logprobs(logprobs):
        raise InvalidEngineAnswer("the engine answered a logprob that is not a finite number")
    if top_wanted:
        _check_alternatives(top, len(ids), vocab_size)


def _check_alternatives(top: Sequence[Any] | None, count: int, vocab_size: int) -> None:
    if not isinstance(top, list) or len(top) != count:
        raise InvalidEngineAnswer("the engine answered no top logprobs aligned with its output ids")
    for position in top:
        if not isinstance(position, list) or not all(
            isinstance(entry, tuple)
            and len(entry) == 2
            and _is_id(entry[0], vocab_size)
            and _is_logprob(entry[1])
            for entry in position
        ):
            raise InvalidEngineAnswer("the engine answered a malformed top logprob")


def check_finish(finish: Any) -> FinishReason:
    if not isinstance(finish, FinishReason) or finish.kind not in _FINISH_KINDS:
        raise InvalidEngineAnswer(f"the engine answered no known finish reason: {finish!r}")
    if finish.matched_token is not None and type(finish.matched_token) is not int:
        raise InvalidEngineAnswer("the engine answered a stop token that is not a token id")
    return finish


def check_length(count: int, params: SamplingParams) -> None:
    """No more ids than max_new_tokens (an engine's own cap can only be lower)."""
    if params.max_new_tokens is not None and count > params.max_new_tokens:
        raise InvalidEngineAnswer(f"the engine answered {count} tokens for at most {params.max_new_tokens}")


def check_ending(
    finish: FinishReason, count: int, last: int | None, params: SamplingParams, stop_ids: frozenset[int]
) -> None:
    """An output of `count` ids ending with `last` fits what was asked: no more ids than
    max_new_tokens, a stop on a token ends with that token, which is one the request stops on or an
    end-of-sequence special token (`stop_ids`), and a stop on a string names a string it asked for.
    Past such an ending (tokens after the stop, a stop claimed on a token that was not sampled) the
    record would hold tokens the engine never sampled, or the answer would drop one it did."""
    check_length(count, params)
    if finish.kind != "stop":
        return
    token, text = finish.matched_token, finish.matched_text
    if token is not None and (
        last != token or (token not in stop_ids and token not in params.stop_token_ids)
    ):
        raise InvalidEngineAnswer(
            f"the engine stopped on token {token}, which its output does not end with or nothing stops on"
        )
    if text is not None and text not in params.stop:
        raise InvalidEngineAnswer(f"the engine stopped on {text!r}, a string the request did not ask for")


def check_generation(
    generation: Generation,
    *,
    vocab_size: int,
    top_wanted: bool,
    params: SamplingParams | None = None,
    stop_ids: frozenset[int] = frozenset(),
) -> Generation:
    check_tokens(
        generation.output_ids,
        generation.logprobs,
        generation.top_logprobs,
        vocab_size=vocab_size,
        top_wanted=top_wanted,
    )
    finish = check_finish(generation.finish)
    if params is not None:
        ids = generation.output_ids
        check_ending(finish, len(ids), ids[-1] if ids else None, params, stop_ids)
    return generation


class CheckedEngine:
    """An engine whose every answer is checked; it speaks the same protocol as the engine it wraps."""

    def __init__(self, inner: Engine, *, vocab_size: int, stop_ids: frozenset[int] = frozenset()) -> None:
        self.inner = inner
        self.vocab_size = vocab_size
        # The tokens an engine may stop on unasked: the tokenizer's special ones (its end of sequence).
        self.stop_ids = stop_ids
        self.name = inner.name
        self.supports_constraints = inner.supports_constraints
        self.limits: ContextLimits = inner.limits

    def __getattr__(self, attribute: str) -> Any:
        return getattr(self.inner, attribute)  # an engine's extras: report, honours_seed, wire_sampling...

    async def generate(
        self,
        input_ids: PromptIds,
        params: SamplingParams,
        request_id: str | None = None,
        *,
        affinity: str | None = None,
    ) -> Generation:
        generation = await self.inner.generate(input_ids, params, request_id, affinity=affinity)
        return check_generation(
            generation,
            vocab_size=self.vocab_size,
            top_wanted=params.top_logprobs > 0,
            params=params,
            stop_ids=self.stop_ids,
        )

    async def stream(
        self, input_ids: PromptIds, params: SamplingParams, request_id: str, *, affinity: str | None = None
    ) -> AsyncIterator[StreamChunk]:
        chunks = await self.inner.stream(input_ids, params, request_id, affinity=affinity)
        return self._checked(chunks, params)

    async def _checked(
        self, chunks: AsyncIterator[StreamChunk], params: SamplingParams
    ) -> AsyncIterator[StreamChunk]:
        count, last = 0, None
        try:
            async for chunk in chunks:
                check_tokens(
                    chunk.output_ids,
                    chunk.logprobs,
                    chunk.top_logprobs,
                    vocab_size=self.vocab_size,
                    top_wanted=params.top_logprobs > 0,
                )
                count += len(chunk.output_ids)
                last = chunk.output_ids[-1] if chunk.output_ids else last
                if chunk.finish is not None:
                    check_ending(check_finish(chunk.finish), count, last, params, self.stop_ids)
                else:
                    check_length(count, params)
                yield chunk
                if chunk.finish is not None:
                    return  # the last chunk: nothing after it is read
        finally:
            # Closed at once: an unfinished engine stream closes its connection (which aborts it).
            if isinstance(chunks, AsyncGenerator):
                await chunks.aclose()
        # Not an InvalidEngineAnswer: what arrived was checked, and is kept as an aborted turn.
        raise EngineError("the engine stream ended without a finish reason")

    async def abort(self, request_id: str) -> None:
        await self.inner.abort(request_id)

    async def info(self) -> EngineInfo:
        return await self.inner.info()

    async def ready(self) -> bool:
        return await self.inner.ready()

    async def aclose(self) -> None:
        await self.inner.aclose()
