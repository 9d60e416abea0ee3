"""The OpenAPI schema documents the harness routes as FastAPI's include_router would: their headers,
path and body, though they are included flat and answered by the plain call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI

from proxy.api import models
from proxy.api.auth import require_harness_key
from proxy.api.groups import group_from_headers
from proxy.api.harness_route import include_flat
from proxy.app import create_app
from proxy.config import Settings
from proxy.dialects import anthropic, chat, completions, responses

SURFACES = (models.router, chat.router, completions.router, responses.router, anthropic.router)
PREFIX = "/sessions/{session_id}"
HEADERS = {"x-session-id", "idempotency-key", "x-tito-group-id", "x-tito-sample-index", "x-tito-group-size"}
TURN_BODIES = {
    "/v1/chat/completions": "ChatCompletionRequest",
    "/v1/completions": "CompletionRequest",
    "/v1/responses": "ResponsesRequest",
    "/v1/messages": "MessagesRequest",
}


def _harness() -> list[Any]:
    return [Depends(require_harness_key), Depends(group_from_headers)]


async def _session_in_path(session_id: str) -> None:
    """What include_router needs to be given to declare the prefix's session id, which the routes
    read from the path themselves: without it its schema names a path parameter it never defines."""


def test_flat_inclusion_documents_what_include_router_documents() -> None:
    """...given the declaration of the prefix's path parameter, which include_flat adds itself."""
    included, flat = FastAPI(), FastAPI()
    for surface in SURFACES:
        for prefix in ("", PREFIX):
            declared = [Depends(_session_in_path)] if prefix else []
            included.include_router(surface, prefix=prefix, dependencies=[*declared, *_harness()])
            include_flat(flat, surface, prefix=prefix, dependencies=_harness())
    assert flat.openapi() == included.openapi()
    assert list(flat.openapi()["paths"]) == list(included.openapi()["paths"])  # matched in this order


def test_the_turn_routes_document_their_headers_and_bodies(tmp_path: Path) -> None:
    settings = Settings(
        engine_url="http://127.0.0.1:9", tokenizer=tmp_path, db=f"sqlite:///{tmp_path / 'p.db'}"
    )
    schema = create_app(settings).openapi()
    for path, model in TURN_BODIES.items():
        for documented in (path, PREFIX + path):
            operation = schema["paths"][documented]["post"]
            headers = {p["name"] for p in operation["parameters"] if p["in"] == "header"}
            assert headers == HEADERS, documented
            body = operation["requestBody"]["content"]["application/json"]["schema"]
            assert body == {"$ref": f"#/components/schemas/{model}"}, documented
            assert operation["requestBody"]["required"] is True
            assert model in schema["components"]["schemas"]


def test_refusals_are_documented_as_answered_a_400_in_the_routes_envelope(tmp_path: Path) -> None:
    """FastAPI documents a 422 of its own shape; the proxy answers a malformed request with a 400 in
    the dialect's envelope (Anthropic's under /v1/messages)."""
    settings = Settings(
        engine_url="http://127.0.0.1:9", tokenizer=tmp_path, db=f"sqlite:///{tmp_path / 'p.db'}"
    )
    schema = create_app(settings).openapi()
    operations = [(path, op) for path, ops in schema["paths"].items() for op in ops.values()]
    assert not [path for path, op in operations if "422" in op["responses"]]
    assert "HTTPValidationError" not in schema["components"]["schemas"]
    for path in TURN_BODIES:
        for documented in (path, PREFIX + path):
            refusal = schema["paths"][documented]["post"]["responses"]["400"]
            envelope = "AnthropicError" if "/messages" in path else "OpenAIError"
            assert refusal["content"]["application/json"]["schema"] == {
                "$ref": f"#/components/schemas/{envelope}"
            }, documented
            assert envelope in schema["components"]["schemas"]
