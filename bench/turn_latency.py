"""Latency tito-proxy adds per non-streaming turn, over calling the same engine directly.

Engine: the SGLang stand-in (answers instantly, real HTTP, own process). Proxy: `tito-proxy serve`
in its own process with SQLite (synchronous=FULL). Per session, a tool conversation whose every
tool result adds about 500 tokens, so turn 64 carries a ~32k-token context.

Rounds are interleaved: each measured turn is sent straight to the engine just before it goes
through the proxy, as the previous session's same turn (its prompt ids, read from that session's
trajectory, are as long as this one's to a token or two). Both calls then find the engine and the
proxy in the same state: on this shared host a process that sat idle for half a second runs its
next request markedly slower, and measuring all direct calls after a session would compare an idle
proxy at turn 1 with a busy one at turn 64. A first session, not measured, gives session 0 its ids.
The added time is the median of each pair's difference (and, beside it, the difference of the two
medians).

Run: .venv/bin/python -m bench.turn_latency [--sessions 10] [--turns 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import TOOLS, PairedRounds, keep_results, running_stack, tool_result

RESULT_LINES = 21  # ~500 tokens per tool result: turn 64 carries ~32k tokens
# Bodies are made before the clock starts, on both sides: httpx's own JSON of a 33k-id prompt takes
# the client ~3 ms, a turn's messages ~0.4 ms, and that gap is the client's, not the proxy's.
JSON = {"content-type": "application/json"}


def _direct(client: httpx.Client, engine_url: str, prompt_ids: list[int]) -> float:
    payload = orjson.dumps(
        {
            "input_ids": prompt_ids,
            "return_logprob": True,
            "sampling_params": {"max_new_tokens": 256, "skip_special_tokens": False},
        }
    )
    started = time.perf_counter()
    client.post(f"{engine_url}/generate", content=payload, headers=JSON).raise_for_status()
    return time.perf_counter() - started


def _session(
    client: httpx.Client,
    urls: tuple[str, str],
    name: str,
    *,
    turns: int,
    rounds: PairedRounds | None,
    previous: dict[int, list[int]],
) -> dict[int, list[int]]:
    """One tool conversation through the proxy; with `rounds`, each measured turn is timed, right
    after the same turn of the previous session straight to the engine. Returns each measured
    turn's prompt ids."""
    engine_url, proxy_url = urls
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        # Each session a task of its own, each tool result its own text: what the proxy caches
        # (first prompts, encoded chunks) answers no measured turn from another.
        {"role": "user", "content": f"Fix the bug in src/main.py (task {name})."},
    ]
    sent: dict[int, int] = {}
    for turn in range(1, turns + 1):
        if rounds is not None and turn in rounds.via_proxy:
            rounds.direct[turn].append(_direct(client, engine_url, previous[turn]))
        body = orjson.dumps({"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256})
        started = time.perf_counter()
        reply = client.post(
            f"{proxy_url}/sessions/bench-{name}/v1/chat/completions", content=body, headers=JSON
        )
        elapsed = time.perf_counter() - started
        reply.raise_for_status()
        body = reply.json()
        if turn in previous:
            sent[turn] = body["usage"]["prompt_tokens"]
            if rounds is not None:
                rounds.via_proxy[turn].append(elapsed)
                rounds.prompt_tokens[turn] = sent[turn]
        message = body["choices"][0]["message"]
        messages.append(message)
        result = tool_result(RESULT_LINES, f"task {name} turn {turn}")
        messages.append({"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result})
    [segment] = client.get(f"{proxy_url}/sessions/bench-{name}/trajectory").json()["segments"]
    stream = segment["prompt_ids"] + segment["response_ids"]
    return {turn: stream[:length] for turn, length in sent.items()}


def measure(sessions: int, turns: int, measured: tuple[int, ...]) -> dict[str, Any]:
    rounds = PairedRounds(measured)
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        urls = (stack.engine_url, stack.proxy_url)
        with httpx.Client(timeout=60) as client:
            return rounds.run(
                sessions,
                lambda name, paired, previous: _session(
                    client, urls, name, turns=turns, rounds=paired, previous=previous
                ),
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=10)
    parser.add_argument("--turns", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.sessions, args.turns, (1, args.turns))
    keep_results(args.out, "turn_latency", results)
    header = ("turn", "prompt tok", "direct p50", "proxy p50", "added p50", "proxy p99")
    print("  ".join(f"{h:>10}" for h in header))
    for turn, row in results["turns"].items():
        cells = [turn, row["prompt_tokens"]] + [
            f"{row[key]:.2f}ms" for key in ("direct_p50_ms", "proxy_p50_ms", "added_p50_ms", "proxy_p99_ms")
        ]
        print("  ".join(f"{cell:>10}" for cell in cells))


if __name__ == "__main__":
    main()
