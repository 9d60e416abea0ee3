"""Token arrays as compact bytes: little-endian int32 ids, float32 logprobs."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

_IDS = np.dtype("<i4")
_LOGPROBS = np.dtype("<f4")

IdArray = npt.NDArray[np.int32]


def pack_ids(ids: Sequence[int] | IdArray) -> bytes:
    return np.asarray(ids, dtype=_IDS).tobytes()


def id_count(blob: bytes) -> int:
    return len(blob) // _IDS.itemsize


def unpack_ids(blob: bytes) -> IdArray:
    return np.frombuffer(blob, dtype=_IDS).astype(np.int32)


def pack_logprobs(values: Sequence[float]) -> bytes:
    return np.asarray(values, dtype=_LOGPROBS).tobytes()


def unpack_logprobs(blob: bytes) -> list[float]:
    # float32 storage: exported values are the float32 nearest the engine's number.
    return [float(v) for v in np.frombuffer(blob, dtype=_LOGPROBS)]
