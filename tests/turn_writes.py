"""Writes for the turn-store tests: one request's calls, small and fixed, for any session."""

from __future__ import annotations

from datetime import datetime

from proxy.store.turn_store import NewCall, TurnWrite

TEMPLATE_NOW = datetime(2026, 1, 2)


def new_call(
    session_id: str, *, segment_id: int | None = None, parent_id: int | None = None, content: str = "hi"
) -> NewCall:
    return NewCall(
        session_id=session_id,
        segment_id=segment_id,
        parent_id=parent_id,
        depth=0 if parent_id is None else 1,
        status="ok",
        history_key="k",
        prompt_len=3,
        prompt_added=b"\x01\x00\x00\x00",
        output_ids=b"\x02\x00\x00\x00",
        output_logprobs=b"\x00\x00\x00\x00",
        finish_reason="stop",
        finish_detail={},
        boundary_edits=[],
        request={"messages": [{"role": "user", "content": content}]},
        response_message={"role": "assistant", "content": "ok"},
        sampling_params={},
        weight_version=None,
        engine_meta={},
        timings={},
    )


def turn_write(
    session_id: str,
    *,
    calls: int = 1,
    segment_id: int | None = None,
    parent_id: int | None = None,
    content: str = "hi",
) -> TurnWrite:
    """A request of `calls` choices (each opening its own segment unless `segment_id` is given)."""
    call = new_call(session_id, segment_id=segment_id, parent_id=parent_id, content=content)
    return TurnWrite(session_id=session_id, template_now=TEMPLATE_NOW, calls=[call] * calls)
