"""The OpenAI Agents SDK with its default model class (the Responses API) runs an agent with a
function tool to completion through the proxy: one exact segment; streamed too, and with its Chat
Completions model class."""

from __future__ import annotations

import asyncio

import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_default_openai_client,
    set_tracing_disabled,
)
from agents.models.multi_provider import MultiProvider
from openai import AsyncOpenAI
from tokenizers import Tokenizer

from tests.e2e.test_responses import call_text, push
from tests.fakes.sglang import FakeSGLang
from tests.invariants import assert_invariants
from tests.support import segments


@function_tool
def lookup(word: str) -> str:
    """Look a word up."""
    return f"{word}: a go-between"


async def _run(url: str) -> str:
    client = AsyncOpenAI(base_url=f"{url}/sessions/agent/v1", api_key="unused", max_retries=0)
    try:
        # As a user would: the default client, a plain model name, the default model provider.
        set_default_openai_client(client, use_for_tracing=False)
        assert isinstance(MultiProvider().get_model("m"), OpenAIResponsesModel)
        agent = Agent(name="define", instructions="Define words with the tool.", tools=[lookup], model="m")
        result = await Runner.run(agent, "Define proxy.")
        return str(result.final_output)
    finally:
        await client.close()


def test_agent_with_a_function_tool_runs_to_completion(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    set_tracing_disabled(True)
    outputs = [
        push(
            engine,
            qwen_tokenizer,
            "<think>\nUse the tool.\n</think>\n\n" + call_text("lookup", {"word": "proxy"}),
        ),
        push(engine, qwen_tokenizer, "<think>\nGot it.\n</think>\n\nA proxy is a go-between."),
    ]
    assert asyncio.run(_run(proxy_url)) == "A proxy is a go-between."
    [segment] = segments(proxy_url, "agent")
    assert segment["num_calls"] == 2
    assert_invariants(segment, engine.requests, outputs)


async def _run_with(url: str, session: str, model_class: type, streamed: bool) -> str:
    client = AsyncOpenAI(base_url=f"{url}/sessions/{session}/v1", api_key="unused", max_retries=0)
    try:
        model = model_class(model="m", openai_client=client)
        agent = Agent(name="define", instructions="Define words with the tool.", tools=[lookup], model=model)
        if not streamed:
            return str((await Runner.run(agent, "Define proxy.")).final_output)
        result = Runner.run_streamed(agent, "Define proxy.")
        async for _ in result.stream_events():
            pass
        return str(result.final_output)
    finally:
        await client.close()


@pytest.mark.parametrize("streamed", [False, True], ids=["plain", "streamed"])
@pytest.mark.parametrize("model_class", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_agent_runs_streamed_and_over_chat_completions(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer, model_class: type, streamed: bool
) -> None:
    set_tracing_disabled(True)
    outputs = [
        push(
            engine, qwen_tokenizer, "<think>\nUse it.\n</think>\n\n" + call_text("lookup", {"word": "proxy"})
        ),
        push(engine, qwen_tokenizer, "<think>\nGot it.\n</think>\n\nA proxy is a go-between."),
    ]
    session = f"agent-{model_class.__name__}-{streamed}"
    assert asyncio.run(_run_with(proxy_url, session, model_class, streamed)) == "A proxy is a go-between."
    [segment] = segments(proxy_url, session)
    assert segment["num_calls"] == 2
    assert_invariants(segment, engine.requests, outputs)
