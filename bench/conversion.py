"""An Anthropic or Responses body's history, converted whole on every turn against through the
session's converted history (proxy/dialects/converted_history.py), in process.

The bodies of one 64-turn tool conversation (each tool result ~500 tokens): as an Anthropic SDK
loop sends it, as Claude Code sends it (its cache marker moved to the newest message every turn)
and as Codex sends a Responses input (reasoning, call and output items per turn). Each turn's time
covers the body's validation, its conversion to messages, their canonical forms and the history key;
the two ways alternate round by round, and each turn's figure is the median over the rounds.

Run: .venv/bin/python -m bench.conversion [--rounds 15]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from bench.harness import keep_results, tool_result
from proxy.chat.messages import HistoryHash, canonical_json
from proxy.dialects.anthropic import MessagesRequest, message_forms
from proxy.dialects.anthropic_input import anthropic_messages
from proxy.dialects.anthropic_tools import AnthropicTools
from proxy.dialects.converted_history import ConvertedHistories, Forms
from proxy.dialects.responses import ResponsesRequest, input_forms
from proxy.dialects.responses_input import input_messages
from proxy.dialects.seals import Sealer

TURNS = 64
SEALER = Sealer(None)
SESSION = ("bench", False)
SYSTEM = "You are a coding agent."
TOOLS = [
    {"name": "read_file", "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}}}
]
MARKER = {"type": "ephemeral"}
Convert = Callable[[ConvertedHistories, dict[str, Any]], None]


def _anthropic_bodies(*, moving_marker: bool) -> list[bytes]:
    messages: list[Any] = [{"role": "user", "content": [{"type": "text", "text": "Fix the bug."}]}]
    bodies = []
    for turn in range(TURNS):
        shown = messages
        if moving_marker:
            *blocks, newest = messages[-1]["content"]
            shown = [
                *messages[:-1],
                {**messages[-1], "content": [*blocks, {**newest, "cache_control": MARKER}]},
            ]
        body = {"model": "m", "max_tokens": 256, "system": SYSTEM, "messages": shown, "tools": TOOLS}
        bodies.append(orjson.dumps(body))
        use = {"type": "tool_use", "id": f"toolu_{turn:024d}", "name": "read_file", "input": {"path": "a.py"}}
        thinking = {"type": "thinking", "thinking": "Look.", "signature": SEALER.signature("Look.")}
        result = {"type": "tool_result", "tool_use_id": use["id"], "content": tool_result(21, f"s-{turn}")}
        messages = [
            *messages,
            {"role": "assistant", "content": [thinking, use]},
            {"role": "user", "content": [result]},
        ]
    return bodies


def _responses_bodies() -> list[bytes]:
    items: list[Any] = [{"role": "user", "content": "Fix the bug."}]
    bodies = []
    for turn in range(TURNS):
        bodies.append(orjson.dumps({"model": "m", "instructions": SYSTEM, "input": items}))
        call = {"type": "function_call", "call_id": f"call_{turn}", "name": "read_file", "arguments": "{}"}
        items = [
            *items,
            {"type": "reasoning", "summary": [], "encrypted_content": SEALER.envelope("Look.")},
            call,
            {
                "type": "function_call_output",
                "call_id": call["call_id"],
                "output": tool_result(21, f"s-{turn}"),
            },
        ]
    return bodies


def _keyed(forms: Forms) -> None:
    forms.hash.key(len(forms.canonical), None, None, None)


def _whole(messages: list[Any]) -> None:
    canonical = [canonical_json(m) for m in messages]
    HistoryHash(canonical).key(len(canonical), None, None, None)


def _anthropic_whole(_: ConvertedHistories, data: dict[str, Any]) -> None:
    body = MessagesRequest.model_validate(data)
    _whole(anthropic_messages(body.system, body.messages, SEALER, AnthropicTools.of(body.tools)))


def _anthropic_kept(histories: ConvertedHistories, data: dict[str, Any]) -> None:
    body = MessagesRequest.model_validate(data)
    _keyed(message_forms(histories, SEALER, SESSION, body, AnthropicTools.of(body.tools)))


def _responses_whole(_: ConvertedHistories, data: dict[str, Any]) -> None:
    body = ResponsesRequest.model_validate(data)
    _whole(input_messages(body.instructions, body.input, SEALER))


def _responses_kept(histories: ConvertedHistories, data: dict[str, Any]) -> None:
    _keyed(input_forms(histories, SEALER, SESSION, ResponsesRequest.model_validate(data)))


def _compare(bodies: list[bytes], ways: dict[str, Convert], rounds: int) -> dict[str, Any]:
    times: dict[str, list[list[float]]] = {name: [[] for _ in bodies] for name in ways}
    for _ in range(rounds):
        for name, convert in ways.items():
            histories = ConvertedHistories()
            for turn, raw in enumerate(bodies):
                data = orjson.loads(raw)
                started = time.perf_counter()
                convert(histories, data)
                times[name][turn].append(time.perf_counter() - started)
    result = {}
    for name, per_turn in times.items():
        medians = [statistics.median(turn) * 1e3 for turn in per_turn]
        result[name] = {
            "turn_1_ms": round(medians[0], 3),
            "turn_64_ms": round(medians[-1], 3),
            "mean_ms": round(statistics.mean(medians), 3),
        }
    return result


def measure(rounds: int) -> dict[str, Any]:
    anthropic: dict[str, Convert] = {"whole": _anthropic_whole, "kept": _anthropic_kept}
    return {
        "rounds": rounds,
        "anthropic": _compare(_anthropic_bodies(moving_marker=False), anthropic, rounds),
        "anthropic_moving_marker": _compare(_anthropic_bodies(moving_marker=True), anthropic, rounds),
        "responses": _compare(
            _responses_bodies(), {"whole": _responses_whole, "kept": _responses_kept}, rounds
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.rounds)
    keep_results(args.out, "conversion", results)
    for shape in ("anthropic", "anthropic_moving_marker", "responses"):
        for way, row in results[shape].items():
            print(
                f"{shape:>24} {way:>6}  turn 1 {row['turn_1_ms']:.3f} ms  turn 64 {row['turn_64_ms']:.3f} ms"
                f"  mean {row['mean_ms']:.3f} ms"
            )


if __name__ == "__main__":
    main()
