"""Every structure the proxy keeps across requests is bounded by entries and bytes, whatever the
requests hold: the context cache, the renderer's cache of encoded bases, the retry locks."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.api.retries import RetryGuard, RetryIdentity
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.store.prompts import ContextCache, Recorded


def _recorded(tokens: int, text_chars: int) -> Recorded:
    conversation = [{"role": "user", "content": "x" * text_chars}, {"role": "assistant", "content": "ok"}]
    return Recorded(np.zeros(tokens, dtype=np.int32), conversation)


def test_the_context_cache_is_bounded_by_bytes_counting_the_conversation_text() -> None:
    cache = ContextCache(max_bytes=1_000_000, max_entries=1000)
    for call_id in range(200):
        cache.put(call_id, _recorded(10, 50_000))  # few tokens, much text
    assert cache.bytes <= 1_000_000
    assert len(cache) < 200
    assert cache.get(199) is not None, "the newest entry is kept"
    assert cache.get(0) is None, "the oldest ones are evicted"


def test_the_context_cache_is_bounded_by_entries() -> None:
    cache = ContextCache(max_bytes=10**9, max_entries=100)
    for call_id in range(1000):
        cache.put(call_id, _recorded(3, 3))
    assert len(cache) == 100
    assert cache.bytes == sum(entry_bytes for entry_bytes in cache.sizes())


def test_the_context_cache_keeps_its_accounting_through_drops_and_replacements() -> None:
    cache = ContextCache(max_bytes=10**9, max_entries=100)
    for call_id in range(50):
        cache.put(call_id, _recorded(call_id, call_id))
    for call_id in range(0, 50, 2):
        cache.drop(call_id)
    cache.put(1, _recorded(500, 500))
    assert cache.bytes == sum(cache.sizes())
    for call_id in range(50):
        cache.drop(call_id)
    assert cache.bytes == 0
    assert len(cache) == 0


def test_a_continued_context_is_measured_from_its_parent() -> None:
    cache = ContextCache(max_bytes=10**9, max_entries=10)
    parent = _recorded(10, 1000)
    cache.put(1, parent)
    child = Recorded(
        np.zeros(30, dtype=np.int32), [*parent.conversation, {"role": "user", "content": "y" * 500}]
    )
    cache.put(2, child, extends=1)
    cache.put(3, child)
    assert cache.sizes()[1] == cache.sizes()[2] == 30 * 4 + 1000 + 2 + 500


def test_a_single_entry_over_the_budget_is_not_kept() -> None:
    cache = ContextCache(max_bytes=1000, max_entries=10)
    cache.put(1, _recorded(10, 10))
    cache.put(2, _recorded(10, 10_000))
    assert cache.get(2) is None
    assert cache.bytes <= 1000


def test_the_renderers_base_cache_is_bounded_by_entries_and_characters(qwen_dir: Path) -> None:
    renderer = Renderer(load_tokenizer_files(qwen_dir))

    def tools(variant: int) -> list[dict[str, Any]]:
        return [
            {"type": "function", "function": {"name": f"t{variant}_{i}", "description": "d" * 20_000}}
            for i in range(3)
        ]

    for variant in range(400):
        renderer.render_delta(
            {"role": "assistant", "content": "ok"},
            [{"role": "user", "content": "next"}],
            tools=tools(variant),
            template_kwargs=None,
            now=None,
        )
        renderer._head_ids("h" * 50_000 + str(variant))
    assert renderer.cached_heads() <= 256
    assert renderer.cached_head_chars() <= 8 * 1024 * 1024


def test_retry_locks_are_released_when_their_requests_end() -> None:
    guard = RetryGuard(wait_s=5)

    def identity(n: int) -> RetryIdentity:
        return RetryIdentity(idempotency_key=f"k{n % 7}", request_hash="h", is_sdk_retry=False)

    async def hold(n: int, until: asyncio.Event | None = None) -> None:
        async with guard.hold(f"s{n % 3}", identity(n)):
            await (until.wait() if until else asyncio.sleep(0))

    async def main() -> None:
        await asyncio.gather(*(hold(n) for n in range(500)))
        release = asyncio.Event()
        holder = asyncio.create_task(hold(1, release))
        waiter = asyncio.create_task(hold(1))  # the same identity: waits for the holder
        await asyncio.sleep(0.05)
        assert guard.held() == 1
        assert guard.running_session(identity(1).lock_name) == "s1"  # where a sessionless retry waits
        waiter.cancel()  # a client that went away while waiting
        release.set()
        await holder
        with pytest.raises(asyncio.CancelledError):
            await waiter

    asyncio.run(main())
    assert guard.held() == 0
    assert all(guard.running_session(identity(n).lock_name) is None for n in range(7))
