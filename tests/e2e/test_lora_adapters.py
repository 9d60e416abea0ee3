"""Per-request LoRA: a request whose `model` names an adapter the engine serves is sampled with it
(SGLang's `lora_path`) and recorded with it; other names follow the documented rule (base model,
recorded as requested; 404 model_not_found under --strict-model-names); an adapter's name is never
sampled by the base weights."""

from __future__ import annotations

import time
from typing import Any

import httpx

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import chat, stream_events

USER = [{"role": "user", "content": "hi"}]


def _samples(url: str, session: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/sessions/{session}/samples")
    assert response.status_code == 200, response.text
    rows: list[dict[str, Any]] = response.json()["samples"]
    return rows


def _post(url: str, session: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}/sessions/{session}{path}", json=body, timeout=30)


def test_an_adapter_name_is_sampled_with_the_adapter_and_recorded(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.adapters["math-lora"] = "/adapters/math"
    with start_proxy() as url:
        answer = chat(url, USER, "lora-1", model="math-lora")
        assert answer["model"] == "math-lora"
        assert engine.requests[-1]["lora_path"] == "math-lora"
        stream_events(
            url, {"model": "math-lora", "messages": USER, "max_tokens": 8, "stream": True}, "lora-2"
        )
        assert engine.requests[-1]["lora_path"] == "math-lora"
        chat(url, USER, "lora-3", model="fake-model")  # the served model: the base weights
        assert "lora_path" not in engine.requests[-1]
        for session in ("lora-1", "lora-2"):
            [row] = _samples(url, session)
            assert (row["adapter"], row["model"]) == ("math-lora", "math-lora")
        [base] = _samples(url, "lora-3")
        assert base["adapter"] is None
        merged = httpx.get(f"{url}/sessions/lora-1/samples", params={"mode": "merged"}).json()["samples"]
        assert merged[0]["adapters"] == ["math-lora"]


def test_models_lists_the_adapters_with_their_parent(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    engine.adapters["math-lora"] = "/adapters/math"
    with start_proxy() as url:
        data = httpx.get(f"{url}/v1/models").json()["data"]
        base, adapter = data
        assert (base["id"], base["parent"]) == ("fake-model", None)
        assert adapter["id"] == "math-lora"
        assert (adapter["parent"], adapter["root"]) == ("fake-model", "/adapters/math")


def test_an_adapter_loaded_at_run_time_is_served_without_a_restart(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    with start_proxy() as url:
        chat(url, USER, "late-0", model="late-lora")  # unknown: the base model, recorded as asked
        assert "lora_path" not in engine.requests[-1]
        httpx.post(
            f"{engine.url}/load_lora_adapter",  # type: ignore[attr-defined]
            json={"lora_name": "late-lora", "lora_path": "/adapters/late"},
        ).raise_for_status()
        time.sleep(1.1)  # an unknown name lists the adapters again at most once a second
        chat(url, USER, "late-1", model="late-lora")
        assert engine.requests[-1]["lora_path"] == "late-lora"
        assert _samples(url, "late-1")[0]["adapter"] == "late-lora"
        [row] = _samples(url, "late-0")
        assert (row["model"], row["adapter"]) == ("late-lora", None)


def test_an_unloaded_adapter_is_a_404_never_the_base_weights(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.adapters["gone-lora"] = "/adapters/gone"
    with start_proxy() as url:
        chat(url, USER, "gone-1", model="gone-lora")
        sent = len(engine.requests)
        del engine.adapters["gone-lora"]  # the engine unloads it; the proxy's listing may still hold it
        for _ in range(2):
            response = httpx.post(
                f"{url}/sessions/gone-2/v1/chat/completions",
                json={"model": "gone-lora", "messages": USER, "max_tokens": 8},
            )
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert (error["code"], error["param"]) == ("model_not_found", "model")
            assert "gone-lora" in error["message"]
        assert all(request.get("lora_path") == "gone-lora" for request in engine.requests[sent:])


OPENAI_ROUTES = [
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 8}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 8}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 8}),
]


def test_strict_names_answer_404_model_not_found_in_openai_envelopes(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.adapters["math-lora"] = "/adapters/math"
    with start_proxy(strict_model_names=True, model_aliases="my-policy, other") as url:
        for index, (path, body) in enumerate(OPENAI_ROUTES):
            response = _post(url, f"strict-{index}", path, {"model": "gpt-5-codex", **body})
            assert response.status_code == 404, response.text
            error = response.json()["error"]
            assert (error["type"], error["code"], error["param"]) == (
                "invalid_request_error",
                "model_not_found",
                "model",
            )
            assert "gpt-5-codex" in error["message"]
            assert not engine.requests
        for index, (path, body) in enumerate(OPENAI_ROUTES):
            for name in ("fake-model", "my-policy", "math-lora"):
                answer = _post(url, f"ok-{index}-{name}", path, {"model": name, **body})
                assert answer.status_code == 200, answer.text


def test_strict_names_answer_404_in_anthropic_envelope(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    with start_proxy(strict_model_names=True) as url:
        body = {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": USER}
        response = httpx.post(f"{url}/sessions/anth/v1/messages", json=body)
        assert response.status_code == 404
        assert response.json()["type"] == "error"
        assert response.json()["error"]["type"] == "not_found_error"
        assert "claude-sonnet-4-5" in response.json()["error"]["message"]


def test_by_default_other_names_are_the_base_model_recorded_as_requested(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    with start_proxy() as url:
        body = {"model": "claude-sonnet-4-5", "max_tokens": 8, "messages": USER}
        assert httpx.post(f"{url}/sessions/cc/v1/messages", json=body).status_code == 200
        assert "lora_path" not in engine.requests[-1]
        [row] = _samples(url, "cc")
        assert (row["model"], row["adapter"]) == ("claude-sonnet-4-5", None)
