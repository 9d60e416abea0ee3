"""Idempotent retries: a request that repeats one already answered is answered from the record.

A retry is recognised by its Idempotency-Key header, or, for the OpenAI SDKs (which send no key),
by their retry-count header with a body identical to an earlier request of the same session.
Requests sharing a retry identity run one at a time, so a retry that arrives while its original is
still sampling waits for it instead of sampling a second branch; a retry that names no session is
first sent to its running original's session (proxy/api/answering.py, retried_session).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime, timedelta

from proxy.chat.parsing import ParsedOutput
from proxy.engines.base import FinishReason, Generation
from proxy.errors import Conflict
from proxy.store.claims import RetryClaims
from proxy.store.codec import unpack_ids, unpack_logprobs
from proxy.store.models import CallRow
from proxy.store.repository import Repository, utcnow
from proxy.turns import TurnResult

log = logging.getLogger("tito_proxy.retries")

# An SDK retry follows its original within the client's timeout and backoff.
SDK_RETRY_WINDOW = timedelta(minutes=30)
# Failed attempts remembered (attempt_failed): an SDK retries within seconds.
_FAILED_KEPT = 4096


@dataclass(frozen=True)
class RetryIdentity:
    idempotency_key: str | None
    request_hash: str
    is_sdk_retry: bool  # the SDK's retry count says an earlier attempt was sent

    @classmethod
    def from_request(cls, headers: Mapping[str, str], body: bytes) -> RetryIdentity | None:
        key = headers.get("idempotency-key")
        retry_count = headers.get("x-stainless-retry-count")
        if key is None and retry_count is None:
            return None
        return cls(
            idempotency_key=key,
            request_hash=hashlib.sha256(body).hexdigest(),
            is_sdk_retry=retry_count not in (None, "0"),
        )

    @property
    def lock_name(self) -> str:
        return (
            f"key:{self.idempotency_key}" if self.idempotency_key is not None else f"body:{self.request_hash}"
        )


class RetryGuard:
    """Per-process locks on retry identities. A waiter gives up after `wait_s` (its original may be
    a stream whose client vanished before it started) and samples afresh."""

    def __init__(self, wait_s: float = 600.0, claims: RetryClaims | None = None) -> None:
        self.wait_s = wait_s
        # With several worker processes, the database also orders duplicates across processes.
        self.claims = claims
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._holders: dict[tuple[str, str], int] = {}
        # Per identity name, the sessions whose lock on it is held or awaited, oldest first: where a
        # retry that names no session finds its original while that is still sampling.
        self._sessions: dict[str, dict[str, None]] = {}
        # When an attempt known by its body alone last failed, by body hash (attempt_failed).
        self._failed: dict[str, datetime] = {}

    def attempt_failed(self, identity: RetryIdentity) -> None:
        """An attempt known by its body alone was answered with an error (nothing recorded): a retry
        of it is a request of its own, never answered with an identical earlier request's record
        (another rollout's, or an earlier sample of the same session)."""
        if identity.idempotency_key is not None:
            return
        if len(self._failed) >= _FAILED_KEPT:
            for name in list(self._failed)[: _FAILED_KEPT // 2]:  # the oldest half (insertion order)
                del self._failed[name]
        self._failed.pop(identity.request_hash, None)
        self._failed[identity.request_hash] = utcnow()

    def retry_since(self, identity: RetryIdentity) -> datetime:
        """The oldest answer an SDK retry may take for its original's: within the SDKs' retry window,
        and after this process last answered an identical attempt with an error."""
        since = utcnow() - SDK_RETRY_WINDOW
        failed = self._failed.get(identity.request_hash)
        return max(since, failed) if failed is not None else since

    def held(self) -> int:
        """Identities with a request holding or awaiting their lock (the only ones kept)."""
        return len(self._locks)

    def running_session(self, name: str) -> str | None:
        """The session of the newest request of this identity under way in this process, if any."""
        sessions = self._sessions.get(name)
        return next(reversed(sessions)) if sessions else None

    @asynccontextmanager
    async def hold(self, session_id: str, identity: RetryIdentity | None) -> AsyncIterator[None]:
        if identity is None:
            yield
            return
        name = (session_id, identity.lock_name)
        lock = self._locks.setdefault(name, asyncio.Lock())
        self._holders[name] = self._holders.get(name, 0) + 1
        self._sessions.setdefault(identity.lock_name, {})[session_id] = None
        acquired = False
        try:
            try:
                await asyncio.wait_for(lock.acquire(), self.wait_s)
                acquired = True
            except TimeoutError:
                log.warning(
                    "session %s: retry waited %.0f s for its original; sampling anew", session_id, self.wait_s
                )
            if self.claims is None:
                yield
            else:
                async with self.claims.claim(session_id, identity.lock_name, self.wait_s):
                    yield
        finally:
            if acquired:
                lock.release()
            self._holders[name] -= 1
            if not self._holders[name]:
                del self._holders[name]
                del self._locks[name]
                sessions = self._sessions[identity.lock_name]
                del sessions[session_id]
                if not sessions:
                    del self._sessions[identity.lock_name]


async def recorded_answer(
    repo: Repository, session_id: str, identity: RetryIdentity, since: datetime
) -> list[CallRow] | None:
    """The calls that answered an earlier attempt of this request, choices in order; None if none.
    `since`: for an SDK retry (known by its body alone), the oldest answer that may be its original's
    (RetryGuard.retry_since)."""
    if identity.idempotency_key is not None:
        rows = await repo.answered_calls(session_id, idempotency_key=identity.idempotency_key)
        if rows and any(row.request_hash != identity.request_hash for row in rows):
            raise Conflict(
                "this Idempotency-Key was used with a different request body", param="Idempotency-Key"
            )
    elif identity.is_sdk_retry:
        rows = await repo.answered_calls(session_id, request_hash=identity.request_hash, since=since)
        # The newest identical request only: an older identical one was answered already.
        if rows:
            newest = rows[-1].finish_detail.get("request_id")
            rows = [row for row in rows if row.finish_detail.get("request_id") == newest]
    else:
        return None
    return sorted(rows, key=lambda row: row.finish_detail.get("choice", 0)) or None


def replayed_results(rows: Sequence[CallRow]) -> list[TurnResult]:
    """Recorded calls as the results they were answered with."""
    results = []
    for row in rows:
        message = row.response_message
        detail = row.finish_detail
        top = row.engine_meta.get("top_logprobs")
        generation = Generation(
            output_ids=unpack_ids(row.output_ids).tolist(),
            logprobs=unpack_logprobs(row.output_logprobs),
            finish=FinishReason(
                row.finish_reason,  # type: ignore[arg-type]
                matched_token=detail.get("matched_token"),
                matched_text=detail.get("matched_text"),
            ),
            weight_version=row.weight_version,
            top_logprobs=[[(int(t), float(lp)) for t, lp in position] for position in top] if top else None,
        )
        results.append(
            TurnResult(
                call_id=row.id,
                session_id=row.session_id,
                output=ParsedOutput(
                    content=message.get("content"),
                    reasoning_content=message.get("reasoning_content"),
                    tool_calls=message.get("tool_calls") or [],
                ),
                finish_reason=detail["openai"],
                prompt_tokens=row.prompt_len,
                completion_tokens=len(generation.output_ids),
                generation=generation,
                request_id=str(detail.get("request_id") or row.id),
                choice_index=detail.get("choice", 0),
            )
        )
    return results
