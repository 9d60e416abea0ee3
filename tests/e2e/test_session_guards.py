"""Guards around sessions: finite rewards only, API docs behind the admin key when keys are set, and
session ids the proxy makes that nobody can guess."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.support import chat

HARNESS, ADMIN = "harness-secret-4f1c", "admin-secret-9b2e"
USER = [{"role": "user", "content": "hi"}]


def test_a_reward_that_is_not_a_finite_number_is_a_400_and_keeps_the_reward(proxy_url: str) -> None:
    chat(proxy_url, USER, "r")
    (call_id,) = httpx.get(f"{proxy_url}/sessions/r/trajectory").json()["segments"][0]["call_ids"]
    reward = f"{proxy_url}/sessions/r/reward"
    assert httpx.post(reward, json={"reward": 0.5, "call_rewards": {str(call_id): 0.25}}).status_code == 200
    # The literals Python's JSON parser accepts beyond the standard; 1e999 overflows to infinity.
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        for field, body in (
            ("reward", f'{{"reward": {literal}}}'),
            ("call_rewards", f'{{"call_rewards": {{"{call_id}": {literal}}}}}'),
        ):
            refused = httpx.post(reward, content=body, headers={"content-type": "application/json"})
            assert refused.status_code == 400, (body, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error"
            assert (error["param"] or "").startswith(field)
            assert "finite" in error["message"]
    # A number's text or a boolean is not a number (lax parsing read "1" and true as 1.0).
    for body_json in ({"reward": "1"}, {"reward": True}, {"call_rewards": {str(call_id): "1"}}):
        refused = httpx.post(reward, json=body_json)
        assert refused.status_code == 400, (body_json, refused.text)
        assert (refused.json()["error"]["param"] or "").startswith(next(iter(body_json)))
    assert httpx.get(f"{proxy_url}/sessions/r").json()["reward"] == 0.5
    httpx.post(f"{proxy_url}/sessions/r/finish").raise_for_status()
    exported = httpx.get(f"{proxy_url}/export", params={"mode": "merged"})
    [row] = [json.loads(line) for line in exported.text.splitlines()]
    assert row["reward"] == 0.5
    assert row["call_rewards"] == [0.25]


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_the_api_docs_need_the_admin_key_when_keys_are_set(start_proxy: ProxyFactory, path: str) -> None:
    with start_proxy(api_key=HARNESS, admin_key=ADMIN) as url:
        assert httpx.get(url + path).status_code == 401
        as_harness = httpx.get(url + path, headers={"Authorization": f"Bearer {HARNESS}"})
        assert as_harness.status_code == 403
        assert as_harness.json()["error"]["type"] == "permission_error"
        opened = httpx.get(url + path, headers={"Authorization": f"Bearer {ADMIN}"})
        assert opened.status_code == 200
    if path == "/openapi.json":
        assert "/sessions/{session_id}/finish" in opened.json()["paths"]


def test_the_api_docs_stay_open_without_keys(proxy_url: str) -> None:
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(proxy_url + path).status_code == 200, path


def test_session_ids_the_proxy_makes_carry_128_random_bits(proxy_url: str) -> None:
    made = [httpx.post(f"{proxy_url}/sessions", json={}).json()["id"] for _ in range(24)]
    for _ in range(24):
        body = {"model": "m", "messages": USER, "max_tokens": 4}
        response = httpx.post(f"{proxy_url}/v1/chat/completions", json=body)
        assert response.status_code == 200
        made.append(response.headers["x-session-id"])
    assert len(set(made)) == len(made)
    for made_id in made:
        assert len(made_id) == 32
        int(made_id, 16)
    # A uuid4 fixes 6 of its 128 bits (version nibble 4 at position 12): every position must vary.
    for position in range(32):
        assert len({made_id[position] for made_id in made}) > 1, position


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/admin/pause", {"abort_in_flight": "yes"}, "abort_in_flight"),
        ("/sessions", {"group_id": "g", "sample_index": "1", "group_size": 2}, "sample_index"),
        ("/admin/weight_version", {"weight_version": 7}, "weight_version"),
    ],
)
def test_trainer_routes_refuse_values_of_the_wrong_json_type(
    proxy_url: str, path: str, body: dict[str, object], param: str
) -> None:
    refused = httpx.post(proxy_url + path, json=body)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == param
    assert httpx.get(f"{proxy_url}/admin/state").json()["paused"] is False


@pytest.mark.parametrize("dots", [".", ".."])
def test_a_session_id_no_url_can_name_is_refused(proxy_url: str, dots: str) -> None:
    """A URL resolves . and .. away: /sessions/../finish is not session '..'s finish."""
    created = httpx.post(f"{proxy_url}/sessions", json={"id": dots})
    assert created.status_code == 400, created.text
    assert created.json()["error"]["param"] == "session_id"
    body = {"model": "m", "messages": USER, "max_tokens": 4}
    turn = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, headers={"x-session-id": dots})
    assert turn.status_code == 400, turn.text
    assert httpx.post(f"{proxy_url}/sessions", json={"id": f"a{dots}b"}).status_code == 201
