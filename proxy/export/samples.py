"""Export rows in the shapes trainers load without glue.

- merged: one row per segment path (prompt_ids, response_ids, loss_mask, rollout_logprobs, reward,
  weight versions, finish reasons, drift report);
- stepwise: one row per engine call with exactly the engine's prompt and output ids, loss mask all 1,
  samples of a trajectory contiguous, `is_last_step`, the reward on the last step's last token
  (the step-wise rules of SkyRL's GeneratorOutput);
- merge_steps: a prefix-aware merge of step-wise rows back into sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.chat.renderer import Renderer
from proxy.export.drift import DriftMode
from proxy.export.trajectory import build_trajectories
from proxy.store.codec import unpack_ids, unpack_logprobs
from proxy.store.models import CallRow, SessionRow
from proxy.weight_versions import version_range, version_spans

EXPORT_MODES = ("merged", "stepwise")


def _versions(calls: Sequence[CallRow]) -> dict[str, Any]:
    versions = [c.weight_version for c in calls]
    lowest, highest = version_range(versions)  # as versions: "9" < "10", never as strings
    return {
        "weight_versions": versions,
        "weight_version_min": lowest,
        "weight_version_max": highest,
    }


def merged_rows(
    session: SessionRow, calls: Sequence[CallRow], renderer: Renderer | None, drift_mode: DriftMode
) -> list[dict[str, Any]]:
    rows = []
    trajectories = build_trajectories(
        calls,
        renderer=renderer,
        drift_mode=drift_mode,
        template_now=session.template_now,
        session_id=session.id,
    )
    for index, trajectory in enumerate(trajectories):
        rows.append(
            {
                "session_id": session.id,
                "sample_index": index,
                "segment_id": trajectory.segment_id,
                "call_ids": [c.id for c in trajectory.calls],
                "num_calls": len(trajectory.calls),
                "prompt_ids": trajectory.prompt_ids,
                "response_ids": trajectory.response_ids,
                "loss_mask": trajectory.loss_mask,
                "rollout_logprobs": trajectory.rollout_logprobs,
                "reward": session.reward,
                "call_rewards": [c.reward for c in trajectory.calls],
                "finish_reasons": [c.finish_reason for c in trajectory.calls],
                "boundary_edits": trajectory.boundary_edits,
                "drift": trajectory.drift,
                "metadata": session.meta,
                **_versions(trajectory.calls),
            }
        )
    return rows


def stepwise_rows(session: SessionRow, calls: Sequence[CallRow]) -> list[dict[str, Any]]:
    """One row per completed call, in call order; the last one carries the session's reward."""
    done = [c for c in calls if c.status == "ok"]
    contexts: dict[int, list[int]] = {}
    rows = []
    for index, call in enumerate(done):
        parent = contexts.get(call.parent_id) if call.parent_id is not None else []
        assert parent is not None, "a call's parent precedes it"
        prompt = parent + unpack_ids(call.prompt_added).tolist()
        output = unpack_ids(call.output_ids).tolist()
        contexts[call.id] = prompt + output
        last = index == len(done) - 1
        reward = session.reward if last and session.reward is not None else (call.reward or 0.0)
        token_rewards = [0.0] * len(output)
        if token_rewards:
            token_rewards[-1] = reward
        rows.append(
            {
                "session_id": session.id,
                "trajectory_id": session.id,
                "step": index,
                "call_id": call.id,
                "segment_id": call.segment_id,
                "is_last_step": last,
                "prompt_ids": prompt,
                "response_ids": output,
                "loss_mask": [1] * len(output),
                "rollout_logprobs": unpack_logprobs(call.output_logprobs),
                "reward": reward if last else (call.reward or 0.0),
                "token_rewards": token_rewards,
                "finish_reason": call.finish_reason,
                "weight_version": call.weight_version,
                "weight_version_spans": version_spans(
                    (call.engine_meta or {}).get("weight_versions"), call.weight_version, len(output)
                ),
                "metadata": session.meta,
            }
        )
    return rows


class MergeRefused(ValueError):
    """Two steps overlap or disagree; merging them would invent tokens."""


def merge_steps(steps: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Merge consecutive steps of one trajectory while prompt + response of the merged run is a
    prefix of the next step's prompt; the tokens in between become observation (mask 0, logprob 0.0).
    A step that does not extend the run starts a new sample."""
    merged: list[dict[str, Any]] = []
    for step in steps:
        run = merged[-1] if merged and merged[-1]["trajectory_id"] == step["trajectory_id"] else None
        if len(step["response_ids"]) != len(step["rollout_logprobs"]):
            raise MergeRefused(f"step {step['step']} of {step['trajectory_id']} has misaligned logprobs")
        if run is not None:
            stream = run["prompt_ids"] + run["response_ids"]
            prompt = step["prompt_ids"]
            if len(prompt) >= len(stream) and prompt[: len(stream)] == stream:
                observation = prompt[len(stream) :]
                run["response_ids"] += observation + step["response_ids"]
                run["loss_mask"] += [0] * len(observation) + [1] * len(step["response_ids"])
                run["rollout_logprobs"] += [0.0] * len(observation) + list(step["rollout_logprobs"])
                run["steps"].append(step["step"])
                run["reward"] = step["reward"]
                continue
        merged.append(
            {
                "trajectory_id": step["trajectory_id"],
                "steps": [step["step"]],
                "prompt_ids": list(step["prompt_ids"]),
                "response_ids": list(step["response_ids"]),
                "loss_mask": [1] * len(step["response_ids"]),
                "rollout_logprobs": list(step["rollout_logprobs"]),
                "reward": step["reward"],
            }
        )
    return merged
