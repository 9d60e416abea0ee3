"""Anthropic's error shape, and the paths that answer in it: /v1/messages and everything under it,
with or without a /sessions/{id} prefix, whether a route answers or the router refuses first."""

from __future__ import annotations

from typing import Any

# Anthropic's error types by status; any other 4xx is an invalid_request_error (Anthropic's docs:
# "we may also use this error type for other 4XX status codes"), any other 5xx an api_error.
_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def error_payload(kind: str, message: str, request_id: str | None) -> dict[str, Any]:
    """Anthropic's error body (also an `error` event's data), with the request id where Anthropic
    puts it (beside the error) and where every envelope of this proxy has it (inside)."""
    error: dict[str, Any] = {"type": kind, "message": message}
    if request_id is None:
        return {"type": "error", "error": error}
    return {"type": "error", "error": {**error, "request_id": request_id}, "request_id": request_id}


def error_body(status: int, message: str, request_id: str | None = None) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")
    return error_payload(kind, message, request_id)


def is_anthropic_path(path: str) -> bool:
    """/v1/messages, /v1/messages/count_tokens, /sessions/{id}/v1/messages/..., also a route that
    does not exist under them: an Anthropic client reads whatever comes back in Anthropic's shape."""
    tail = path.partition("/v1/")[2]
    return tail == "messages" or tail.startswith("messages/")
