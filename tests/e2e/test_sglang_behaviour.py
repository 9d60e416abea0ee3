"""SGLang as it really behaves (../shared/docs/sglang-generate.md, "Measured on a real server"):
its input and output limits, its refusals inside a stream, its weight version; and what the proxy
records for an aborted call."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from tokenizers import Tokenizer

from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang

USER = [{"role": "user", "content": "hi"}]
FILLER = 100  # any id of the vocabulary: token prompts of an exact length


def _complete(url: str, session: str, length: int, **extra: Any) -> httpx.Response:
    body = {"model": "m", "prompt": [FILLER] * length, **extra}
    return httpx.post(f"{url}/sessions/{session}/v1/completions", json=body, timeout=30)


def _streamed(url: str, path: str, body: dict[str, Any]) -> tuple[int, list[str]]:
    """Status and data lines of a streamed request (the error body when it is not a 200)."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=30) as response:
        if response.status_code != 200:
            return response.status_code, [response.read().decode()]
        return 200, [line[6:] for line in response.iter_lines() if line.startswith("data: ")]


def _code(response: httpx.Response) -> tuple[int, str]:
    return response.status_code, response.json()["error"]["code"]


def test_prompts_are_refused_where_sglang_refuses_them(start_proxy: ProxyFactory, engine: FakeSGLang) -> None:
    engine.context_length = 2048  # SGLang takes inputs of at most 2041 tokens here (measured)
    with start_proxy() as url:
        for length in (2042, 2045, 2047):
            response = _complete(url, "long", length, max_tokens=1)
            assert _code(response) == (400, "context_length_exceeded"), response.text
        assert engine.requests == []
        response = _complete(url, "long", 2041, max_tokens=5)
        assert response.status_code == 200, response.text
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 5


