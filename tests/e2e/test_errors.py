"""Bad input and engine faults answer in OpenAI's error envelope with the right status, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import serve

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}


def _post(url: str, body: Any, path: str = "/v1/chat/completions") -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(url + path, content=body, headers={"content-type": "application/json"})
    return httpx.post(url + path, json=body, timeout=30)


def _error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "m", "messages": USER, "stream_options": {"include_usage": True}}, "stream_options", None),
        ({"model": "m", "messages": USER, "logit_bias": {"1": 2}}, "logit_bias", "unsupported_parameter"),
        ({"model": "m", "messages": USER, "n": 65}, "n", "invalid_value"),
        ({"model": "m", "messages": USER, "tool_choice": "required"}, "tool_choice", None),
        (
            {"model": "m", "messages": USER, "tools": [TOOL], "tool_choice": {"function": {"name": "nope"}}},
            "tool_choice",
            None,
        ),
        ({"model": "m", "messages": USER, "top_logprobs": 3}, "top_logprobs", None),
        (
            {"model": "m", "messages": USER, "top_logprobs": 21, "logprobs": True},
            "top_logprobs",
            "invalid_value",
        ),
        (
            {"model": "m", "messages": USER, "response_format": {"type": "xml"}},
            "response_format",
            "unsupported_parameter",
        ),
        (
            {
                "model": "m",
                "messages": USER,
                "response_format": {"type": "json_schema", "json_schema": {"name": "a"}},
            },
            "response_format",
            "unsupported_parameter",
        ),
        (
            {"model": "m", "messages": USER, "response_format": {"type": "json_schema", "json_schema": {}}},
            "response_format.json_schema.name",
            None,
        ),
        (
            {"model": "m", "messages": USER, "parallel_tool_calls": False},
            "parallel_tool_calls",
            "unsupported_parameter",
        ),
        (
            {"model": "m", "messages": [{"role": "wizard", "content": "x"}]},
            "messages.0.role",
            "invalid_value",
        ),
        ({"model": "m", "messages": []}, "messages", "invalid_value"),
        (
            {"model": "m", "messages": USER, "tools": [{"type": "function", "function": {"name": ""}}]},
            "tools.0.function.name",
            "invalid_value",
        ),
        ({"model": "m", "messages": USER, "stop": ""}, "stop", "invalid_value"),
        ({"model": "m", "messages": USER, "stop": [""]}, "stop", "invalid_value"),
        ({"messages": USER}, "model", "invalid_value"),
        ({"model": "m", "messages": USER, "temperature": -1}, "temperature", "invalid_value"),
        ({"model": "m", "messages": USER, "max_tokens": "many"}, "max_tokens", "invalid_value"),
        (
            {"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages",
            "unsupported_parameter",
        ),
    ],
)
def test_invalid_requests_are_400_in_the_envelope(
    proxy_url: str, body: Any, param: str, code: str | None
) -> None:
    error = _error(_post(proxy_url, body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code


@pytest.mark.parametrize(
    ("path", "field", "value"),
    [
        ("/v1/chat/completions", "stream", "yes"),
        ("/v1/chat/completions", "stream", 1),
        ("/v1/chat/completions", "logprobs", "true"),
        ("/v1/chat/completions", "parallel_tool_calls", "on"),
        ("/v1/completions", "stream", "no"),
        ("/v1/completions", "echo", 0),
        ("/v1/completions", "return_token_ids", "yes"),
    ],
)
def test_a_boolean_field_takes_only_a_boolean(proxy_url: str, path: str, field: str, value: Any) -> None:
    """`"stream": "yes"` streamed and `"echo": 0` passed as false: a bad type is a 400, as at OpenAI."""
    body = {"model": "m", "messages": USER, "prompt": "p", field: value}
    body.pop("prompt" if path.endswith("chat/completions") else "messages")
    error = _error(_post(proxy_url, body, path), 400)
    assert error["param"] == field


def test_malformed_json_is_400(proxy_url: str) -> None:
    _error(_post(proxy_url, b"{not json"), 400)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/sessions"])
def test_malformed_json_names_no_parameter(proxy_url: str, path: str) -> None:
    """A JSON syntax error is in no field: `param` is null, not the error's character offset."""
    for body in (b"{not json", b'{"model": "m", "n": 1', b"[1, 2"):
        error = _error(_post(proxy_url, body, path), 400)
        assert error["param"] is None
        assert "JSON" in error["message"]


