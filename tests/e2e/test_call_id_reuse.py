"""Call ids are never reused: the in-process context cache (keyed by call id) of this or another
worker process must not hand a deleted session's context to a new call."""

from __future__ import annotations

from typing import Any

import httpx
from tokenizers import Tokenizer

from tests.fakes.sglang import FakeSGLang
from tests.support import token_id


def _turn(url: str, session: str, messages: list[dict[str, Any]]) -> dict[str, Any]:
    body = {"model": "m", "messages": messages, "max_tokens": 16}
    reply = httpx.post(f"{url}/sessions/{session}/v1/chat/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    message: dict[str, Any] = reply.json()["choices"][0]["message"]
    return message


def test_a_deleted_sessions_call_ids_do_not_come_back(
    proxy_url: str, engine: FakeSGLang, qwen_tokenizer: Tokenizer
) -> None:
    im_end = token_id(qwen_tokenizer, "<|im_end|>")
    for text in ("old answer", "new answer", "new second"):
        engine.push([*qwen_tokenizer.encode(text, add_special_tokens=False).ids, im_end])
    _turn(proxy_url, "old", [{"role": "user", "content": "a question about something else entirely"}])
    [old] = httpx.get(f"{proxy_url}/sessions/old/trajectory").json()["segments"]
    old_ids = set(old["call_ids"])
    assert httpx.delete(f"{proxy_url}/sessions/old").status_code == 204
    history: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]
    history += [_turn(proxy_url, "new", history), {"role": "user", "content": "more"}]
    _turn(proxy_url, "new", history)
    [segment] = httpx.get(f"{proxy_url}/sessions/new/trajectory").json()["segments"]
    assert not old_ids & set(segment["call_ids"])
    # The second turn continued the new session's first call, not the deleted one's context.
    second = engine.requests[-1]["input_ids"]
    first = engine.requests[-2]["input_ids"]
    assert second[: len(first)] == first
