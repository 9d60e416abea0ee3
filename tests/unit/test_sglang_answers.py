"""An SGLang /generate answer read into a Generation: each logprob entry must be a list whose second
item is its output id; anything else is refused, whatever the position of the bad entry."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.engines.sglang import parse_generation
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
