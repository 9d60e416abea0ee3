"""Export rows as bytes, streamed page by page: JSON lines, or Parquet written one row group per page
with the same structure (nested values as Arrow structs and lists)."""

from __future__ import annotations

import asyncio
import functools
import io
from collections.abc import AsyncIterator
from typing import Any

import orjson

from proxy.errors import UnsupportedParameter

EXPORT_FORMATS = ("jsonl", "parquet")
# The fields of a boundary edit (proxy/turns/planning.py); every edit carries them all, null where
# they do not apply.
BOUNDARY_EDIT_FIELDS = ("kind", "position", "call_id", "token", "sampled", "rendered")
TOKEN_COLUMNS = ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_rewards")
# A Parquet row group is closed once it holds this many tokens (about 20 MB of Arrow buffers).
ROW_GROUP_TOKENS = 2_000_000
SINK_BUFFER = 1 << 20


def _version_span_type() -> Any:
    import pyarrow as pa

    return pa.struct([("version", pa.string()), ("start", pa.int64()), ("end", pa.int64())])


def drift_kinds() -> list[str]:
    from proxy.export.drift import ALLOWED_KINDS

    return sorted({*ALLOWED_KINDS, "unclassified"})


def export_drift(drift: dict[str, Any]) -> dict[str, Any] | None:
    """A segment's drift report as exported: null when there is none (drift disabled), else with a
    count for every kind (0 when absent), so its structure never depends on the data. A report that
    was not made (skipped, or the template refused the render: `error`) has a null `unclassified`:
    nothing was checked, which a trainer filtering on `unclassified == 0` must not take as clean."""
    if not drift:
        return None
    counts = drift.get("counts", {})
    made = not drift.get("skipped") and not drift.get("error")
    return {
        "differences": [],
        "unclassified": 0 if made else None,
        "skipped": None,
        "error": None,
        **drift,
        "counts": {kind: counts.get(kind, 0) for kind in drift_kinds()},
    }


def jsonl(rows: list[dict[str, Any]], *, shared: bool = True) -> bytes:
    """JSON lines; token columns (proxy.export.columns) are written from their blobs, each blob
    encoded once if it is `shared` by rows (step-wise prompts), each column whole if not (merged)."""
    from proxy.export.columns import Encoder, as_json_row

    encoder = Encoder(shared=shared)
    return b"".join([as_json_row(row, encoder) for row in rows])


def _boundary_edit_type() -> Any:
    import pyarrow as pa

    return pa.struct(
        [("kind", pa.string())] + [(name, pa.int64()) for name in BOUNDARY_EDIT_FIELDS if name != "kind"]
    )


def _drift_type() -> Any:
    import pyarrow as pa

    difference = pa.struct(
        [
            ("kind", pa.string()),
            ("allowed", pa.bool_()),
            ("position", pa.int64()),
            ("response_position", pa.int64()),
            ("stream_text", pa.string()),
            ("render_text", pa.string()),
            ("whitespace_only", pa.bool_()),
        ]
    )
    # One count per drift kind, so the column's type never depends on the data.
    counts = pa.struct([(kind, pa.int64()) for kind in drift_kinds()])
    return pa.struct(
        [
            ("mode", pa.string()),
            ("differences", pa.list_(difference)),
            ("counts", counts),
            ("unclassified", pa.int64()),
            ("skipped", pa.string()),  # why no report was made (text completions have no messages)
            ("error", pa.string()),  # the template refused the fresh render: why
        ]
    )


def _token_list(value_type: Any) -> Any:
    """A token column's type: a list in every row, of values that are never null. Said so in the
    schema, the writer has fewer levels to encode per value (a tenth of its time on these columns)."""
    import pyarrow as pa

    return pa.list_(pa.field("element", value_type, nullable=False))


def _schema(fields: list[tuple[str, Any]]) -> Any:
    """The schema of these fields; a token column is never null."""
    import pyarrow as pa

    return pa.schema([pa.field(name, kind, nullable=name not in TOKEN_COLUMNS) for name, kind in fields])


