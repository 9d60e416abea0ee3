"""The proxy on vLLM (the stand-in in tests/fakes/vllm.py): exact tokens and logprobs on both token
routes, vLLM's own sampling names, stops, top logprobs, the logprobs mode, aborts and errors."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.config import Settings
from proxy.engines.setup import build_engine, check_engine
from proxy.errors import EngineMismatch
from tests.fakes.vllm import FakeVLLM
from tests.invariants import assert_invariants
from tests.support import assemble_stream, serve, stream_events, token_id

USER = [{"role": "user", "content": "hi"}]
SGLANG_NAMES = {"max_new_tokens", "sampling_seed", "no_stop_trim", "json_schema", "min_new_tokens"}


@pytest.fixture
def vllm(qwen_tokenizer: Tokenizer) -> Iterator[FakeVLLM]:
    fake = FakeVLLM(
        tokenizer=qwen_tokenizer,
        eos_ids=(token_id(qwen_tokenizer, "<|im_end|>"), token_id(qwen_tokenizer, "<|endoftext|>")),
        vocab_size=qwen_tokenizer.get_vocab_size(with_added_tokens=True),
    )
    with serve(fake.app()) as url:
        fake.url = url  # type: ignore[attr-defined]
        yield fake
    assert fake.ignored == [], "a key vLLM does not know was sent: vLLM drops those silently"


VLLMProxy = Callable[..., AbstractContextManager[str]]


@pytest.fixture
def vllm_proxy(tmp_path: Path, qwen_dir: Path, vllm: FakeVLLM) -> VLLMProxy:
    @contextmanager
    def start(**overrides: object) -> Iterator[str]:
        values: dict[str, object] = {
            "engine": "vllm",
            "engine_url": vllm.url,  # type: ignore[attr-defined]
            "tokenizer": qwen_dir,
            "db": f"sqlite:///{tmp_path / 'proxy.db'}",
            **overrides,
        }
        with serve(create_app(Settings(**values))) as url:  # type: ignore[arg-type]
            yield url

    return start


def _chat(url: str, session: str, **body: Any) -> httpx.Response:
    payload = {"model": "m", "messages": USER, "max_tokens": 32, **body}
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=payload, timeout=30)


def _recorded(tmp_path: Path) -> list[dict[str, Any]]:
    """The calls as the database holds them: weight version, sampling params, engine metadata."""
    import json
    import sqlite3

    with sqlite3.connect(tmp_path / "proxy.db") as db:
        rows = db.execute(
            "SELECT weight_version, sampling_params, engine_meta FROM calls ORDER BY id"
        ).fetchall()
    return [
        {"weight_version": v, "sampling_params": json.loads(p), "engine_meta": json.loads(m)}
        for v, p, m in rows
    ]


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("scale_out", [True, False], ids=["generate", "completions"])
def test_tool_conversation_keeps_every_token_on_both_routes(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_tokenizer: Tokenizer, scale_out: bool
) -> None:
    vllm.scale_out = scale_out
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    call = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
    outputs = [
        vllm.push([*_encode(qwen_tokenizer, call), im_end]),
        vllm.push([*_encode(qwen_tokenizer, "Done: 1."), im_end]),
    ]
    with vllm_proxy() as url:
        first = _chat(url, "tools", tools=tools)
        assert first.status_code == 200, first.text
        message = first.json()["choices"][0]["message"]
        assert message["tool_calls"][0]["function"]["name"] == "f"
        messages = [
            *USER,
            message,
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": "1"},
        ]
        second = _chat(url, "tools", tools=tools, messages=messages)
        assert second.json()["choices"][0]["message"]["content"] == "Done: 1."
        (segment,) = httpx.get(f"{url}/sessions/tools/trajectory").json()["segments"]
        template = httpx.get(f"{url}/v1/template").json()
    assert_invariants(segment, vllm.requests, outputs)
    path = "token_ids" if scale_out else "prompt"
    assert all(path in request for request in vllm.requests)
    assert template["engine"]["route"] == ("generate" if scale_out else "completions")


def test_sampling_is_sent_under_vllm_names_and_recorded_so(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, tmp_path: Path
) -> None:
    with vllm_proxy() as url:
        body = {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "seed": 7, "stop": ["zz"], "min_p": 0.1}
        assert _chat(url, "s", **body).status_code == 200
    params = vllm.requests[0]["sampling_params"]
    assert not SGLANG_NAMES & set(params)
    assert params["seed"] == 7
    assert params["max_tokens"] == 32
    assert params["n"] == 1
    assert (params["temperature"], params["top_p"], params["top_k"], params["min_p"]) == (0.7, 0.9, 5, 0.1)
    assert params["stop"] == ["zz"]
    assert params["skip_special_tokens"] is False
    (call,) = _recorded(tmp_path)
    assert call["sampling_params"] == params  # recorded as sent, under vLLM's names


def test_completions_fallback_sends_every_field_and_a_number_of_max_tokens(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy
) -> None:
    vllm.scale_out = False
    with vllm_proxy(context_length=None) as url:
        assert _chat(url, "c", max_tokens=None).status_code == 200
    request = vllm.requests[0]
    # null means 16 on /v1/completions: the proxy sends the room left itself.
    assert request["max_tokens"] == vllm.context_length - len(request["prompt"])
    assert request["return_token_ids"] is request["return_tokens_as_token_ids"] is True
    assert request["temperature"] == 1.0
    assert request["top_k"] == -1


@pytest.mark.parametrize("scale_out", [True, False], ids=["generate", "completions"])
def test_top_logprobs_are_the_engines_best_k(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_tokenizer: Tokenizer, scale_out: bool
) -> None:
    vllm.scale_out = scale_out
    ids = [*_encode(qwen_tokenizer, "one two three"), token_id(qwen_tokenizer, "<|im_end|>")]
    scripted = vllm.push(ids)
    with vllm_proxy() as url:
        answer = _chat(url, "top", logprobs=True, top_logprobs=3).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) - 1  # the stop token is not content
    for position, entry in enumerate(content):
        assert entry["logprob"] == pytest.approx(scripted.logprobs[position])
        expected = vllm.distribution(ids[position], scripted.logprobs[position], position, 3)
        got = [(t["token"], t["logprob"]) for t in entry["top_logprobs"]]
        assert got == [
            (qwen_tokenizer.decode([t], skip_special_tokens=False), pytest.approx(lp)) for t, lp in expected
        ]
    assert vllm.requests[0].get("sampling_params", vllm.requests[0]).get("logprobs") == 3


@pytest.mark.parametrize("scale_out", [True, False], ids=["generate", "completions"])
def test_stream_reassembles_to_the_record(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_tokenizer: Tokenizer, scale_out: bool
) -> None:
    vllm.scale_out = scale_out
    ids = [
        *_encode(qwen_tokenizer, "<think>\nhm\n</think>\n\nHello there"),
        token_id(qwen_tokenizer, "<|im_end|>"),
    ]
    scripted = vllm.push(ids)
    with vllm_proxy() as url:
        body = {"model": "m", "messages": USER, "max_tokens": 64, "stream": True}
        events, raw = stream_events(url, body, "st")
        (segment,) = httpx.get(f"{url}/sessions/st/trajectory").json()["segments"]
    message = assemble_stream(events)
    assert message["content"] == "Hello there"
    assert message["reasoning_content"] == "hm"
    assert message["finish_reason"] == "stop"
    assert raw[-1] == "data: [DONE]"
    assert_invariants(segment, vllm.requests, [scripted])


def test_stop_string_token_and_length_finishes(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_tokenizer: Tokenizer
) -> None:
    endoftext = token_id(qwen_tokenizer, "<|endoftext|>")
    vllm.push([*_encode(qwen_tokenizer, "a b STOP c"), endoftext])
    vllm.push([*_encode(qwen_tokenizer, "x y"), endoftext])  # generation_config's EOS: stop_reason = id
    vllm.push(_encode(qwen_tokenizer, "one two three four five"))
    with vllm_proxy() as url:
        by_string = _chat(url, "a", stop=["STOP"]).json()["choices"][0]
        by_token = _chat(url, "b").json()["choices"][0]
        by_length = _chat(url, "c", max_tokens=2).json()["choices"][0]
    assert (by_string["finish_reason"], by_string["message"]["content"]) == ("stop", "a b ")
    assert (by_token["finish_reason"], by_token["message"]["content"]) == ("stop", "x y")
    assert by_length["finish_reason"] == "length"


def test_temperature_vllm_would_change_is_refused(vllm: FakeVLLM, vllm_proxy: VLLMProxy) -> None:
    with vllm_proxy() as url:
        response = _chat(url, "t", temperature=0.005)
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "temperature"
        assert _chat(url, "t", temperature=0.0).status_code == 200
    assert len(vllm.requests) == 1


def test_context_limit_is_checked_by_the_proxy(vllm: FakeVLLM, vllm_proxy: VLLMProxy) -> None:
    """vLLM clamps prompt + max_tokens to max_model_len silently: the proxy refuses first."""
    vllm.context_length = 64
    with vllm_proxy() as url:
        response = _chat(url, "ctx", max_tokens=60)
        assert response.json()["error"]["code"] == "context_length_exceeded"
        assert _chat(url, "ctx2", max_tokens=None).status_code == 200
    assert len(vllm.requests) == 1
    request = vllm.requests[0]
    assert request["sampling_params"]["max_tokens"] == 64 - len(request["token_ids"])


@pytest.mark.parametrize("stream", [False, True])
def test_vllms_own_length_refusal_is_a_400_context_length_exceeded(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, stream: bool
) -> None:
    """A context the proxy was told is longer than the engine's: vLLM's refusal, in its own words
    ("... longer than the maximum model length of 64"), is OpenAI's length error, not engine_rejected."""
    vllm.context_length = 64
    with vllm_proxy(context_length=4096) as url:
        response = _chat(url, "ctx", messages=[{"role": "user", "content": "word " * 80}], stream=stream)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert "maximum model length of 64" in error["message"]


