"""Routed experts in export rows: positions [0, len(ids) - 1) of a row's prompt + response, the
shape trainers replay (slime's rollout_routed_experts, verl's routed_experts), and per response
token the experts of the forward pass that sampled it, aligned with the loss mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from proxy.engines.routed_experts import RoutedExperts

Rows = list[list[list[int]]]


class Routed(Protocol):
    """A recorded call (its row, or the export's light view of it)."""

    @property
    def routed_experts(self) -> bytes | None: ...


def path_experts(calls: Sequence[Routed], length: int) -> Rows | None:
    """The routings of a path's calls over positions [0, length - 1), or None unless every call
    recorded its part and the parts cover every position once."""
    if not calls or any(call.routed_experts is None for call in calls):
        return None
    parts = [RoutedExperts.unpack(call.routed_experts) for call in calls if call.routed_experts is not None]
    position = 0
    for part in parts:
        if part.start != position or part.rows.shape[1:] != parts[0].rows.shape[1:]:
            return None
        position = part.end
    if parts[0].start != 0 or position != length - 1:
        return None
    rows: Rows = np.concatenate([part.rows for part in parts]).tolist()
    return rows


def per_response_token(rows: Rows | None, prompt_len: int, loss_mask: Sequence[int]) -> list[Any] | None:
    """For each response token, the experts of the forward pass that sampled it (position
    prompt_len + j - 1); null at mask-0 positions, which nothing sampled."""
    if rows is None:
        return None
    return [rows[prompt_len + j - 1] if mask == 1 else None for j, mask in enumerate(loss_mask)]


def export_fields(
    calls: Sequence[Routed], prompt: Sequence[int], response: Sequence[int], mask: Sequence[int]
) -> dict[str, Any]:
    rows = path_experts(calls, len(prompt) + len(response))
    return {
        "routed_experts": rows,
        "response_routed_experts": per_response_token(rows, len(prompt), mask),
    }
