"""Property: in every dialect, a streamed answer reassembles to the plain answer of the same sampled
tokens, whatever the token (and so chunk) boundaries are."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from tests.e2e.test_properties import ARGS, TEXT, _encode, _sampled_text
from tests.fakes.sglang import FakeSGLang
from tests.support import assemble_stream, token_id

TURN = st.fixed_dictionaries(
    {
        "reasoning": st.one_of(st.none(), TEXT.filter(lambda t: t.strip() != "")),
        "content": TEXT,
        "calls": st.lists(st.tuples(st.sampled_from(["read", "run"]), ARGS), max_size=2),
        "retokenize": st.booleans(),
        "truncate": st.booleans(),
    }
)
TOOL = {"type": "object", "properties": {"path": {"type": "string"}}}

Answer = tuple[str, str, list[tuple[str, Any]], str]  # reasoning, content, calls, finish


def _events(client: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    events = []
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def _chat(client: httpx.Client, session: str, limit: int) -> tuple[Answer, Answer]:
    path = f"/sessions/{session}/v1/chat/completions"
    tools = [{"type": "function", "function": {"name": n, "parameters": TOOL}} for n in ("read", "run")]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "go"}],
        "tools": tools,
        "max_tokens": limit,
    }
    choice = client.post(path, json=body).json()["choices"][0]
    message = choice["message"]
    plain = (
        message.get("reasoning_content") or "",
        message.get("content") or "",
        [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in message.get("tool_calls") or []
        ],
        choice["finish_reason"],
    )
    assembled = assemble_stream(_events(client, path, body))
    calls = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(assembled["tool_calls"].items())]
    return plain, (assembled["reasoning_content"], assembled["content"], calls, assembled["finish_reason"])


def _responses_answer(output: list[dict[str, Any]], status: str) -> Answer:
    reasoning = "".join(p["text"] for i in output if i["type"] == "reasoning" for p in i["content"])
    content = "".join(p["text"] for i in output if i["type"] == "message" for p in i["content"])
    calls = [(i["name"], json.loads(i["arguments"])) for i in output if i["type"] == "function_call"]
    return reasoning, content, calls, status


def _responses(client: httpx.Client, session: str, limit: int) -> tuple[Answer, Answer]:
    path = f"/sessions/{session}/v1/responses"
    tools = [{"type": "function", "name": n, "parameters": TOOL} for n in ("read", "run")]
    body = {"model": "m", "input": "go", "tools": tools, "max_output_tokens": limit}
    response = client.post(path, json=body).json()
    plain = _responses_answer(response["output"], response["status"])
    events = _events(client, path, body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    content = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    names = {
        e["item"]["id"]: e["item"]["name"]
        for e in events
        if e["type"] == "response.output_item.added" and e["item"]["type"] == "function_call"
    }
    calls = [
        (names[e["item_id"]], json.loads(e["delta"]))
        for e in events
        if e["type"] == "response.function_call_arguments.delta"
    ]
    final = events[-1]["response"]
    # The closing event carries the same items as the deltas built.
    assert _responses_answer(final["output"], final["status"]) == (reasoning, content, calls, final["status"])
    return plain, (reasoning, content, calls, final["status"])


def _anthropic(client: httpx.Client, session: str, limit: int) -> tuple[Answer, Answer]:
    path = f"/sessions/{session}/v1/messages"
    tools = [{"name": n, "input_schema": TOOL} for n in ("read", "run")]
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "go"}],
        "tools": tools,
        "max_tokens": limit,
    }
    message = client.post(path, json=body).json()
    blocks = message["content"]
    plain = (
        "".join(b["thinking"] for b in blocks if b["type"] == "thinking"),
        "".join(b["text"] for b in blocks if b["type"] == "text"),
        [(b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"],
        message["stop_reason"],
    )
    events = _events(client, path, body)
    started = {e["index"]: e["content_block"] for e in events if e["type"] == "content_block_start"}
    text: dict[int, str] = {}
    signatures = []
    for event in events:
        if event["type"] == "content_block_delta":
            delta = event["delta"]
            if delta["type"] == "signature_delta":
                signatures.append(delta["signature"])
            else:
                piece = delta.get("thinking") or delta.get("text") or delta.get("partial_json") or ""
                text[event["index"]] = text.get(event["index"], "") + piece
    assert signatures == [b["signature"] for b in blocks if b["type"] == "thinking"]
    kinds = {
        kind: [text.get(i, "") for i, b in sorted(started.items()) if b["type"] == kind]
        for kind in ("thinking", "text", "tool_use")
    }
    calls = [(b["name"], json.loads(text[i])) for i, b in sorted(started.items()) if b["type"] == "tool_use"]
    [stop] = [e["delta"]["stop_reason"] for e in events if e["type"] == "message_delta"]
    assert events[-1]["type"] == "message_stop"
    return plain, ("".join(kinds["thinking"]), "".join(kinds["text"]), calls, stop)


DIALECTS: list[Callable[[httpx.Client, str, int], tuple[Answer, Answer]]] = [_chat, _responses, _anthropic]


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(turn=TURN, incremental=st.booleans())
def test_streamed_answers_reassemble_to_the_plain_answer_in_every_dialect(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, turn: dict[str, Any], incremental: bool
) -> None:
    engine.incremental = incremental
    ids = _encode(qwen_tokenizer, _sampled_text(turn), retokenize=turn["retokenize"]) or [15]
    truncated = turn["truncate"] and not turn["calls"]
    limit = max(1, len(ids) // 2) if truncated else 4096
    sampled = ids if truncated else [*ids, token_id(qwen_tokenizer, "<|im_end|>")]
    with httpx.Client(base_url=proxy_url, timeout=60) as client:
        for dialect in DIALECTS:
            engine.push(sampled)
            engine.push(sampled)
            plain, streamed = dialect(client, uuid.uuid4().hex, limit)
            assert streamed == plain, dialect.__name__