def test_errors_in_a_union_field_name_the_field(proxy_url: str) -> None:
    """Pydantic's union members (`str`, `list[...]`) and `[key]` are not parameters of the request."""
    body = {"model": "m", "messages": [{"role": "user", "content": 5}]}
    assert _error(_post(proxy_url, body), 400)["param"] == "messages.0.content"
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": None}}
    body = {"model": "m", "messages": [*USER, {"role": "assistant", "tool_calls": [call]}]}
    assert _error(_post(proxy_url, body), 400)["param"] == "messages.1.tool_calls.0.function.arguments"
    assert httpx.post(f"{proxy_url}/sessions", json={"id": "u"}).status_code == 201
    answer = httpx.post(f"{proxy_url}/sessions/u/reward", json={"call_rewards": {"abc": 1.0}})
    assert _error(answer, 400)["param"] == "call_rewards.abc"


def test_session_metadata_an_export_could_not_write_back_is_refused(proxy_url: str) -> None:
    """Python's JSON parser reads 1e400 as infinity and any integer; an export row could hold
    neither (infinity would come back null, a 65-bit integer broke every export of the session)."""
    json_body = {"content-type": "application/json"}
    for bad in ('{"x": 1e400}', '{"x": [1, {"y": -1e999}]}', '{"x": 18446744073709551616}', '{"x": NaN}'):
        answer = httpx.post(f"{proxy_url}/sessions", content=f'{{"metadata": {bad}}}', headers=json_body)
        assert _error(answer, 400)["param"] == "metadata", bad
    fine = {"big": 2**64 - 1, "low": -(2**63), "f": 1.5, "nested": [{"b": True}]}
    created = httpx.post(f"{proxy_url}/sessions", json={"id": "meta-ok", "metadata": fine})
    assert created.status_code == 201
    assert httpx.get(f"{proxy_url}/sessions/meta-ok").json()["metadata"] == fine


def test_query_parameter_errors_name_the_parameter(proxy_url: str) -> None:
    """OpenAI's `param` names the parameter, not FastAPI's location of it (`query.mode`)."""
    error = _error(httpx.get(f"{proxy_url}/export", params={"mode": "rows"}), 400)
    assert error["param"] == "mode"
    error = _error(httpx.get(f"{proxy_url}/sessions", params={"limit": 0}), 400)
    assert error["param"] == "limit"


def test_bad_session_id_is_400(proxy_url: str) -> None:
    error = _error(
        _post(proxy_url, {"model": "m", "messages": USER}, "/sessions/bad%20id/v1/chat/completions"), 400
    )
    assert error["param"] == "session_id"


def test_unknown_session_trajectory_is_404(proxy_url: str) -> None:
    error = _error(httpx.get(f"{proxy_url}/sessions/nobody/trajectory"), 404)
    assert error["type"] == "not_found_error"


def test_unknown_route_is_404_in_the_envelope(proxy_url: str) -> None:
    _error(httpx.get(f"{proxy_url}/v2/nothing"), 404)


