"""Request fields beyond the plain turn: logprobs, n, tool_choice, response_format, retries."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
from tokenizers import Tokenizer

from proxy.app import create_app
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.config import Settings
from tests.fakes.sglang import FakeSGLang
from tests.families import FAMILIES, build_tokenizer_dir
from tests.support import assemble_stream, chat, segments, serve, stream_events, token_id

USER = [{"role": "user", "content": "go"}]
RUN_PARAMETERS = {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}
RUN = {"type": "function", "function": {"name": "run", "parameters": RUN_PARAMETERS}}
READ = {"type": "function", "function": {"name": "read", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "run", "arguments": {"cmd": "ls"}}\n</tool_call>'


def _script(engine: FakeSGLang, tokenizer: Tokenizer, text: str) -> list[int]:
    ids = [*tokenizer.encode(text).ids, token_id(tokenizer, "<|im_end|>")]
    engine.push(ids, [-0.125 * (i + 1) for i in range(len(ids))])
    return ids


def test_logprobs_are_the_sampled_tokens_in_openai_shape(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    ids = _script(engine, qwen_tokenizer, "Grüße, 世界")
    body = chat(proxy_url, USER, "lp", logprobs=True, top_logprobs=2)
    assert engine.requests[-1]["top_logprobs_num"] == 2
    entries = body["choices"][0]["logprobs"]["content"]
    # Every sampled token but the stop token, with the engine's logprob (float32 on the wire is exact
    # for these values).
    assert [e["logprob"] for e in entries] == [-0.125 * (i + 1) for i in range(len(ids) - 1)]
    assert b"".join(bytes(e["bytes"]) for e in entries).decode() == body["choices"][0]["message"]["content"]
    for entry in entries:
        assert len(entry["top_logprobs"]) == 2
        assert entry["top_logprobs"][0]["logprob"] == entry["logprob"]
    # Without logprobs=true nothing is asked of the engine and nothing is returned.
    _script(engine, qwen_tokenizer, "plain")
    assert chat(proxy_url, USER, "lp2")["choices"][0]["logprobs"] is None
    assert "top_logprobs_num" not in engine.requests[-1]


def test_streamed_logprobs_match_the_plain_answer(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, "one two 三")
    plain = chat(proxy_url, USER, "p", logprobs=True, top_logprobs=1)["choices"][0]["logprobs"]["content"]
    _script(engine, qwen_tokenizer, "one two 三")
    events, _ = stream_events(
        proxy_url, {"model": "m", "messages": USER, "stream": True, "logprobs": True, "top_logprobs": 1}, "s"
    )
    streamed = [
        entry
        for event in events
        for choice in event["choices"]
        if choice["logprobs"]
        for entry in choice["logprobs"]["content"]
    ]
    assert streamed == plain


def test_n_choices_are_recorded_as_branches_and_continued_by_the_echoed_one(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, "first option")
    _script(engine, qwen_tokenizer, "second option")
    body = chat(proxy_url, USER, "n", n=2)
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in choices] == [0, 1]
    texts = {c["message"]["content"] for c in choices}
    assert texts == {"first option", "second option"}
    assert len(segments(proxy_url, "n")) == 2
    # The harness keeps the second option: the next turn extends that branch only.
    kept = "second option"
    _script(engine, qwen_tokenizer, "done")
    chat(proxy_url, [*USER, {"role": "assistant", "content": kept}, {"role": "user", "content": "more"}], "n")
    found = segments(proxy_url, "n")
    assert sorted(s["num_calls"] for s in found) == [1, 2]
    extended = next(s for s in found if s["num_calls"] == 2)
    assert kept in qwen_tokenizer.decode(extended["response_ids"])


def test_n_choices_stream_interleaved_with_their_index(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.chunk_delay_s = 0.01
    _script(engine, qwen_tokenizer, "alpha beta gamma")
    _script(engine, qwen_tokenizer, "delta epsilon")
    events, raw = stream_events(
        proxy_url,
        {"model": "m", "messages": USER, "stream": True, "n": 2, "stream_options": {"include_usage": True}},
        "ns",
    )
    assert raw[-1] == "data: [DONE]"
    streamed = {assemble_stream(events, i)["content"] for i in (0, 1)}
    assert streamed == {"alpha beta gamma", "delta epsilon"}
    assert all(assemble_stream(events, i)["finish_reason"] == "stop" for i in (0, 1))
    assert events[-1]["usage"]["completion_tokens"] == sum(
        len(s["response_ids"]) for s in segments(proxy_url, "ns")
    )


@pytest.mark.parametrize(
    ("tool_choice", "forced"),
    [
        ("required", (["run", "read"], False)),
        ({"type": "function", "function": {"name": "run"}}, (["run"], True)),
    ],
)
def test_forced_tool_calls_are_constrained_in_the_family_format(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, tool_choice: Any, forced: Any
) -> None:
    names, stop_after_first = forced
    _script(engine, qwen_tokenizer, CALL)
    body = chat(proxy_url, USER, "tc", tools=[RUN, READ], tool_choice=tool_choice)
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    assert body["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "run"
    tag = json.loads(engine.requests[-1]["sampling_params"]["structural_tag"])
    fmt = tag["format"]
    assert fmt["type"] == "triggered_tags"
    assert fmt["triggers"] == ["<tool_call>"]
    assert fmt["at_least_one"] is True
    assert fmt["stop_after_first"] is stop_after_first
    assert [t["begin"] for t in fmt["tags"]] == [
        f'<tool_call>\n{{"name": "{n}", "arguments": ' for n in names
    ]
    assert fmt["tags"][0]["content"]["json_schema"] == RUN_PARAMETERS
    # The constrained call is exactly the text the template renders for it in history.
    assert CALL.startswith(fmt["tags"][0]["begin"])
    assert CALL.endswith(fmt["tags"][0]["end"])


def test_tool_choice_none_returns_call_markup_as_text(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, CALL)
    body = chat(proxy_url, USER, "none", tools=[RUN], tool_choice="none")
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == CALL
    assert "tool_calls" not in choice["message"]
    assert "structural_tag" not in engine.requests[-1]["sampling_params"]


def test_response_format_json_schema_is_passed_to_structured_generation(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}}
    _script(engine, qwen_tokenizer, '{"answer": 4}')
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    body = chat(proxy_url, USER, "rf", response_format=fmt)
    assert json.loads(body["choices"][0]["message"]["content"]) == {"answer": 4}
    assert json.loads(engine.requests[-1]["sampling_params"]["json_schema"]) == schema
    _script(engine, qwen_tokenizer, "{}")
    chat(proxy_url, USER, "rf", response_format={"type": "json_object"})
    assert json.loads(engine.requests[-1]["sampling_params"]["json_schema"]) == {"type": "object"}


SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}
FORMATS: list[tuple[str, dict[str, Any], str]] = [
    (
        "chat/completions",
        {
            "messages": USER,
            "tools": [RUN],
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
        },
        "response_format",
    ),
    (
        "responses",
        {
            "input": "go",
            "tools": [{"type": "function", "name": "run", "parameters": RUN_PARAMETERS}],
            "text": {"format": {"type": "json_schema", "name": "a", "schema": SCHEMA}},
        },
        "text.format",
    ),
    (
        "messages",
        {
            "max_tokens": 32,
            "messages": USER,
            "tools": [{"name": "run", "input_schema": RUN_PARAMETERS}],
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        },
        "output_config.format",
    ),
]


@pytest.mark.parametrize(("route", "body", "param"), FORMATS, ids=[route for route, _, _ in FORMATS])
def test_a_json_format_beside_callable_tools_is_refused_and_served_with_tool_choice_none(
    proxy_url: str,
    engine: FakeSGLang,
    qwen_tokenizer: Tokenizer,
    *,
    route: str,
    body: dict[str, Any],
    param: str,
) -> None:
    """The JSON grammar admits no tool call: with tools the model may call, the tools could never be
    called (the Agents SDK's output_type beside tools asks exactly that). Refused, naming the format;
    with tool_choice none the tools are only shown, and the format is honoured."""
    url = f"{proxy_url}/sessions/fmt-{route[:4]}/v1/{route}"
    refused = httpx.post(url, json={"model": "m", **body}, timeout=30)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert param in error["message"]
    if route != "messages":
        assert error["param"] == param
    assert engine.requests == []
    _script(engine, qwen_tokenizer, '{"answer": 4}')
    none = {"type": "none"} if route == "messages" else "none"
    served = httpx.post(url, json={"model": "m", **body, "tool_choice": none}, timeout=30)
    assert served.status_code == 200, served.text
    assert json.loads(engine.requests[-1]["sampling_params"]["json_schema"]) == SCHEMA


def _post(url: str, session: str, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_idempotency_key_answers_a_retry_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, "only once")
    body = {"model": "m", "messages": USER, "max_tokens": 32, "n": 2}
    _script(engine, qwen_tokenizer, "twice")
    first = _post(proxy_url, "ik", body, {"Idempotency-Key": "k1"})
    second = _post(proxy_url, "ik", body, {"Idempotency-Key": "k1"})
    assert first.status_code == second.status_code == 200
    assert second.headers["X-Tito-Replayed"] == "true"
    assert len(engine.requests) == 2  # the two choices of the first attempt, nothing for the retry
    assert second.json()["choices"] == first.json()["choices"]
    assert second.json()["usage"] == first.json()["usage"]
    assert len(segments(proxy_url, "ik")) == 2
    reused = _post(proxy_url, "ik", {**body, "max_tokens": 8}, {"Idempotency-Key": "k1"})
    assert reused.status_code == 409
    assert reused.json()["error"]["param"] == "Idempotency-Key"


def test_idempotency_key_without_a_session_answers_the_retry_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """At /v1 without a session each request used to open a new session, so a retry with the same
    key was sampled again (a duplicate rollout in the export): the key now names the session."""
    _script(engine, qwen_tokenizer, "only once")
    _script(engine, qwen_tokenizer, "twice")
    body = {"model": "m", "messages": USER, "max_tokens": 32}
    sent = [
        httpx.post(f"{proxy_url}/v1/chat/completions", json=body, headers={"Idempotency-Key": "free-1"})
        for _ in range(2)
    ]
    first, second = sent
    assert first.status_code == second.status_code == 200
    assert second.headers["X-Tito-Replayed"] == "true"
    assert len(engine.requests) == 1
    assert second.json()["choices"] == first.json()["choices"]
    session = first.headers["X-Session-Id"]
    assert second.headers["X-Session-Id"] == session
    assert len(segments(proxy_url, session)) == 1
    other = httpx.post(f"{proxy_url}/v1/chat/completions", json=body, headers={"Idempotency-Key": "free-2"})
    assert other.json()["choices"][0]["message"]["content"] == "twice"
    assert other.headers["X-Session-Id"] != session


def test_streamed_retry_replays_the_recorded_stream(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    _script(engine, qwen_tokenizer, "I will run it.\n" + CALL)
    body = {"model": "m", "messages": USER, "tools": [RUN], "stream": True}
    first, _ = stream_events(proxy_url, body, "rs", headers={"Idempotency-Key": "s1"})
    again, _ = stream_events(proxy_url, body, "rs", headers={"Idempotency-Key": "s1"})
    assert len(engine.requests) == 1
    one, two = assemble_stream(first), assemble_stream(again)
    assert one["content"] == two["content"] == "I will run it."
    assert one["tool_calls"] == two["tool_calls"]
    assert one["finish_reason"] == two["finish_reason"] == "tool_calls"


def test_sdk_retry_with_an_identical_body_is_not_sampled_twice(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    body = {"model": "m", "messages": USER, "max_tokens": 32}
    _script(engine, qwen_tokenizer, "answer")
    first = _post(proxy_url, "sdk", body, {"x-stainless-retry-count": "0"})
    retry = _post(proxy_url, "sdk", body, {"x-stainless-retry-count": "1"})
    assert retry.json()["choices"] == first.json()["choices"]
    assert len(engine.requests) == 1
    # A new request (retry count 0) with the same body is a new sample, as harnesses expect.
    _script(engine, qwen_tokenizer, "again")
    fresh = _post(proxy_url, "sdk", body, {"x-stainless-retry-count": "0"})
    assert fresh.json()["choices"][0]["message"]["content"] == "again"
    [segment] = segments(proxy_url, "sdk")[:1]
    assert segment["num_calls"] == 1


def test_sdk_retry_without_a_session_is_answered_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """The OpenAI SDK at /v1 names no session: its retry (count 1, the same body) is answered from
    the session its first attempt was recorded in, not sampled again in a new one."""
    body = {"model": "m", "messages": [{"role": "user", "content": "sessionless"}], "max_tokens": 32}
    _script(engine, qwen_tokenizer, "answer")
    url = f"{proxy_url}/v1/chat/completions"
    first = httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"})
    retry = httpx.post(url, json=body, headers={"x-stainless-retry-count": "1"})
    assert retry.status_code == 200, retry.text
    assert retry.headers["X-Tito-Replayed"] == "true"
    assert retry.json()["choices"] == first.json()["choices"]
    assert retry.headers["X-Session-Id"] == first.headers["X-Session-Id"]
    assert len(engine.requests) == 1
    # A first attempt (count 0) with the same body is a new rollout: a new session, sampled.
    _script(engine, qwen_tokenizer, "again")
    fresh = httpx.post(url, json=body, headers={"x-stainless-retry-count": "0"})
    assert fresh.json()["choices"][0]["message"]["content"] == "again"
    assert fresh.headers["X-Session-Id"] != first.headers["X-Session-Id"]
    completions = f"{proxy_url}/v1/completions"
    text = {"model": "m", "prompt": "sessionless text", "max_tokens": 8}
    one = httpx.post(completions, json=text, headers={"x-stainless-retry-count": "0"})
    two = httpx.post(completions, json=text, headers={"x-stainless-retry-count": "2"})
    assert two.headers["X-Tito-Replayed"] == "true"
    assert two.headers["X-Session-Id"] == one.headers["X-Session-Id"]
    assert len(engine.requests) == 3


def test_a_retry_sent_while_the_original_runs_waits_for_it(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    engine.fault, engine.hang_s = "hang", 0.5  # a slow engine: the retry arrives mid-sample
    _script(engine, qwen_tokenizer, "slow answer")
    body = {"model": "m", "messages": USER, "max_tokens": 32}
    answers: list[httpx.Response] = []

    def send() -> None:
        answers.append(_post(proxy_url, "race", body, {"Idempotency-Key": "r1"}))

    threads = [threading.Thread(target=send) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [a.status_code for a in answers] == [200, 200, 200]
    assert len(engine.requests) == 1
    assert len({json.dumps(a.json()["choices"]) for a in answers}) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_seed_is_sent_to_sglang_as_its_sampling_seed(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, stream: bool
) -> None:
    # OpenAI's seed is best effort; harnesses (smolagents, ...) set it. SGLang's key is sampling_seed.
    _script(engine, qwen_tokenizer, "seeded")
    body = {"model": "m", "messages": USER, "seed": 1234, "stream": stream}
    response = httpx.post(f"{proxy_url}/sessions/seed/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 200, response.text
    sent = engine.requests[-1]["sampling_params"]
    assert sent["sampling_seed"] == 1234
    assert "seed" not in sent
    [call] = httpx.get(f"{proxy_url}/sessions/seed/trajectory").json()["segments"]
    assert call["num_calls"] == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/chat/completions", "/completions"])
def test_n_seeded_choices_are_sampled_with_seeds_of_their_own(
    proxy_url: str, engine: FakeSGLang, stream: bool, path: str
) -> None:
    """Each of n choices is its own engine request: with one seed they would all be the same sample
    (on a deterministic server), n copies of one rollout. As vLLM does, choice i gets seed + i."""
    body: dict[str, Any] = {"model": "m", "n": 3, "seed": 2**63 - 2, "stream": stream, "max_tokens": 8}
    body.update({"messages": USER} if path == "/chat/completions" else {"prompt": "go"})
    response = httpx.post(f"{proxy_url}/sessions/seeds/v1{path}", json=body, timeout=30)
    assert response.status_code == 200, response.text
    seeds = sorted(request["sampling_params"]["sampling_seed"] for request in engine.requests)
    assert seeds == [-(2**63), 2**63 - 2, 2**63 - 1]  # seed + i, wrapped within int64


@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 2**70])
def test_a_seed_outside_int64_is_a_400(proxy_url: str, engine: FakeSGLang, seed: int) -> None:
    body = {"model": "m", "messages": USER, "seed": seed}
    response = httpx.post(f"{proxy_url}/sessions/seed/v1/chat/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "seed"
    assert engine.requests == []


@pytest.mark.parametrize(
    ("tool_choice", "one_call"),
    [
        ({"type": "tool", "name": "run"}, False),
        ({"type": "tool", "name": "run", "disable_parallel_tool_use": True}, True),
        ({"type": "any"}, False),
        ({"type": "any", "disable_parallel_tool_use": True}, True),
        ({"type": "auto", "disable_parallel_tool_use": True}, None),
    ],
)
def test_anthropics_forced_tool_use_is_one_call_only_when_parallel_use_is_disabled(
    proxy_url: str,
    engine: FakeSGLang,
    qwen_tokenizer: Tokenizer,
    tool_choice: dict[str, Any],
    one_call: bool | None,
) -> None:
    """Anthropic: a forced tool use may be several parallel uses unless disable_parallel_tool_use,
    which the call grammar enforces (it stops after the first call); a free turn has no grammar to
    enforce it with: a 400."""
    _script(engine, qwen_tokenizer, CALL)
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": USER,
        "tools": [{"name": "run", "input_schema": RUN_PARAMETERS}],
        "tool_choice": tool_choice,
    }
    answer = httpx.post(f"{proxy_url}/sessions/one/v1/messages", json=body, timeout=30)
    if one_call is None:
        assert answer.status_code == 400, answer.text
        assert engine.requests == []
        return
    assert answer.status_code == 200, answer.text
    tag = json.loads(engine.requests[-1]["sampling_params"]["structural_tag"])
    assert tag["format"]["stop_after_first"] is one_call


def test_reasoning_effort_reaches_the_template_as_its_reasoning_effort(tmp_path: Path) -> None:
    """OpenAI chat's reasoning_effort is what gpt-oss's template renders as `Reasoning: <effort>`; it
    is checked against OpenAI's values, and must agree with chat_template_kwargs' own."""
    directory = build_tokenizer_dir(FAMILIES["gpt_oss"], tmp_path / "gpt-oss")
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    stops = Renderer(load_tokenizer_files(directory)).stop_token_ids
    engine = FakeSGLang(tokenizer=tokenizer, eos_ids=stops, vocab_size=tokenizer.get_vocab_size())
    with serve(engine.app()) as engine_url:
        settings = Settings(engine_url=engine_url, tokenizer=directory, db=f"sqlite:///{tmp_path / 'r.db'}")
        with serve(create_app(settings)) as url:

            def send(**extra: Any) -> httpx.Response:
                body = {"model": "m", "messages": USER, "max_tokens": 4, **extra}
                return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=30)

            for effort in ("high", "low"):
                assert send(reasoning_effort=effort).status_code == 200
                prompt = tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)
                assert f"Reasoning: {effort}" in prompt
            assert send(reasoning_effort="bogus").json()["error"]["param"] == "reasoning_effort"
            mixed = send(reasoning_effort="high", chat_template_kwargs={"reasoning_effort": "low"})
            assert mixed.status_code == 400
            assert (
                send(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "low"}).status_code
                == 200
            )
