"""Export rows from a session's branch summaries and its calls' token blobs: no render, no Python
object per token (token columns are proxy.export.columns values until they are written)."""

from __future__ import annotations

from typing import Any

from proxy.export.branches import BranchFilter, kept
from proxy.export.columns import Ids, Logprobs, Mask, Piece, TokenRewards
from proxy.export.experts import export_fields
from proxy.export.formats import export_drift
from proxy.export.summaries import Summary, default_spans, versions
from proxy.store.codec import id_count
from proxy.store.models import SessionRow
from proxy.store.repository import TokenCall


def group_fields(session: SessionRow) -> dict[str, Any]:
    """The session's GRPO group, first-class in every row (None when it has none)."""
    return {
        "group_id": session.group_id,
        "sample_index": session.sample_index,
        "group_size": session.group_size,
    }


def _added(call: TokenCall) -> Piece:
    return (2 * call.id, call.prompt_added)


def _output(call: TokenCall) -> Piece:
    return (2 * call.id + 1, call.output_ids)


def _logprobs(call: TokenCall) -> Piece:
    return (2 * call.id + 1, call.output_logprobs)


def _merged_tokens(path: list[TokenCall]) -> dict[str, Any]:
    """prompt_ids: the first call's prompt; response_ids: each output (mask 1, the engine's logprobs)
    after the ids the next call added (mask 0, logprob 0.0)."""
    ids: list[Piece] = []
    mask: list[tuple[int, int]] = []
    logprobs: list[Piece | int] = []
    for index, call in enumerate(path):
        if index > 0:
            added = id_count(call.prompt_added)
            ids.append(_added(call))
            mask.append((0, added))
            logprobs.append(added)
        ids.append(_output(call))
        mask.append((1, id_count(call.output_ids)))
        logprobs.append(_logprobs(call))
    return {
        "prompt_ids": Ids((_added(path[0]),)),
        "response_ids": Ids(tuple(ids)),
        "loss_mask": Mask(tuple(mask)),
        "rollout_logprobs": Logprobs(tuple(logprobs)),
    }


def merged_rows_of(
    session: SessionRow, summaries: dict[int, Summary], calls: dict[int, TokenCall], branches: BranchFilter
) -> list[dict[str, Any]]:
    """One row per kept branch, in the order of their leaf calls."""
    rows = []
    for summary in sorted(summaries.values(), key=lambda s: int(s["path_index"])):
        if not kept(summary["labels"][-1], branches):
            continue
        path = [calls[call_id] for call_id in summary["call_ids"]]
        tokens = _merged_tokens(path)
        rows.append(
            {
                "session_id": session.id,
                **group_fields(session),
                "path_index": summary["path_index"],
                "segment_id": summary["segment_id"],
                "branch": summary["labels"][-1],
                "call_ids": summary["call_ids"],
                "num_calls": len(path),
                **tokens,
                "reward": session.reward,
                "call_rewards": [c.reward for c in path],
                "finish_reasons": summary["finish_reasons"],
                "boundary_edits": summary["boundary_edits"],
                # Counted anew: a summary stored before a kind existed has no count for it.
                "drift": export_drift(summary["drift"]),
                "metadata": session.meta,
                # Counted anew: summaries stored before the spans were counted in min and max.
                **versions(summary["weight_versions"], summary["spans"]),
                "adapters": summary["adapters"],
                **_experts(path, id_count(path[0].prompt_added), tokens["loss_mask"]),
            }
        )
    return rows


def _experts(path: list[TokenCall], prompt_len: int, mask: Mask) -> dict[str, Any]:
    """The row's routed experts (proxy.export.experts); per-token lists only where they were recorded."""
    if all(call.routed_experts is None for call in path):
        return {"routed_experts": None, "response_routed_experts": None}
    flat = [value for value, count in mask.runs for _ in range(count)]
    return export_fields(path, range(prompt_len), range(len(flat)), flat)


def _steps(summaries: dict[int, Summary]) -> dict[int, tuple[Summary, int]]:
    """Each call on a branch: a summary of a branch through it and its place on that branch."""
    steps: dict[int, tuple[Summary, int]] = {}
    for leaf in sorted(summaries):
        for position, call_id in enumerate(summaries[leaf]["call_ids"]):
            steps.setdefault(call_id, (summaries[leaf], position))
    return steps


def _prompt(summary: Summary, position: int, calls: dict[int, TokenCall]) -> Ids:
    """What the engine got for the call at `position`: the path's earlier prompts and outputs, then
    what this call added."""
    pieces: list[Piece] = []
    for call_id in summary["call_ids"][:position]:
        pieces += (_added(calls[call_id]), _output(calls[call_id]))
    pieces.append(_added(calls[summary["call_ids"][position]]))
    return Ids(tuple(pieces))


def _step_reward(session_reward: float | None, call_reward: float | None, *, ends_path: bool) -> float | None:
    """A step's reward: where a path ends, the session's (its call's if the session has none, null if
    neither); elsewhere its call's, 0.0 if unset."""
    if not ends_path:
        return call_reward or 0.0
    return session_reward if session_reward is not None else call_reward


def stepwise_rows_of(
    session: SessionRow, summaries: dict[int, Summary], calls: dict[int, TokenCall], branches: BranchFilter
) -> list[dict[str, Any]]:
    """One row per completed call of the kept branches, in call order. The last step of each path
    (the final branch's, each sample's: where a merged row ends) carries the session's reward, or
    its call's where the session has none (null if neither is set); other steps their call reward
    or 0.0."""
    steps = _steps(summaries)
    done = [c for c in sorted(steps) if kept(steps[c][0]["labels"][steps[c][1]], branches)]
    rows = []
    for index, call_id in enumerate(done):
        summary, position = steps[call_id]
        call = calls[call_id]
        size = id_count(call.output_ids)
        last = index == len(done) - 1
        ends_path = call_id in summaries  # summaries are keyed by the call each path ends at
        reward = _step_reward(session.reward, call.reward, ends_path=ends_path)
        prompt = _prompt(summary, position, calls)
        rows.append(
            {
                "session_id": session.id,
                **group_fields(session),
                "trajectory_id": session.id,
                "step": index,
                "call_id": call_id,
                "segment_id": summary["segment_id"],
                "branch": summary["labels"][position],
                "is_last_step": last,
                "prompt_ids": prompt,
                "response_ids": Ids((_output(call),)),
                "loss_mask": Mask(((1, size),)),
                "rollout_logprobs": Logprobs((_logprobs(call),)),
                "reward": reward,
                "call_reward": call.reward,
                "token_rewards": TokenRewards(size, reward or 0.0),
                "finish_reason": summary["finish_reasons"][position],
                "weight_version": summary["weight_versions"][position],
                "weight_version_spans": summary["spans"][position]
                or default_spans(summary["weight_versions"][position], size),
                "metadata": session.meta,
                "model": summary["models"][position],
                "adapter": summary["adapters"][position],
                **_experts(
                    [calls[c] for c in summary["call_ids"][: position + 1]], len(prompt), Mask(((1, size),))
                ),
            }
        )
    return rows
