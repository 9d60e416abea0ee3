"""Export rows as verl's padded rollout batch (verl 0.9.1, verl/experimental/agent_loop/agent_loop.py,
AgentLoopWorker._postprocess): prompts left-padded, responses right-padded, verl's key names.

    rows = list(client.iter_samples("merged", consumer="verl", whole_groups=True))
    batch = verl_batch(rows, pad_id=tokenizer.pad_token_id, as_torch=True)
    data = DataProto.from_dict(tensors=batch.tensors, non_tensors=batch.non_tensors)

numpy arrays by default; torch tensors with as_torch=True (torch is imported only then).

Rows with routed experts (--record-routed-experts) add verl's R3 routing-replay tensor
`routed_experts` (batch, prompt_length + response_length, layers, top_k), each row's routings placed
from its first prompt token on, zeros elsewhere (the layout of verl's agent loop
`_InternalAgentLoopOutput.routed_experts`, main as of 2026-11); it is left out unless every row has them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt


@dataclass
class VerlBatch:
    """DataProto's two parts: `batch` (tensors, one row per sample) and `non_tensor_batch`."""

    tensors: dict[str, Any]
    non_tensors: dict[str, npt.NDArray[Any]]


def _width(lengths: Sequence[int], limit: int | None, name: str) -> int:
    longest = max(lengths, default=0)
    if limit is None:
        return longest
    if longest > limit:
        # Never cut a recorded sequence: a trainer would learn from a context the model never saw.
        raise ValueError(f"a row has {longest} {name} tokens, more than {name}_length={limit}")
    return limit


def _arrays(rows: Sequence[dict[str, Any]], pad_id: int, prompt_w: int, response_w: int) -> dict[str, Any]:
    count = len(rows)
    prompts = np.full((count, prompt_w), pad_id, dtype=np.int64)
    responses = np.full((count, response_w), pad_id, dtype=np.int64)
    prompt_mask = np.zeros((count, prompt_w), dtype=np.int64)
    response_attention = np.zeros((count, response_w), dtype=np.int64)
    response_mask = np.zeros((count, response_w), dtype=np.int64)
    logprobs = np.zeros((count, response_w), dtype=np.float32)
    scores = np.zeros((count, response_w), dtype=np.float32)
    for i, row in enumerate(rows):
        prompt, response = row["prompt_ids"], row["response_ids"]
        if prompt:
            prompts[i, prompt_w - len(prompt) :] = prompt
            prompt_mask[i, prompt_w - len(prompt) :] = 1
        responses[i, : len(response)] = response
        response_attention[i, : len(response)] = 1
        response_mask[i, : len(response)] = row["loss_mask"]
        logprobs[i, : len(response)] = row["rollout_logprobs"]
        if response:  # verl puts the score on the last response token
            scores[i, len(response) - 1] = float(row.get("reward") or 0.0)
    attention = np.concatenate([prompt_mask, response_attention], axis=1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": np.concatenate([prompts, responses], axis=1),
        "attention_mask": attention,
        "position_ids": np.clip(np.cumsum(attention, axis=1) - 1, 0, None).astype(np.int64),
        "rollout_log_probs": logprobs,
        "rm_scores": scores,
    }


def verl_batch(
    rows: Sequence[dict[str, Any]],
    *,
    pad_id: int = 0,
    prompt_length: int | None = None,
    response_length: int | None = None,
    as_torch: bool = False,
) -> VerlBatch:
    """Merged rows (one sample each; mask 0 on tool results) as verl's rollout batch: `prompts`,
    `responses`, `response_mask`, `input_ids`, `attention_mask`, `position_ids`, `rollout_log_probs`,
    `rm_scores` (the reward on the last response token); non-tensors `uid` (the GRPO group, else the
    session: verl's advantage estimators group by it), `__num_turns__`, `session_id`."""
    if any("step" in row for row in rows):
        raise ValueError("verl_batch takes merged rows (mode=merged), or merge_steps(stepwise rows)")
    prompt_w = _width([len(r["prompt_ids"]) for r in rows], prompt_length, "prompt")
    response_w = _width([len(r["response_ids"]) for r in rows], response_length, "response")
    tensors = _arrays(rows, pad_id, prompt_w, response_w)
    experts = _routed_experts(rows, prompt_w, response_w)
    if experts is not None:
        tensors["routed_experts"] = experts
    if as_torch:
        import torch

        tensors = {key: torch.from_numpy(value) for key, value in tensors.items()}
    non_tensors = {
        "uid": np.array([str(r.get("group_id") or r["session_id"]) for r in rows], dtype=object),
        "session_id": np.array([r["session_id"] for r in rows], dtype=object),
        # As verl's agent loops count turns: the prompt, each assistant turn and each observation
        # between two (its tool agent loop's user_turns + assistant_turns + 1; a single turn is 2).
        "__num_turns__": np.array([2 * len(r.get("call_ids") or [1]) for r in rows], dtype=np.int32),
    }
    return VerlBatch(tensors, non_tensors)


def _routed_experts(rows: Sequence[dict[str, Any]], prompt_w: int, response_w: int) -> Any:
    """verl's routed_experts tensor, or None unless every row carries its routings."""
    if not rows or any(row.get("routed_experts") is None for row in rows):
        return None
    per_row = [np.asarray(row["routed_experts"], dtype=np.int32) for row in rows]
    layers, top_k = per_row[0].shape[1:]
    tensor = np.zeros((len(rows), prompt_w + response_w, layers, top_k), dtype=np.int32)
    for i, (row, experts) in enumerate(zip(rows, per_row, strict=True)):
        start = prompt_w - len(row["prompt_ids"])
        tensor[i, start : start + len(experts)] = experts
    return tensor
