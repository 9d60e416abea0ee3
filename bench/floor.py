"""The floor in the same run: a minimal pass-through proxy next to tito-proxy and the engine alone.

Three systems, measured one after the other on the same machine with the same aiohttp client:
- the engine alone (a chat-completions stand-in that answers a canned tool call instantly);
- the floor: a ~20-line aiohttp proxy that forwards /v1/chat/completions to that engine;
- tito-proxy (SQLite, synchronous=FULL, every turn committed before it is answered) on the SGLang
  stand-in.
For each: turns per second with 256 concurrent sessions, the proxy process's own CPU time per turn
(utime + stime from /proc/<pid>/stat, not wall time), and per-turn latency over a 64-turn tool
conversation (p50, p99, turns slower than 10x p50 flagged with their index). Ratios to the floor
are the figures to read; absolute numbers move with the machine.

Run: .venv/bin/python -m bench.floor [--sessions 256] [--turns 4] [--long-turns 64]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from bench.concurrency import run_sessions
from bench.harness import (
    TOOLS,
    cpu_seconds,
    free_port,
    percentile,
    running_stack,
    tool_result,
    wait_healthy,
)

RESULT_LINES = 21  # ~500 tokens per tool result, as in bench.turn_latency
_ANSWER = {
    "id": "chatcmpl-floor",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_0",
                        "type": "function",
                        "function": {"name": "read_file", "arguments": '{"path": "src/main.py"}'},
                    }
                ],
            },
        }
    ],
    "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
}


def engine_app() -> web.Application:
    """The engine alone: reads the body, answers a canned tool call."""
    body = orjson.dumps(_ANSWER)

    async def chat(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=body, content_type="application/json")

    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/sessions/{session}/v1/chat/completions", chat)
    app.router.add_get("/health", lambda _: web.json_response({}))  # type: ignore[arg-type,return-value]
    return app


def passthrough_app(upstream: str) -> web.Application:
    """The floor: forward the body, return the answer; nothing parsed, nothing recorded."""
    app = web.Application(client_max_size=64 << 20)

    async def start(app: web.Application) -> None:
        app["client"] = aiohttp.ClientSession(upstream)

    async def stop(app: web.Application) -> None:
        await app["client"].close()

    async def forward(request: web.Request) -> web.Response:
        async with request.app["client"].post(
            "/v1/chat/completions", data=await request.read(), headers={"content-type": "application/json"}
        ) as answer:
            return web.Response(
                body=await answer.read(), status=answer.status, content_type="application/json"
            )

    app.on_startup.append(start)
    app.on_cleanup.append(stop)
    app.router.add_post("/v1/chat/completions", forward)
    app.router.add_post("/sessions/{session}/v1/chat/completions", forward)
    app.router.add_get("/health", lambda _: web.json_response({}))  # type: ignore[arg-type,return-value]
    return app


@contextmanager
def _floor_stack() -> Iterator[tuple[str, str, int]]:
    """(engine url, floor proxy url, floor proxy pid), each in its own process."""
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    engine = subprocess.Popen([sys.executable, "-m", "bench.floor", "engine", "--port", str(engine_port)])
    proxy = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "bench.floor",
            "passthrough",
            "--port",
            str(proxy_port),
            "--upstream",
            engine_url,
        ]
    )
    try:
        wait_healthy(engine_url, engine)
        wait_healthy(proxy_url, proxy)
        yield engine_url, proxy_url, proxy.pid
    finally:
        for process in (proxy, engine):
            process.terminate()
            process.wait(30)


async def long_conversation(urls: Sequence[str], session: str, turns: int) -> list[float]:
    """Per-turn latency (ms) of one tool conversation whose every result adds ~500 tokens, turn k
    sent to urls[k mod len(urls)] (replicas)."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": f"Fix the bug in src/main.py ({session})."},
    ]
    latencies = []
    async with aiohttp.ClientSession() as client:
        for turn in range(turns):
            body = orjson.dumps({"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256})
            started = time.perf_counter()
            async with client.post(
                f"{urls[turn % len(urls)]}/sessions/{session}/v1/chat/completions",
                data=body,
                headers={"content-type": "application/json"},
            ) as reply:
                reply.raise_for_status()
                answer = orjson.loads(await reply.read())
            latencies.append((time.perf_counter() - started) * 1000)
            message = answer["choices"][0]["message"]
            messages += [
                message,
                {
                    "role": "tool",
                    "tool_call_id": message["tool_calls"][0]["id"],
                    "content": tool_result(RESULT_LINES, f"{session} turn {turn}"),
                },
            ]
    return latencies


def _measure(url: str, pid: int | None, sessions: int, turns: int, long_turns: int) -> dict[str, Any]:
    asyncio.run(long_conversation([url], "warm-up", 2))  # first connections and lazy imports, untimed
    latencies = asyncio.run(long_conversation([url], "long", long_turns))
    before = cpu_seconds(pid) if pid is not None else 0.0
    turns_per_s = asyncio.run(run_sessions([url], sessions, turns, "load", sessions))
    cpu = cpu_seconds(pid) - before if pid is not None else None
    p50 = statistics.median(latencies)
    return {
        "turns_per_s": round(turns_per_s, 1),
        "cpu_ms_per_turn": round(cpu * 1000 / (sessions * turns), 3) if cpu is not None else None,
        "turn_1_ms": round(latencies[0], 3),
        "turn_last_ms": round(latencies[-1], 3),
        "p50_ms": round(p50, 3),
        "p99_ms": round(percentile(latencies, 99), 3),
        "p99_over_p50": round(percentile(latencies, 99) / p50, 2),
        # Turn index (1-based) and latency of every turn slower than 10x the median.
        "outliers": [[i + 1, round(v, 1)] for i, v in enumerate(latencies) if v > 10 * p50],
    }


def measure(sessions: int, turns: int, long_turns: int) -> dict[str, Any]:
    with _floor_stack() as (engine_url, floor_url, floor_pid):
        engine = _measure(engine_url, None, sessions, turns, long_turns)
        floor = _measure(floor_url, floor_pid, sessions, turns, long_turns)
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        tito = _measure(stack.proxy_url, stack.proxy_pid, sessions, turns, long_turns)
    floor_cpu, tito_cpu = floor["cpu_ms_per_turn"], tito["cpu_ms_per_turn"]
    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "long_turns": long_turns,
        "engine_alone": engine,
        "floor": floor,
        "tito": tito,
        "ratios": {
            "cpu_per_turn_tito_over_floor": round(tito_cpu / floor_cpu, 2) if floor_cpu else None,
            "turns_per_s_tito_over_floor": round(tito["turns_per_s"] / floor["turns_per_s"], 2),
            "p50_tito_over_floor": round(tito["p50_ms"] / floor["p50_ms"], 2),
            "last_turn_over_first_tito": round(tito["turn_last_ms"] / tito["turn_1_ms"], 2),
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("role", nargs="?", choices=("measure", "engine", "passthrough"), default="measure")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--upstream", default="")
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--long-turns", type=int, default=64)
    args = parser.parse_args()
    if args.role == "engine":
        web.run_app(engine_app(), host="127.0.0.1", port=args.port, print=None, access_log=None)
    elif args.role == "passthrough":
        web.run_app(
            passthrough_app(args.upstream), host="127.0.0.1", port=args.port, print=None, access_log=None
        )
    else:
        print(
            orjson.dumps(
                measure(args.sessions, args.turns, args.long_turns), option=orjson.OPT_INDENT_2
            ).decode()
        )


if __name__ == "__main__":
    main()
