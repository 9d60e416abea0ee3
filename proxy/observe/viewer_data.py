"""What the trajectory viewer shows, as JSON: session summaries, the call tree, a path's tokens."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from proxy.app_state import AppState
from proxy.errors import ProxyError
from proxy.export.branches import branch_labels
from proxy.export.trajectory import SegmentTrajectory, build_trajectories
from proxy.store.codec import unpack_ids
from proxy.store.models import CallRow, SessionRow
from proxy.store.prompts import chain_conversation, chain_tools
from proxy.store.repository import utc_iso


def trajectories(state: AppState, session: SessionRow, calls: Sequence[CallRow]) -> list[SegmentTrajectory]:
    """Every path of the session, abandoned ones too, each with its drift report."""
    mode = state.settings.drift_report
    return build_trajectories(
        calls,
        renderer=state.renderer,
        drift_mode="strict" if mode == "disable" else mode,
        template_now=session.template_now,
        session_id=session.id,
        branches="all",
    )


def group_of(session: SessionRow) -> Any:
    """The session's GRPO group (group_id), else the `group` its metadata names (the viewer's
    convention before sessions had groups)."""
    return session.group_id if session.group_id is not None else (session.meta or {}).get("group")


def summary(
    session: SessionRow, calls: Sequence[CallRow], paths: Sequence[SegmentTrajectory] | None
) -> dict[str, Any]:
    """A session at a glance; `drift_kinds` is None when its paths (and their drift) were not built."""
    versions = sorted({c.weight_version for c in calls if c.weight_version is not None})
    drift: set[str] = set()
    for path in paths or []:
        drift.update(path.drift.get("counts", {}))
    return {
        "id": session.id,
        "status": session.status,
        "group": group_of(session),
        "created_at": utc_iso(session.created_at),
        "finished_at": utc_iso(session.finished_at) if session.finished_at else None,
        "reward": session.reward,
        "num_calls": len(calls),
        "num_segments": len({c.segment_id for c in calls}),
        "num_paths": len(paths) if paths is not None else None,
        "weight_versions": versions,
        "drift_kinds": sorted(drift) if paths is not None else None,
        "metadata": session.meta,
    }


def call_tree(calls: Sequence[CallRow]) -> list[dict[str, Any]]:
    """The calls as a tree (parent ids), with their branch labels and what opened each segment."""
    labels = branch_labels(calls)
    first_segment = calls[0].segment_id if calls else None
    return [
        {
            "id": c.id,
            "parent_id": c.parent_id,
            "segment_id": c.segment_id,
            "depth": c.depth,
            "status": c.status,
            "branch": labels.get(c.id, "aborted"),
            "choice": c.finish_detail.get("choice"),
            "request_id": c.finish_detail.get("request_id"),
            "finish_reason": c.finish_reason,
            "weight_version": c.weight_version,
            "reward": c.reward,
            # A call without a parent opened its segment with a fresh render.
            "opens_segment": c.parent_id is None,
            "segment_reason": None if c.parent_id is not None else _segment_reason(c, first_segment),
            "timings": c.timings,
        }
        for c in calls
    ]


def _segment_reason(call: CallRow, first_segment: int | None) -> str:
    recorded = call.finish_detail.get("segment_reason")
    if recorded:
        return str(recorded)
    return "new_conversation" if call.segment_id == first_segment else "fresh_render"  # older records


def _call_spans(path: SegmentTrajectory) -> list[dict[str, Any]]:
    """Where each call's sampled output sits in the stream (prompt + response), and what it said."""
    spans = []
    position = len(path.prompt_ids)
    for index, call in enumerate(path.calls):
        if index > 0:
            position += len(unpack_ids(call.prompt_added))
        size = len(unpack_ids(call.output_ids))
        message = call.response_message or {}
        spans.append(
            {
                "call_id": call.id,
                "prompt_end": position,
                "start": position,
                "end": position + size,
                "weight_version": call.weight_version,
                "finish_reason": call.finish_reason,
                "reward": call.reward,
                "reasoning": message.get("reasoning_content"),
                "content": message.get("content"),
                "tool_calls": message.get("tool_calls"),
            }
        )
        position += size
    return spans


def _fresh_render(state: AppState, session: SessionRow, path: SegmentTrajectory) -> dict[str, Any]:
    last = path.calls[-1]
    if any(call.request.get("kind") == "completion" for call in path.calls):
        return {"error": "text completions have no messages to render"}
    try:
        ids = state.renderer.render_prompt(
            chain_conversation(path.calls),
            tools=chain_tools(path.calls),
            template_kwargs=last.request.get("chat_template_kwargs"),
            now=session.template_now,
            add_generation_prompt=False,
        )
    except ProxyError as exc:
        return {"error": exc.message}
    specials = state.renderer.special_ids
    return {
        "ids": ids,
        "pieces": [state.pieces.text_of(t) for t in ids],
        "special": [int(t in specials) for t in ids],
    }


def tokens(state: AppState, session: SessionRow, path: SegmentTrajectory, index: int) -> dict[str, Any]:
    """One path token by token, in stream positions (prompt + response)."""
    prompt_len = len(path.prompt_ids)
    ids = path.prompt_ids + path.response_ids
    specials = state.renderer.special_ids
    return {
        "session_id": session.id,
        "path": index,
        "segment_id": path.segment_id,
        "branch": path.branch,
        "reward": session.reward,
        "prompt_len": prompt_len,
        "ids": ids,
        "pieces": [state.pieces.text_of(t) for t in ids],
        "special": [int(t in specials) for t in ids],
        "mask": [0] * prompt_len + path.loss_mask,
        "logprobs": [0.0] * prompt_len + path.rollout_logprobs,
        "edits": [{**edit, "position": edit["position"] + prompt_len} for edit in path.boundary_edits],
        "drift": path.drift.get("differences", []),
        "drift_counts": path.drift.get("counts", {}),
        "calls": _call_spans(path),
        "render": _fresh_render(state, session, path),
    }
