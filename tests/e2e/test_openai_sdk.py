"""The official openai SDK against the proxy: the shapes it parses, plain and streamed, and a tool
round trip whose history the SDK's own objects echo back."""

from __future__ import annotations

from typing import Any

import httpx
from openai import OpenAI
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import token_id

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a word up",
            "parameters": {"type": "object", "properties": {"word": {"type": "string"}}},
        },
    }
]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"word": "proxy"}}\n</tool_call>'


def test_sdk_tool_round_trip_plain_and_streamed(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    client = OpenAI(base_url=f"{proxy_url}/sessions/sdk/v1", api_key="unused", max_retries=0)
    messages: list[Any] = [{"role": "user", "content": "What is a proxy?"}]
    engine.push([*qwen_tokenizer.encode(CALL).ids, im_end])
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.function.name == "lookup"  # type: ignore[union-attr]
    # The SDK's own message object goes back into the history, as agent loops do.
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "A go-between."},
    ]
    engine.push([*qwen_tokenizer.encode("A proxy stands between two parties.").ids, im_end])
    stream = client.chat.completions.create(
        model="m", messages=messages, tools=TOOLS, stream=True, stream_options={"include_usage": True}
    )
    text = ""
    finish = None
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for streamed in chunk.choices:
            text += streamed.delta.content or ""
            finish = streamed.finish_reason or finish
    assert text == "A proxy stands between two parties."
    assert finish == "stop"
    assert usage is not None
    assert (
        usage.completion_tokens == len(qwen_tokenizer.encode("A proxy stands between two parties.").ids) + 1
    )
    [segment] = httpx.get(f"{proxy_url}/sessions/sdk/trajectory").json()["segments"]
    assert segment["num_calls"] == 2  # the streamed turn continued the plain one
