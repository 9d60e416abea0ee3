"""The Responses dialect through the official openai SDK: plain, streamed, a tool loop whose echoed
items continue one segment (I1-I6), previous_response_id, Codex-style echoes, and refusals."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang, ScriptedOutput
from tests.invariants import assert_invariants
from tests.support import segments, token_id

TOOLS: Any = [
    {
        "type": "function",
        "name": "lookup",
        "description": "Look a word up",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        "strict": False,
    }
]


def call_text(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def push(engine: FakeSGLang, tokenizer: Tokenizer, text: str) -> ScriptedOutput:
    return engine.push([*tokenizer.encode(text).ids, token_id(tokenizer, "<|im_end|>")])


def client_for(url: str, session: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="unused", max_retries=0)


def test_plain_answer_has_reasoning_message_and_usage(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    output = push(engine, qwen_tokenizer, "<think>\nShort.\n</think>\n\nHello there.")
    with client_for(proxy_url, "r-plain") as client:
        response = client.responses.create(model="m", input="Hi")
    assert response.status == "completed"
    assert response.output_text == "Hello there."
    reasoning = response.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.content is not None
    assert reasoning.content[0].text == "Short."
    assert response.usage is not None
    assert response.usage.output_tokens == len(output.ids)
    think_close = token_id(qwen_tokenizer, "</think>")
    assert response.usage.output_tokens_details.reasoning_tokens == output.ids.index(think_close) + 1
    [segment] = segments(proxy_url, "r-plain")
    assert_invariants(segment, engine.requests, [output])


def test_tool_loop_streamed_and_plain_is_one_exact_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    client = client_for(proxy_url, "r-loop")
    request.addfinalizer(client.close)
    outputs = [
        push(
            engine, qwen_tokenizer, "<think>\nLook it up.\n</think>\n\n" + call_text("lookup", {"word": "a"})
        ),
        push(engine, qwen_tokenizer, "<think>\nAnd b.\n</think>\n\n" + call_text("lookup", {"word": "b"})),
        push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nBoth found."),
    ]
    items: list[Any] = [{"role": "user", "content": "Define a and b."}]
    response: Any = None
    for turn in range(3):
        if turn == 1:
            with client.responses.stream(model="m", input=items, tools=TOOLS) as stream:
                for _ in stream:
                    pass
                response = stream.get_final_response()
        else:
            response = client.responses.create(model="m", input=items, tools=TOOLS)
        # The SDK's own output items go back into the input, as agent loops do.
        items += [item.model_dump(exclude_none=True) for item in response.output]
        for item in response.output:
            if item.type == "function_call":
                items.append({"type": "function_call_output", "call_id": item.call_id, "output": "found"})
    assert response.output_text == "Both found."
    [segment] = segments(proxy_url, "r-loop")
    assert segment["num_calls"] == 3
    assert_invariants(segment, engine.requests, outputs)


def test_previous_response_id_continues_without_history(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    client = OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    request.addfinalizer(client.close)
    outputs = [push(engine, qwen_tokenizer, "<think>\nx\n</think>\n\n" + call_text("lookup", {"word": "w"}))]
    first = client.responses.create(model="m", input="Define w.", tools=TOOLS, instructions="Be brief.")
    [call] = [item for item in first.output if item.type == "function_call"]
    outputs.append(push(engine, qwen_tokenizer, "<think>\ny\n</think>\n\nDone."))
    second = client.responses.create(
        model="m",
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "a letter"}],
        tools=TOOLS,
        instructions="Be brief.",
    )
    assert second.output_text == "Done."
    session = httpx.get(f"{proxy_url}/sessions").json()["data"]
    [only] = [s for s in session if s["id"] in first.id]
    [segment] = segments(proxy_url, only["id"])
    assert segment["num_calls"] == 2
    assert_invariants(segment, engine.requests, outputs)


def codex_body(items: list[dict[str, Any]]) -> dict[str, Any]:
    """A request as Codex CLI sends it (agent-clis.md)."""
    return {
        "model": "m",
        "instructions": None,
        "input": items,
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "description": "run",
                "strict": False,
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
            },
            {
                "type": "namespace",
                "name": "mcp",
                "description": "MCP tools",
                "tools": [
                    {
                        "type": "function",
                        "name": "ping",
                        "description": "ping",
                        "strict": False,
                        "parameters": {"type": "object", "properties": {}},
                    }
                ],
            },
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"summary": "auto"},
        "store": False,
        "stream": True,
        "include": ["reasoning.encrypted_content"],
        "prompt_cache_key": "thread-1",
        "client_metadata": {"x": "y"},
    }


def sse_items(url: str, body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The events of a streamed response and the items of its response.completed."""
    events = []
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[-1]["type"] == "response.completed"
    return events, events[-1]["response"]["output"]


