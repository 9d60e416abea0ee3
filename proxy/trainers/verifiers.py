"""Export rows as verifiers' rollout outputs, the shape prime-rl's orchestrator trains on
(verifiers 0.1.14, verifiers/types.py: RolloutOutput, TrajectoryStep, TrajectoryStepTokens).

    steps = list(client.iter_samples("stepwise", consumer="prime-rl", whole_groups=True))
    outputs = rollout_outputs(steps)   # one per trajectory, its `trajectory` the engine calls
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def step_tokens(row: dict[str, Any]) -> dict[str, Any]:
    """TrajectoryStepTokens of one step-wise row: the engine's exact prompt and sampled ids."""
    return {
        "prompt_ids": list(row["prompt_ids"]),
        "prompt_mask": [0] * len(row["prompt_ids"]),
        "completion_ids": list(row["response_ids"]),
        "completion_mask": [int(m) for m in row["loss_mask"]],
        "completion_logprobs": [float(p) for p in row["rollout_logprobs"]],
        "overlong_prompt": False,
        "is_truncated": row["finish_reason"] == "length",
        # [seq_len, layers, top_k] for router replay: the row's positions but the last sampled token
        "routed_experts": row.get("routed_experts"),
    }


def trajectory_step(row: dict[str, Any]) -> dict[str, Any]:
    """A TrajectoryStep; messages are not in the export (the tokens are what is trained)."""
    return {
        "prompt": [],
        "completion": [],
        "response": None,
        "tokens": step_tokens(row),
        "reward": row["call_reward"],
        "advantage": None,
        "is_truncated": row["finish_reason"] == "length",
        "trajectory_id": row["trajectory_id"],
        "extras": {
            "session_id": row["session_id"],
            "call_id": row["call_id"],
            "branch": row["branch"],
            "weight_version": row["weight_version"],
        },
    }


def _example_ids(rows: Sequence[dict[str, Any]]) -> dict[str, int]:
    """verifiers numbers its examples, one number per example (its identity there): when every
    group id is a number written plainly (a dataset's row index), it is kept; else the groups are
    numbered in order. Never two groups under one number ("1" and "01", "1" and the first named)."""
    groups = list(dict.fromkeys(str(row.get("group_id") or row["session_id"]) for row in rows))
    if all(group.isdigit() and str(int(group)) == group for group in groups):
        return {group: int(group) for group in groups}
    return {group: number for number, group in enumerate(groups)}


def rollout_outputs(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One RolloutOutput per trajectory of step-wise rows (contiguous, as exported): `example_id`
    (its group), `reward` (the session's, 0.0 if unset), `trajectory` (its steps), `info`."""
    if any("step" not in row for row in rows):
        raise ValueError("rollout_outputs takes step-wise rows (mode=stepwise)")
    examples = _example_ids(rows)
    outputs: list[dict[str, Any]] = []
    for row in rows:
        if not outputs or outputs[-1]["info"]["session_id"] != row["session_id"]:
            group = str(row.get("group_id") or row["session_id"])
            outputs.append(
                {
                    "example_id": examples[group],
                    "prompt": None,
                    "completion": None,
                    "reward": 0.0,
                    "timing": None,
                    "is_completed": True,
                    "is_truncated": False,
                    "metrics": {},
                    "stop_condition": None,
                    "trajectory": [],
                    "info": {
                        "session_id": row["session_id"],
                        "group_id": row.get("group_id"),
                        "sample_index": row.get("sample_index"),
                    },
                }
            )
        output = outputs[-1]
        output["trajectory"].append(trajectory_step(row))
        if row["is_last_step"]:
            output["reward"] = float(row["reward"] or 0.0)
            output["is_truncated"] = row["finish_reason"] == "length"
            output["stop_condition"] = row["finish_reason"]
    return outputs
