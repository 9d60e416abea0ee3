"""Tool search as Claude Code (2.1.331) sends it, over raw HTTP: tools marked `defer_loading` stay out
of the prompt until a tool_result's `tool_reference` blocks load them, and a loaded tool's definition
is rendered where it was loaded, in the <functions> form the client's ToolSearch tool describes."""

from __future__ import annotations

import json
from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.e2e.test_responses import call_text, push
from tests.fakes.sglang import FakeSGLang
from tests.invariants import assert_invariants
from tests.support import segments

EMPTY: Any = {"type": "object", "properties": {}}
SEARCH: Any = {
    "name": "ToolSearch",
    "description": "Fetches full schema definitions for deferred tools so they can be called.",
    "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
}
BASH: Any = {
    "name": "Bash",
    "description": "Run a command.",
    "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}},
}
CRON: Any = {
    "name": "CronList",
    "description": "List the scheduled jobs.",
    "input_schema": EMPTY,
    "defer_loading": True,
}
# Claude Code keeps one deferred tool in every request so that its tool search stays on.
PLACEHOLDER: Any = {
    "name": "DeferredToolPlaceholder",
    "description": "Reserved placeholder that keeps deferred tool loading active; never call this tool.",
    "input_schema": EMPTY,
    "defer_loading": True,
}
TOOLS = [BASH, CRON, SEARCH, PLACEHOLDER]
HEADERS = {
    "x-api-key": "k",
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "advanced-tool-use-2025-11-20",
}
CRON_LOADED = (
    "<functions>\n"
    '<function>{"description": "List the scheduled jobs.", "name": "CronList", '
    '"parameters": {"type": "object", "properties": {}}}</function>\n'
    "</functions>"
)


def _post(url: str, path: str, messages: list[Any], **extra: Any) -> dict[str, Any]:
    body = {"model": "m", "max_tokens": 256, "tools": TOOLS, "messages": messages, **extra}
    answer = httpx.post(f"{url}/sessions/search/v1/{path}?beta=true", json=body, headers=HEADERS, timeout=30)
    assert answer.status_code == 200, answer.text
    found: dict[str, Any] = answer.json()
    return found


def _prompt(engine: FakeSGLang, tokenizer: Tokenizer) -> str:
    return tokenizer.decode(engine.requests[-1]["input_ids"], skip_special_tokens=False)


def _answered(messages: list[Any], reply: dict[str, Any], result: list[Any] | str) -> None:
    """The reply as the assistant turn, and `result` as the result of its tool call."""
    [use] = [block for block in reply["content"] if block["type"] == "tool_use"]
    messages.append({"role": "assistant", "content": reply["content"]})
    messages.append(
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": result}]}
    )


def test_a_deferred_tool_enters_the_prompt_where_a_tool_reference_loads_it(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    outputs = [
        push(engine, qwen_tokenizer, call_text("ToolSearch", {"query": "select:CronList"})),
        push(engine, qwen_tokenizer, call_text("CronList", {})),
        push(engine, qwen_tokenizer, "No jobs are scheduled."),
    ]
    messages: list[Any] = [{"role": "user", "content": "List my cron jobs."}]
    first = _post(proxy_url, "messages", messages)
    prompt = _prompt(engine, qwen_tokenizer)
    assert '"name": "Bash"' in prompt
    assert '"name": "ToolSearch"' in prompt
    assert "CronList" not in prompt
    assert "DeferredToolPlaceholder" not in prompt

    _answered(messages, first, [{"type": "tool_reference", "tool_name": "CronList"}])
    counted = _post(proxy_url, "messages/count_tokens", messages)
    second = _post(proxy_url, "messages", messages)
    prompt = _prompt(engine, qwen_tokenizer)
    assert f"<tool_response>\n{CRON_LOADED}\n</tool_response>" in prompt
    assert "DeferredToolPlaceholder" not in prompt
    assert counted["input_tokens"] == len(engine.requests[-1]["input_ids"])
    assert second["content"][-1]["name"] == "CronList"

    _answered(messages, second, "No scheduled jobs.")
    third = _post(proxy_url, "messages", messages)
    assert third["content"][-1] == {"type": "text", "text": "No jobs are scheduled."}
    # The deferred tools never change the declared ones: the whole loop is one exact segment.
    [segment] = segments(proxy_url, "search")
    assert segment["num_calls"] == 3
    assert_invariants(segment, engine.requests, outputs)


def test_references_and_text_in_one_result_keep_their_order(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    push(engine, qwen_tokenizer, call_text("ToolSearch", {"query": "cron"}))
    push(engine, qwen_tokenizer, "ok")
    messages: list[Any] = [{"role": "user", "content": "Find a cron tool."}]
    first = _post(proxy_url, "messages", messages)
    reference = {"type": "tool_reference", "tool_name": "CronList"}
    _answered(messages, first, [{"type": "text", "text": "1 match:"}, reference, reference])
    _post(proxy_url, "messages", messages)
    line = CRON_LOADED.split("\n")[1]
    expected = f"1 match:\n<functions>\n{line}\n{line}\n</functions>"
    assert f"<tool_response>\n{expected}\n</tool_response>" in _prompt(engine, qwen_tokenizer)


def test_a_forced_call_may_name_a_loaded_deferred_tool_only(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    """A loaded tool is one the model can call, so tool_choice may force it; a tool still deferred
    is one the model has not seen."""
    push(engine, qwen_tokenizer, call_text("ToolSearch", {"query": "select:CronList"}))
    messages: list[Any] = [{"role": "user", "content": "List my cron jobs."}]
    first = _post(proxy_url, "messages", messages)
    forced = {"type": "tool", "name": "CronList"}
    early = httpx.post(
        f"{proxy_url}/v1/messages",
        json={"model": "m", "max_tokens": 64, "tools": TOOLS, "messages": messages, "tool_choice": forced},
        timeout=30,
    )
    assert early.status_code == 400, early.text
    assert "CronList" in early.json()["error"]["message"]
    _answered(messages, first, [{"type": "tool_reference", "tool_name": "CronList"}])
    push(engine, qwen_tokenizer, call_text("CronList", {}))
    second = _post(proxy_url, "messages", messages, tool_choice=forced)
    assert second["content"][-1]["name"] == "CronList"
    constraint = json.loads(engine.requests[-1]["sampling_params"]["structural_tag"])
    assert "CronList" in json.dumps(constraint)
