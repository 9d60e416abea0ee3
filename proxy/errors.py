"""One error tree for the whole proxy, rendered as OpenAI's error envelope.

ProxyError                      500 server_error
├── InvalidRequest              400 invalid_request_error
│   ├── UnsupportedParameter    400 code=unsupported_parameter
│   ├── ContextLengthExceeded   400 code=context_length_exceeded
│   ├── TemplateError           400 code=template_error (the served template refuses the conversation)
│   └── JsonNestingTooDeep      400 code=json_too_deep (JSON nested past proxy/json_limits.py's cap)
├── Unauthorized                401 code=invalid_api_key (no key, or a wrong one)
├── Forbidden                   403 permission_error (the harness key on an admin route)
├── NotFound                    404 not_found_error
│   └── ModelNotFound           404 code=model_not_found (unknown under --strict-model-names; adapter gone)
├── PayloadTooLarge             413 code=request_too_large (a body past --max-body-bytes)
├── ClientClosedRequest         499 (the client left before its answer; nobody reads this one)
├── Conflict                    409 conflict_error (a session id that is taken, or deleted mid-turn)
│   └── SessionFinished         409 code=session_finished (a turn for, or committed after, a finish)
├── Paused                      429 code=engine_paused (a weight sync holds new turns; Retry-After)
├── DatabaseUnavailable         503 code=database_unavailable (disk full, locked, connection lost)
│   └── RecordFailed            503 code=record_failed (the database refused a turn's commit)
├── ShuttingDown                503 code=shutting_down (the server cancelled the request at shutdown)
└── EngineError                 502 engine_error (bad answer from the engine)
    ├── InvalidEngineAnswer     502 (ids, logprobs or finish reason that fail the checks: never recorded)
    ├── EngineUnavailable       503 (cannot connect, or the engine says it is not ready)
    │   └── EngineMismatch      503 code=engine_mismatch (the URL speaks another engine's protocol, or none)
    └── EngineTimeout           504
"""

from __future__ import annotations

from typing import Any

from proxy.observe import context


class ProxyError(Exception):
    status_code = 500
    error_type = "server_error"
    default_code: str | None = None
    # Seconds a client should wait before retrying, sent as Retry-After (429 and 503 answers).
    retry_after_s: float | None = None
    # Sent as x-should-retry, which the OpenAI and Anthropic SDKs obey over their own rules (they
    # retry every 409): False where the same request can never succeed.
    should_retry: bool | None = None

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code

    def envelope(self) -> dict[str, Any]:
        return with_request_id(
            {
                "error": {
                    "message": self.message,
                    "type": self.error_type,
                    "param": self.param,
                    "code": self.code,
                }
            }
        )


def with_request_id(body: dict[str, Any]) -> dict[str, Any]:
    """An error envelope with the request's id (also in the `x-request-id` header), for bug reports."""
    request_id = context.request_id.get()
    if request_id is not None:
        body["error"]["request_id"] = request_id
    return body


class InvalidRequest(ProxyError):
    status_code = 400
    error_type = "invalid_request_error"


class UnsupportedParameter(InvalidRequest):
    default_code = "unsupported_parameter"


class ContextLengthExceeded(InvalidRequest):
    default_code = "context_length_exceeded"


class Unauthorized(ProxyError):
    status_code = 401
    error_type = "invalid_request_error"
    default_code = "invalid_api_key"


class Forbidden(ProxyError):
    status_code = 403
    error_type = "permission_error"
    default_code = "insufficient_permissions"


class NotFound(ProxyError):
    status_code = 404
    error_type = "not_found_error"
    default_code = "not_found"


class ModelNotFound(NotFound):
    """OpenAI's answer for a model it does not serve: 404, invalid_request_error, model_not_found."""

    error_type = "invalid_request_error"
    default_code = "model_not_found"

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class ClientClosedRequest(ProxyError):
    """The client disconnected before its answer: the turn was aborted (nginx's 499, for the log)."""

    status_code = 499
    error_type = "invalid_request_error"
    default_code = "client_closed_request"


class Conflict(ProxyError):
    status_code = 409
    error_type = "conflict_error"
    default_code = "conflict"
    should_retry = False  # a finished session, a key reused with another body, a taken index


class ConcurrentChange(Conflict):
    """A write a concurrent one made impossible: the same request may succeed now."""

    should_retry = True


class Paused(ProxyError):
    """The trainer paused generation for a weight sync and the turn could not wait for the resume."""

    status_code = 429
    error_type = "rate_limit_error"
    default_code = "engine_paused"

    def __init__(self, message: str, *, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class SessionFinished(Conflict):
    """The session is finished: a turn that reaches its commit after the finish is refused, so that
    every recorded turn is in the export that follows the finish."""

    default_code = "session_finished"


class DatabaseUnavailable(ProxyError):
    """The database failed (disk full, locked past the busy timeout, connection lost); the
    transaction was rolled back, so nothing of the request is written."""

    status_code = 503
    error_type = "server_error"
    default_code = "database_unavailable"


class RecordFailed(DatabaseUnavailable):
    """The database refused a turn's commit: the turn is not answered, since it is not recorded."""

    default_code = "record_failed"


class ShuttingDown(ProxyError):
    """The server stopped the request at shutdown, past its grace period, before answering it."""

    status_code = 503
    error_type = "server_error"
    default_code = "shutting_down"


class EngineError(ProxyError):
    status_code = 502
    error_type = "engine_error"
    default_code = "bad_gateway"


class InvalidEngineAnswer(EngineError):
    """The engine answered ids, logprobs or a finish reason the proxy must not record."""


class EngineUnavailable(EngineError):
    status_code = 503
    default_code = "engine_unavailable"


class EngineMismatch(EngineUnavailable):
    """The engine URL speaks another protocol than the configured engine's: a start-up error."""

    default_code = "engine_mismatch"


class EngineTimeout(EngineError):
    status_code = 504
    default_code = "engine_timeout"


class TemplateError(InvalidRequest):
    """The chat template raised on this conversation (e.g. roles that must alternate)."""

    default_code = "template_error"


class JsonNestingTooDeep(InvalidRequest):
    """A JSON value in the request nested deeper than proxy.json_limits.MAX_JSON_DEPTH."""

    default_code = "json_too_deep"


class PayloadTooLarge(ProxyError):
    status_code = 413
    error_type = "invalid_request_error"
    default_code = "request_too_large"
