"""Routed experts as engines send them: decoded against the positions asked for, refused when they do
not fit, joined over resumed attempts, stored in 1-2 bytes per expert slot."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import pytest

from proxy.engines.base import SamplingParams
from proxy.engines.local import _refuse_unsupported
from proxy.engines.routed_experts import ExpertsAsk, RoutedExperts, from_sglang, from_vllm
from proxy.errors import InvalidEngineAnswer, UnsupportedParameter
from proxy.model_source import routed_experts_shape


def _sglang(array: np.ndarray) -> str:
    return base64.b64encode(array.astype("<i4").tobytes()).decode()


def _npy(array: np.ndarray) -> str:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return base64.b64encode(buffer.getvalue()).decode()


ROWS = (np.arange(5 * 3 * 2).reshape(5, 3, 2) * 37) % 300  # ids past 255 too


def test_sglang_routings_are_read_in_the_models_shape() -> None:
    experts = from_sglang(_sglang(ROWS), ExpertsAsk(4, (3, 2)), end=9)
    assert (experts.start, experts.end) == (4, 9)
    assert experts.rows.tolist() == ROWS.tolist()


@pytest.mark.parametrize(
    ("raw", "ask", "end"),
    [
        (_sglang(ROWS), ExpertsAsk(4, (3, 2)), 10),  # one position short
        (_sglang(ROWS), ExpertsAsk(0, (3, 2)), 9),  # the whole sequence where a part was asked
        (_sglang(ROWS), ExpertsAsk(4, (4, 2)), 9),  # another shape
        (_sglang(ROWS), ExpertsAsk(4, None), 9),  # no shape known
        ("not base64!", ExpertsAsk(4, (3, 2)), 9),
        (_sglang(ROWS - 400), ExpertsAsk(4, (3, 2)), 9),  # negative ids
        (17, ExpertsAsk(4, (3, 2)), 9),
    ],
)
def test_routings_that_do_not_fit_the_request_are_engine_errors(
    raw: object, ask: ExpertsAsk, end: int
) -> None:
    with pytest.raises(InvalidEngineAnswer):
        from_sglang(raw, ask, end)


def test_vllm_routings_are_npy_arrays() -> None:
    assert from_vllm(_npy(ROWS.astype(np.int16)), ExpertsAsk(2), end=7).rows.tolist() == ROWS.tolist()
    with pytest.raises(InvalidEngineAnswer):
        from_vllm(_npy(ROWS[0]), ExpertsAsk(2), end=5)  # not (positions, layers, top_k)
    with pytest.raises(InvalidEngineAnswer):
        from_vllm(_sglang(ROWS), ExpertsAsk(2), end=7)  # raw int32, not .npy


def test_packing_keeps_every_id_in_one_or_two_bytes() -> None:
    small = RoutedExperts(3, ROWS % 256)
    wide = RoutedExperts(0, ROWS)
    for experts, itemsize in ((small, 1), (wide, 2)):
        blob = experts.pack()
        assert len(blob) == 9 + ROWS.size * itemsize
        back = RoutedExperts.unpack(blob)
        assert (back.start, back.rows.tolist()) == (experts.start, experts.rows.tolist())
    empty = RoutedExperts.unpack(RoutedExperts(7, np.zeros((0, 3, 2), dtype=np.int64)).pack())
    assert (empty.start, empty.rows.shape) == (7, (0, 3, 2))


def test_attempts_join_only_where_they_meet() -> None:
    first, second = RoutedExperts(0, ROWS[:2]), RoutedExperts(2, ROWS[2:])
    assert first.then(second).rows.tolist() == ROWS.tolist()
    with pytest.raises(InvalidEngineAnswer):
        first.then(RoutedExperts(3, ROWS[2:]))


def test_the_models_shape_comes_from_the_flag_or_its_config(tmp_path: Path) -> None:
    assert routed_experts_shape("48,8", []) == (48, 8)
    assert routed_experts_shape("48x8", []) == (48, 8)
    assert routed_experts_shape(None, [tmp_path, None]) is None
    (tmp_path / "config.json").write_text(
        '{"text_config": {"num_hidden_layers": 94, "num_experts_per_tok": 8}}'
    )
    assert routed_experts_shape(None, [None, tmp_path]) == (94, 8)


def test_the_local_engine_refuses_adapters_and_routings() -> None:
    for params in (
        SamplingParams(max_new_tokens=4, adapter="math-lora"),
        SamplingParams(max_new_tokens=4, routed_experts=ExpertsAsk(0)),
    ):
        with pytest.raises(UnsupportedParameter):
            _refuse_unsupported(params)
