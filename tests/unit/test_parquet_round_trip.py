"""A Parquet export's token columns, built from the stored blobs at once per row group, read back as
exactly the values the rows' Python lists give, in every way a trainer's loader reads them."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.export.columns import Ids, Logprobs, Mask, TokenRewards, as_lists
from proxy.export.formats import TOKEN_COLUMNS, MetadataType, export_drift, jsonl, parquet_stream

IDS = st.lists(st.integers(min_value=0, max_value=2**31 - 1), max_size=6)
LOGPROBS = st.lists(st.floats(min_value=-1e6, max_value=0.0, width=32), max_size=6)
RUNS = st.lists(st.tuples(st.sampled_from([0, 1]), st.integers(min_value=0, max_value=4)), max_size=6)


def _blob(values: list[int] | list[float], dtype: str) -> bytes:
    return np.asarray(values, dtype=dtype).tobytes()


Spec = tuple[list[list[int]], Any, Any, float]  # ids blobs, mask runs, logprob pieces, reward


def _row(n: int, mode: str, spec: Spec) -> dict[str, Any]:
    ids, runs, logprobs, reward = spec
    row: dict[str, Any] = {
        "cursor": n,
        "session_id": f"s{n}",
        "prompt_ids": Ids(tuple((2 * k, _blob(p, "<i4")) for k, p in enumerate(ids))),
        "response_ids": Ids(tuple((2 * k + 1, _blob(p, "<i4")) for k, p in enumerate(reversed(ids)))),
        "loss_mask": Mask(tuple(runs)),
        "rollout_logprobs": Logprobs(
            tuple(p if isinstance(p, int) else (k, _blob(p, "<f4")) for k, p in enumerate(logprobs))
        ),
        "reward": reward,
    }
    if mode == "stepwise":
        row |= {"step": n, "token_rewards": TokenRewards(len(runs), reward)}
    return row


async def _pages(rows: list[dict[str, Any]]) -> AsyncIterator[list[dict[str, Any]]]:
    for row in rows:
        yield [row]


def _written(mode: str, rows: list[dict[str, Any]]) -> bytes:
    async def chunks() -> bytes:
        return b"".join([chunk async for chunk in parquet_stream(mode, _pages(rows), MetadataType(), 64)])

    return asyncio.run(chunks())


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(["merged", "stepwise"]),
    st.lists(
        st.tuples(
            st.lists(IDS, max_size=4),
            RUNS,
            st.lists(st.one_of(st.integers(min_value=0, max_value=4), LOGPROBS), max_size=4),
            st.floats(allow_nan=False, allow_infinity=False, width=32),
        ),
        min_size=1,
        max_size=6,
    ),
)
def test_a_parquet_export_reads_back_the_rows_lists(mode: str, specs: list[Spec]) -> None:
    rows = [_row(n, mode, spec) for n, spec in enumerate(specs)]
    data = _written(mode, rows)
    file = pq.ParquetFile(io.BytesIO(data))
    read = file.read()
    lists = [as_lists(row) for row in rows]
    for name in TOKEN_COLUMNS:
        if name in read.column_names:
            assert read.column(name).to_pylist() == [row[name] for row in lists], name
    # The table the rows' Python values give under the export's own schema, value for value.
    expected = pa.Table.from_pylist(
        [{key: row.get(key) for key in read.column_names} for row in lists], schema=read.schema
    )
    assert read.equals(expected)
    # Read in batches, as `datasets.load_dataset("parquet")` does, and column by column as numpy.
    batches = pa.Table.from_batches(list(file.iter_batches(batch_size=2)))
    assert batches.to_pylist() == expected.to_pylist()
    for name in TOKEN_COLUMNS:
        if name in read.column_names:
            numpy_rows = read.column(name).to_numpy()
            assert [list(values) for values in numpy_rows] == expected.column(name).to_pylist()


def _spec(n: int) -> Spec:
    return ([[n, n + 1, n + 2]], [(1, 3)], [[-0.5, -0.25, -0.125]], float(n))


def test_row_groups_written_while_the_next_is_built_keep_their_order() -> None:
    rows = [_row(n, "merged", _spec(n)) for n in range(40)]
    file = pq.ParquetFile(io.BytesIO(_written("merged", rows)))
    assert file.metadata.num_row_groups == 4  # 6 tokens a row, a group closed at 64: 11 rows
    assert file.read(columns=["cursor"]).column("cursor").to_pylist() == list(range(40))
    assert file.read(columns=["prompt_ids"]).column("prompt_ids").to_pylist() == [
        as_lists(row)["prompt_ids"] for row in rows
    ]


def test_a_page_failing_while_a_row_group_is_written_fails_the_stream() -> None:
    async def failing() -> AsyncIterator[list[dict[str, Any]]]:
        for n in range(3):
            yield [_row(n, "merged", _spec(n))]
        raise RuntimeError("the database went away")

    async def chunks() -> list[bytes]:
        return [chunk async for chunk in parquet_stream("merged", failing(), MetadataType(), 8)]

    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(chunks())


def test_an_export_given_up_while_a_row_group_is_written_leaves_nothing_running() -> None:
    async def stalled() -> AsyncIterator[list[dict[str, Any]]]:
        for n in range(3):
            yield [_row(n, "merged", _spec(n))]
        await asyncio.Event().wait()  # the next page never comes: the client goes away meanwhile
        yield []

    async def consume() -> list[bytes]:
        return [chunk async for chunk in parquet_stream("merged", stalled(), MetadataType(), 8)]

    async def give_up() -> None:
        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        consumer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await consumer

    asyncio.run(give_up())  # returns once the default executor's threads are done


def test_a_drift_report_not_made_says_why_in_both_formats_and_is_not_clean() -> None:
    """A render the template refused (`error`) or a skipped report: the same fields in JSON lines and
    Parquet, and `unclassified` null (nothing was checked), where a made report has a count."""
    reports: list[dict[str, Any]] = [
        {"mode": "strict", "error": "the chat template refused this conversation: no"},
        {"mode": "strict", "skipped": "text completions have no messages for a chat-template render"},
        {"mode": "strict", "differences": [], "counts": {}, "unclassified": 0},
    ]
    spec: Spec = ([[1]], [(1, 1)], [[-0.5]], 0.0)
    rows = [_row(n, "merged", spec) | {"drift": export_drift(report)} for n, report in enumerate(reports)]
    lines = [orjson.loads(line) for line in jsonl(rows, shared=False).splitlines()]
    read = pq.read_table(io.BytesIO(_written("merged", rows))).column("drift").to_pylist()
    assert [line["drift"] for line in lines] == read
    assert [(d["error"] is not None, d["skipped"] is not None, d["unclassified"]) for d in read] == [
        (True, False, None),
        (False, True, None),
        (False, False, 0),
    ]
