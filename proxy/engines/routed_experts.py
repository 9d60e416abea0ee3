"""MoE routing replay: the experts each position was routed to, as engines send them, stored compactly.

What the engines send (read in their source):
- SGLang (python/sglang/srt/managers/io_struct.py at 001067f, GenerateReqInput; main in 2026-11): the
  request flags `return_routed_experts: bool` and `routed_experts_start_len: int` ("response covers
  `[routed_experts_start_len, seqlen - 1)`; must be in [0, prompt_tokens]"); the server needs
  `--enable-return-routed-experts`. The answer's `meta_info["routed_experts"]` is base64 of a C-order
  int32 array shaped (positions, num_hidden_layers, num_experts_per_tok)
  (tokenizer_manager.py encodes `val.numpy().tobytes()`; layers/moe/routed_experts_capturer.py sizes
  its buffers from hf_text_config's `num_hidden_layers` and `num_experts_per_tok`). The array says
  no shape, so the proxy needs the model's (config.json or --routed-experts-shape).
- vLLM (../shared/docs/vllm-generate.md, vLLM 0.33.0): `sampling_params.routed_experts_prompt_start`;
  each choice's `routed_experts` is base64 of a NumPy `.npy` array (tokens - 1, layers,
  experts_per_token) from that start on, the last sampled token excluded; sent in the last chunk.

Positions: row i is the forward pass whose input was token `start + i` of prompt + output, so the
last sampled token (never fed back) has none. A call asks from its parent's last sampled token on
(0 for a segment's first call), so the calls of a path cover positions [0, len(ids) - 1) without
overlap: the shape trainers take (slime's `Sample.rollout_routed_experts`,
(len(tokens) - 1, num_layers, moe_router_topk); verl's `AgentLoopOutput.routed_experts`, one row per
prompt + response position). The experts that sampled response token j are the row of position
`len(prompt) + j - 1`: what the token's logprob came from.

Stored as a 9-byte header (item size, start, layers, top_k) and the ids as uint8 (fewer than 256
experts) or uint16: 1-2 bytes per expert slot, a quarter to an eighth of the engines' int32.
"""

from __future__ import annotations

import base64
import binascii
import io
import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from proxy.errors import InvalidEngineAnswer

_HEADER = struct.Struct("<BIHH")  # item size, start position, layers, top_k


@dataclass(frozen=True)
class ExpertsAsk:
    """A request for routed experts from absolute position `start` on (at most the prompt's length);
    `shape` (layers, top_k) reads SGLang's shapeless array, None where unknown."""

    start: int
    shape: tuple[int, int] | None = None


@dataclass(frozen=True, eq=False)
class RoutedExperts:
    """rows[i]: the experts position start + i was routed to, shaped (positions, layers, top_k)."""

    start: int
    rows: npt.NDArray[np.int64]

    @property
    def end(self) -> int:
        return self.start + len(self.rows)

    def then(self, other: RoutedExperts) -> RoutedExperts:
        """These rows followed by another attempt's, which must start where these end."""
        if other.start != self.end or other.rows.shape[1:] != self.rows.shape[1:]:
            raise InvalidEngineAnswer(
                f"routed experts of a continued generation do not line up: positions "
                f"[{self.start}, {self.end}) then [{other.start}, {other.end})"
            )
        return RoutedExperts(self.start, np.concatenate([self.rows, other.rows]))

    def pack(self) -> bytes:
        layers, top_k = self.rows.shape[1:]
        dtype = np.uint8 if self.rows.size == 0 or int(self.rows.max()) < 256 else np.uint16
        header = _HEADER.pack(np.dtype(dtype).itemsize, self.start, layers, top_k)
        return header + self.rows.astype(dtype).tobytes()

    @staticmethod
    def unpack(blob: bytes) -> RoutedExperts:
        itemsize, start, layers, top_k = _HEADER.unpack_from(blob)
        dtype = np.uint8 if itemsize == 1 else np.uint16
        flat = np.frombuffer(blob, dtype=dtype, offset=_HEADER.size)
        return RoutedExperts(start, flat.astype(np.int64).reshape(-1, layers, top_k))


def _checked(rows: npt.NDArray[np.int64], ask: ExpertsAsk, end: int) -> RoutedExperts:
    if len(rows) != end - ask.start:
        raise InvalidEngineAnswer(
            f"the engine answered routed experts for {len(rows)} positions; positions "
            f"[{ask.start}, {end}) were asked for"
        )
    if rows.size and (int(rows.min()) < 0 or int(rows.max()) >= 1 << 16):
        raise InvalidEngineAnswer("the engine answered a routed expert id out of range")
    return RoutedExperts(ask.start, rows)


def _decoded(raw: object) -> bytes:
    if not isinstance(raw, str):
        raise InvalidEngineAnswer("the engine answered routed experts that are not base64 text")
    try:
        return base64.b64decode(raw, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidEngineAnswer("the engine answered routed experts that are not base64") from exc


def from_sglang(raw: object, ask: ExpertsAsk, end: int) -> RoutedExperts:
    """SGLang's `meta_info["routed_experts"]` for positions [ask.start, end)."""
    if ask.shape is None:
        raise InvalidEngineAnswer(
            "SGLang's routed experts carry no shape and the model's is unknown: set "
            "--routed-experts-shape LAYERS,TOP_K"
        )
    data = _decoded(raw)
    layers, top_k = ask.shape
    if len(data) % (4 * layers * top_k):
        raise InvalidEngineAnswer(
            f"SGLang's routed experts ({len(data)} bytes) are not int32 rows of {layers}x{top_k}"
        )
    rows = np.frombuffer(data, dtype="<i4").astype(np.int64).reshape(-1, layers, top_k)
    return _checked(rows, ask, end)


def from_vllm(raw: object, ask: ExpertsAsk, end: int) -> RoutedExperts:
    """vLLM's `routed_experts` (a base64 .npy array) for positions [ask.start, end)."""
    try:
        array = np.load(io.BytesIO(_decoded(raw)), allow_pickle=False)
    except ValueError as exc:
        raise InvalidEngineAnswer("vLLM answered routed experts that are not a .npy array") from exc
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise InvalidEngineAnswer(f"vLLM answered routed experts shaped {array.shape} of {array.dtype}")
    return _checked(array.astype(np.int64), ask, end)
