"""Anthropic's error shape on /v1/messages keeps what every error of the proxy carries: the request
id, Retry-After on a 429 or 503, the metrics of a refused turn."""

from __future__ import annotations

from typing import Any

import anthropic
import httpx
import pytest

from tests.conftest import ProxyFactory

ANTHROPIC: dict[str, Any] = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}


def test_anthropic_errors_carry_the_request_id(proxy_url: str) -> None:
    answer = httpx.post(
        f"{proxy_url}/v1/messages", json={"model": "m"}, headers={"x-request-id": "req-17"}, timeout=30
    )
    assert answer.status_code == 400
    assert answer.headers["x-request-id"] == "req-17"
    body = answer.json()
    assert body["request_id"] == "req-17"  # where Anthropic's API puts it
    assert body["error"]["request_id"] == "req-17"  # where every envelope of this proxy has it


@pytest.mark.parametrize("stream", [False, True])
def test_a_paused_anthropic_turn_is_a_429_with_retry_after(start_proxy: ProxyFactory, stream: bool) -> None:
    with start_proxy(pause_mode="reject", retry_after_s=7) as url:
        assert httpx.post(f"{url}/admin/pause", json={}).status_code == 200
        answer = httpx.post(f"{url}/sessions/p/v1/messages", json={**ANTHROPIC, "stream": stream}, timeout=30)
        assert answer.status_code == 429, answer.text
        assert answer.headers["retry-after"] == "7"
        assert answer.json()["error"]["type"] == "rate_limit_error"


def test_anthropic_refusals_are_counted_like_chats(proxy_url: str) -> None:
    httpx.post(f"{proxy_url}/v1/messages", json={"model": "m"}, timeout=30)
    metrics = httpx.get(f"{proxy_url}/metrics").text
    assert 'tito_turns_total{dialect="anthropic",status="error"} 1.0' in metrics
    assert 'tito_errors_total{code="invalid_value",status="400"} 1.0' in metrics


def test_the_anthropic_sdk_reads_the_request_id(proxy_url: str) -> None:
    """Anthropic's SDK takes a request's id from the `request-id` header, answered or refused."""
    client = anthropic.Anthropic(
        base_url=f"{proxy_url}/sessions/rid",
        api_key="unused",
        max_retries=0,
        default_headers={"x-request-id": "req-9"},
    )
    message = client.messages.create(**ANTHROPIC)
    assert message._request_id == "req-9"
    with client.messages.stream(**ANTHROPIC) as stream:
        stream.get_final_message()
        assert stream.response.headers["request-id"] == "req-9"
    with pytest.raises(anthropic.BadRequestError) as refused:
        client.messages.create(model="m", max_tokens=16, messages=[])
    assert refused.value.request_id == "req-9"


@pytest.mark.parametrize(
    "path",
    ["/v1/messages", "/sessions/m405/v1/messages", "/v1/messages/count_tokens", "/v1/messages/batches"],
)
def test_a_wrong_method_or_route_under_messages_answers_in_anthropics_shape(
    proxy_url: str, path: str
) -> None:
    """Refused before any route runs (405, or 404 for a route that does not exist), still in
    Anthropic's shape, with the request named in `request-id`."""
    answer = httpx.get(proxy_url + path, headers={"x-request-id": "req-405"}, timeout=30)
    assert answer.status_code in (404, 405)
    body = answer.json()
    assert body["type"] == "error"
    kind = "not_found_error" if answer.status_code == 404 else "invalid_request_error"
    assert body["error"]["type"] == kind
    assert body["error"]["message"]
    assert body["request_id"] == "req-405"
    assert answer.headers["request-id"] == "req-405"
    if answer.status_code == 405:
        assert answer.headers["allow"] == "POST"


@pytest.mark.parametrize("path", ["/v1/responses", "/v1/chat/completions", "/sessions/m405/v1/responses"])
def test_a_wrong_method_on_an_openai_route_is_a_405_in_openais_envelope(proxy_url: str, path: str) -> None:
    answer = httpx.get(proxy_url + path, timeout=30)
    assert answer.status_code == 405
    assert answer.headers["allow"] == "POST"
    assert answer.json()["error"]["type"] == "invalid_request_error"
