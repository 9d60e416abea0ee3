"""The trainer client's protocol without I/O: each call as a request to send and a parser of its
answer, the retry policy, and the ack bookkeeping of a streamed export. TitoClient (httpx.Client)
and AsyncTitoClient (httpx.AsyncClient) only move the bytes, so the two cannot disagree."""

from __future__ import annotations

import email.utils
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Branches = Literal["final", "all"]
Mode = Literal["merged", "stepwise"]
Status = Literal["finished", "active", "all"]
RETRY_STATUSES = frozenset({429, 503})


class TitoError(RuntimeError):
    """The proxy answered with an error envelope."""

    def __init__(self, message: str, status_code: int = 0) -> None:
        super().__init__(message)
        self.status_code = status_code


@dataclass(frozen=True)
class Call:
    """One request of the protocol and what to make of its JSON answer."""

    method: str
    path: str
    parse: Callable[[Any], Any] = lambda body: body
    params: dict[str, Any] | None = None
    json: Any = None


@dataclass(frozen=True)
class RetryPolicy:
    """Retries on 429 and 503: wait what Retry-After says (capped), else back off exponentially."""

    max_attempts: int = 5
    backoff_s: float = 0.5
    max_delay_s: float = 60.0

    def delay(self, response: httpx.Response, attempt: int) -> float | None:
        """Seconds to wait before attempt `attempt + 1`, or None when the answer is final."""
        if response.status_code not in RETRY_STATUSES or attempt >= self.max_attempts:
            return None
        told = retry_after_s(response.headers.get("retry-after"))
        wait = told if told is not None else self.backoff_s * 2 ** (attempt - 1)
        return min(max(wait, 0.0), self.max_delay_s)


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Retry-After as seconds: delta-seconds or an HTTP date (RFC 9110 10.2.3); None if absent or bad."""
    if value is None or not value.strip():
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return when.timestamp() - (time.time() if now is None else now)


def error_of(response: httpx.Response) -> TitoError | None:
    """The proxy's error envelope as an exception, None for a success. The body must be read."""
    if response.status_code < 400:
        return None
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    return TitoError(f"HTTP {response.status_code}: {message}", response.status_code)


def result_of(call: Call, response: httpx.Response) -> Any:
    error = error_of(response)
    if error is not None:
        raise error
    return call.parse(response.json() if response.content else None)


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


# The calls ------------------------------------------------------------------------------------


def create_session(
    session_id: str | None,
    metadata: dict[str, Any] | None,
    group_id: str | None = None,
    sample_index: int | None = None,
    group_size: int | None = None,
) -> Call:
    body: dict[str, Any] = {"metadata": metadata or {}}
    optional = {
        "id": session_id,
        "group_id": group_id,
        "sample_index": sample_index,
        "group_size": group_size,
    }
    body.update({key: value for key, value in optional.items() if value is not None})
    return Call("POST", "/sessions", parse=lambda answer: str(answer["id"]), json=body)


def session(session_id: str) -> Call:
    return Call("GET", f"/sessions/{session_id}")


def reward(session_id: str, value: float | None, call_rewards: dict[int, float] | None) -> Call:
    body: dict[str, Any] = {"reward": value}
    if call_rewards:
        body["call_rewards"] = {str(k): v for k, v in call_rewards.items()}
    return Call("POST", f"/sessions/{session_id}/reward", json=body)


def trajectory(session_id: str, branches: Branches) -> Call:
    return Call("GET", f"/sessions/{session_id}/trajectory", params={"branches": branches})


def samples(session_id: str, mode: Mode, branches: Branches) -> Call:
    return Call(
        "GET",
        f"/sessions/{session_id}/samples",
        parse=lambda answer: list(answer["samples"]),
        params={"mode": mode, "branches": branches},
    )


def finish(session_id: str) -> Call:
    return Call("POST", f"/sessions/{session_id}/finish")


def set_weight_version(version: str) -> Call:
    return Call("POST", "/admin/weight_version", json={"weight_version": version})


def ack(consumer: str, session_ids: Sequence[str]) -> Call:
    return Call(
        "POST",
        "/export/ack",
        parse=lambda answer: int(answer["acked"]),
        json={"consumer": consumer, "session_ids": list(session_ids)},
    )


@dataclass(frozen=True)
class ExportQuery:
    """The filters of GET /export (see the README's export section)."""

    mode: Mode = "merged"
    consumer: str | None = None
    after: int = 0
    branches: Branches = "final"
    status: Status = "finished"
    session_ids: Sequence[str] | None = None
    group_ids: Sequence[str] | None = None
    whole_groups: bool = False
    limit: int | None = None
    min_weight_version: str | None = None

    def params(self, fmt: str = "jsonl") -> dict[str, Any]:
        params: dict[str, Any] = {
            "mode": self.mode,
            "format": fmt,
            "after": self.after,
            "branches": self.branches,
            "status": self.status,
        }
        optional = {
            "consumer": self.consumer,
            "session_ids": ",".join(self.session_ids) if self.session_ids is not None else None,
            "group_ids": ",".join(self.group_ids) if self.group_ids is not None else None,
            "whole_groups": "true" if self.whole_groups else None,
            "limit": self.limit,
            "min_weight_version": self.min_weight_version,
        }
        params.update({key: value for key, value in optional.items() if value is not None})
        return params


@dataclass
class AckTracker:
    """Acks each session of a streamed export once all its rows were handed out (rows of one
    session are contiguous); with `whole_groups`, each group's sessions together, once the group's
    last row was (a consumer that stops in the middle of a group has acked none of it, and gets it
    whole again)."""

    consumer: str | None
    enabled: bool
    whole_groups: bool = False
    pending: list[str] = field(default_factory=list)
    unit: str | None = None

    def __post_init__(self) -> None:
        if self.enabled and self.consumer is None:
            raise ValueError("ack needs a consumer name")

    def before(self, row: dict[str, Any]) -> list[str]:
        """The sessions to ack before handing out `row`: the previous unit's, if `row` starts another."""
        if not self.enabled:
            return []
        unit = row["group_id"] if self.whole_groups else row["session_id"]
        done = self.pending if unit != self.unit else []
        if unit != self.unit:
            self.unit, self.pending = unit, []
        if row["session_id"] not in self.pending:
            self.pending.append(row["session_id"])
        return done

    def at_end(self) -> list[str]:
        return self.pending if self.enabled else []
