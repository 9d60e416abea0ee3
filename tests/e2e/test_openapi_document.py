"""/openapi.json as a client reads it from the running proxy: a valid OpenAPI 3.1 document, whose
every templated path parameter each operation declares (the session id of the harness routes too,
which read it from the path themselves)."""

from __future__ import annotations

import re
from typing import Any

import httpx
from openapi_spec_validator import OpenAPIV31SpecValidator

# Starlette's path template syntax: `{name}` or `{name:convertor}`.
_TEMPLATE = re.compile(r"{([a-zA-Z_][a-zA-Z0-9_]*)(?::[a-zA-Z_][a-zA-Z0-9_]*)?}")
_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


def _undeclared(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(method, path, name) for each path parameter an operation does not declare required."""
    undeclared = []
    for path, item in document["paths"].items():
        shared = item.get("parameters", [])
        for method, operation in item.items():
            if method not in _METHODS:
                continue
            declared = {
                p["name"]
                for p in [*shared, *operation.get("parameters", [])]
                if p["in"] == "path" and p.get("required") is True
            }
            undeclared += [(method, path, name) for name in _TEMPLATE.findall(path) if name not in declared]
    return undeclared


def test_the_served_document_is_valid_openapi_3_1(proxy_url: str) -> None:
    served = httpx.get(f"{proxy_url}/openapi.json")
    assert served.status_code == 200
    document = served.json()
    assert document["openapi"].startswith("3.1.")
    # Every error at once, so that a failure names each: `validate` raises only the first.
    errors = [error.message for error in OpenAPIV31SpecValidator(document).iter_errors()]
    assert errors == []
    assert _undeclared(document) == []  # named in the path, so declared required: true


def test_the_harness_routes_declare_their_session_id_once(proxy_url: str) -> None:
    document = httpx.get(f"{proxy_url}/openapi.json").json()
    harness = [path for path in document["paths"] if re.fullmatch(r"/sessions/\{session_id\}/v1/.+", path)]
    # chat, completions, responses, messages, count_tokens, models, template
    assert len(harness) == 7, harness
    for path in harness:
        for operation in document["paths"][path].values():
            in_path = [p for p in operation["parameters"] if p["in"] == "path"]
            assert in_path == [
                {
                    "name": "session_id",
                    "in": "path",
                    "required": True,
                    "schema": {"type": "string", "title": "Session Id"},
                }
            ], path
    # The same routes without the prefix have no path parameter to declare.
    for path in harness:
        unprefixed = path.removeprefix("/sessions/{session_id}")
        for operation in document["paths"][unprefixed].values():
            assert not [p for p in operation.get("parameters", []) if p["in"] == "path"], unprefixed