def test_paused_engine_is_503_and_engine_errors_keep_their_status(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy
) -> None:
    with vllm_proxy() as url:
        vllm.paused = True
        assert _chat(url, "p").status_code == 503
        streamed = httpx.post(
            f"{url}/sessions/p2/v1/chat/completions",
            json={"model": "m", "messages": USER, "stream": True},
            timeout=30,
        )
        assert streamed.status_code == 503  # vLLM's in-stream error before any token: a plain error
        vllm.paused = False
        assert _chat(url, "p").status_code == 200


def test_client_disconnect_aborts_by_vllms_engine_id(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_tokenizer: Tokenizer
) -> None:
    import time

    vllm.chunk_delay_s = 0.2
    vllm.push(_encode(qwen_tokenizer, " word" * 40))
    with vllm_proxy() as url:
        body = {"model": "m", "messages": USER, "max_tokens": 64, "stream": True}
        with httpx.stream("POST", f"{url}/sessions/gone/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break
        deadline = time.monotonic() + 10
        while not vllm.aborted and time.monotonic() < deadline:
            time.sleep(0.05)
    assert vllm.aborted == [f"generate-tokens-{vllm.requests[0]['request_id']}"]


def test_weight_versions_from_vllm_and_its_default_label(
    vllm: FakeVLLM, vllm_proxy: VLLMProxy, tmp_path: Path
) -> None:
    with vllm_proxy() as url:
        httpx.post(f"{url}/admin/weight_version", json={"weight_version": "7"})
        assert _chat(url, "w").status_code == 200  # vLLM's "default" names no version: the trainer's
        vllm.weight_version = "step-8"
        assert _chat(url, "w2").status_code == 200
    calls = _recorded(tmp_path)
    assert [c["weight_version"] for c in calls] == ["7", "step-8"]
    assert calls[1]["engine_meta"]["weight_versions"] == [{"version": "step-8", "start": 0, "end": 2}]


@pytest.mark.parametrize(
    "case",
    [
        (True, "processed_logprobs", None, ("processed_logprobs", "server_info", True)),
        (True, "raw_logprobs", None, ("raw_logprobs", "server_info", False)),
        (False, "raw_logprobs", None, (None, "unknown", None)),
        (False, "raw_logprobs", "processed_logprobs", ("processed_logprobs", "declared", True)),
    ],
)
def test_logprobs_mode_is_found_reported_and_recorded_per_call(
    vllm: FakeVLLM,
    vllm_proxy: VLLMProxy,
    tmp_path: Path,
    case: tuple[Any, ...],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dev_mode, mode, declared, expected = case
    vllm.dev_mode, vllm.logprobs_mode = dev_mode, mode
    with vllm_proxy(vllm_logprobs_mode=declared) as url:
        report = httpx.get(f"{url}/v1/template").json()["engine"]
        assert _chat(url, "lp", temperature=0.5).status_code == 200
    found = (
        report["logprobs_mode"],
        report["logprobs_mode_source"],
        report["logprobs_are_sampled_distribution"],
    )
    assert found == expected
    assert (report["warning"] is None) == (expected[2] is True)
    if expected[2] is not True:
        assert any("NOT the" in r.message or "UNKNOWN" in r.message for r in caplog.records)
    (call,) = _recorded(tmp_path)
    assert call["engine_meta"]["logprobs_mode"] == expected[0]
    assert call["engine_meta"]["sampled_distribution"] == expected[2]  # temperature 0.5


def start_error(**values: Any) -> str:
    """The start-up check's error message for these settings ("" when the check passes)."""
    settings = Settings(**values)

    async def check() -> str:
        engine = build_engine(settings)
        try:
            await check_engine(settings, engine)
        except EngineMismatch as exc:
            return exc.message
        finally:
            await engine.aclose()
        return ""

    return asyncio.run(check())


def test_logits_mode_or_a_contradicted_declaration_stops_the_start(vllm: FakeVLLM, qwen_dir: Path) -> None:
    vllm.dev_mode, vllm.logprobs_mode = True, "raw_logits"
    common = {"engine": "vllm", "engine_url": vllm.url, "tokenizer": qwen_dir}  # type: ignore[attr-defined]
    assert "its logprobs are logits" in start_error(**common)
    vllm.logprobs_mode = "raw_logprobs"
    assert "told processed_logprobs" in start_error(**common, vllm_logprobs_mode="processed_logprobs")
    assert start_error(**common, vllm_logprobs_mode="raw_logprobs") == ""


def test_api_key_is_sent_to_vllm(vllm: FakeVLLM, vllm_proxy: VLLMProxy, qwen_dir: Path) -> None:
    vllm.api_key = "sk-engine"
    common = {"engine": "vllm", "engine_url": vllm.url, "tokenizer": qwen_dir}  # type: ignore[attr-defined]
    # vLLM answers 401: a start-up error, not a proxy that fails every turn.
    assert "wants an API key" in start_error(**common)
    with vllm_proxy(engine_api_key="sk-engine") as url:
        assert _chat(url, "k").status_code == 200
