"""Token columns written from their stored blobs are the JSON and the Arrow values the same lists
give, to the byte; Parquet row groups close at a token budget and the rows read back the same."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.export.columns import (
    Encoder,
    Ids,
    Logprobs,
    Mask,
    TokenRewards,
    as_json_row,
    as_lists,
    list_values,
)
from proxy.export.formats import MetadataType, parquet_stream

IDS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=8)
LOGPROBS = st.lists(st.floats(min_value=-1e6, max_value=0.0, width=32), max_size=8)


def _blob(values: list[int]) -> bytes:
    return np.asarray(values, dtype="<i4").tobytes()


@settings(max_examples=200, deadline=None)
@given(
    st.lists(IDS, max_size=6),
    # Up to 20 runs: a mask of many runs is written in one buffer, of a few from shared run texts.
    st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(min_value=0, max_value=5)), max_size=20),
    st.lists(st.one_of(st.integers(min_value=0, max_value=5), LOGPROBS), max_size=6),
    st.integers(min_value=0, max_value=4),
    st.floats(allow_nan=False, allow_infinity=False),
)
def test_columns_write_the_json_of_their_lists(
    pieces: list[list[int]],
    runs: list[tuple[int, int]],
    logprobs: list[int | list[float]],
    size: int,
    reward: float,
) -> None:
    row: dict[str, Any] = {
        "a": 1,
        "prompt_ids": Ids(tuple((n, _blob(p)) for n, p in enumerate(pieces))),
        "loss_mask": Mask(tuple(runs)),
        "rollout_logprobs": Logprobs(
            tuple(
                p if isinstance(p, int) else (n, np.asarray(p, dtype="<f4").tobytes())
                for n, p in enumerate(logprobs)
            )
        ),
        "token_rewards": TokenRewards(size, reward),
        "z": None,
    }
    lists = as_lists(row)
    assert lists["prompt_ids"] == [i for p in pieces for i in p]
    assert lists["loss_mask"] == [v for v, n in runs for _ in range(n)]
    expected = [x for p in logprobs for x in ([0.0] * p if isinstance(p, int) else [float(v) for v in p])]
    assert lists["rollout_logprobs"] == expected
    assert lists["token_rewards"] == ([0.0] * (size - 1) + [reward] if size else [])
    assert as_json_row(row, Encoder()) == orjson.dumps(lists) + b"\n"
    assert as_json_row(row, Encoder(shared=False)) == orjson.dumps(lists) + b"\n"
    for key in ("prompt_ids", "loss_mask", "rollout_logprobs", "token_rewards"):
        # The Arrow values are those the lists convert to (a reward past float32's range is inf).
        array = row[key].array()
        assert array.tolist() == pa.array(lists[key], type=pa.from_numpy_dtype(array.dtype)).to_pylist()


async def _pages(rows: list[dict[str, Any]]) -> AsyncIterator[list[dict[str, Any]]]:
    for row in rows:
        yield [row]


async def _parquet(rows: list[dict[str, Any]], budget: int) -> bytes:
    return b"".join(
        [chunk async for chunk in parquet_stream("stepwise", _pages(rows), MetadataType(), budget)]
    )


def test_parquet_row_groups_close_at_the_token_budget_with_the_same_rows() -> None:
    rows = [
        {
            "session_id": f"s{n}",
            "step": n,
            "prompt_ids": Ids(((2 * n, _blob(list(range(n * 10)))),)),
            "response_ids": Ids(((2 * n + 1, _blob([7, 8, 9])),)),
            "loss_mask": Mask(((1, 3),)),
            "rollout_logprobs": Logprobs(
                ((2 * n + 1, np.asarray([-0.5, -1.0, -2.0], dtype="<f4").tobytes()),)
            ),
            "token_rewards": TokenRewards(3, 1.0),
        }
        for n in range(6)
    ]
    small = pq.ParquetFile(io.BytesIO(asyncio.run(_parquet(rows, 40))))
    whole = pq.ParquetFile(io.BytesIO(asyncio.run(_parquet(rows, 10**9))))
    assert small.num_row_groups > 1
    assert whole.num_row_groups == 1
    assert small.read().to_pylist() == whole.read().to_pylist()
    assert small.read().column("prompt_ids").to_pylist() == [list(range(n * 10)) for n in range(6)]


def test_metadata_holding_an_empty_object_anywhere_is_written_as_json_text() -> None:
    metas = [
        {"plain": 1, "empty": {}, "listed": [{}], "nested": {"inner": {}}, "kept": {"a": 1}},
        {"plain": 2, "empty": {}, "listed": [], "nested": {"inner": {}}, "kept": {"a": 2}},
    ]
    meta = MetadataType()
    meta.add(metas)
    rows = [
        {
            "session_id": f"s{n}",
            "step": 0,
            "prompt_ids": Ids(((n, _blob([1, 2])),)),
            "response_ids": Ids(((n, _blob([3])),)),
            "loss_mask": Mask(((1, 1),)),
            "rollout_logprobs": Logprobs(((n, np.asarray([-0.5], dtype="<f4").tobytes()),)),
            "token_rewards": TokenRewards(1, 1.0),
            "metadata": metas[n],
        }
        for n in range(2)
    ]

    async def written() -> bytes:
        return b"".join([chunk async for chunk in parquet_stream("stepwise", _pages(rows), meta)])

    read = pq.ParquetFile(io.BytesIO(asyncio.run(written()))).read().column("metadata").to_pylist()
    assert [orjson.loads(value["empty"]) for value in read] == [{}, {}]
    assert [orjson.loads(value["listed"]) for value in read] == [[{}], []]
    assert [orjson.loads(value["nested"]) for value in read] == [{"inner": {}}, {"inner": {}}]
    assert [value["kept"] for value in read] == [{"a": 1}, {"a": 2}]
    assert [value["plain"] for value in read] == [1.0, 2.0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.lists(IDS, max_size=4), max_size=5),
    st.lists(
        st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(min_value=0, max_value=5)), max_size=4),
        max_size=5,
    ),
    st.lists(st.lists(st.one_of(st.integers(min_value=0, max_value=5), LOGPROBS), max_size=4), max_size=5),
    st.lists(st.tuples(st.integers(min_value=0, max_value=4), st.floats(allow_nan=False)), max_size=5),
)
def test_a_token_column_over_rows_is_the_arrow_list_of_their_values(
    ids: list[list[list[int]]],
    masks: list[list[tuple[int, int]]],
    logprobs: list[list[int | list[float]]],
    rewards: list[tuple[int, float]],
) -> None:
    """A row group's token column (offsets and flat values built from the rows' blobs and runs at
    once) is the Arrow list array the rows' Python lists convert to, empty rows included."""
    columns: list[tuple[list[Any], Any]] = [
        ([Ids(tuple((n, _blob(p)) for n, p in enumerate(row))) for row in ids], pa.list_(pa.int32())),
        ([Mask(tuple(row)) for row in masks], pa.list_(pa.int8())),
        (
            [
                Logprobs(
                    tuple(
                        p if isinstance(p, int) else (n, np.asarray(p, dtype="<f4").tobytes())
                        for n, p in enumerate(row)
                    )
                )
                for row in logprobs
            ],
            pa.list_(pa.float32()),
        ),
        ([TokenRewards(size, reward) for size, reward in rewards], pa.list_(pa.float32())),
    ]
    for values, kind in columns:
        offsets, flat = list_values(values, kind.value_type)
        built = pa.ListArray.from_arrays(pa.array(offsets), flat, type=kind)
        expected = pa.array([as_lists({"c": value})["c"] for value in values], type=kind)
        assert built.equals(expected), kind
