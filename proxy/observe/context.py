"""The request id and session id of the request being served, for log lines and error envelopes;
and whether it recorded calls, for the metrics."""

from __future__ import annotations

from contextvars import ContextVar

# Each request runs in its own task (uvicorn), so a value set while serving it never leaks to another.
request_id: ContextVar[str | None] = ContextVar("tito_request_id", default=None)
session_id: ContextVar[str | None] = ContextVar("tito_session_id", default=None)
# Set when the request's calls are recorded (they count as ok/aborted turns): an error it ends in
# is then no refused turn too.
calls_recorded: ContextVar[bool] = ContextVar("tito_calls_recorded", default=False)
