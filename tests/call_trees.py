"""Recorded sessions built in memory, shaped as the turn path records them, for export tests."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import UTC, datetime

from proxy.store.codec import pack_ids, pack_logprobs, unpack_ids
from proxy.store.models import CallRow, SessionRow

Output = tuple[list[int], list[float]]


class SessionBuilder:
    """Calls get ids in recording order; a call without a parent opens a segment of its own."""

    def __init__(self, session_id: str = "s", reward: float | None = 1.0) -> None:
        self.session = SessionRow(
            id=session_id,
            status="finished",
            reward=reward,
            meta={"task": "t"},
            template_now=datetime(2026, 1, 2),
            created_at=datetime(2026, 1, 2, tzinfo=UTC),
            updated_at=datetime(2026, 1, 2, tzinfo=UTC),
        )
        self.calls: list[CallRow] = []
        self._segments = 0

    def turn(
        self,
        parent: CallRow | None,
        added: Sequence[int],
        outputs: Sequence[Output],
        *,
        finish: str = "stop",
        weight_version: str | None = None,
        status: str = "ok",
        reward: float | None = None,
    ) -> list[CallRow]:
        """One request: `outputs` are its choices (n > 1 when several), all with the same prompt."""
        request_id = uuid.uuid4().hex
        made = []
        for choice, (ids, logprobs) in enumerate(outputs):
            if parent is None:
                self._segments += 1
            call = CallRow(
                id=len(self.calls) + 1,
                session_id=self.session.id,
                segment_id=parent.segment_id if parent is not None else self._segments,
                parent_id=parent.id if parent is not None else None,
                depth=parent.depth + 1 if parent is not None else 0,
                status=status,
                prompt_added=pack_ids(list(added)),
                output_ids=pack_ids(ids),
                output_logprobs=pack_logprobs(logprobs),
                finish_reason=finish,
                finish_detail={"openai": finish, "choice": choice, "request_id": request_id},
                boundary_edits=[],
                request={},
                weight_version=weight_version,
                reward=reward,
            )
            self.calls.append(call)
            made.append(call)
        return made

    def context(self, call: CallRow) -> list[int]:
        """The call's prompt + output, rebuilt from its chain."""
        by_id = {c.id: c for c in self.calls}
        chain = [call]
        while chain[-1].parent_id is not None:
            chain.append(by_id[chain[-1].parent_id])
        ids: list[int] = []
        for link in reversed(chain):
            ids += unpack_ids(link.prompt_added).tolist() + unpack_ids(link.output_ids).tolist()
        return ids
