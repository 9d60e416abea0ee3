"""Turns per second with many concurrent sessions, and resident memory with many sessions open.

Each of N sessions runs short tool conversations concurrently against `tito-proxy serve` (one
process, SQLite, every turn committed before it is answered). Client, proxy and engine stand-in
share the machine's cores, so the figure is a floor for the proxy alone; the client is aiohttp, whose
CPU per request is a quarter of httpx's, so that it takes as little of them as it can.

Run: .venv/bin/python -m bench.concurrency [--sessions 256] [--turns 8] [--open-sessions 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from bench.harness import TOOLS, cpu_seconds, rss_mib, running_stack


def result(session: str, turn: int) -> str:
    """A tool result of its own (no cache of the proxy answers one turn from another's)."""
    return f"src/main.py: 3 lines changed ({session}, turn {turn})"


async def _session(client: aiohttp.ClientSession, urls: Sequence[str], session: str, turns: int) -> int:
    """A tool conversation of `turns` turns, turn k sent to urls[k mod len(urls)] (replicas)."""
    messages: list[dict[str, Any]] = [{"role": "user", "content": f"Fix the bug of {session}."}]
    for turn in range(turns):
        body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64}
        async with client.post(
            f"{urls[turn % len(urls)]}/sessions/{session}/v1/chat/completions",
            data=orjson.dumps(body),
            headers={"content-type": "application/json"},
        ) as reply:
            reply.raise_for_status()
            message = orjson.loads(await reply.read())["choices"][0]["message"]
        messages += [
            message,
            {
                "role": "tool",
                "tool_call_id": message["tool_calls"][0]["id"],
                "content": result(session, turn),
            },
        ]
    return turns


async def run_sessions(
    urls: Sequence[str], sessions: int, turns: int, prefix: str, concurrency: int, *, timeout_s: float = 120
) -> float:
    """Turns per second of `sessions` sessions, `concurrency` at a time, each alternating over `urls`."""
    # Idle connections are dropped before uvicorn's 5 s keep-alive ends, so none is reused as it closes.
    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as client:
        gate = asyncio.Semaphore(concurrency)

        async def one(n: int) -> int:
            async with gate:
                return await _session(client, urls, f"{prefix}-{n}", turns)

        started = time.perf_counter()
        done = sum(await asyncio.gather(*(one(n) for n in range(sessions))))
        return done / (time.perf_counter() - started)


def measure(sessions: int, turns: int, open_sessions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        cpu_before = cpu_seconds(stack.proxy_pid)
        turns_per_s = asyncio.run(run_sessions([stack.proxy_url], sessions, turns, "c", sessions))
        cpu = cpu_seconds(stack.proxy_pid) - cpu_before
        idle_rss = rss_mib(stack.proxy_pid)
        asyncio.run(run_sessions([stack.proxy_url], open_sessions, 1, "open", 256))
        open_rss = rss_mib(stack.proxy_pid)
    return {
        "concurrent_sessions": sessions,
        "turns_per_session": turns,
        "turns_per_s": round(turns_per_s, 1),
        # The proxy process's own CPU time (user + system), steadier than wall time on a shared host.
        "cpu_ms_per_turn": round(cpu * 1000 / (sessions * turns), 3),
        "open_sessions": open_sessions + sessions,
        "rss_mib_after_concurrency_run": idle_rss,
        "rss_mib_with_open_sessions": open_rss,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--open-sessions", type=int, default=10_000)
    args = parser.parse_args()
    results = measure(args.sessions, args.turns, args.open_sessions)
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
