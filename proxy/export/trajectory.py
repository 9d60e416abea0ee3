"""A session's recorded calls as token trajectories: one per branch of each segment.

Per segment path: prompt_ids are the first call's prompt; response_ids interleave each call's
sampled output (loss mask 1, the engine's logprobs) with the ids the next call added (observation,
separator, generation prompt, synthesized close: mask 0, logprob 0.0). The prompt sent to the
engine for call k is always prompt_ids + response_ids[:offset_k] (invariant I6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from proxy.store.codec import unpack_ids, unpack_logprobs
from proxy.store.models import CallRow


@dataclass(frozen=True)
class SegmentTrajectory:
    segment_id: int
    call_ids: list[int]
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    finish_reasons: list[str]
    boundary_edits: list[dict[str, Any]]

    def as_json(self) -> dict[str, Any]:
        return {
            "segment_id": self.segment_id,
            "call_ids": self.call_ids,
            "num_calls": len(self.call_ids),
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "finish_reasons": self.finish_reasons,
            "boundary_edits": self.boundary_edits,
        }


def _path(leaf: CallRow, by_id: dict[int, CallRow]) -> list[CallRow]:
    chain = [leaf]
    while chain[-1].parent_id is not None:
        chain.append(by_id[chain[-1].parent_id])
    return chain[::-1]


def build_trajectories(calls: Sequence[CallRow]) -> list[SegmentTrajectory]:
    """One trajectory per leaf of every segment, in recording order. Aborted calls are left out."""
    done = [c for c in calls if c.status == "ok"]
    by_id = {c.id: c for c in done}
    has_child = {c.parent_id for c in done if c.parent_id is not None}
    trajectories = []
    for leaf in done:
        if leaf.id in has_child:
            continue
        chain = _path(leaf, by_id)
        prompt = unpack_ids(chain[0].prompt_added).tolist()
        response: list[int] = []
        mask: list[int] = []
        logprobs: list[float] = []
        edits: list[dict[str, Any]] = []
        for index, call in enumerate(chain):
            if index > 0:
                added = unpack_ids(call.prompt_added).tolist()
                # Edits are recorded at stream positions; trainers index the response.
                edits.extend(
                    {**edit, "call_id": call.id, "position": edit["position"] - len(prompt)}
                    for edit in call.boundary_edits
                )
                response.extend(added)
                mask.extend([0] * len(added))
                logprobs.extend([0.0] * len(added))
            output = unpack_ids(call.output_ids).tolist()
            response.extend(output)
            mask.extend([1] * len(output))
            logprobs.extend(unpack_logprobs(call.output_logprobs))
        trajectories.append(
            SegmentTrajectory(
                segment_id=leaf.segment_id,
                call_ids=[c.id for c in chain],
                prompt_ids=prompt,
                response_ids=response,
                loss_mask=mask,
                rollout_logprobs=logprobs,
                finish_reasons=[c.finish_reason for c in chain],
                boundary_edits=edits,
            )
        )
    return trajectories