def _with_client_ids(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    # Codex keeps what it needs and makes its own ids; the status field is dropped.
    return [
        {**{k: v for k, v in item.items() if k != "status"}, "id": f"client-{i}"}
        for i, item in enumerate(items)
    ]


def test_codex_traffic_continues_the_segment_through_sealed_reasoning(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    url = f"{proxy_url}/sessions/codex/v1/responses"
    outputs = [
        push(
            engine,
            qwen_tokenizer,
            "<think>\nRun ls.\n</think>\n\n" + call_text("exec_command", {"cmd": "ls"}),
        )
    ]
    items: list[dict[str, Any]] = [
        {
            "type": "message",
            "role": "developer",
            "content": [{"type": "input_text", "text": "You are Codex."}],
        },
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files."}]},
    ]
    events, output = sse_items(url, codex_body(items))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.function_call_arguments.delta" in kinds
    reasoning = output[0]
    assert reasoning["type"] == "reasoning"
    assert reasoning["encrypted_content"]
    # Codex echoes the reasoning without its text: the seal alone carries it.
    items += _with_client_ids([{**reasoning, "content": None}, *output[1:]])
    items.append({"type": "function_call_output", "call_id": output[1]["call_id"], "output": "a.txt"})
    outputs.append(push(engine, qwen_tokenizer, "<think>\nDone.\n</think>\n\nOne file."))
    sse_items(url, codex_body(items))
    [segment] = segments(proxy_url, "codex")
    assert segment["num_calls"] == 2
    assert_invariants(segment, engine.requests, outputs)
    # A seal we did not issue is an edit: a new segment.
    items[2] = {**items[2], "encrypted_content": "forged.seal"}
    push(engine, qwen_tokenizer, "ok")
    sse_items(url, codex_body(items))
    assert len(segments(proxy_url, "codex")) == 2


def test_namespace_call_comes_back_with_its_namespace(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    push(engine, qwen_tokenizer, call_text("mcp.ping", {}))
    _, output = sse_items(
        f"{proxy_url}/sessions/ns/v1/responses",
        codex_body([{"type": "message", "role": "user", "content": "ping"}]),
    )
    [call] = output
    assert (call["namespace"], call["name"]) == ("mcp", "ping")


def test_max_output_tokens_gives_incomplete(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    push(engine, qwen_tokenizer, "one two three four five six seven")
    with client_for(proxy_url, "r-cut") as client:
        response = client.responses.create(model="m", input="Count", max_output_tokens=3)
    assert response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"parallel_tool_calls": False}, "parallel_tool_calls"),
        ({"truncation": "auto"}, "truncation"),
        ({"include": ["file_search_call.results"]}, "include"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0]"),
        ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ],
)
def test_what_cannot_be_honoured_is_a_400(proxy_url: str, extra: dict[str, Any], param: str) -> None:
    # Closed in the test: a client left to the collector warns of its open socket in a later test.
    with client_for(proxy_url, "r-bad") as client, pytest.raises(BadRequestError) as raised:
        client.responses.create(model="m", input="Hi", extra_body=extra)
    body: Any = raised.value.body
    assert body["param"] == param


