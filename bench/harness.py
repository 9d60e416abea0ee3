"""What the benchmarks share: the SGLang stand-in and `tito-proxy serve` as separate processes."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from proxy.demo_model import copy_qwen_tokenizer

# A proxy in its steady state: tiktoken proven for the tokenizer at start-up, as a serving proxy has it
# after its first 100k tokens (proxy/chat/rank_bpe.py).
STEADY_STATE = {"TITO_FAST_BPE_AFTER_TOKENS": "0"}
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


def tool_result(lines: int, source: str = "") -> str:
    """Code-like text, about 24 tokens a line; `source` names where it was read (a turn's own text,
    so that no cache of the proxy answers a benchmark's turn from an earlier one)."""
    heading = [f"# {source}"] if source else []
    return "\n".join(
        heading
        + [f"    value_{i} = compute(value_{i - 1}, {i}) + offset  # step {i}" for i in range(1, lines + 1)]
    )


def cpu_seconds(pid: int) -> float:
    """The process's own user + system CPU time, from /proc/<pid>/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_healthy(url: str, process: subprocess.Popen[bytes]) -> None:
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


@dataclass(frozen=True)
class Stack:
    engine_url: str
    proxy_url: str
    db_path: Path
    proxy_pid: int


@contextmanager
def running_stack(work: Path, *extra_args: str, reply: str = REPLY) -> Iterator[Stack]:
    """The stand-in engine and the proxy (SQLite under `work`), each in its own process."""
    tokenizer_dir = work / "tokenizer"
    copy_qwen_tokenizer(tokenizer_dir)
    engine_port, proxy_port = free_port(), free_port()
    engine_url, proxy_url = f"http://127.0.0.1:{engine_port}", f"http://127.0.0.1:{proxy_port}"
    db_path = work / "bench.db"
    with ExitStack() as processes:

        def spawn(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
            log = processes.enter_context((work / f"{args[2].replace('.', '-')}.log").open("wb"))
            process = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT)
            processes.callback(process.wait, 30)
            processes.callback(process.terminate)
            return process

        engine = spawn(
            [
                sys.executable,
                "-m",
                "tests.fakes.sglang",
                "--tokenizer",
                str(tokenizer_dir),
                "--port",
                str(engine_port),
                "--reply",
                reply,
            ]
        )
        wait_healthy(engine_url, engine)
        env = {**os.environ, "TITO_DB": f"sqlite:///{db_path}", "TITO_LOG_LEVEL": "warning", **STEADY_STATE}
        proxy = spawn(
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
                *extra_args,
            ],
            env,
        )
        wait_healthy(proxy_url, proxy)
        yield Stack(engine_url, proxy_url, db_path, proxy.pid)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


class PairedRounds:
    """The measured turns' times through the proxy and straight to the engine, side by side: the
    k-th proxied time of a turn is paired with the k-th direct one, the call sent just before it.
    On this shared host a stretch of slow machine slows both calls of a pair, so the added time is
    the median of the pairs' differences, not the difference of the two medians."""

    def __init__(self, measured: tuple[int, ...]) -> None:
        self.via_proxy: dict[int, list[float]] = {t: [] for t in measured}
        self.direct: dict[int, list[float]] = {t: [] for t in measured}
        self.prompt_tokens: dict[int, int] = {}

    def run(
        self, sessions: int, session: Callable[[str, PairedRounds | None, dict[int, Any]], dict[int, Any]]
    ) -> dict[str, Any]:
        """An unmeasured warm-up session, then `sessions` measured ones: `session(name, rounds,
        previous)` runs one, pairing each measured turn with the same turn of `previous` (what the
        session before returned) sent straight to the engine. The sessions and their rows."""
        previous = session("warm-up", None, {turn: [] for turn in self.via_proxy})
        for n in range(sessions):
            previous = session(str(n), self, previous)
        return {"sessions": sessions, "turns": self.rows()}

    def rows(self) -> dict[str, dict[str, Any]]:
        """Per measured turn, in milliseconds: both sides' p50, the added p50 (the pairs' median
        difference), the difference of the medians beside it, both sides' p99."""
        rows = {}
        for turn, seconds in self.via_proxy.items():
            proxy_ms = [v * 1000 for v in seconds]
            direct_ms = [v * 1000 for v in self.direct[turn]]
            rows[str(turn)] = {
                "prompt_tokens": self.prompt_tokens[turn],
                "direct_p50_ms": round(statistics.median(direct_ms), 3),
                "proxy_p50_ms": round(statistics.median(proxy_ms), 3),
                "added_p50_ms": round(
                    statistics.median(p - d for p, d in zip(proxy_ms, direct_ms, strict=True)), 3
                ),
                "median_difference_ms": round(statistics.median(proxy_ms) - statistics.median(direct_ms), 3),
                "direct_p99_ms": round(percentile(direct_ms, 99), 3),
                "proxy_p99_ms": round(percentile(proxy_ms, 99), 3),
            }
        return rows


def keep_results(out: Path, key: str, results: dict[str, Any]) -> None:
    """`results` under `key` in the results file `out`, the other benchmarks' kept as they are."""
    existing = json.loads(out.read_text()) if out.is_file() else {}
    existing[key] = results
    out.write_text(json.dumps(existing, indent=2) + "\n")
