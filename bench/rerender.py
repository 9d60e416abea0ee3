"""What a turn costs to tokenize: a full chat-template render of the history (other gateways) next
to tito-proxy's (the first prompt in full, then the fixed-base delta of the appended messages), at
turn 1 and turn 64; the delta also with the whole fixed base rendered (no short render), and for a
short tool result as bench.concurrency sends.

In process, on the real Qwen3 tokenizer and template; a tool conversation whose tool results are
~500 tokens, so turn 64 carries ~32k tokens.

Run: .venv/bin/python -m bench.rerender
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bench.harness import REPLY, TOOLS, tool_result
from proxy.chat.parsing import parse_output
from proxy.chat.renderer import Renderer
from proxy.chat.tokenizer import load_tokenizer_files
from proxy.demo_model import copy_qwen_tokenizer

TURNS = 64
REPEATS = 30


def _median_ms(action: Callable[[], Any], cold: Callable[[], None]) -> float:
    """The median time of `action`, each run from empty caches: a turn's new text is never cached,
    and the full re-render stands for gateways that keep nothing."""
    timings = []
    for _ in range(REPEATS):
        cold()
        started = time.perf_counter()
        action()
        timings.append(time.perf_counter() - started)
    return round(statistics.median(timings) * 1000, 3)


def measure() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work:
        copy_qwen_tokenizer(Path(work))
        # A serving proxy's steady state: tiktoken proven for the tokenizer (bench.harness.STEADY_STATE).
        renderer = Renderer(load_tokenizer_files(Path(work)), fast_bpe_after=0)
    now = datetime(2026, 1, 1)

    def cold() -> None:
        renderer.pieces.clear()
        renderer.first_prompts.clear()
        renderer.template.tojson.clear()

    call = parse_output(REPLY, parse_reasoning=True).as_message()
    result = tool_result(21)
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug in src/main.py."},
    ]
    rows: dict[str, Any] = {}
    for turn in range(1, TURNS + 1):
        if turn in (1, TURNS):
            full = partial(renderer.render_prompt, list(messages), tools=TOOLS, template_kwargs=None, now=now)
            short_result = [{**messages[-1], "content": "src/main.py: 3 lines changed"}]
            short_delta = partial(
                renderer.render_delta, call, short_result, tools=TOOLS, template_kwargs=None, now=now
            )
            # tito-proxy renders a first prompt in full, and only the appended messages after that.
            ours = (
                full
                if turn == 1
                else partial(
                    renderer.render_delta, call, messages[-1:], tools=TOOLS, template_kwargs=None, now=now
                )
            )
            rows[str(turn)] = {
                "prompt_tokens": len(full()),
                "full_render_ms": _median_ms(full, cold),
                "tito_ms": _median_ms(ours, cold),
            }
            if turn > 1:
                # The delta with the whole fixed base rendered, as before the short render was proven.
                short, renderer.short_context = renderer.short_context, None
                rows[str(turn)]["tito_fixed_base_ms"] = _median_ms(ours, cold)
                renderer.short_context = short
                rows[str(turn)]["tito_short_result_ms"] = _median_ms(short_delta, cold)
                renderer.short_context = None
                rows[str(turn)]["tito_fixed_base_short_result_ms"] = _median_ms(short_delta, cold)
                renderer.short_context = short
        messages += [call, {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": result}]
    return {"turns": rows}


def main() -> None:
    print(orjson.dumps(measure(), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
