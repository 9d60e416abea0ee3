"""Time to first token when streaming, through the proxy and straight to the engine.

The stand-in engine streams a text reply; the first event that carries generated text is the first
token. Measured at turns 1 and 64 of a tool conversation (~500 tokens per tool result, ~32k at
turn 64), in rounds paired as bench.turn_latency pairs them: each measured turn is streamed straight
from the engine (the previous session's same turn: its prompt ids, read from that session's
trajectory, are as long as this one's to a token or two) just before it goes through the proxy, and
the added time is the median of each pair's difference (PairedRounds; the difference of the two
medians beside it). A first session, not measured, gives session 0 its ids. Every request's body is
made before its clock starts.

Run: .venv/bin/python -m bench.streaming_ttft [--sessions 10] [--turns 64]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import TOOLS, PairedRounds, running_stack, tool_result

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


def _direct_first_token_s(client: httpx.Client, engine_url: str, prompt_ids: list[int]) -> float:
    payload = {
        "input_ids": prompt_ids,
        "stream": True,
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": 64, "skip_special_tokens": False},
    }
    return _first_token_s(client, f"{engine_url}/generate", payload, "engine")[0]


def _sent_prompt(client: httpx.Client, proxy_url: str, name: str) -> list[int]:
    """The prompt ids the session's last turn sent the engine, from its trajectory."""
    segment = client.get(f"{proxy_url}/sessions/ttft-{name}/trajectory").json()
    leaf = segment["segments"][-1]
    stream_ids: list[int] = leaf["prompt_ids"] + leaf["response_ids"]
    return stream_ids[: len(stream_ids) - _sampled_tail(leaf)]


def _session(
    client: httpx.Client,
    urls: tuple[str, str],
    name: str,
    *,
    turns: int,
    rounds: PairedRounds | None,
    previous: dict[int, list[int]],
) -> dict[int, list[int]]:
    """One streamed tool conversation through the proxy; with `rounds`, each measured turn's first
    token is timed, right after the same turn of the previous session straight from the engine.
    Returns each measured turn's prompt ids."""
    engine_url, proxy_url = urls
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        # Each session a task of its own, each result its own text (no cache answers a turn).
        {"role": "user", "content": f"Fix the bug in src/main.py (task {name})."},
    ]
    url = f"{proxy_url}/sessions/ttft-{name}/v1/chat/completions"
    sent: dict[int, list[int]] = {}
    for turn in range(1, turns + 1):
        if rounds is not None and turn in rounds.via_proxy:
            rounds.direct[turn].append(_direct_first_token_s(client, engine_url, previous[turn]))
        body = {"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 64, "stream": True}
        first, text = _first_token_s(client, url, body, "proxy")
        if turn in previous:
            sent[turn] = _sent_prompt(client, proxy_url, name)
            if rounds is not None:
                rounds.via_proxy[turn].append(first)
                rounds.prompt_tokens[turn] = len(sent[turn])
        # A plain assistant turn, then a user message carrying a tool-sized result.
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": tool_result(21, f"task {name} turn {turn}")},
        ]
    return sent


def measure(sessions: int, turns: int = TURNS) -> dict[str, Any]:
    measured = (1, turns)
    rounds = PairedRounds(measured)
    with (
        tempfile.TemporaryDirectory() as work,
        running_stack(Path(work), reply=REPLY) as stack,
        httpx.Client(timeout=60) as client,
    ):
        urls = (stack.engine_url, stack.proxy_url)
        return rounds.run(
            sessions,
            lambda name, paired, previous: _session(
                client, urls, name, turns=turns, rounds=paired, previous=previous
            ),
        )


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
    parser.add_argument("--turns", type=int, default=TURNS)
    args = parser.parse_args()
    print(orjson.dumps(measure(args.sessions, args.turns), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
