"""Parquet token columns declare their items non-null (no definition level per token) and read back
as exactly the values the rows' Python lists give, the same as the nullable-item lists written before."""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.export.columns import Ids, Logprobs, Mask, TokenRewards, as_lists
from proxy.export.formats import TOKEN_COLUMNS, MetadataType, _parquet_schema, parquet_stream

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


def _nullable_items(schema: Any) -> Any:
    """The schema as it was: token lists whose items could be null."""
    return pa.schema(
        [
            pa.field(field.name, pa.list_(field.type.value_type)) if field.name in TOKEN_COLUMNS else field
            for field in schema
        ]
    )


def test_token_columns_declare_items_that_are_never_null() -> None:
    for mode in ("merged", "stepwise"):
        schema = _parquet_schema(mode, pa.null())
        token_fields = [field for field in schema if field.name in TOKEN_COLUMNS]
        assert len(token_fields) == (5 if mode == "stepwise" else 4)
        for field in token_fields:
            assert pa.types.is_list(field.type)
            assert not field.type.value_field.nullable, field
            assert field.nullable  # the column itself keeps its nullability: only the items changed
        # Every other column is as it was.
        assert [f for f in schema if f.name not in TOKEN_COLUMNS] == [
            f for f in _nullable_items(schema) if f.name not in TOKEN_COLUMNS
        ]


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
def test_a_parquet_export_reads_back_the_rows_lists_as_nullable_items_did(
    mode: str, specs: list[Spec]
) -> None:
    rows = [_row(n, mode, spec) for n, spec in enumerate(specs)]
    data = _written(mode, rows)
    file = pq.ParquetFile(io.BytesIO(data))
    read = file.read()
    leaves = {file.schema.column(i).path: file.schema.column(i) for i in range(len(file.schema))}
    for name in TOKEN_COLUMNS:
        if name in read.column_names:
            # In the file: a required leaf under the optional list, one definition level fewer.
            assert leaves[f"{name}.list.element"].max_definition_level == 2, name
            assert not read.schema.field(name).type.value_field.nullable
    lists = [as_lists(row) for row in rows]
    for name in TOKEN_COLUMNS:
        if name in read.column_names:
            assert read.column(name).to_pylist() == [row[name] for row in lists], name
    # The same table as the nullable-item schema gave, value for value, row groups and all.
    before = pa.Table.from_pylist(
        [{key: row.get(key) for key in read.column_names} for row in lists],
        schema=_nullable_items(read.schema),
    )
    assert read.to_pylist() == before.to_pylist()
    assert read.cast(before.schema).equals(before)
    # Read in batches, as `datasets.load_dataset("parquet")` does, and column by column as numpy.
    batches = pa.Table.from_batches(list(file.iter_batches(batch_size=2)))
    assert batches.to_pylist() == before.to_pylist()
    for name in TOKEN_COLUMNS:
        if name in read.column_names:
            numpy_rows = read.column(name).to_numpy()
            assert [list(values) for values in numpy_rows] == before.column(name).to_pylist()
