"""Export rows as bytes, streamed page by page: JSON lines, or Parquet written one row group per page."""

from __future__ import annotations

import io
from collections.abc import AsyncIterator
from typing import Any

import orjson

from proxy.errors import UnsupportedParameter

EXPORT_FORMATS = ("jsonl", "parquet")
# Nested values of varying shape are JSON text in Parquet, so every page has one schema.
_JSON_COLUMNS = ("drift", "metadata", "boundary_edits", "weight_version_spans")


def jsonl(rows: list[dict[str, Any]]) -> bytes:
    return b"".join(orjson.dumps(row) + b"\n" for row in rows)


def _parquet_schema(mode: str) -> Any:
    import pyarrow as pa

    ids = pa.list_(pa.int32())
    floats = pa.list_(pa.float32())
    common = [
        ("cursor", pa.int64()),
        ("session_id", pa.string()),
        ("prompt_ids", ids),
        ("response_ids", ids),
        ("loss_mask", pa.list_(pa.int8())),
        ("rollout_logprobs", floats),
        ("metadata", pa.string()),
    ]
    if mode == "stepwise":
        return pa.schema(
            [
                *common,
                ("trajectory_id", pa.string()),
                ("step", pa.int32()),
                ("call_id", pa.int64()),
                ("segment_id", pa.int64()),
                ("branch", pa.string()),
                ("is_last_step", pa.bool_()),
                ("reward", pa.float64()),
                ("call_reward", pa.float64()),
                ("token_rewards", floats),
                ("finish_reason", pa.string()),
                ("weight_version", pa.string()),
                ("weight_version_spans", pa.string()),
            ]
        )
    return pa.schema(
        [
            *common,
            ("sample_index", pa.int32()),
            ("segment_id", pa.int64()),
            ("branch", pa.string()),
            ("call_ids", pa.list_(pa.int64())),
            ("num_calls", pa.int32()),
            ("reward", pa.float64()),
            ("call_rewards", pa.list_(pa.float64())),
            ("finish_reasons", pa.list_(pa.string())),
            ("boundary_edits", pa.string()),
            ("drift", pa.string()),
            ("weight_versions", pa.list_(pa.string())),
            ("weight_version_min", pa.string()),
            ("weight_version_max", pa.string()),
        ]
    )


class _Drain(io.RawIOBase):
    """A write-only sink whose bytes are taken out after every row group."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.position = 0

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self.chunks.append(chunk)
        self.position += len(chunk)
        return len(chunk)

    def tell(self) -> int:
        return self.position

    def take(self) -> bytes:
        data, self.chunks = b"".join(self.chunks), []
        return data


def require_pyarrow(fmt: str) -> None:
    if fmt != "parquet":
        return
    try:
        import pyarrow  # noqa: F401
    except ImportError as exc:
        raise UnsupportedParameter(
            "Parquet export needs the 'parquet' extra (pyarrow)", param="format"
        ) from exc


async def parquet_stream(mode: str, pages: AsyncIterator[list[dict[str, Any]]]) -> AsyncIterator[bytes]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    schema = _parquet_schema(mode)
    sink = _Drain()
    writer = pq.ParquetWriter(sink, schema)
    async for rows in pages:
        if not rows:
            continue
        for row in rows:
            for column in _JSON_COLUMNS:
                if column in row:
                    row[column] = orjson.dumps(row[column]).decode()
        writer.write_table(pa.Table.from_pylist(rows, schema=schema))
        yield sink.take()
    writer.close()
    yield sink.take()
