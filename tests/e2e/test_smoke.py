from __future__ import annotations

import httpx

from tests.fakes.sglang import FakeSGLang


def test_first_turn_is_recorded_and_answered(proxy_url: str, engine: FakeSGLang) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16}
    response = httpx.post(f"{proxy_url}/sessions/s1/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["x-session-id"] == "s1"
    assert response.json()["choices"][0]["message"]["content"] == "ok"
    trajectory = httpx.get(f"{proxy_url}/sessions/s1/trajectory").json()
    assert trajectory["segments"][0]["prompt_ids"] == engine.requests[0]["input_ids"]
