"""The proxy's CPU per turn of a 64-turn tool conversation in each wire format: chat, Anthropic
Messages (as Claude Code sends it: its cache marker moves to the newest message every turn) and
Responses, the same conversation (each tool result ~500 tokens, turn 64 at ~32k tokens).

A harness resends its whole history on every turn, in its own format: what the proxy does with it
(reading the body, converting it to messages, keying the history) is where a format can cost more
than another, and more the longer the history. Measured from the proxy process's own CPU time over
whole sessions (a figure a busy host inflates less than wall time), formats interleaved session by
session so that a slow spell of the host falls on all of them; the client's latency of turn 1 and
of turns 60-64 (p50) beside it.

Run: .venv/bin/python -m bench.dialects [--sessions 4]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import httpx
import orjson

from bench.harness import TOOLS, cpu_seconds, keep_results, running_stack, tool_result

TURNS = 64
RESULT_LINES = 21
SYSTEM = "You are a coding agent."
TASK = "Fix the bug."
MARKER = {"type": "ephemeral"}
SCHEMA = cast(dict[str, Any], TOOLS[0]["function"])["parameters"]  # read_file's, in each format


def _post(client: httpx.Client, path: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    data = orjson.dumps(body)
    started = time.perf_counter()
    reply = client.post(path, content=data, headers={"content-type": "application/json"})
    elapsed = time.perf_counter() - started
    reply.raise_for_status()
    answer: dict[str, Any] = reply.json()
    return answer, elapsed


def _chat(client: httpx.Client, session: str) -> list[float]:
    messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TASK}]
    times = []
    for turn in range(TURNS):
        body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256}
        answer, elapsed = _post(client, f"/sessions/{session}/v1/chat/completions", body)
        message = answer["choices"][0]["message"]
        result = tool_result(RESULT_LINES, f"{session}-{turn}")
        messages += [
            message,
            {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result},
        ]
        times.append(elapsed)
    return times


def _anthropic(client: httpx.Client, session: str) -> list[float]:
    """As Claude Code sends it: system blocks, and a cache marker on the newest message's last block
    only (it moves every turn)."""
    tools = [{"name": "read_file", "input_schema": SCHEMA}]
    system = [{"type": "text", "text": SYSTEM, "cache_control": MARKER}]
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": TASK}]}]
    times = []
    for turn in range(TURNS):
        *blocks, newest = messages[-1]["content"]
        marked = [*messages[:-1], {**messages[-1], "content": [*blocks, {**newest, "cache_control": MARKER}]}]
        body = {"model": "m", "max_tokens": 256, "system": system, "messages": marked, "tools": tools}
        answer, elapsed = _post(client, f"/sessions/{session}/v1/messages", body)
        use = next(block for block in answer["content"] if block["type"] == "tool_use")
        result = tool_result(RESULT_LINES, f"{session}-{turn}")
        messages += [
            {"role": "assistant", "content": answer["content"]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": result}],
            },
        ]
        times.append(elapsed)
    return times


def _responses(client: httpx.Client, session: str) -> list[float]:
    tools = [{"type": "function", "name": "read_file", "parameters": SCHEMA}]
    items: list[Any] = [{"role": "user", "content": TASK}]
    times = []
    for turn in range(TURNS):
        body = {"model": "m", "instructions": SYSTEM, "input": items, "tools": tools, "store": False}
        answer, elapsed = _post(client, f"/sessions/{session}/v1/responses", body)
        call = next(item for item in answer["output"] if item["type"] == "function_call")
        result = tool_result(RESULT_LINES, f"{session}-{turn}")
        items += [
            *answer["output"],
            {"type": "function_call_output", "call_id": call["call_id"], "output": result},
        ]
        times.append(elapsed)
    return times


FORMATS: dict[str, Callable[[httpx.Client, str], list[float]]] = {
    "chat": _chat,
    "anthropic": _anthropic,
    "responses": _responses,
}


def measure(sessions: int) -> dict[str, Any]:
    cpu: dict[str, float] = dict.fromkeys(FORMATS, 0.0)
    times: dict[str, list[list[float]]] = {name: [] for name in FORMATS}
    with (
        tempfile.TemporaryDirectory() as work,
        running_stack(Path(work)) as stack,
        httpx.Client(base_url=stack.proxy_url, timeout=60) as client,
    ):
        for name, drive in FORMATS.items():
            drive(client, f"warm-{name}")
        for n in range(sessions):
            for name, drive in FORMATS.items():
                started = cpu_seconds(stack.proxy_pid)
                times[name].append(drive(client, f"{name}-{n}"))
                cpu[name] += cpu_seconds(stack.proxy_pid) - started
    return {
        "sessions": sessions,
        "turns": TURNS,
        "formats": {
            name: {
                "cpu_per_turn_ms": round(cpu[name] / (sessions * TURNS) * 1e3, 3),
                "turn_1_p50_ms": round(statistics.median(run[0] for run in times[name]) * 1e3, 2),
                "turns_60_64_p50_ms": round(
                    statistics.median(t for run in times[name] for t in run[-5:]) * 1e3, 2
                ),
            }
            for name in FORMATS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.sessions)
    keep_results(args.out, "dialects", results)
    print(f"{'format':>10}  {'CPU/turn':>9}  {'turn 1 p50':>10}  {'turns 60-64 p50':>15}")
    for name, row in results["formats"].items():
        print(
            f"{name:>10}  {row['cpu_per_turn_ms']:>7.2f}ms  {row['turn_1_p50_ms']:>8.2f}ms"
            f"  {row['turns_60_64_p50_ms']:>13.2f}ms"
        )


if __name__ == "__main__":
    main()