def test_context_length_is_checked_before_the_engine(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    with start_proxy(context_length=12) as url:
        error = _error(
            _post(url, {"model": "m", "messages": [{"role": "user", "content": "word " * 20}]}), 400
        )
        assert error["code"] == "context_length_exceeded"
        error = _error(_post(url, {"model": "m", "messages": USER, "max_tokens": 100}), 400)
        assert error["code"] == "context_length_exceeded"
    assert engine.requests == []


def test_a_completion_limit_past_the_context_names_the_field_sent(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    with start_proxy(context_length=4096) as url:
        for field in ("max_tokens", "max_completion_tokens"):
            for stream in (False, True):
                body = {"model": "m", "messages": USER, field: 100_000, "stream": stream}
                error = _error(_post(url, body), 400)
                assert (error["code"], error["param"]) == ("context_length_exceeded", field)
    assert engine.requests == []


def test_engine_down_is_503(start_proxy: ProxyFactory) -> None:
    with start_proxy(engine_url="http://127.0.0.1:9", context_length=4096) as url:
        error = _error(
            _post(url, {"model": "m", "messages": USER}, "/sessions/down/v1/chat/completions"), 503
        )
        assert error["code"] == "engine_unavailable"
        assert httpx.get(f"{url}/health").status_code == 503
        # Nothing is recorded for a call that never happened, not even its session.
        assert httpx.get(f"{url}/sessions/down/trajectory").status_code == 404


def test_engine_500_and_malformed_answers_are_502(start_proxy: ProxyFactory) -> None:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    answers = iter(
        [
            Response("boom", status_code=500),
            Response("{not json", status_code=200, media_type="application/json"),
            JSONResponse(
                {"output_ids": [1, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
            ),
        ]
    )

    async def generate(_: Request) -> Response:
        return next(answers)

    broken = Starlette(routes=[Route("/generate", generate, methods=["POST"])])
    with serve(broken) as engine_url, start_proxy(engine_url=engine_url, context_length=4096) as url:
        for _ in range(3):
            error = _error(_post(url, {"model": "m", "messages": USER}), 502)
            assert error["type"] == "engine_error"


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("GET", "/export?after=9223372036854775808", None),
        ("POST", "/export/ack", {"consumer": "c", "cursor": 2**63}),
        ("POST", "/sessions/s/reward", {"call_rewards": {str(2**63): 1.0}}),
    ],
)
def test_integers_beyond_the_database_range_are_400(
    proxy_url: str, method: str, path: str, body: Any
) -> None:
    httpx.post(f"{proxy_url}/sessions", json={"id": "s"})
    _error(httpx.request(method, proxy_url + path, json=body), 400)


CHAT = {"model": "m", "messages": USER, "max_tokens": 4}
RESPONSES = {"model": "m", "input": "hi", "max_output_tokens": 16}
MESSAGES = {"model": "m", "messages": USER, "max_tokens": 4}
# (route, body): fields the proxy refuses when they ask for something, sent unset (null, as clients
# that send every field do) or with a value that asks for nothing this proxy does not do anyway.
ASK_FOR_NOTHING: list[tuple[str, dict[str, Any]]] = [
    *(
        ("/v1/chat/completions", {**CHAT, name: None})
        for name in ("logit_bias", "functions", "function_call", "audio", "prediction", "web_search_options")
    ),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {}}),
    ("/v1/chat/completions", {**CHAT, "modalities": ["text"]}),
    ("/v1/chat/completions", {**CHAT, "stream": True, "stream_options": {"include_obfuscation": False}}),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 4, "logit_bias": None}),
    *(("/v1/responses", {**RESPONSES, name: None}) for name in ("max_tool_calls", "prompt", "conversation")),
    ("/v1/messages", {**MESSAGES, "mcp_servers": None}),
]


@pytest.mark.parametrize(
    ("route", "body"), ASK_FOR_NOTHING, ids=[f"{r}:{sorted(b)}" for r, b in ASK_FOR_NOTHING]
)
def test_a_refused_field_sent_unset_or_asking_for_nothing_is_served(
    proxy_url: str, route: str, body: dict[str, Any]
) -> None:
    answer = httpx.post(f"{proxy_url}/sessions/noop{route}", json=body, timeout=30)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "logit_bias": {"1": 2}}, "logit_bias"),
        ("/v1/chat/completions", {**CHAT, "modalities": ["text", "audio"]}, "modalities"),
        (
            "/v1/chat/completions",
            {**CHAT, "stream": True, "stream_options": {"include_obfuscation": True}},
            "stream_options",
        ),
        ("/v1/responses", {**RESPONSES, "max_tool_calls": 3}, "max_tool_calls"),
    ],
)
def test_the_same_fields_asking_for_something_are_refused(
    proxy_url: str, route: str, body: dict[str, Any], param: str
) -> None:
    answer = httpx.post(f"{proxy_url}/sessions/asks{route}", json=body, timeout=30)
    assert _error(answer, 400)["param"] == param


def test_a_conflict_no_retry_can_resolve_tells_the_sdks_not_to_retry(proxy_url: str) -> None:
    """The OpenAI and Anthropic SDKs retry every 409 unless told `x-should-retry: false`: a turn in a
    finished session would be sent three times, with back-off, before the harness saw the error."""
    assert httpx.post(f"{proxy_url}/sessions", json={"id": "done"}).status_code == 201
    httpx.post(f"{proxy_url}/sessions/done/finish").raise_for_status()
    chat = {"model": "m", "messages": USER}
    anthropic = {"model": "m", "max_tokens": 8, "messages": USER}
    for route, body in (("chat/completions", chat), ("messages", anthropic)):
        answer = httpx.post(f"{proxy_url}/sessions/done/v1/{route}", json=body)
        assert answer.status_code == 409, answer.text
        assert answer.headers["x-should-retry"] == "false"
