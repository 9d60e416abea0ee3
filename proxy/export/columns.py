"""Token columns of export rows kept as the stored int32/float32 blobs they are made of, written as
JSON text or Arrow values without a Python object per token. Each blob is encoded once per batch of
rows, so a step-wise prompt (every earlier step again) costs a copy of text, not a new encoding."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

# A stored blob and a key naming it within one batch (call id * 2, + 1 for the call's output).
Piece = tuple[int, bytes]
_IDS = np.dtype("<i4")
_LOGPROBS = np.dtype("<f4")
_NUMPY = orjson.OPT_SERIALIZE_NUMPY


# JSON text is handled as views: slicing off brackets or a last comma copies nothing, and each
# column is copied once, when its parts are joined.
Text = bytes | memoryview


def _inner(array: npt.NDArray[Any]) -> memoryview:
    """The JSON list of an array without its brackets."""
    return memoryview(orjson.dumps(array, option=_NUMPY))[1:-1]


class Encoder:
    """JSON text of each blob (without brackets), made once per batch. Where no blob is in two rows
    (`shared=False`: merged rows), a column is encoded whole instead, in one call rather than one per
    blob (a 64-turn row has 128 of them)."""

    def __init__(self, *, shared: bool = True) -> None:
        self.shared = shared
        self._ids: dict[int, Text] = {}
        self._logprobs: dict[int, Text] = {}

    def ids(self, piece: Piece) -> Text:
        key, blob = piece
        text = self._ids.get(key)
        if text is None:
            text = self._ids[key] = _inner(np.frombuffer(blob, dtype=_IDS))
        return text

    def logprobs(self, piece: Piece) -> Text:
        key, blob = piece
        text = self._logprobs.get(key)
        if text is None:
            text = self._logprobs[key] = _inner(_as_exported(blob))
        return text


def _as_exported(blob: bytes) -> npt.NDArray[np.float64]:
    """Stored logprobs as float64, the way they always were exported: each float32 value printed
    exactly (its float32 shortest text would read back as a different float64)."""
    return np.frombuffer(blob, dtype=_LOGPROBS).astype(np.float64)


# Runs of one value (mask runs, 0.0 logprobs) are views of these texts where they are long enough:
# a 64-turn row has over a hundred runs, and a new bytes object for each costs more than the copy.
_RUNS = {item: item * 65536 for item in (b"0,", b"1,", b"0.0,")}


# Zeros for runs of 0.0 logprobs (64k of them): a view of these costs a tenth of a new bytes object.
_ZEROS = memoryview(bytes(1 << 18))


def _zeros(size: int) -> Text:
    return _ZEROS[:size] if size <= len(_ZEROS) else bytes(size)


def _repeated(item: bytes, count: int) -> Text:
    """`count` times one JSON value followed by a comma, without the last comma."""
    run = _RUNS.get(item)
    if run is not None and 0 < count * len(item) <= len(run):
        return memoryview(run)[: count * len(item) - 1]
    return memoryview(item * count)[:-1]


# From this many runs on (a merged row has two per call), a mask's text is written in one buffer
# rather than joined from a view per run.
_MANY_RUNS = 8


def _digit_list(runs: tuple[tuple[int, int], ...]) -> bytes:
    """The JSON list of a 0/1 mask given as runs: a digit and a comma per value, made in one buffer."""
    values = np.fromiter((value != 0 for value, _ in runs), dtype=np.uint8, count=len(runs))
    counts = np.fromiter((count for _, count in runs), dtype=np.int64, count=len(runs))
    total = int(counts.sum())
    if not total:
        return b"[]"
    text = np.full(2 * total + 1, ord(","), dtype=np.uint8)
    text[0], text[-1] = ord("["), ord("]")
    text[1::2] = np.repeat(values + ord("0"), counts)
    return text.tobytes()


def _joined(parts: list[Text]) -> bytes:
    """A JSON list of these texts (each a comma-separated run of values; empty ones left out)."""
    out: list[Text] = [b"["]
    for part in parts:
        if len(part):
            out += (part, b",")
    out[-1] = b"]" if len(out) > 1 else b"[]"
    return b"".join(out)


@dataclass(frozen=True)
class Ids:
    """Token ids: the concatenation of int32 blobs."""

    pieces: tuple[Piece, ...]

    def __len__(self) -> int:
        # Counted per row group of a Parquet export over every piece (a 64-turn row has 128): one
        # call of map per row, not a generator step per piece.
        return sum(map(len, map(itemgetter(1), self.pieces))) // _IDS.itemsize

    def json(self, encoder: Encoder) -> bytes:
        if not encoder.shared:
            return orjson.dumps(self.array(), option=_NUMPY)
        return _joined([encoder.ids(piece) for piece in self.pieces if piece[1]])

    def parts(self) -> list[Text]:
        return [blob for _, blob in self.pieces]

    def raw(self) -> bytes:
        return b"".join(self.parts())

    def array(self) -> npt.NDArray[np.int32]:
        return np.frombuffer(self.raw(), dtype=_IDS)

    def values(self) -> list[int]:
        values: list[int] = self.array().tolist()
        return values


@dataclass(frozen=True)
class Mask:
    """A loss mask as runs of (value, length)."""

    runs: tuple[tuple[int, int], ...]

    def json(self, encoder: Encoder) -> bytes:
        if len(self.runs) >= _MANY_RUNS:
            return _digit_list(self.runs)
        return _joined([_repeated(b"1," if v else b"0,", n) for v, n in self.runs])

    def parts(self) -> list[Text]:
        return [b"\x01" * n if v else bytes(n) for v, n in self.runs]

    def raw(self) -> bytes:
        return b"".join(self.parts())

    def array(self) -> npt.NDArray[np.int8]:
        return np.frombuffer(self.raw(), dtype=np.int8)

    def values(self) -> list[int]:
        return [v for v, n in self.runs for _ in range(n)]


@dataclass(frozen=True)
class Logprobs:
    """Logprobs per response token: stored float32 blobs, and runs of 0.0 (an int: their length)."""

    pieces: tuple[Piece | int, ...]

    def json(self, encoder: Encoder) -> bytes:
        texts = iter(self._texts()) if not encoder.shared else None
        return _joined(
            [
                _repeated(b"0.0,", piece)
                if isinstance(piece, int)
                else (encoder.logprobs(piece) if texts is None else next(texts))
                for piece in self.pieces
            ]
        )

    def _texts(self) -> list[Text]:
        """The JSON text of each blob, all encoded in one call, then cut at the commas."""
        blobs = [piece[1] for piece in self.pieces if not isinstance(piece, int)]
        text = memoryview(orjson.dumps(_as_exported(b"".join(blobs)), option=_NUMPY))
        # The separator before each value (the bracket before the first, a comma before the others),
        # and the closing bracket: the values [s, e) are the text between separators s and e.
        separators = np.flatnonzero(np.frombuffer(text, dtype=np.uint8) == ord(","))
        separators = np.concatenate(([0], separators, [len(text) - 1]))
        counts = np.fromiter(map(len, blobs), dtype=np.int64, count=len(blobs)) // _LOGPROBS.itemsize
        firsts = np.zeros(len(blobs) + 1, dtype=np.int64)
        np.cumsum(counts, out=firsts[1:])
        cuts: list[int] = separators[firsts].tolist()  # one Python int per blob, not per value
        return [text[cuts[n] + 1 : cuts[n + 1]] if cuts[n + 1] > cuts[n] else b"" for n in range(len(blobs))]

    def parts(self) -> list[Text]:
        # A run of 0.0 is that many all-zero float32s: a view of shared zeros where they are long
        # enough (a new bytes object per run, allocated and cleared, cost ten times the view).
        return [_zeros(_LOGPROBS.itemsize * p) if isinstance(p, int) else p[1] for p in self.pieces]

    def raw(self) -> bytes:
        return b"".join(self.parts())

    def array(self) -> npt.NDArray[np.float32]:
        return np.frombuffer(self.raw(), dtype=_LOGPROBS)

    def values(self) -> list[float]:
        # float32 storage: the exported values are the float32 nearest the engine's number.
        return [float(v) for v in self.array()]


@dataclass(frozen=True)
class TokenRewards:
    """0.0 on every token of a step's response but the last, which carries the step's reward."""

    length: int
    reward: float

    def json(self, encoder: Encoder) -> bytes:
        return (
            orjson.dumps(self.values())
            if self.length < 2
            else _joined([_repeated(b"0.0,", self.length - 1), orjson.dumps(self.reward)])
        )

    def parts(self) -> list[Text]:
        return [self.raw()]

    def raw(self) -> bytes:
        values = np.zeros(self.length, dtype=_LOGPROBS)
        if self.length:
            with np.errstate(over="ignore"):  # a reward past float32's range is inf, as Arrow casts it
                values[-1] = self.reward
        return values.tobytes()

    def array(self) -> npt.NDArray[np.float32]:
        return np.frombuffer(self.raw(), dtype=_LOGPROBS)

    def values(self) -> list[float]:
        values = [0.0] * self.length
        if values:
            values[-1] = self.reward
        return values


Column = Ids | Mask | Logprobs | TokenRewards
COLUMN_TYPES = (Ids, Mask, Logprobs, TokenRewards)


def as_json_row(row: dict[str, Any], encoder: Encoder) -> bytes:
    """One JSON line (with its newline); token columns go in as their ready text."""
    return orjson.dumps(
        {k: orjson.Fragment(v.json(encoder)) if isinstance(v, COLUMN_TYPES) else v for k, v in row.items()},
        option=orjson.OPT_APPEND_NEWLINE,
    )


def as_lists(row: dict[str, Any]) -> dict[str, Any]:
    """The row with its token columns as Python lists (the /samples route, merge_steps, tests)."""
    return {k: v.values() if isinstance(v, COLUMN_TYPES) else v for k, v in row.items()}


def list_values(columns: Sequence[Column], value_type: Any) -> tuple[npt.NDArray[np.int32], Any]:
    """The offsets and the flat values of one list column over rows, as Arrow takes them: every
    row's parts joined once, straight into the buffer Arrow reads (each column's bytes are already
    in the Arrow value type), with no copy per row and no Python object per token. Each row's length
    is read off the running sum of its parts' lengths, not counted row by row."""
    import pyarrow as pa

    masks = [column for column in columns if isinstance(column, Mask)]
    if masks and len(masks) == len(columns):
        return _mask_values(masks, value_type)
    itemsize = value_type.bit_width // 8
    parts: list[Text] = []
    bounds = [0]
    for column in columns:
        parts += column.parts()
        bounds.append(len(parts))
    data = b"".join(parts)
    sizes = np.fromiter(map(len, parts), dtype=np.int64, count=len(parts))
    offsets = _row_offsets(sizes, bounds) // itemsize
    return offsets.astype(np.int32), pa.Array.from_buffers(
        value_type, len(data) // itemsize, [None, pa.py_buffer(data)]
    )


def _row_offsets(sizes: npt.NDArray[np.int64], bounds: list[int]) -> npt.NDArray[np.int64]:
    """Where each row starts (and the last ends) given its parts' sizes and each row's first part."""
    ends = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=ends[1:])
    offsets: npt.NDArray[np.int64] = ends[bounds]
    return offsets


def _mask_values(masks: list[Mask], value_type: Any) -> tuple[npt.NDArray[np.int32], Any]:
    """A loss-mask column from its runs: one repeat over all rows' runs, no bytes per run."""
    import pyarrow as pa

    values = [value for mask in masks for value, _ in mask.runs]
    counts = np.fromiter(
        (count for mask in masks for _, count in mask.runs), dtype=np.int64, count=len(values)
    )
    bounds = [0]
    for mask in masks:
        bounds.append(bounds[-1] + len(mask.runs))
    flat = np.repeat((np.asarray(values) != 0).astype(np.int8), counts)  # as parts() writes them
    return _row_offsets(counts, bounds).astype(np.int32), pa.array(flat, type=value_type)
