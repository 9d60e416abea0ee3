"""The turn routes' shortcuts through the framework: a route passed over by its path's tail matches
exactly as FastAPI's own matching does, and a body read without Starlette's stream generator is the
same body (one message, parts, or a client that left)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.routing import APIRoute
from starlette.datastructures import Headers
from starlette.requests import ClientDisconnect, Request

from proxy.api.json_route import IndexedHeaders, OrjsonRequest, OrjsonRoute
from proxy.app import create_app
from proxy.config import Settings

PATHS = [
    "/v1/chat/completions",
    "/v1/chat/completions/",
    "/sessions/s1/v1/chat/completions",
    "/sessions/s1/v1/chat/completions/x",
    "/sessions//v1/chat/completions",
    "/sessions/a/b/v1/chat/completions",
    "/v1/completions",
    "/sessions/s1/v1/completions",
    "/v1/responses",
    "/sessions/s1/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/sessions/s1/v1/messages/count_tokens",
    "/v1/models",
    "/v1/models/m",
    "/sessions/s1/v1/models",
    "/v1/template",
    "/sessions/s1/v1/template",
    "/prefix/v1/chat/completions",
    "/health",
    "/",
]


def _scope(path: str, method: str, root_path: str = "") -> dict[str, Any]:
    return {
        "type": "http",
        "method": method,
        "path": root_path + path,
        "root_path": root_path,
        "headers": [],
        "query_string": b"",
    }


def test_a_route_passed_over_by_its_tail_would_not_have_matched(tmp_path: Path) -> None:
    settings = Settings(
        engine_url="http://127.0.0.1:9", tokenizer=tmp_path, db=f"sqlite:///{tmp_path / 'p.db'}"
    )
    routes = [r for r in create_app(settings).router.routes if isinstance(r, OrjsonRoute)]
    assert len(routes) >= 14
    for route in routes:
        for path in PATHS:
            for method in ("GET", "POST"):
                for root_path in ("", "/mounted"):
                    shortcut = route.matches(_scope(path, method, root_path))
                    full = APIRoute.matches(route, _scope(path, method, root_path))
                    assert shortcut == full, (route.path, path, method, root_path)


def _read(request_class: type[Request], messages: list[dict[str, Any]]) -> tuple[Any, bytes | None]:
    async def read() -> tuple[Any, bytes | None]:
        pending = list(messages)

        async def receive() -> dict[str, Any]:
            return pending.pop(0)

        request = request_class({"type": "http", "headers": []}, receive)
        try:
            body = await request.body()
        except ClientDisconnect:
            return "disconnected", None
        later = await request.receive() if pending else None  # what the app reads after the body
        return body, None if later is None else later.get("body", later["type"].encode())

    return asyncio.run(read())


@pytest.mark.parametrize(
    "messages",
    [
        [{"type": "http.request", "body": b'{"a": 1}'}, {"type": "http.disconnect"}],
        [{"type": "http.request", "body": b'{"a": 1}', "more_body": False}],
        [{"type": "http.request"}, {"type": "http.disconnect"}],
        [
            {"type": "http.request", "body": b'{"a"', "more_body": True},
            {"type": "http.request", "body": b": 1}", "more_body": False},
            {"type": "http.disconnect"},
        ],
        [{"type": "http.disconnect"}],
        [{"type": "http.request", "body": b"{", "more_body": True}, {"type": "http.disconnect"}],
    ],
)
def test_a_body_reads_as_starlette_reads_it(messages: list[dict[str, Any]]) -> None:
    assert _read(OrjsonRequest, messages) == _read(Request, messages)


RAW_HEADERS = [
    (b"host", b"127.0.0.1:8000"),
    (b"x-session-id", b"first"),
    (b"content-type", b"application/json"),
    (b"x-session-id", b"second"),
    (b"x-tito-group-id", b"g\xe9"),
    (b"authorization", b""),
]


@pytest.mark.parametrize(
    "name",
    [
        "host",
        "x-session-id",
        "X-Session-Id",
        "X-TITO-GROUP-ID",
        "authorization",
        "x-api-key",
        "",
        "content-type",
    ],
)
def test_indexed_headers_read_as_starlettes(name: str) -> None:
    indexed, plain = IndexedHeaders(raw=list(RAW_HEADERS)), Headers(raw=list(RAW_HEADERS))
    assert indexed.get(name) == plain.get(name)
    assert indexed.get(name, "absent") == plain.get(name, "absent")
    assert (name in indexed) == (name in plain)
    if name in plain:
        assert indexed[name] == plain[name]
    else:
        with pytest.raises(KeyError):
            indexed[name]
    assert indexed.getlist(name) == plain.getlist(name)
    assert list(indexed.items()) == list(plain.items())


def test_a_turn_request_reads_its_headers_indexed() -> None:
    request = OrjsonRequest({"type": "http", "headers": list(RAW_HEADERS)})
    assert isinstance(request.headers, IndexedHeaders)
    assert request.headers.get("X-Session-Id") == "first"
