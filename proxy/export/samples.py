"""Export rows in the shapes trainers load without glue.

- merged: one row per segment path (prompt_ids, response_ids, loss_mask, rollout_logprobs, reward,
  weight versions, finish reasons, drift report);
- stepwise: one row per engine call with exactly the engine's prompt and output ids, loss mask all 1,
  samples of a trajectory contiguous, `is_last_step`, the reward on the last step's last token
  (the step-wise rules of SkyRL's GeneratorOutput);
- merge_steps: a prefix-aware merge of step-wise rows back into sequences.

Both modes leave out abandoned branches unless asked for (`branches="all"`); each row says its
`branch` (final, sample or abandoned: see branches.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.chat.renderer import Renderer
from proxy.export.branches import BranchFilter
from proxy.export.columns import as_lists
from proxy.export.drift import DriftMode
from proxy.export.rows import merged_rows_of, stepwise_rows_of
from proxy.export.summaries import summarize, token_calls
from proxy.store.models import CallRow, SessionRow
from proxy.weight_versions import row_versions, version_range

EXPORT_MODES = ("merged", "stepwise")


def merged_rows(
    session: SessionRow,
    calls: Sequence[CallRow],
    renderer: Renderer | None,
    drift_mode: DriftMode,
    branches: BranchFilter = "final",
) -> list[dict[str, Any]]:
    """One row per segment path (branch), its drift report rendered now; token columns as lists."""
    summaries = summarize(session, calls, renderer, drift_mode)
    return [as_lists(row) for row in merged_rows_of(session, summaries, token_calls(calls), branches)]


def stepwise_rows(
    session: SessionRow, calls: Sequence[CallRow], branches: BranchFilter = "final"
) -> list[dict[str, Any]]:
    """One row per completed call of the exported branches, in call order; the last one carries
    the session's reward. Token columns as lists."""
    summaries = summarize(session, calls, None, "disable")
    return [as_lists(row) for row in stepwise_rows_of(session, summaries, token_calls(calls), branches)]


class MergeRefused(ValueError):
    """A row disagrees with itself; merging it would invent tokens."""


# Per-step values a merged run lists in step order: (a step's key, a merged run's key).
_LISTED = (
    ("step", "steps"),
    ("call_id", "call_ids"),
    ("call_reward", "call_rewards"),
    ("finish_reason", "finish_reasons"),
    ("weight_version", "weight_versions"),
    ("adapter", "adapters"),
)
# Where a run gathers every version its rows' tokens were sampled with, until merging ends.
_VERSIONS = "_versions"
# Values a run takes from its first step, and from its last.
_FIRST = ("cursor", "session_id", "group_id", "sample_index", "group_size", "trajectory_id", "metadata")
_LAST = ("segment_id", "branch", "is_last_step", "finish_reason", "reward")


def _as_run(row: dict[str, Any]) -> dict[str, Any]:
    """A step-wise row, or an already merged one, as a run: its own masks and logprobs kept."""
    where = f"step {row.get('step', row.get('steps'))} of {row.get('trajectory_id')}"
    size = len(row["response_ids"])
    for key in ("loss_mask", "rollout_logprobs", "token_rewards"):
        if key in row and len(row[key]) != size:
            raise MergeRefused(f"{where}: {key} has {len(row[key])} entries for {size} response ids")
    if "loss_mask" not in row or "rollout_logprobs" not in row:
        raise MergeRefused(f"{where}: a row needs loss_mask and rollout_logprobs")
    if any(m not in (0, 1) for m in row["loss_mask"]):
        raise MergeRefused(f"{where}: a loss mask holds only 0 and 1")
    run = {key: row[key] for key in (*_FIRST, *_LAST) if key in row}
    run.setdefault("trajectory_id", row.get("session_id"))
    for key in ("prompt_ids", "response_ids", "loss_mask", "rollout_logprobs", "token_rewards"):
        if key in row:
            run[key] = list(row[key])
    for key in ("routed_experts", "response_routed_experts"):
        if key in row:
            run[key] = None if row[key] is None else list(row[key])
    for one, many in _LISTED:
        if many in row:
            run[many] = list(row[many])
        elif one in row:
            run[many] = [row[one]]
    run[_VERSIONS] = row_versions(row)
    return run


def _extend(run: dict[str, Any], other: dict[str, Any], observation: list[int]) -> None:
    gap = len(observation)
    run["response_ids"] += observation + other["response_ids"]
    run["loss_mask"] += [0] * gap + other["loss_mask"]
    run["rollout_logprobs"] += [0.0] * gap + other["rollout_logprobs"]
    if "token_rewards" in run and "token_rewards" in other:
        run["token_rewards"] += [0.0] * gap + other["token_rewards"]
    else:
        run.pop("token_rewards", None)
    _extend_experts(run, other, gap)
    run[_VERSIONS] += other[_VERSIONS]
    for _, many in _LISTED:
        if many in run and many in other:
            run[many] += other[many]
        else:
            run.pop(many, None)
    for key in _LAST:
        if key in other:
            run[key] = other[key]
        else:
            run.pop(key, None)


def _extend_experts(run: dict[str, Any], other: dict[str, Any], gap: int) -> None:
    """The later step's routings cover the merged run's positions (its prompt extends the run);
    per response token, the observation in between has none."""
    if "routed_experts" not in run or "routed_experts" not in other:
        run.pop("routed_experts", None)
        run.pop("response_routed_experts", None)
        return
    run["routed_experts"] = other["routed_experts"]
    before, after = run.get("response_routed_experts"), other.get("response_routed_experts")
    joined = None if before is None or after is None else [*before, *([None] * gap), *after]
    run["response_routed_experts"] = joined if other["routed_experts"] is not None else None


def _extended_run(
    runs: list[dict[str, Any]], other: dict[str, Any]
) -> tuple[dict[str, Any], list[int]] | None:
    """The most recent run of the same trajectory whose prompt + response the row's prompt extends."""
    prompt = other["prompt_ids"]
    for run in reversed(runs):
        if run["trajectory_id"] != other["trajectory_id"]:
            continue
        stream = run["prompt_ids"] + run["response_ids"]
        if len(prompt) >= len(stream) and prompt[: len(stream)] == stream:
            return run, prompt[len(stream) :]
    return None


def merge_steps(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge each step into the latest earlier run of its trajectory whose prompt + response is a
    prefix of the step's prompt; the tokens in between become observation (mask 0, logprob 0.0),
    the step's own response keeps its loss mask and logprobs. A step that extends no run starts one.

    Rows may be step-wise rows or already merged ones (merging is associative); a merged run lists
    its steps' `steps`, `call_ids`, `call_rewards`, `finish_reasons` and `weight_versions`, takes
    `segment_id`, `branch`, `is_last_step`, `finish_reason` and `reward` from its last step, and
    concatenates `token_rewards` (0.0 on observations)."""
    runs: list[dict[str, Any]] = []
    for row in steps:
        other = _as_run(row)
        found = _extended_run(runs, other)
        if found is None:
            runs.append(other)
        else:
            run, observation = found
            _extend(run, other, observation)
    for run in runs:
        if "call_ids" in run:
            run["num_calls"] = len(run["call_ids"])
        held = run.pop(_VERSIONS)
        if "weight_versions" in run:
            lowest, highest = version_range(held)  # spans included: a resumed call's older tokens
            run.update(weight_version_min=lowest, weight_version_max=highest)
    return runs
