"""Export rows as SkyRL's GeneratorOutput (skyrl-train 0.3.1, skyrl_train/generators/base.py),
merged (one sequence per row) or step-wise (one row per engine call, `is_last_step` set).

    rows = list(client.iter_samples("stepwise", consumer="skyrl", whole_groups=True))
    output = generator_output(rows)   # return it from your SkyRL generator's generate()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# GeneratorOutput's keys in skyrl-train 0.3.1 (a TypedDict there).
GENERATOR_OUTPUT_KEYS = (
    "prompt_token_ids",
    "response_ids",
    "rewards",
    "loss_masks",
    "stop_reasons",
    "rollout_metrics",
    "rollout_logprobs",
    "trajectory_ids",
    "is_last_step",
)


@dataclass
class TrajectoryID:
    """SkyRL's TrajectoryID (same fields); skyrl_train's own class is used when it is installed."""

    instance_id: str  # the prompt: the GRPO group
    repetition_id: int  # which sample of that prompt

    def to_string(self) -> str:
        return f"{self.instance_id}_{self.repetition_id}"


def _trajectory_id_class() -> Any:
    try:
        from skyrl_train.generators.base import TrajectoryID as SkyrlTrajectoryID  # type: ignore[import-not-found]
    except ImportError:
        return TrajectoryID
    return SkyrlTrajectoryID


def trajectory_ids(rows: Sequence[dict[str, Any]], stepwise: bool) -> list[Any]:
    """Each row's TrajectoryID: `instance_id` is its prompt (the GRPO group, else the session),
    `repetition_id` numbers the trajectories of that prompt in export order (sessions by their
    sample index); a step-wise trajectory is a session, a merged one a row."""
    make = _trajectory_id_class()
    numbers: dict[str, dict[tuple[str, int], int]] = {}
    ids = []
    for index, row in enumerate(rows):
        instance = str(row.get("group_id") or row["session_id"])
        key = (row["session_id"], 0 if stepwise else index)
        seen = numbers.setdefault(instance, {})
        repetition = seen.setdefault(key, len(seen))
        ids.append(make(instance_id=instance, repetition_id=repetition))
    return ids


def _is_stepwise(rows: Sequence[dict[str, Any]]) -> bool:
    kinds = {"step" in row for row in rows}
    if len(kinds) > 1:
        raise ValueError("mix of step-wise and merged rows: export one mode")
    return kinds == {True}


def generator_output(rows: Sequence[dict[str, Any]], *, order: Sequence[str] | None = None) -> dict[str, Any]:
    """A GeneratorOutput dict. Merged rows: one reward per sequence (the session's, 0.0 if unset).
    Step-wise rows: token-level rewards (the session's reward on the last token of each path's last
    step), and
    `is_last_step`; rows of one trajectory must be contiguous, as the export delivers them.
    `order`: session ids in the generator input's order (SkyRL wants its outputs in that order)."""
    if order is not None:
        place = {session_id: index for index, session_id in enumerate(order)}
        missing = {row["session_id"] for row in rows} - place.keys()
        if missing:
            raise ValueError(f"rows of sessions not in order: {sorted(missing)}")
        rows = sorted(rows, key=lambda row: place[row["session_id"]])  # stable: steps keep their order
    stepwise = _is_stepwise(rows)
    if stepwise:
        rewards: list[Any] = [[float(r) for r in row["token_rewards"]] for row in rows]
        stop_reasons = [row["finish_reason"] for row in rows]
    else:
        rewards = [float(row["reward"] or 0.0) for row in rows]
        stop_reasons = [row["finish_reasons"][-1] for row in rows]
    return {
        "prompt_token_ids": [list(row["prompt_ids"]) for row in rows],
        "response_ids": [list(row["response_ids"]) for row in rows],
        "rewards": rewards,
        "loss_masks": [[int(m) for m in row["loss_mask"]] for row in rows],
        "stop_reasons": stop_reasons,
        "rollout_metrics": None,
        "rollout_logprobs": [[float(p) for p in row["rollout_logprobs"]] for row in rows],
        "trajectory_ids": trajectory_ids(rows, stepwise),
        "is_last_step": [bool(row["is_last_step"]) for row in rows] if stepwise else None,
    }
