"""An agent resends its whole tool list (tens of KB) on every turn: a continuation sent with its
parent's tools, written the very same, does not store them again, and everything that reads a
call's tools (the drift report, the viewer's fresh render, a context rebuilt after a restart) finds
them where they were stored. Tools resent in another key order are the same history, and are
stored on the call that sent them so."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import httpx
import orjson
from transformers import AutoTokenizer

from proxy.store.packed_json import unpack_json
from tests.conftest import ProxyFactory
from tests.fakes.sglang import FakeSGLang
from tests.support import chat, segments


def _tools(count: int) -> list[dict[str, Any]]:
    """A tool list the size of an agent CLI's (each tool a long description and a few parameters)."""
    return [
        {
            "type": "function",
            "function": {
                "name": f"tool_{n}",
                "description": f"Tool number {n}. " + "It does one careful thing with the workspace. " * 12,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "path": {"type": "string", "description": "A path inside the workspace."},
                        "limit": {"type": "integer", "description": "At most this many lines."},
                    },
                    "required": ["path"],
                },
            },
        }
        for n in range(count)
    ]


def _reordered(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same tools with each one's parameters in reverse order: the same history (its keys sort
    keys), other JSON, which the template renders in that order."""
    reordered = []
    for tool in tools:
        parameters = tool["function"]["parameters"]
        properties = dict(reversed(parameters["properties"].items()))
        function = {**tool["function"], "parameters": {**parameters, "properties": properties}}
        reordered.append({**tool, "function": function})
    return reordered


def _stored_requests(db: Path) -> list[dict[str, Any]]:
    with sqlite3.connect(db) as connection:
        rows = connection.execute("SELECT request FROM calls ORDER BY id").fetchall()
    return [unpack_json(request) for (request,) in rows]


def _template_ids(tokenizer_dir: Path, messages: list[dict[str, Any]], tools: list[Any]) -> list[int]:
    """The chat template's own render of a finished conversation, as ids."""
    template = AutoTokenizer.from_pretrained(tokenizer_dir)
    text = template.apply_chat_template(messages, tools=tools, tokenize=False)
    assert isinstance(text, str)
    return list(template.encode(text, add_special_tokens=False))


def _conversation(url: str, turns: list[list[dict[str, Any]]], messages: list[dict[str, Any]]) -> None:
    """One turn per tool list in `turns`, each continuing the last (the fake engine answers "ok")."""
    for tools in turns:
        messages.append(chat(url, messages, "s", tools=tools)["choices"][0]["message"])
        messages.append({"role": "user", "content": f"next {len(messages)}"})


def test_a_continuation_sent_with_its_parents_tools_stores_them_once(
    start_proxy: ProxyFactory, engine: FakeSGLang, qwen_dir: Path, tmp_path: Path
) -> None:
    tools = _tools(30)
    tools_json = orjson.dumps(tools)
    assert len(tools_json) > 20_000
    db = tmp_path / "tools.db"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "work"}]
    with start_proxy(db=db) as url:
        _conversation(url, [tools, tools], messages)
    # After a restart the context is rebuilt from the record: the tools are found on the root call.
    with start_proxy(db=db) as url:
        _conversation(url, [tools, tools], messages)
        [segment] = segments(url, "s")
        viewer = httpx.get(f"{url}/ui/api/sessions/s/tokens", params={"path": 0}, timeout=30)
    stored = _stored_requests(db)
    assert segment["num_calls"] == 4
    assert stored[0]["tools"] == tools
    assert all("tools" not in request for request in stored[1:])
    assert all(len(orjson.dumps(request)) < len(tools_json) // 4 for request in stored[1:])
    # The drift report renders the conversation with the tools it was sent with: a render without
    # them would differ from the recorded stream in its whole tool block.
    assert segment["drift"]["unclassified"] == 0
    # The viewer's fresh render is the chat template's own, tools included.
    assert viewer.status_code == 200, viewer.text
    assert viewer.json()["render"]["ids"] == _template_ids(qwen_dir, messages[:-1], tools)
    # The engine was sent the recorded stream: the last prompt is its beginning.
    stream = segment["prompt_ids"] + segment["response_ids"]
    last_prompt = engine.requests[-1]["input_ids"]
    assert stream[: len(last_prompt)] == last_prompt


def test_tools_resent_in_another_key_order_are_stored_on_the_call_that_sent_them(
    start_proxy: ProxyFactory, qwen_dir: Path, tmp_path: Path
) -> None:
    tools = _tools(3)
    reordered = _reordered(tools)
    assert orjson.dumps(reordered) != orjson.dumps(tools)
    db = tmp_path / "order.db"
    messages: list[dict[str, Any]] = [{"role": "user", "content": "work"}]
    with start_proxy(db=db) as url:
        _conversation(url, [tools, reordered, reordered], messages)
        [segment] = segments(url, "s")
        viewer = httpx.get(f"{url}/ui/api/sessions/s/tokens", params={"path": 0}, timeout=30)
    stored = _stored_requests(db)
    assert segment["num_calls"] == 3  # one history: its keys sort the tools' keys
    assert [request.get("tools", "inherited") for request in stored] == [tools, reordered, "inherited"]
    # The last call was sent the reordered tools: the fresh render of its conversation uses them.
    assert viewer.json()["render"]["ids"] == _template_ids(qwen_dir, messages[:-1], reordered)
