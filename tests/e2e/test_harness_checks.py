"""The turn routes' checks (keys, session ids, group headers, bodies) answer the same on the plain
call (proxy/api/harness_route.py) as through FastAPI's dependency solver, on every dialect."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Depends, FastAPI, HTTPException

from proxy.api.auth import require_harness_key
from proxy.api.groups import group_from_headers
from proxy.api.harness_route import HarnessRoute
from proxy.app import create_app
from proxy.config import Settings
from proxy.dialects import completions
from tests.fakes.sglang import FakeSGLang
from tests.support import serve

HARNESS, ADMIN = "harness-key-77", "admin-key-88"
USER = [{"role": "user", "content": "hi"}]
BODIES = {
    "/v1/chat/completions": {"model": "m", "messages": USER, "max_tokens": 8},
    "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 4},
    "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 8},
    "/v1/messages": {"model": "m", "messages": USER, "max_tokens": 8},
}
GOOD = {"Authorization": f"Bearer {HARNESS}"}
# (name, path prefix, headers, body override or None, raw content) -> each answered with an error.
CASES: list[tuple[str, str, dict[str, str], Any]] = [
    ("no key", "/sessions/c1", {}, None),
    ("wrong key", "/sessions/c1", {"Authorization": "Bearer nope"}, None),
    ("wrong x-api-key", "/sessions/c1", {"x-api-key": "nope"}, None),
    ("not a bearer", "/sessions/c1", {"Authorization": f"Basic {HARNESS}"}, None),
    ("no key, bad body", "/sessions/c1", {}, {"model": 5}),
    ("bad path id", "/sessions/bad%20id", GOOD, None),
    ("long path id", "/sessions/" + "x" * 129, GOOD, None),
    ("header contradicts path", "/sessions/c1", {**GOOD, "X-Session-Id": "c2"}, None),
    ("bad header id", "", {**GOOD, "X-Session-Id": "bad id"}, None),
    ("empty header id", "", {**GOOD, "X-Session-Id": ""}, None),
    ("bad header id, bad body", "", {**GOOD, "X-Session-Id": "bad id"}, {"model": 5}),
    (
        "index not a number",
        "/sessions/c3",
        {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Sample-Index": "x"},
        None,
    ),
    ("index negative", "/sessions/c3", {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Sample-Index": "-1"}, None),
    (
        "index past 2**31",
        "/sessions/c3",
        {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Sample-Index": "9" * 11},
        None,
    ),
    ("size zero", "/sessions/c3", {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Group-Size": "0"}, None),
    ("index without group", "/sessions/c3", {**GOOD, "X-Tito-Sample-Index": "0"}, None),
    ("bad group id", "/sessions/c3", {**GOOD, "X-Tito-Group-Id": "bad group"}, None),
    (
        "index past size",
        "/sessions/c3",
        {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Sample-Index": "2", "X-Tito-Group-Size": "2"},
        None,
    ),
    ("invalid body", "/sessions/c4", GOOD, {"model": "m"}),
    ("body not an object", "/sessions/c4", GOOD, [1, 2]),
    ("malformed JSON", "/sessions/c4", GOOD, b"{not json"),
    ("empty body", "/sessions/c4", GOOD, b""),
    ("JSON as text/plain", "/sessions/c4", {**GOOD, "content-type": "text/plain"}, "BODY"),
]


@pytest.fixture
def keyed(engine: FakeSGLang, qwen_dir: Path, tmp_path: Path) -> Iterator[tuple[FastAPI, str]]:
    settings = Settings(
        engine="sglang",
        engine_url=engine.url,  # type: ignore[attr-defined]
        tokenizer=qwen_dir,
        db=f"sqlite:///{tmp_path / 'p.db'}",
        api_key=HARNESS,
        admin_key=ADMIN,
    )
    app = create_app(settings)
    with serve(app) as url:
        yield app, url


def _post(url: str, route: str, prefix: str, headers: dict[str, str], body: Any) -> httpx.Response:
    if body == "BODY":
        body = httpx.Request("POST", url, json=BODIES[route]).content
    if isinstance(body, bytes):
        headers = {"content-type": "application/json", **headers}
        return httpx.post(f"{url}{prefix}{route}", content=body, headers=headers, timeout=60)
    return httpx.post(
        f"{url}{prefix}{route}", json=BODIES[route] if body is None else body, headers=headers, timeout=60
    )


def _answer(response: httpx.Response) -> tuple[int, Any, str | None]:
    body = response.json()
    error = body.get("error", {})
    error.pop("request_id", None)
    body.pop("request_id", None)  # Anthropic's place for it
    return response.status_code, body, response.headers.get("content-type")


def _through_the_solver(app: FastAPI) -> None:
    """Any dependency override sends a turn route through FastAPI's solver (the reference)."""
    app.dependency_overrides[_through_the_solver] = _through_the_solver


