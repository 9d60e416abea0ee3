"""A conversation continues its segment whichever dialect its history is echoed in, and a retried
request in a new dialect is answered from the record."""

from __future__ import annotations

import json
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.e2e.test_responses import call_text, push
from tests.fakes.sglang import FakeSGLang
from tests.invariants import assert_invariants
from tests.support import segments

SCHEMA = {"type": "object", "properties": {"word": {"type": "string"}}}


def test_chat_then_responses_then_anthropic_is_one_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    outputs = [
        push(engine, qwen_tokenizer, "<think>\nFirst a.\n</think>\n\n" + call_text("lookup", {"word": "a"})),
        push(engine, qwen_tokenizer, "<think>\nThen b.\n</think>\n\n" + call_text("lookup", {"word": "b"})),
        push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nBoth."),
    ]
    base = f"{proxy_url}/sessions/mix/v1"
    chat = httpx.post(
        f"{base}/chat/completions",
        json={
            "model": "m",
            "messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}],
            "tools": [{"type": "function", "function": {"name": "lookup", "parameters": SCHEMA}}],
        },
        timeout=30,
    ).json()["choices"][0]["message"]
    [first] = chat["tool_calls"]
    responses = httpx.post(
        f"{base}/responses",
        json={
            "model": "m",
            "instructions": "S",
            "input": [
                {"role": "user", "content": "U"},
                {
                    "type": "reasoning",
                    "summary": [],
                    "content": [{"type": "reasoning_text", "text": "First a."}],
                },
                {
                    "type": "function_call",
                    "call_id": first["id"],
                    "name": "lookup",
                    "arguments": '{"word": "a"}',
                },
                {"type": "function_call_output", "call_id": first["id"], "output": "A"},
            ],
            "tools": [{"type": "function", "name": "lookup", "parameters": SCHEMA}],
        },
        timeout=30,
    ).json()
    second = next(i for i in responses["output"] if i["type"] == "function_call")
    thinking = next(i for i in responses["output"] if i["type"] == "reasoning")["content"][0]["text"]
    anthropic = httpx.post(
        f"{proxy_url}/sessions/mix/v1/messages",
        json={
            "model": "m",
            "max_tokens": 256,
            "system": "S",
            "tools": [{"name": "lookup", "input_schema": SCHEMA}],
            "messages": [
                {"role": "user", "content": "U"},
                # Reasoning dropped, as many clients do: a missing reasoning counts as unchanged.
                {
                    "role": "assistant",
                    "content": [
                        {"type": "tool_use", "id": first["id"], "name": "lookup", "input": {"word": "a"}}
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": first["id"], "content": "A"}],
                },
                {
                    "role": "assistant",
                    "content": [
                        {
                            "type": "tool_use",
                            "id": second["call_id"],
                            "name": "lookup",
                            "input": json.loads(second["arguments"]),
                        }
                    ],
                },
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": second["call_id"], "content": "B"}],
                },
            ],
        },
        timeout=30,
    ).json()
    assert thinking == "Then b."
    assert anthropic["content"][-1]["text"] == "Both."
    [segment] = segments(proxy_url, "mix")
    assert segment["num_calls"] == 3
    assert_invariants(segment, engine.requests, outputs)


def test_a_retried_anthropic_request_is_answered_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    push(engine, qwen_tokenizer, "<think>\nx\n</think>\n\nOnce.")
    url = f"{proxy_url}/sessions/retry/v1/messages"
    body: dict[str, Any] = {"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Idempotency-Key": "k1"}
    first = httpx.post(url, json=body, headers=headers, timeout=30)
    replay = httpx.post(url, json=body, headers=headers, timeout=30)
    assert replay.headers["X-Tito-Replayed"] == "true"
    assert replay.json()["content"] == first.json()["content"]
    assert len(engine.requests) == 1


def test_a_retried_responses_stream_is_replayed_from_the_record(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    push(engine, qwen_tokenizer, "<think>\nx\n</think>\n\n" + call_text("lookup", {"word": "a"}))
    url = f"{proxy_url}/sessions/retry-r/v1/responses"
    body = {
        "model": "m",
        "input": "hi",
        "stream": True,
        "tools": [{"type": "function", "name": "lookup", "parameters": SCHEMA}],
    }
    outputs = []
    for _ in range(2):
        with httpx.stream("POST", url, json=body, headers={"Idempotency-Key": "k"}, timeout=30) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        final = json.loads(lines[-1][6:])
        assert final["type"] == "response.completed"
        outputs.append(
            [(i["type"], i.get("call_id"), i.get("arguments")) for i in final["response"]["output"]]
        )
    assert outputs[0] == outputs[1]
    assert len(engine.requests) == 1


def test_a_plain_dialect_answer_names_its_recorded_call(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """X-Tito-Call-Ids, as chat's answers carry it: the id call_rewards takes."""
    base = f"{proxy_url}/sessions/named/v1"
    push(engine, qwen_tokenizer, "One.")
    first = httpx.post(f"{base}/responses", json={"model": "m", "input": "hi"}, timeout=30)
    push(engine, qwen_tokenizer, "Two.")
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}]}
    second = httpx.post(f"{base}/messages", json=body, timeout=30)
    ids = [first.headers["x-tito-call-ids"], second.headers["x-tito-call-ids"]]
    rewards = {ids[0]: 0.25, ids[1]: 0.5}
    answer = httpx.post(f"{proxy_url}/sessions/named/reward", json={"reward": 1.0, "call_rewards": rewards})
    assert answer.status_code == 200, answer.text
    [row, other] = httpx.get(f"{proxy_url}/sessions/named/samples").json()["samples"]
    assert [row["call_id"], other["call_id"]] == [int(i) for i in ids]
    assert [row["call_reward"], other["call_reward"]] == [0.25, 0.5]


def _final_event(response: httpx.Response) -> dict[str, Any]:
    data = [json.loads(line[6:]) for line in response.text.splitlines() if line.startswith("data: ")]
    found: dict[str, Any] = data[-1] if data[-1]["type"] != "message_stop" else data[0]["message"]
    return found


def test_a_replayed_answer_keeps_its_id_and_continues(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """A retry answered from the record is the same answer, id included (as chat's chatcmpl- id): a
    previous_response_id taken from the replay finds the recorded response."""
    base = f"{proxy_url}/sessions/same-id/v1"
    anthropic_body = {"model": "m", "max_tokens": 32, "messages": [{"role": "user", "content": "hi"}]}
    for stream in (False, True):
        push(engine, qwen_tokenizer, "Hello.")
        push(engine, qwen_tokenizer, "Hi.")
        for route, body in (("responses", {"model": "m", "input": "hi"}), ("messages", anthropic_body)):
            ids = []
            for _ in range(2):
                headers = {"Idempotency-Key": f"{route}-{stream}"}
                answer = httpx.post(f"{base}/{route}", json={**body, "stream": stream}, headers=headers)
                assert answer.status_code == 200, answer.text
                found = _final_event(answer) if stream else answer.json()
                ids.append(found["response"]["id"] if "response" in found else found["id"])
            assert ids[0] == ids[1], (route, stream)
            if route == "responses":
                push(engine, qwen_tokenizer, "More.")
                follow = {"model": "m", "input": "more", "previous_response_id": ids[1]}
                assert httpx.post(f"{base}/responses", json=follow).status_code == 200