@functools.lru_cache(maxsize=16)
def _parquet_schema(mode: str, metadata: Any) -> Any:
    """The file's schema, made once per mode and metadata type (each export asks for it)."""
    import pyarrow as pa

    ids = _token_list(pa.int32())
    floats = _token_list(pa.float32())
    experts = pa.list_(pa.list_(pa.list_(pa.int32())))  # positions x layers x top_k
    common = [
        ("cursor", pa.int64()),
        ("session_id", pa.string()),
        ("group_id", pa.string()),
        ("sample_index", pa.int32()),
        ("group_size", pa.int32()),
        ("prompt_ids", ids),
        ("response_ids", ids),
        ("loss_mask", _token_list(pa.int8())),
        ("rollout_logprobs", floats),
        ("metadata", metadata),
        ("routed_experts", experts),
        ("response_routed_experts", experts),
    ]
    if mode == "stepwise":
        return _schema(
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
                ("weight_version_spans", pa.list_(_version_span_type())),
                ("model", pa.string()),
                ("adapter", pa.string()),
            ]
        )
    return _schema(
        [
            *common,
            ("path_index", pa.int32()),
            ("segment_id", pa.int64()),
            ("branch", pa.string()),
            ("call_ids", pa.list_(pa.int64())),
            ("num_calls", pa.int32()),
            ("reward", pa.float64()),
            ("call_rewards", pa.list_(pa.float64())),
            ("finish_reasons", pa.list_(pa.string())),
            ("boundary_edits", pa.list_(_boundary_edit_type())),
            ("drift", _drift_type()),
            ("weight_versions", pa.list_(pa.string())),
            ("weight_version_min", pa.string()),
            ("weight_version_max", pa.string()),
            ("adapters", pa.list_(pa.string())),
        ]
    )


class MetadataType:
    """The Parquet type of the `metadata` column: a struct of every key the exported sessions use,
    each typed by its values (ints widened to floats, structs merged); a key whose values cannot
    share one type holds JSON text."""

    def __init__(self) -> None:
        self.fields: dict[str, Any] = {}
        self.json_keys: set[str] = set()

    def add(self, metas: list[dict[str, Any]]) -> None:
        keys = {key for meta in metas for key in meta} - self.json_keys
        for key in keys:
            merged = self._merged_type(key, [meta.get(key) for meta in metas])
            # Parquet cannot store a struct without fields (`{}` anywhere in the value) either.
            if merged is None or _holds_empty_struct(merged):
                self.json_keys.add(key)
                self.fields.pop(key, None)
            else:
                self.fields[key] = merged

    def _merged_type(self, key: str, values: list[Any]) -> Any:
        """The Arrow type that holds both the key's values so far and these, or None if none does."""
        import pyarrow as pa

        try:
            found = pa.array(values).type
            known = self.fields.get(key, found)
            merged = pa.unify_schemas(
                [pa.schema([("v", known)]), pa.schema([("v", found)])], promote_options="permissive"
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError):
            return None
        return merged.field("v").type

    def arrow_type(self) -> Any:
        import pyarrow as pa

        columns = [
            (key, pa.string() if key in self.json_keys else self.fields[key])
            for key in sorted(self.fields.keys() | self.json_keys)
        ]
        # Parquet cannot store a struct without fields: no metadata anywhere is a null column.
        return pa.struct(columns) if columns else pa.null()

    def value(self, meta: dict[str, Any]) -> dict[str, Any] | None:
        if not self.fields and not self.json_keys:
            return None
        return {
            key: orjson.dumps(value).decode() if key in self.json_keys and value is not None else value
            for key, value in meta.items()
        }


def _holds_empty_struct(kind: Any) -> bool:
    """Whether an Arrow type has a struct without fields anywhere inside it."""
    import pyarrow as pa

    if pa.types.is_struct(kind):
        return kind.num_fields == 0 or any(_holds_empty_struct(field.type) for field in kind)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return _holds_empty_struct(kind.value_type)
    return False


def _column(values: list[Any], kind: Any) -> Any:
    """One column of a row group; token columns go in as whole buffers, never value by value."""
    import pyarrow as pa

    from proxy.export.columns import COLUMN_TYPES, list_values

    if pa.types.is_list(kind) and values and all(isinstance(v, COLUMN_TYPES) for v in values):
        offsets, flat = list_values(values, kind.value_type)
        return pa.ListArray.from_arrays(pa.array(offsets), flat, type=kind)
    return pa.array(values, type=kind)


