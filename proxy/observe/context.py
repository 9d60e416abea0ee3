"""The request id and session id of the request being served, for log lines and error envelopes."""

from __future__ import annotations

from contextvars import ContextVar

# Each request runs in its own task (uvicorn), so a value set while serving it never leaks to another.
request_id: ContextVar[str | None] = ContextVar("tito_request_id", default=None)
session_id: ContextVar[str | None] = ContextVar("tito_session_id", default=None)