@pytest.mark.parametrize("route", list(BODIES))
def test_every_check_answers_as_fastapis_solver_does(keyed: tuple[FastAPI, str], route: str) -> None:
    app, url = keyed
    for name, prefix, headers, body in CASES:
        plain = _answer(_post(url, route, prefix, headers, body))
        _through_the_solver(app)
        try:
            solved = _answer(_post(url, route, prefix, headers, body))
        finally:
            app.dependency_overrides.clear()
        assert plain == solved, name
        assert 400 <= plain[0] < 500, (name, plain)


def test_the_checks_answer_in_each_dialects_shape(keyed: tuple[FastAPI, str]) -> None:
    _, url = keyed
    for route in BODIES:
        refused = _post(url, route, "/sessions/s1", {"Authorization": "Bearer nope"}, None)
        assert refused.status_code == 401
        bad_id = _post(url, route, "/sessions/bad%20id", GOOD, None)
        assert bad_id.status_code == 400
        bad_index = _post(
            url, route, "/sessions/s1", {**GOOD, "X-Tito-Group-Id": "g", "X-Tito-Sample-Index": "x"}, None
        )
        assert bad_index.status_code == 400
        if route == "/v1/messages":
            assert refused.json()["error"]["type"] == "authentication_error"
            request_id = bad_id.headers["x-request-id"]
            assert bad_id.json() == {
                "type": "error",
                "error": {
                    "type": "invalid_request_error",
                    "message": (
                        "session ids are 1-128 characters of letters, digits and . _ : @ - (not . or ..)"
                    ),
                    "request_id": request_id,
                },
                "request_id": request_id,
            }
            assert "X-Tito-Sample-Index" in bad_index.json()["error"]["message"]
        else:
            assert refused.json()["error"]["code"] == "invalid_api_key"
            assert bad_id.json()["error"]["param"] == "session_id"
            assert bad_index.json()["error"]["param"] == "X-Tito-Sample-Index"


def test_keys_sessions_and_groups_are_honoured_on_the_plain_call(keyed: tuple[FastAPI, str]) -> None:
    _, url = keyed
    for n, route in enumerate(BODIES):
        for headers in (
            GOOD,
            {"x-api-key": HARNESS},
            {"api-key": HARNESS},
            {"Authorization": f"bearer {ADMIN}"},
        ):
            ok = _post(url, route, f"/sessions/ok-{n}", headers, None)
            assert ok.status_code == 200, (route, headers, ok.text)
            assert ok.headers["x-session-id"] == f"ok-{n}"
        by_header = _post(url, route, "", {**GOOD, "X-Session-Id": f"hdr-{n}"}, None)
        assert by_header.headers["x-session-id"] == f"hdr-{n}"
        grouped = {
            **GOOD,
            "X-Tito-Group-Id": f"grp-{n}",
            "X-Tito-Sample-Index": "0",
            "X-Tito-Group-Size": "2",
        }
        assert _post(url, route, f"/sessions/in-{n}", grouped, None).status_code == 200
        taken = _post(url, route, f"/sessions/other-{n}", grouped, None)
        assert taken.status_code == 409, taken.text
        moved = _post(url, route, f"/sessions/ok-{n}", {**GOOD, "X-Tito-Group-Id": f"grp-{n}"}, None)
        assert moved.status_code == 409, moved.text
        info = httpx.get(f"{url}/sessions/in-{n}", headers={"Authorization": f"Bearer {ADMIN}"}).json()
        assert (info["group_id"], info["sample_index"], info["group_size"]) == (f"grp-{n}", 0, 2)


def test_the_turn_routes_take_the_plain_call(keyed: tuple[FastAPI, str]) -> None:
    app, _ = keyed
    routes = {route.path: route for route in app.routes if isinstance(route, HarnessRoute)}
    for path in BODIES:
        for prefixed in (path, f"/sessions/{{session_id}}{path}"):
            assert routes[prefixed].plain_paths == {prefixed}
    assert not routes["/v1/messages/count_tokens"].plain_paths  # answers a dict: FastAPI serializes it


def test_a_dependency_the_plain_call_does_not_know_is_still_solved() -> None:
    calls: list[str] = []

    async def teapot() -> None:
        calls.append("teapot")
        raise HTTPException(status_code=418, detail="a teapot")

    app = FastAPI()
    app.include_router(
        completions.router,
        dependencies=[Depends(teapot), Depends(require_harness_key), Depends(group_from_headers)],
    )
    with serve(app) as url:
        response = httpx.post(f"{url}/v1/completions", json=BODIES["/v1/completions"])
    assert response.status_code == 418
    assert calls == ["teapot"]
