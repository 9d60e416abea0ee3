"""The client libraries harnesses are built on, against the proxy over HTTP: the async openai SDK,
SDK retries, LiteLLM and LangChain's ChatOpenAI. Each tool round trip echoes the history the
library itself built, and must continue the recorded segment."""

from __future__ import annotations

import asyncio
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
from openai import AsyncOpenAI, OpenAI
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import segments, token_id

# LiteLLM fetches a price list from GitHub at import unless told to use its bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up",
            "parameters": {
                "type": "object",
                "properties": {"word": {"type": "string"}},
                "required": ["word"],
            },
        },
    }
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "proxy"}}\n</tool_call>'
ANSWER = "A proxy stands between two parties."


def _push(engine: FakeSGLang, tokenizer: Tokenizer, text: str) -> None:
    engine.push([*tokenizer.encode(text).ids, token_id(tokenizer, "<|im_end|>")])


def test_async_sdk_tool_round_trip_with_n_choices_and_a_stream(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    async def run() -> tuple[Any, str]:
        client = AsyncOpenAI(base_url=f"{proxy_url}/sessions/async/v1", api_key="unused", max_retries=0)
        messages: list[Any] = [{"role": "user", "content": "What is a proxy?"}]
        _push(engine, qwen_tokenizer, CALL)
        _push(engine, qwen_tokenizer, CALL)
        first = await client.chat.completions.create(
            model="m", messages=messages, tools=TOOLS, n=2, logprobs=True, top_logprobs=1
        )
        assert [c.index for c in first.choices] == [0, 1]
        choice = first.choices[1]
        assert choice.logprobs is not None
        assert choice.logprobs.content
        call = choice.message.tool_calls[0]  # type: ignore[index]
        messages += [
            choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "A go-between."},
        ]
        _push(engine, qwen_tokenizer, ANSWER)
        stream = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS, stream=True)
        text = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
        await client.close()
        return call, text

    call, text = asyncio.run(run())
    assert call.function.name == "lookup"
    assert text == ANSWER
    found = segments(proxy_url, "async")
    assert sorted(s["num_calls"] for s in found) == [1, 2]  # two branches; the echoed one continued


def test_sdk_retry_after_a_client_timeout_samples_afresh_and_the_abandoned_attempt_is_aborted(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    # The SDK gives up on the first attempt (it hangs past the client's timeout) and closes its
    # connection: the proxy aborts that engine request and records it as aborted, so the retry is
    # sampled afresh and only the answered attempt is ever exported.
    engine.fault, engine.hang_s = "hang", 30.0
    _push(engine, qwen_tokenizer, ANSWER)
    _push(engine, qwen_tokenizer, ANSWER)
    client = OpenAI(base_url=f"{proxy_url}/sessions/retry/v1", api_key="unused", max_retries=2, timeout=1.0)
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(
            lambda: client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        )
        deadline = time.monotonic() + 30
        while not engine.requests:  # the first attempt has reached the engine: the next ones answer
            assert time.monotonic() < deadline
            time.sleep(0.01)
        engine.fault = None
        answer = pending.result()
    assert answer.choices[0].message.content == ANSWER
    first, retry = engine.requests
    assert engine.aborted == [first["rid"]]
    assert retry["rid"] != first["rid"]
    [segment] = segments(proxy_url, "retry")
    assert segment["num_calls"] == 1
    assert httpx.get(f"{proxy_url}/sessions/retry").json()["calls_by_status"] == {"aborted": 1, "ok": 1}


def test_litellm_tool_round_trip_plain_then_streamed(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    import litellm

    base = f"{proxy_url}/sessions/litellm/v1"
    messages: list[Any] = [{"role": "user", "content": "What is a proxy?"}]
    _push(engine, qwen_tokenizer, CALL)
    first: Any = litellm.completion(
        model="openai/m", api_base=base, api_key="unused", messages=messages, tools=TOOLS
    )
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls"
    call = message.tool_calls[0]
    assert json.loads(call.function.arguments) == {"word": "proxy"}
    # LiteLLM's own message object goes back into the history.
    messages += [message, {"role": "tool", "tool_call_id": call.id, "content": "A go-between."}]
    _push(engine, qwen_tokenizer, ANSWER)
    stream: Any = litellm.completion(
        model="openai/m", api_base=base, api_key="unused", messages=messages, tools=TOOLS, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == ANSWER
    [segment] = segments(proxy_url, "litellm")
    assert segment["num_calls"] == 2


def test_langchain_chat_openai_tool_round_trip(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model="m",
        base_url=f"{proxy_url}/sessions/langchain/v1",
        api_key="unused",
        max_retries=0,
    ).bind_tools(TOOLS)
    history: list[Any] = [HumanMessage("What is a proxy?")]
    _push(engine, qwen_tokenizer, CALL)
    reply: Any = model.invoke(history)
    [call] = reply.tool_calls
    assert call["name"] == "lookup"
    assert call["args"] == {"word": "proxy"}
    # LangChain re-serializes the call from its own parsed args when it sends the history back.
    history += [reply, ToolMessage("A go-between.", tool_call_id=call["id"])]
    _push(engine, qwen_tokenizer, ANSWER)
    chunks = list(model.stream(history))
    assert "".join(str(c.content) for c in chunks) == ANSWER
    [segment] = segments(proxy_url, "langchain")
    assert segment["num_calls"] == 2
    assert httpx.get(f"{proxy_url}/health").status_code == 200
