"""Latency tito-proxy adds per non-streaming turn, over calling the same engine directly.

Engine: the SGLang stand-in (answers instantly, real HTTP, own process). Proxy: `tito-proxy serve`
in its own process with SQLite (synchronous=FULL). Per session, a tool conversation whose every
tool result adds about 1,000 tokens, so turn 32 carries a ~32k-token context. For each measured
turn, the same prompt ids are then sent straight to the engine; the difference is the proxy's cost.

Run: .venv/bin/python -m bench.turn_latency [--sessions 40] [--turns 32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from proxy.demo_model import copy_qwen_tokenizer

REPLY = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>'
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
# ~1,000 tokens of code-like text per tool result.
TOOL_RESULT = "\n".join(
    f"    value_{i} = compute(value_{i - 1}, {i}) + offset  # step {i}" for i in range(1, 42)
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not become healthy")


def _spawn(stack: ExitStack, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    process = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    stack.callback(process.wait, 30)
    stack.callback(process.terminate)
    return process


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[index]


def measure(sessions: int, turns: int, measured: tuple[int, ...]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        tokenizer_dir = Path(work) / "tokenizer"
        copy_qwen_tokenizer(tokenizer_dir)
        engine_port, proxy_port = _free_port(), _free_port()
        engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
        engine = _spawn(
            stack,
            [
                sys.executable,
                "-m",
                "tests.fakes.sglang",
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(engine_port),
                "--reply",
                REPLY,
            ],
        )
        _wait_healthy(engine_url, engine)
        env = {**os.environ, "TITO_DB": f"sqlite:///{work}/bench.db", "TITO_LOG_LEVEL": "warning"}
        proxy = _spawn(
            stack,
            [
                sys.executable,
                "-m",
                "proxy",
                "serve",
                "--engine-url",
                engine_url,
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(proxy_port),
            ],
            env,
        )
        _wait_healthy(proxy_url, proxy)
        via_proxy: dict[int, list[float]] = {t: [] for t in measured}
        direct: dict[int, list[float]] = {t: [] for t in measured}
        prompt_tokens: dict[int, int] = {}
        with httpx.Client(timeout=60) as client:
            for session in range(sessions):
                messages: list[dict[str, Any]] = [
                    {"role": "system", "content": "You are a coding agent."},
                    {"role": "user", "content": "Fix the bug in src/main.py."},
                ]
                sent_prompts: dict[int, int] = {}
                for turn in range(1, turns + 1):
                    started = time.perf_counter()
                    reply = client.post(
                        f"{proxy_url}/sessions/bench-{session}/v1/chat/completions",
                        json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256},
                    )
                    elapsed = time.perf_counter() - started
                    reply.raise_for_status()
                    body = reply.json()
                    if turn in via_proxy:
                        via_proxy[turn].append(elapsed)
                        sent_prompts[turn] = body["usage"]["prompt_tokens"]
                    message = body["choices"][0]["message"]
                    messages.append(message)
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": message["tool_calls"][0]["id"],
                            "content": TOOL_RESULT,
                        }
                    )
                [segment] = client.get(f"{proxy_url}/sessions/bench-{session}/trajectory").json()["segments"]
                stream = segment["prompt_ids"] + segment["response_ids"]
                for turn, length in sent_prompts.items():
                    prompt_tokens[turn] = length
                    payload = {
                        "input_ids": stream[:length],
                        "return_logprob": True,
                        "sampling_params": {"max_new_tokens": 256, "skip_special_tokens": False},
                    }
                    started = time.perf_counter()
                    client.post(f"{engine_url}/generate", json=payload).raise_for_status()
                    direct[turn].append(time.perf_counter() - started)
    results: dict[str, Any] = {"sessions": sessions, "turns": {}}
    for turn in measured:
        proxy_ms = [v * 1000 for v in via_proxy[turn]]
        direct_ms = [v * 1000 for v in direct[turn]]
        results["turns"][str(turn)] = {
            "prompt_tokens": prompt_tokens[turn],
            "direct_p50_ms": round(statistics.median(direct_ms), 3),
            "proxy_p50_ms": round(statistics.median(proxy_ms), 3),
            "added_p50_ms": round(statistics.median(proxy_ms) - statistics.median(direct_ms), 3),
            "direct_p99_ms": round(_percentile(direct_ms, 99), 3),
            "proxy_p99_ms": round(_percentile(proxy_ms, 99), 3),
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=40)
    parser.add_argument("--turns", type=int, default=32)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.sessions, args.turns, (1, args.turns))
    existing = json.loads(args.out.read_text()) if args.out.is_file() else {}
    existing["turn_latency"] = results
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    header = ("turn", "prompt tok", "direct p50", "proxy p50", "added p50", "proxy p99")
    print("  ".join(f"{h:>10}" for h in header))
    for turn, row in results["turns"].items():
        cells = [turn, row["prompt_tokens"]] + [
            f"{row[key]:.2f}ms" for key in ("direct_p50_ms", "proxy_p50_ms", "added_p50_ms", "proxy_p99_ms")
        ]
        print("  ".join(f"{cell:>10}" for cell in cells))


if __name__ == "__main__":
    main()
