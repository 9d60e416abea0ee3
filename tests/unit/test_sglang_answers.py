"""An SGLang /generate answer read into a Generation: each logprob entry must be a list whose second
item is its output id; anything else is refused, whatever the position of the bad entry."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.engines.base import SamplingParams
from proxy.engines.checked import check_generation
from proxy.engines.sglang import _stream_chunk, parse_generation
from proxy.errors import InvalidEngineAnswer


def _answer(output_ids: list[Any], entries: Any) -> dict[str, Any]:
    return {
        "output_ids": output_ids,
        "meta_info": {"finish_reason": {"type": "stop"}, "output_token_logprobs": entries},
    }


def test_logprobs_are_read_from_entries_that_name_their_ids() -> None:
    generation = parse_generation(_answer([5, 7, 9], [[-0.5, 5, "a"], [0, 7, None], [-1.25, 9]]))
    assert generation.output_ids == [5, 7, 9]
    assert generation.logprobs == [-0.5, 0, -1.25]
    assert parse_generation(_answer([], [])).logprobs == []


@pytest.mark.parametrize(
    "entries",
    [
        [[-0.5, 5], [-0.1, 8]],  # another id
        [[-0.5, 5], [-0.1]],  # too short
        [[-0.5, 5], "-0.1,7"],  # not a list
        [[-0.5, 5], {"0": -0.1, "1": 7}],
        [[-0.5, 5], None],
        [[-0.5, 5], 7],
        [[-0.5, 5], [-0.1, 7], [-0.2, 9]],  # more entries than ids
        [[-0.5, 5]],  # fewer
        None,
    ],
)
def test_entries_that_do_not_name_their_ids_are_refused(entries: Any) -> None:
    with pytest.raises(InvalidEngineAnswer):
        parse_generation(_answer([5, 7], entries))


def _meta(ids: list[int], total: int | None, finish: Any = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"finish_reason": finish, "output_token_logprobs": [[-0.5, i] for i in ids]}
    if total is not None:
        meta["completion_tokens"] = total
    return {"output_ids": ids, "meta_info": meta}


def _streamed(chunks: list[dict[str, Any]]) -> list[int]:
    held, out = 0, []
    for chunk in chunks:
        piece, held = _stream_chunk(chunk, held, top_logprobs=False)
        out += piece.output_ids
    return out


def test_stream_chunks_are_read_cumulative_or_incremental_by_their_count() -> None:
    stop = {"type": "stop", "matched": 3}
    cumulative = [_meta([1], 1), _meta([1, 2], 2), _meta([1, 2, 3], 3, stop)]
    incremental = [_meta([1], 1), _meta([2], 2), _meta([3], 3, stop)]
    assert _streamed(cumulative) == _streamed(incremental) == [1, 2, 3]


@pytest.mark.parametrize(
    "chunks",
    [
        [_meta([1], None), _meta([1, 2], None)],  # no count: a cumulative chunk would be appended whole
        [_meta([1, 2, 3], 3), _meta([2, 3], 3)],  # the output shrank
        [_meta([1], 1), _meta([2], 4, {"type": "stop", "matched": 9})],  # ids missing before the stop
    ],
)
def test_a_stream_chunk_that_is_neither_whole_nor_next_is_refused(chunks: list[dict[str, Any]]) -> None:
    """Read as a delta, such chunks put tokens the engine never sampled into the record."""
    with pytest.raises(InvalidEngineAnswer):
        _streamed(chunks)


def test_an_answer_missing_ids_or_its_stop_token_is_refused() -> None:
    """As the app reads it: parsed, then checked as every engine's answer is."""
    stop = {"type": "stop", "matched": 9}
    params = SamplingParams(max_new_tokens=16, stop_token_ids=(9,))

    def read(answer: dict[str, Any]) -> list[int]:
        generation = parse_generation(answer)
        return check_generation(generation, vocab_size=100, top_wanted=False, params=params).output_ids

    assert read(_meta([4, 9], 2, stop)) == [4, 9]
    for answer in (_meta([4], 11, stop), _meta([4, 5], 2, stop), _meta([], 0, stop)):
        with pytest.raises(InvalidEngineAnswer):
            read(answer)


def test_an_abort_chunk_that_repeats_the_last_id_adds_nothing() -> None:
    """SGLang's chunk for a request aborted while it waited: the last id again, counted once."""
    abort = {"type": "abort", "message": "Abort before prefill"}
    chunks = [_meta([11, 12], 2), _meta([11, 12, 13], 3), _meta([13], 3, abort)]
    held, out = 0, []
    for chunk in chunks:
        piece, held = _stream_chunk(chunk, held, top_logprobs=False)
        out += piece.output_ids
    assert (out, held, piece.finish.kind if piece.finish else None) == ([11, 12, 13], 3, "abort")