def _table(rows: list[dict[str, Any]], schema: Any, metadata: MetadataType) -> Any:
    import pyarrow as pa

    columns = [
        _column(
            [metadata.value(row.get("metadata") or {}) for row in rows]
            if field.name == "metadata"
            else [row.get(field.name) for row in rows],
            field.type,
        )
        for field in schema
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def _tokens(row: dict[str, Any]) -> int:
    return sum(len(row[key]) for key in ("prompt_ids", "response_ids") if key in row)


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


class _ParquetFile:
    """The file's writer and its sink, used from a worker thread, one call at a time: Arrow builds
    and writes with the GIL released, so the writer is made while the event loop builds the first
    row group, and a row group is written while it builds the next."""

    def __init__(self, schema: Any) -> None:
        self.schema = schema
        self.sink = _Drain()
        self.stream: Any = None
        self.writer: Any = None

    def open(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        # A row group reaches the sink in ~130 writes (page headers, pages), each a call into Python
        # taking the GIL back from the writer; buffered on Arrow's side they arrive as a few large ones.
        self.stream = pa.BufferedOutputStream(pa.PythonFile(self.sink, mode="w"), buffer_size=SINK_BUFFER)
        # Min/max statistics (row selection by cursor or session) for every column but the token
        # lists (most of the bytes, and most of the time writing them). No dictionary pages: snappy
        # already shrinks repeated strings as much (a step-wise file of 512 rows: 1,962,290 bytes
        # without, 1,961,734 with), and encoding them cost 3-4% of the writer's time.
        others = [f.name for f in self.schema if f.name not in TOKEN_COLUMNS]
        self.writer = pq.ParquetWriter(
            self.stream, self.schema, use_dictionary=False, write_statistics=others
        )

    def write(self, table: Any) -> None:
        self.writer.write_table(table, row_group_size=table.num_rows)
        self.stream.flush()

    def finish(self, table: Any | None) -> None:
        """The last row group (if any) and the footer, in one call."""
        if table is not None:
            self.write(table)
        self.writer.close()  # the footer; the stream is ours to flush (the writer closes only what it opened)
        self.stream.flush()


def _retrieved(done: asyncio.Future[None]) -> None:
    """Whatever a write left behind once nobody awaits it (the export was given up)."""
    if not done.cancelled():
        done.exception()


async def parquet_stream(
    mode: str,
    pages: AsyncIterator[list[dict[str, Any]]],
    meta: MetadataType,
    row_group_tokens: int = ROW_GROUP_TOKENS,
) -> AsyncIterator[bytes]:
    """Parquet with real nested columns (structs and lists, never JSON text but for a metadata key
    of mixed types); the metadata type is settled before the first row. Rows are written a row
    group at a time, each closed once it holds `row_group_tokens` tokens, on a worker thread while
    the next one is built: memory stays bounded (one group written, one built) whatever the number
    of rows, and the event loop serves other requests meanwhile."""
    loop = asyncio.get_running_loop()
    schema = _parquet_schema(mode, meta.arrow_type())
    file = _ParquetFile(schema)
    writing = loop.run_in_executor(None, file.open)
    try:
        held: list[dict[str, Any]] = []
        tokens = 0
        async for rows in pages:
            held += rows
            tokens += sum(_tokens(row) for row in rows)
            if held and tokens >= row_group_tokens:
                table = _table(held, schema, meta)
                held, tokens = [], 0
                await writing  # the group before (one at a time, in order), or the opening
                if chunk := file.sink.take():
                    yield chunk
                writing = loop.run_in_executor(None, file.write, table)
        last = _table(held, schema, meta) if held else None
        await writing
        writing = loop.run_in_executor(None, file.finish, last)
        await writing
    finally:
        # Given up (the client went away, a page failed): the thread ends the call it is in (one row
        # group at most) and is handed nothing more.
        writing.add_done_callback(_retrieved)
    yield file.sink.take()
