"""The OpenAPI schema's refusals as the proxy answers them: a 400 in the route's error envelope
(Anthropic's under /v1/messages, OpenAI's elsewhere), not the 422 FastAPI documents by default."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import FastAPI

from proxy.dialects.anthropic_errors import is_anthropic_path

_NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
_OPENAI_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
                "request_id": {"type": "string"},
            },
        }
    },
}
_ANTHROPIC_ERROR = {
    "type": "object",
    "required": ["type", "error"],
    "properties": {
        "type": {"const": "error"},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string"},
                "message": {"type": "string"},
                "request_id": {"type": "string"},
            },
        },
        "request_id": {"type": "string"},
    },
}
_FASTAPIS_OWN = ("HTTPValidationError", "ValidationError")


def _refusal(anthropic: bool) -> dict[str, Any]:
    name = "AnthropicError" if anthropic else "OpenAIError"
    return {
        "description": "Refused: the request is malformed, or asks for what cannot be honoured",
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{name}"}}},
    }


def document_refusals(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with every operation's 422 replaced by the 400 the proxy answers (in place)."""
    for path, operations in schema.get("paths", {}).items():
        for operation in operations.values():
            responses = operation.get("responses", {})
            if responses.pop("422", None) is not None:
                responses.setdefault("400", _refusal(is_anthropic_path(path)))
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name in _FASTAPIS_OWN:
        components.pop(name, None)
    components["OpenAIError"] = _OPENAI_ERROR
    components["AnthropicError"] = _ANTHROPIC_ERROR
    return schema


def with_documented_refusals(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The app's schema maker, its refusals documented as answered (made once, as FastAPI's is)."""
    make = app.openapi

    def openapi() -> dict[str, Any]:
        made = app.openapi_schema is not None
        schema = make()
        return schema if made else document_refusals(schema)

    return openapi
