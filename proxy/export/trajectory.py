"""A session's recorded calls as token trajectories: one per branch of each segment.

Per segment path: prompt_ids are the first call's prompt; response_ids interleave each call's
sampled output (loss mask 1, the engine's logprobs) with the ids the next call added (observation,
separator, generation prompt, synthesized close: mask 0, logprob 0.0). The prompt sent to the
engine for call k is always prompt_ids + response_ids[:offset_k] (invariant I6). Each trajectory
carries a drift report against a fresh render of its messages, and its branch label (branches.py):
abandoned branches are left out unless asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from proxy.chat.renderer import Renderer
from proxy.errors import TemplateError
from proxy.export.branches import Branch, BranchFilter, branch_labels, kept
from proxy.export.drift import DriftClassifier, DriftMode, StreamFacts, report
from proxy.export.experts import export_fields
from proxy.store.codec import id_count, unpack_ids, unpack_logprobs
from proxy.store.models import CallRow
from proxy.store.prompts import chain_conversation, chain_tools

log = logging.getLogger("tito_proxy.export")


@dataclass(frozen=True)
class SegmentTrajectory:
    segment_id: int
    calls: list[CallRow]
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    rollout_logprobs: list[float]
    boundary_edits: list[dict[str, Any]]
    branch: Branch = "final"
    drift: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "segment_id": self.segment_id,
            "call_ids": [c.id for c in self.calls],
            "num_calls": len(self.calls),
            "prompt_ids": self.prompt_ids,
            "response_ids": self.response_ids,
            "loss_mask": self.loss_mask,
            "rollout_logprobs": self.rollout_logprobs,
            "finish_reasons": [c.finish_reason for c in self.calls],
            "boundary_edits": self.boundary_edits,
            "branch": self.branch,
            "drift": self.drift,
            "adapters": [c.adapter for c in self.calls],
            **export_fields(self.calls, self.prompt_ids, self.response_ids, self.loss_mask),
        }


def call_path(leaf: CallRow, by_id: dict[int, CallRow]) -> list[CallRow]:
    """The calls from the segment's first one down to `leaf`."""
    chain = [leaf]
    while chain[-1].parent_id is not None:
        chain.append(by_id[chain[-1].parent_id])
    return chain[::-1]


def _assemble(chain: list[CallRow], branch: Branch) -> SegmentTrajectory:
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
    return SegmentTrajectory(chain[-1].segment_id, chain, prompt, response, mask, logprobs, edits, branch)


def drift_report(
    trajectory: SegmentTrajectory, renderer: Renderer, mode: DriftMode, template_now: datetime
) -> dict[str, Any]:
    last = trajectory.calls[-1]
    if any(call.request.get("kind") == "completion" for call in trajectory.calls):
        return {"mode": mode, "skipped": "text completions have no messages for a chat-template render"}
    messages = chain_conversation(trajectory.calls)
    try:
        render = renderer.render_prompt(
            messages,
            tools=chain_tools(trajectory.calls),
            template_kwargs=last.request.get("chat_template_kwargs"),
            now=template_now,
            add_generation_prompt=False,
        )
    except TemplateError as exc:
        return {"mode": mode, "error": exc.message}
    prompt_len = len(trajectory.prompt_ids)
    synthesized = frozenset(
        e["position"] + prompt_len
        for e in trajectory.boundary_edits
        if e["kind"] == "truncation_close_synthesized"
    )
    facts = StreamFacts(
        ids=trajectory.prompt_ids + trajectory.response_ids,
        sampled=[False] * prompt_len + [m == 1 for m in trajectory.loss_mask],
        synthesized=synthesized,
        close_ids=renderer.close_token_ids,
        system_texts=tuple(_text_of(m) for m in messages if m.get("role") in ("system", "developer")),
        call_starts=_tool_call_outputs(trajectory.calls, prompt_len),
    )
    added = frozenset(int(i) for i in renderer.tokenizer.get_added_tokens_decoder())
    differences = DriftClassifier(renderer.decode, renderer.special_ids, added).compare(facts, render)
    return report(differences, mode, prompt_len)


def _tool_call_outputs(calls: list[CallRow], prompt_len: int) -> frozenset[int]:
    """Where the output of each call answered with tool calls starts in the stream."""
    starts, position = set(), prompt_len
    for index, call in enumerate(calls):
        if index > 0:
            position += id_count(call.prompt_added)
        if call.response_message.get("tool_calls"):
            starts.add(position)
        position += id_count(call.output_ids)
    return frozenset(starts)


def path_drift(
    path: list[CallRow], renderer: Renderer, mode: DriftMode, template_now: datetime, session_id: str
) -> dict[str, Any]:
    """The drift report of one segment path: the one build_trajectories attaches, logged the same way."""
    trajectory = _assemble(path, "final")
    drift = drift_report(trajectory, renderer, mode, template_now)
    _log_drift(session_id, SegmentTrajectory(**{**trajectory.__dict__, "drift": drift}))
    return drift


def _text_of(message: dict[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def build_trajectories(
    calls: Sequence[CallRow],
    *,
    renderer: Renderer | None = None,
    drift_mode: DriftMode = "disable",
    template_now: datetime | None = None,
    session_id: str = "",
    branches: BranchFilter = "final",
) -> list[SegmentTrajectory]:
    """One trajectory per leaf of every segment, in recording order, abandoned ones only with
    `branches="all"`. Aborted calls are left out."""
    done = [c for c in calls if c.status == "ok"]
    by_id = {c.id: c for c in done}
    has_child = {c.parent_id for c in done if c.parent_id is not None}
    labels = branch_labels(done)
    trajectories = []
    for leaf in done:
        if leaf.id in has_child or not kept(labels[leaf.id], branches):
            continue
        trajectory = _assemble(call_path(leaf, by_id), labels[leaf.id])
        if renderer is not None and drift_mode != "disable" and template_now is not None:
            drift = drift_report(trajectory, renderer, drift_mode, template_now)
            trajectory = SegmentTrajectory(**{**trajectory.__dict__, "drift": drift})
            _log_drift(session_id, trajectory)
        trajectories.append(trajectory)
    return trajectories


def _log_drift(session_id: str, trajectory: SegmentTrajectory) -> None:
    drift = trajectory.drift
    if drift.get("counts"):
        # Debug only: an export logs one line per request (with the drift totals), not one per segment.
        log.debug("session %s segment %s drift %s", session_id, trajectory.segment_id, drift["counts"])
    for difference in drift.get("differences", []):
        if not difference["allowed"]:
            log.warning(
                "session %s segment %s: unclassified drift at stream position %s: %r vs %r",
                session_id,
                trajectory.segment_id,
                difference["position"],
                difference["stream_text"][:80],
                difference["render_text"][:80],
            )
