"""Sessions recorded for the viewer tests: a truncated turn continued (a synthesized close),
reasoning and a tool call, two choices (branches: the sample without reasoning has think_wrapper
drift), and a second, rewarded session."""

from __future__ import annotations

from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import token_id

TOOLS = [{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]
TOOL_TEXT = (
    '<think>\nI should run it\n</think>\n\n<tool_call>\n{"name": "run", "arguments": {}}\n</tool_call>'
)


def _ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False).ids)


def record_viewed_sessions(
    url: str, engine: FakeSGLang, tokenizer: Tokenizer, key: str | None = None
) -> None:
    """`viewed` (group g1, reward 0.5, finished): 2 segments' worth of features; `other` (g2, reward
    1.0, finished); `live` (active)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    im_end = token_id(tokenizer, "<|im_end|>")

    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)
        assert response.status_code in (200, 201), response.text
        result: dict[str, Any] = response.json()
        return result

    for session, group in (("viewed", "g1"), ("other", "g2"), ("live", "g1")):
        post("/sessions", {"id": session, "metadata": {"group": group}})
    engine.push(_ids(tokenizer, "one two three four five six seven"))
    messages: list[dict[str, Any]] = [{"role": "user", "content": "count"}]
    first = post(
        "/sessions/viewed/v1/chat/completions",
        {"model": "m", "messages": messages, "max_tokens": 3, "tools": TOOLS},
    )
    messages += [first["choices"][0]["message"], {"role": "user", "content": "continue"}]
    engine.push([*_ids(tokenizer, TOOL_TEXT), im_end])
    engine.push([*_ids(tokenizer, "no tool needed"), im_end])
    post("/sessions/viewed/v1/chat/completions", {"model": "m", "messages": messages, "tools": TOOLS, "n": 2})
    post("/sessions/viewed/reward", {"reward": 0.5})
    post("/sessions/viewed/finish", {})
    engine.push([*_ids(tokenizer, "<think>\nok\n</think>\n\nfine"), im_end])
    post(
        "/sessions/other/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    )
    post("/sessions/other/reward", {"reward": 1.0})
    post("/sessions/other/finish", {})
    engine.push([*_ids(tokenizer, "<think>\nhm\n</think>\n\nstill going"), im_end])
    post("/sessions/live/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "y"}]})