def test_every_answer_validates_against_the_sdks_own_types(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """Strict validation (not the SDK's lenient construction) of plain and streamed answers, with
    reasoning, text and a call, and when max_output_tokens cuts the turn."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    events = TypeAdapter(ResponseStreamEvent)
    text = "<think>\nHm.\n</think>\n\nSome text " + call_text("lookup", {"word": "a"})
    for extra in ({}, {"max_output_tokens": 3}):
        for stream in (False, True):
            push(engine, qwen_tokenizer, text)
            body = {"model": "m", "input": "x", "tools": TOOLS, "stream": stream, **extra}
            url = f"{proxy_url}/sessions/typed/v1/responses"
            if not stream:
                Response.model_validate(httpx.post(url, json=body, timeout=30).json())
                continue
            with httpx.stream("POST", url, json=body, timeout=30) as answer:
                for line in answer.iter_lines():
                    if line.startswith("data: "):
                        events.validate_python(json.loads(line[6:]))


def test_instructions_are_not_carried_over_by_previous_response_id(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, request: pytest.FixtureRequest
) -> None:
    """OpenAI's rule: the previous response's instructions are not in the next one's context."""
    client = OpenAI(base_url=f"{proxy_url}/v1", api_key="unused", max_retries=0)
    request.addfinalizer(client.close)
    push(engine, qwen_tokenizer, "Arr.")
    first = client.responses.create(model="m", input="hi", instructions="Talk like a pirate.")
    push(engine, qwen_tokenizer, "Hello.")
    second = client.responses.create(model="m", input="again", previous_response_id=first.id)
    prompt = qwen_tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)
    assert "pirate" not in prompt
    assert "hi<|im_end|>" in prompt
    assert "Arr." in prompt
    push(engine, qwen_tokenizer, "Aye.")
    client.responses.create(
        model="m", input="more", previous_response_id=second.id, instructions="Be a sailor."
    )
    prompt = qwen_tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)
    assert prompt.startswith("<|im_start|>system\nBe a sailor.<|im_end|>")
    assert prompt.count("<|im_start|>system") == 1


# (sampled text, budget past `</think>` or None for a budget inside the reasoning, item statuses)
CUTS = [
    ("<think>\nOne two three four five six seven eight", None, ["incomplete"]),
    ("<think>\nHm.\n</think>\n\nOne two three four five six seven", 3, ["completed", "incomplete"]),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cut", CUTS)
def test_the_item_max_output_tokens_cut_is_incomplete(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, stream: bool, cut: tuple[Any, ...]
) -> None:
    """As OpenAI's API: in an `incomplete` response the item being written when the budget ran out
    says `incomplete` (and keeps its text); items finished before it say `completed`."""
    text, cut_after_think, statuses = cut
    ids = qwen_tokenizer.encode(text).ids
    think_close = token_id(qwen_tokenizer, "</think>")
    budget = 4 if cut_after_think is None else ids.index(think_close) + cut_after_think
    engine.push(ids)
    body = {"model": "m", "input": "Count", "max_output_tokens": budget, "stream": stream}
    url = f"{proxy_url}/sessions/r-cut-item/v1/responses"
    if stream:
        events = [
            json.loads(line[6:])
            for line in httpx.post(url, json=body, timeout=30).text.splitlines()
            if line.startswith("data: ")
        ]
        done = [event["item"]["status"] for event in events if event["type"] == "response.output_item.done"]
        assert done == statuses
        response = events[-1]["response"]
        assert events[-1]["type"] == "response.incomplete"
    else:
        response = httpx.post(url, json=body, timeout=30).json()
    assert response["status"] == "incomplete"
    assert [item["status"] for item in response["output"]] == statuses
    written = response["output"][-1]["content"][0]["text"]
    assert written
    assert written in qwen_tokenizer.decode(ids[:budget])


@pytest.mark.parametrize("sampled", ["<think>\n\n</think>\n\n", "", "<think>\nOnly this.\n</think>\n\n"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_that_sampled_no_text_answers_an_empty_message_that_continues_the_segment(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, sampled: str, stream: bool
) -> None:
    """A turn of no text and no call still answers a message, with empty text (chat answers content
    ""): resent whole, as Codex and `store: false` harnesses do, it is the recorded turn, and the
    session stays one segment. Streamed, the message's events come before response.completed."""
    session = f"r-empty-{stream}-{len(sampled)}"
    outputs = [push(engine, qwen_tokenizer, sampled), push(engine, qwen_tokenizer, "Next.")]
    first_input = [{"role": "user", "content": "q"}]
    body = {"model": "m", "input": first_input, "stream": stream}
    if stream:
        events, _ = sse_items(f"{proxy_url}/sessions/{session}/v1/responses", body)
        kinds = [event["type"] for event in events]
        assert kinds.count("response.output_item.done") == len(events[-1]["response"]["output"])
        output = events[-1]["response"]["output"]
    else:
        output = httpx.post(f"{proxy_url}/sessions/{session}/v1/responses", json=body, timeout=30).json()[
            "output"
        ]
    message = output[-1]
    assert (message["type"], message["content"][0]["text"]) == ("message", "")
    resent = {"model": "m", "input": [*first_input, *output, {"role": "user", "content": "again"}]}
    second = httpx.post(f"{proxy_url}/sessions/{session}/v1/responses", json=resent, timeout=30)
    assert second.status_code == 200, second.text
    [segment] = segments(proxy_url, session)
    assert_invariants(segment, engine.requests, outputs)