def test_max_tokens_that_sglang_would_cap_are_refused_not_shortened(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.context_length = 2048  # SGLang samples at most 2048 - 2 - 2000 = 46 tokens after 2000
    with start_proxy() as url:
        response = _complete(url, "cap", 2000, max_tokens=48)
        assert _code(response) == (400, "context_length_exceeded"), response.text
        assert response.json()["error"]["param"] == "max_tokens"
        assert engine.requests == []
        engine.push(qwen_tokenizer.encode(" word" * 60).ids[:60])
        response = _complete(url, "cap", 2000, max_tokens=46)
        assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert response.json()["usage"]["completion_tokens"] == 46
    assert choice["finish_reason"] == "length"


def test_without_max_tokens_a_chat_turn_gets_the_room_sglang_really_gives(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.context_length = 2048
    with start_proxy() as url:
        response = httpx.post(f"{url}/v1/chat/completions", json={"model": "m", "messages": USER}, timeout=30)
        assert response.status_code == 200, response.text
    prompt = response.json()["usage"]["prompt_tokens"]
    assert engine.requests[-1]["sampling_params"]["max_new_tokens"] == 2048 - 2 - prompt


@pytest.mark.parametrize("stream", [False, True])
def test_sglangs_own_length_refusal_is_a_400_context_length_exceeded(
    start_proxy: ProxyFactory, engine: FakeSGLang, stream: bool
) -> None:
    # A KV cache smaller than the context lowers SGLang's input limit below what the proxy can know:
    # SGLang refuses at admission, in a stream as HTTP 200 + a chunk with a fake output id 0.
    engine.context_length, engine.kv_capacity = 4096, 1024
    with start_proxy() as url:
        body = {"model": "m", "prompt": [FILLER] * 1500, "max_tokens": 8}
        if stream:
            status, lines = _streamed(url, "/sessions/adm/v1/completions", body)
            assert status == 400, lines
            error = json.loads(lines[0])["error"]
        else:
            response = httpx.post(f"{url}/sessions/adm/v1/completions", json=body, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert error["type"] == "invalid_request_error"
        assert "1018" in error["message"]  # SGLang's own limit, named
        # Nothing of a refused request is recorded: the fake id 0 is no sampled token.
        assert httpx.get(f"{url}/sessions/adm/trajectory").status_code == 404


def test_a_refused_stream_of_n_choices_is_one_http_error_and_every_choice_is_aborted(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.context_length, engine.kv_capacity = 4096, 1024
    with start_proxy() as url:
        body = {"model": "m", "prompt": [FILLER] * 1500, "max_tokens": 8, "n": 3}
        status, lines = _streamed(url, "/sessions/n/v1/completions", body)
    assert status == 400, lines
    assert json.loads(lines[0])["error"]["code"] == "context_length_exceeded"
    assert sorted(engine.aborted) == sorted(r["rid"] for r in engine.requests)
    assert len(engine.aborted) == 3


def test_an_error_event_at_the_start_of_a_stream_is_the_unstreamed_error(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.fault = "late_error"  # HTTP 200, then {"error": {..., "code": 400}} and [DONE]
    with start_proxy() as url:
        status, lines = _streamed(url, "/sessions/late/v1/chat/completions", {"model": "m", "messages": USER})
        assert httpx.get(f"{url}/sessions/late/trajectory").status_code == 404
    assert status == 400, lines
    error = json.loads(lines[0])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")


def test_an_error_event_mid_stream_carries_the_engines_status_as_its_code(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.fault = "error_mid_stream"
    engine.push(qwen_tokenizer.encode(" word" * 4).ids)
    with start_proxy() as url:
        status, lines = _streamed(url, "/sessions/mid/v1/chat/completions", {"model": "m", "messages": USER})
        calls = httpx.get(f"{url}/sessions/mid").json()["calls_by_status"]
    assert status == 200
    assert lines[-1] == "[DONE]"
    error = json.loads(lines[-2])["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", "context_length_exceeded")
    assert calls == {"aborted": 1}


def _export(url: str) -> list[dict[str, Any]]:
    response = httpx.get(f"{url}/export", params={"mode": "stepwise"}, timeout=60)
    assert response.status_code == 200, response.text
    return [orjson.loads(line) for line in response.content.splitlines() if line]


def test_the_engines_weight_version_at_start_is_dispatched_until_the_trainer_sets_one(
    start_proxy: ProxyFactory, engine: FakeSGLang
) -> None:
    engine.weight_version = "boot-7"  # read from /model_info at start
    with start_proxy() as url:
        engine.weight_version = None  # answers that name no version
        chat = {"model": "m", "messages": USER, "max_tokens": 8}
        first = httpx.post(f"{url}/sessions/w/v1/chat/completions", json=chat, timeout=30).json()
        httpx.post(f"{url}/admin/weight_version", json={"weight_version": "step-1"})
        messages = [*USER, first["choices"][0]["message"], {"role": "user", "content": "more"}]
        second = httpx.post(f"{url}/sessions/w/v1/chat/completions", json={**chat, "messages": messages})
        engine.weight_version = "engine-2"  # the engine's own per-answer version wins
        messages += [second.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
        httpx.post(f"{url}/sessions/w/v1/chat/completions", json={**chat, "messages": messages})
        httpx.post(f"{url}/sessions/w/finish")
        versions = [row["weight_version"] for row in _export(url)]
    assert versions == ["boot-7", "step-1", "engine-2"]


def test_an_aborted_call_records_no_openai_finish_reason(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tmp_path: Path
) -> None:
    # SGLang answers an aborted request (/abort_request) with finish "abort". An abort after sampled
    # tokens is continued (a weight sync's, proxy/engines/resuming.py), and one before any token is
    # retried once: the second abort before any token ends the turn as aborted.
    db = tmp_path / "aborted.db"
    with start_proxy(db=db) as url:
        for session in ("plain", "streamed"):
            body = {"model": "m", "messages": USER, "stream": session == "streamed"}
            for _ in range(2):
                engine.push([], finish={"type": "abort", "message": "Abort by /abort_request"})
            response = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=30)
            assert "engine_aborted" in response.text
    with sqlite3.connect(db) as connection:
        rows = connection.execute("select status, finish_reason, finish_detail from calls").fetchall()
    aborted = [(status, reason, json.loads(detail)["openai"]) for status, reason, detail in rows]
    assert aborted == [("aborted", "abort", None), ("aborted", "abort", None)]


def test_the_stand_in_answers_at_the_limits_as_sglang_was_measured_to(
    engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.context_length = 2048
    url = engine.url  # type: ignore[attr-defined]
    refused = {"input_ids": [FILLER] * 2042, "sampling_params": {"max_new_tokens": 1}, "rid": "r1"}
    plain = httpx.post(f"{url}/generate", json=refused, timeout=30)
    assert plain.status_code == 400
    assert plain.json()["error"]["message"].startswith(
        "Input length (2042 tokens) exceeds the maximum allowed length (2042 tokens)."
    )
    streamed = httpx.post(f"{url}/generate", json={**refused, "stream": True}, timeout=30)
    assert streamed.status_code == 200
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    [chunk] = [json.loads(event) for event in events[:-1]]
    assert chunk["output_ids"] == [0]
    assert chunk["meta_info"]["output_token_logprobs"] == []
    finish = chunk["meta_info"]["finish_reason"]
    assert (finish["type"], finish["status_code"], finish["err_type"]) == ("abort", 400, "BadRequestError")
    # Generation is capped at context - 2 - input tokens, whatever max_new_tokens says.
    engine.push(qwen_tokenizer.encode(" word" * 60).ids[:60])
    capped = {"input_ids": [FILLER] * 2000, "sampling_params": {"max_new_tokens": 48}}
    answer = httpx.post(f"{url}/generate", json=capped, timeout=30).json()
    assert len(answer["output_ids"]) == 46
    assert answer["meta_info"]["finish_reason"] == {"type": "length", "length": 46}
