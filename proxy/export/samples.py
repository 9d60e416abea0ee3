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
from proxy.export.branches import BranchFilter, branch_labels, kept
from proxy.export.drift import DriftMode
from proxy.export.experts import export_fields
from proxy.export.formats import BOUNDARY_EDIT_FIELDS, export_drift
from proxy.export.trajectory import build_trajectories
from proxy.store.codec import unpack_ids, unpack_logprobs
from proxy.store.models import CallRow, SessionRow
from proxy.weight_versions import version_range, version_spans

EXPORT_MODES = ("merged", "stepwise")


def _versions(versions: Sequence[str | None]) -> dict[str, Any]:
    lowest, highest = version_range(list(versions))  # as versions: "9" < "10", never as strings
    return {
        "weight_versions": list(versions),
        "weight_version_min": lowest,
        "weight_version_max": highest,
    }


def _full_edit(edit: dict[str, Any]) -> dict[str, Any]:
    """Every edit with every field (null where it does not apply): one shape in JSONL and Parquet."""
    return {**{name: edit.get(name) for name in BOUNDARY_EDIT_FIELDS}, **edit}


def group_fields(session: SessionRow) -> dict[str, Any]:
    """The session's GRPO group, first-class in every row (None when it has none)."""
    return {
        "group_id": session.group_id,
        "sample_index": session.sample_index,
        "group_size": session.group_size,
    }


def merged_rows(
    session: SessionRow,
    calls: Sequence[CallRow],
    renderer: Renderer | None,
    drift_mode: DriftMode,
    branches: BranchFilter = "final",
) -> list[dict[str, Any]]:
    rows = []
    trajectories = build_trajectories(
        calls,
        renderer=renderer,
        drift_mode=drift_mode,
        template_now=session.template_now,
        session_id=session.id,
        branches=branches,
    )
    # A branch's place among all the session's branches, so it names the same row whatever the filter.
    parents = {c.parent_id for c in calls if c.status == "ok"}
    leaves = {
        leaf: index
        for index, leaf in enumerate(c.id for c in calls if c.status == "ok" and c.id not in parents)
    }
    for trajectory in trajectories:
        rows.append(
            {
                "session_id": session.id,
                **group_fields(session),
                "path_index": leaves[trajectory.calls[-1].id],
                "segment_id": trajectory.segment_id,
                "branch": trajectory.branch,
                "call_ids": [c.id for c in trajectory.calls],
                "num_calls": len(trajectory.calls),
                "prompt_ids": trajectory.prompt_ids,
                "response_ids": trajectory.response_ids,
                "loss_mask": trajectory.loss_mask,
                "rollout_logprobs": trajectory.rollout_logprobs,
                "reward": session.reward,
                "call_rewards": [c.reward for c in trajectory.calls],
                "finish_reasons": [c.finish_reason for c in trajectory.calls],
                "boundary_edits": [_full_edit(edit) for edit in trajectory.boundary_edits],
                "drift": export_drift(trajectory.drift),
                "metadata": session.meta,
                **_versions([c.weight_version for c in trajectory.calls]),
                "adapters": [c.adapter for c in trajectory.calls],
                **export_fields(
                    trajectory.calls, trajectory.prompt_ids, trajectory.response_ids, trajectory.loss_mask
                ),
            }
        )
    return rows


def stepwise_rows(
    session: SessionRow, calls: Sequence[CallRow], branches: BranchFilter = "final"
) -> list[dict[str, Any]]:
    """One row per completed call of the exported branches, in call order; the last one carries
    the session's reward."""
    labels = branch_labels(calls)
    done = [c for c in calls if c.status == "ok" and kept(labels[c.id], branches)]
    contexts: dict[int, list[int]] = {}
    chains: dict[int, list[CallRow]] = {}
    rows = []
    for index, call in enumerate(done):
        # A kept call's parent is kept too: labels only worsen from the root down.
        parent = contexts.get(call.parent_id) if call.parent_id is not None else []
        assert parent is not None, "a call's parent precedes it"
        prompt = parent + unpack_ids(call.prompt_added).tolist()
        output = unpack_ids(call.output_ids).tolist()
        contexts[call.id] = prompt + output
        chains[call.id] = [*(chains[call.parent_id] if call.parent_id is not None else []), call]
        last = index == len(done) - 1
        reward = session.reward if last and session.reward is not None else (call.reward or 0.0)
        token_rewards = [0.0] * len(output)
        if token_rewards:
            token_rewards[-1] = reward
        rows.append(
            {
                "session_id": session.id,
                **group_fields(session),
                "trajectory_id": session.id,
                "step": index,
                "call_id": call.id,
                "segment_id": call.segment_id,
                "branch": labels[call.id],
                "is_last_step": last,
                "prompt_ids": prompt,
                "response_ids": output,
                "loss_mask": [1] * len(output),
                "rollout_logprobs": unpack_logprobs(call.output_logprobs),
                "reward": reward,
                "call_reward": call.reward,
                "token_rewards": token_rewards,
                "finish_reason": call.finish_reason,
                "weight_version": call.weight_version,
                "weight_version_spans": version_spans(
                    (call.engine_meta or {}).get("weight_versions"), call.weight_version, len(output)
                ),
                "metadata": session.meta,
                "model": (call.request.get("body") or {}).get("model"),
                "adapter": call.adapter,
                **export_fields(chains[call.id], prompt, output, [1] * len(output)),
            }
        )
    return rows


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
        if "weight_versions" in run:
            run.update(_versions(run["weight_versions"]))
    return runs
