"""What exporting a branch (a segment path ending at a leaf call) needs beyond its calls' token blobs:
labels, per-call lists, boundary edits and the drift report. Computed once when the session finishes
(the render of the drift report is the costly part) and stored; export only reads it. A finished
session without stored summaries (finished before they existed, or whose finish failed to store
them) gets them on its first export; an active session's are computed afresh each time."""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

import orjson
from sqlalchemy.ext.asyncio import AsyncSession as DbSession

from proxy.chat.renderer import Renderer
from proxy.export.branches import branch_labels
from proxy.export.drift import DriftMode
from proxy.export.formats import BOUNDARY_EDIT_FIELDS, export_drift
from proxy.export.trajectory import call_path, path_drift
from proxy.store.codec import id_count
from proxy.store.models import CallRow, SessionRow
from proxy.store.repository import Repository, TokenCall
from proxy.weight_versions import span_versions, version_range, version_spans

log = logging.getLogger("tito_proxy.export")
Summary = dict[str, Any]
DbSessions = Callable[[], AbstractAsyncContextManager[DbSession]]


def versions(
    values: Sequence[str | None], spans: Sequence[Sequence[dict[str, object]] | None] = ()
) -> dict[str, Any]:
    """The calls' versions, and the oldest and newest of them and of their tokens' spans (a call
    resumed across a weight update holds tokens of an older version than its own)."""
    held = [v for call_spans in spans for v in span_versions(call_spans or [])]
    lowest, highest = version_range([*values, *held])  # as versions: "9" < "10", never as strings
    return {"weight_versions": list(values), "weight_version_min": lowest, "weight_version_max": highest}


def full_edit(edit: dict[str, Any]) -> dict[str, Any]:
    """Every edit with every field (null where it does not apply): one shape in JSONL and Parquet."""
    return {**{name: edit.get(name) for name in BOUNDARY_EDIT_FIELDS}, **edit}


def _summary(path: list[CallRow], index: int, labels: dict[int, Any], drift: dict[str, Any]) -> Summary:
    prompt_len = id_count(path[0].prompt_added)
    return {
        "path_index": index,  # the branch's place among all the session's branches
        "segment_id": path[-1].segment_id,
        "call_ids": [c.id for c in path],
        "labels": [labels[c.id] for c in path],
        "finish_reasons": [c.finish_reason for c in path],
        # Edits are recorded at stream positions; trainers index the response.
        "boundary_edits": [
            full_edit({**edit, "call_id": c.id, "position": edit["position"] - prompt_len})
            for c in path[1:]
            for edit in c.boundary_edits
        ],
        "drift": export_drift(drift),
        # Per-token weight versions where the engine gave them (a resumed call), else null: one
        # span of the call's version, made at export.
        **versions([c.weight_version for c in path], spans := [_engine_spans(c) for c in path]),
        "spans": spans,
        # Per call: the request's `model` as sent and the LoRA adapter it was sampled with.
        "models": [(c.request.get("body") or {}).get("model") for c in path],
        "adapters": [c.adapter for c in path],
    }


def _engine_spans(call: CallRow) -> list[dict[str, object]] | None:
    size = id_count(call.output_ids)
    spans = version_spans((call.engine_meta or {}).get("weight_versions"), call.weight_version, size)
    return None if spans == default_spans(call.weight_version, size) else spans


def default_spans(version: str | None, size: int) -> list[dict[str, object]]:
    return version_spans(None, version, size)


def encode(summary: Summary) -> bytes:
    """A summary as stored: compressed JSON (drift reports repeat their kinds and texts)."""
    return zlib.compress(orjson.dumps(summary))


def decode(blob: bytes) -> Summary:
    summary: Summary = orjson.loads(zlib.decompress(blob))
    return summary


def summarize(
    session: SessionRow, calls: Sequence[CallRow], renderer: Renderer | None, mode: DriftMode
) -> dict[int, Summary]:
    """The summary of every branch of the session (abandoned ones too), by leaf call id."""
    done = [c for c in calls if c.status == "ok"]
    by_id = {c.id: c for c in done}
    labels = branch_labels(done)
    parents = {c.parent_id for c in done}
    render = renderer is not None and mode != "disable" and session.template_now is not None
    summaries = {}
    for index, leaf in enumerate(c for c in done if c.id not in parents):
        path = call_path(leaf, by_id)
        drift = (
            path_drift(path, renderer, mode, session.template_now, session.id)
            if render and renderer is not None
            else {}
        )
        summaries[leaf.id] = _summary(path, index, labels, drift)
    return summaries


def token_calls(calls: Sequence[CallRow]) -> dict[int, TokenCall]:
    return {
        c.id: TokenCall(
            c.id, c.parent_id, c.prompt_added, c.output_ids, c.output_logprobs, c.reward, c.routed_experts
        )
        for c in calls
        if c.status == "ok"
    }


def leaves(calls: dict[int, TokenCall]) -> set[int]:
    parents = {c.parent_id for c in calls.values()}
    return {call_id for call_id in calls if call_id not in parents}


async def fresh_summaries(
    db_sessions: DbSessions, session: SessionRow, renderer: Renderer | None, mode: DriftMode
) -> tuple[dict[int, TokenCall], dict[int, Summary]]:
    """A session's calls and summaries made now (off the event loop: a long conversation's render
    takes tens of milliseconds); stored if the session is finished, when no more calls can come."""
    async with db_sessions() as db:
        calls = await Repository(db).session_calls(session.id)
    summaries = await asyncio.to_thread(summarize, session, calls, renderer, mode)
    if session.status == "finished":
        try:
            async with db_sessions() as db, db.begin():
                blobs = {leaf: encode(summary) for leaf, summary in summaries.items()}
                await Repository(db).add_segment_summaries(session.id, mode, blobs)
        except Exception:  # the rows are right without it; the next export tries again
            log.exception("storing the export summaries of session %s failed", session.id)
    return token_calls(calls), summaries


async def store_on_finish(
    db_sessions: DbSessions, sessions: Sequence[SessionRow], renderer: Renderer | None, mode: DriftMode
) -> None:
    """Compute and store the summaries of sessions that just finished; a failure only means their
    first export computes them."""
    for session in sessions:
        try:
            await fresh_summaries(db_sessions, session, renderer, mode)
        except Exception:
            log.exception("the export summaries of session %s were not stored", session.id)
