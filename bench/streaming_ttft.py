"""Time to first token when streaming, through the proxy and straight to the engine.

The stand-in engine streams a text reply; the first event that carries generated text is the first
token. For turns 1 and 64 of a tool conversation (~500 tokens per tool result, ~32k at turn 64),
the same prompt ids are then streamed straight from the engine.

Run: .venv/bin/python -m bench.streaming_ttft [--sessions 10]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import TOOLS, percentile, running_stack, tool_result

REPLY = "Reading the file now, then I will fix the failing test."
TURNS = 64


def _first_token_s(client: httpx.Client, url: str, body: dict[str, Any], field: str) -> tuple[float, str]:
    """Seconds to the first streamed event whose `field` text is non-empty, and the full text."""
    content = orjson.dumps(body)  # before the clock: the client's JSON is not the server's time
    started = time.perf_counter()
    first: float | None = None
    text = ""
    with client.stream(
        "POST", url, content=content, headers={"content-type": "application/json"}
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            piece = _text(event, field)
            if piece and first is None:
                first = time.perf_counter() - started
            text += piece
    assert first is not None, "no token was streamed"
    return first, text


def _text(event: dict[str, Any], field: str) -> str:
    if field == "engine":
        return "x" if event.get("output_ids") else ""
    return "".join(c["delta"].get("content") or "" for c in event.get("choices", []))


def measure(sessions: int) -> dict[str, Any]:
    measured = (1, TURNS)
    proxy_s: dict[int, list[float]] = {t: [] for t in measured}
    direct_s: dict[int, list[float]] = {t: [] for t in measured}
    prompt_tokens: dict[int, int] = {}
    with (
        tempfile.TemporaryDirectory() as work,
        running_stack(Path(work), reply=REPLY) as stack,
        httpx.Client(timeout=60) as client,
    ):
        for session in range(sessions):
            messages: list[dict[str, Any]] = [
                {"role": "system", "content": "You are a coding agent."},
                # Each session a task of its own, each result its own text (no cache answers a turn).
                {"role": "user", "content": f"Fix the bug in src/main.py (task {session})."},
            ]
            url = f"{stack.proxy_url}/sessions/ttft-{session}/v1/chat/completions"
            for turn in range(1, TURNS + 1):
                body = {
                    "model": "m",
                    "messages": messages,
                    "tools": TOOLS,
                    "max_tokens": 64,
                    "stream": True,
                }
                first, text = _first_token_s(client, url, body, "proxy")
                if turn in proxy_s:
                    proxy_s[turn].append(first)
                    segment = client.get(f"{stack.proxy_url}/sessions/ttft-{session}/trajectory").json()
                    leaf = segment["segments"][-1]
                    stream_ids = leaf["prompt_ids"] + leaf["response_ids"]
                    prompt = stream_ids[: len(stream_ids) - _sampled_tail(leaf)]
                    prompt_tokens[turn] = len(prompt)
                    payload = {
                        "input_ids": prompt,
                        "stream": True,
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": False},
                    }
                    direct, _ = _first_token_s(client, f"{stack.engine_url}/generate", payload, "engine")
                    direct_s[turn].append(direct)
                # A plain assistant turn, then a user message carrying a tool-sized result.
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": tool_result(21, f"task {session} turn {turn}")},
                ]
    rows: dict[str, Any] = {}
    for turn in measured:
        via = [v * 1000 for v in proxy_s[turn]]
        raw = [v * 1000 for v in direct_s[turn]]
        rows[str(turn)] = {
            "prompt_tokens": prompt_tokens[turn],
            "direct_p50_ms": round(statistics.median(raw), 3),
            "proxy_p50_ms": round(statistics.median(via), 3),
            "added_p50_ms": round(statistics.median(via) - statistics.median(raw), 3),
            "proxy_p99_ms": round(percentile(via, 99), 3),
        }
    return {"sessions": sessions, "turns": rows}


def _sampled_tail(segment: dict[str, Any]) -> int:
    tail = 0
    for mask in reversed(segment["loss_mask"]):
        if mask != 1:
            break
        tail += 1
    return tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10)
    args = parser.parse_args()
    print(orjson.dumps(measure(args.sessions), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
