"""API keys: the harness key opens /v1 only; trajectories, exports and admin need the admin key."""

from __future__ import annotations

import logging

import httpx
import pytest
from openai import OpenAI

from tests.conftest import ProxyFactory

HARNESS, ADMIN = "harness-secret-4f1c", "admin-secret-9b2e"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def _auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def test_harness_key_cannot_read_or_export_trajectories(
    start_proxy: ProxyFactory, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    with start_proxy(api_key=HARNESS, admin_key=ADMIN, log_level="debug") as url:
        chat = f"{url}/sessions/k/v1/chat/completions"
        refused = httpx.post(chat, json=CHAT, headers=_auth("wrong"))
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert "wrong" not in refused.text
        assert httpx.post(chat, json=CHAT).status_code == 401
        assert httpx.post(chat, json=CHAT, headers=_auth(HARNESS)).status_code == 200
        sdk = OpenAI(base_url=f"{url}/sessions/k/v1", api_key=HARNESS, max_retries=0)
        assert sdk.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}]).choices
        for method, path in [
            ("GET", "/sessions/k/trajectory"),
            ("GET", "/sessions"),
            ("GET", "/export"),
            ("POST", "/sessions/k/finish"),
            ("POST", "/admin/weight_version"),
        ]:
            as_harness = httpx.request(method, url + path, headers=_auth(HARNESS), json={"version": "v9"})
            assert as_harness.status_code == 403, path
            assert as_harness.json()["error"]["type"] == "permission_error"
            assert httpx.request(method, url + path).status_code == 401, path
        trajectory = httpx.get(f"{url}/sessions/k/trajectory", headers=_auth(ADMIN))
        assert trajectory.status_code == 200
        assert trajectory.json()["segments"]
        assert httpx.get(f"{url}/health").status_code == 200
    assert HARNESS not in caplog.text
    assert ADMIN not in caplog.text


def test_a_harness_key_alone_also_guards_the_recorded_data(start_proxy: ProxyFactory) -> None:
    with start_proxy(api_key=HARNESS) as url:
        assert httpx.get(f"{url}/sessions").status_code == 401
        assert httpx.get(f"{url}/sessions", headers=_auth(HARNESS)).status_code == 200
