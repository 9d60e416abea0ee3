"""Turns per second and CPU per turn with `serve --workers N`, for N = 1 and 2, on SQLite.

The load is bench.concurrency's: 256 concurrent sessions of short tool conversations, every turn
committed before it is answered. CPU is the proxy processes' own (the supervisor and its workers,
utime + stime from /proc), divided by the turns; a bigger host's turns/s follow from it: cores /
CPU per turn, while the database keeps up.

Run: .venv/bin/python -m bench.workers [--sessions 256] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path
from typing import Any

import orjson

from bench.concurrency import _run as run_sessions
from bench.floor import cpu_seconds
from bench.harness import running_stack


def _tree(pid: int) -> list[int]:
    """The process and its descendants, from /proc/<pid>/task/*/children."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += _tree(int(child))
    return found


def _cpu(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) for pid in pids)


def measure(workers: int, sessions: int, turns: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work), "--workers", str(workers)) as stack:
        asyncio.run(run_sessions(stack.proxy_url, 32, 2, "warm-up", 32))
        pids = _tree(stack.proxy_pid)
        before = _cpu(pids)
        turns_per_s = asyncio.run(run_sessions(stack.proxy_url, sessions, turns, "load", sessions))
        cpu_ms = (_cpu(pids) - before) * 1000 / (sessions * turns)
    return {
        "workers": workers,
        "processes": len(pids),
        "turns_per_s": round(turns_per_s, 1),
        "cpu_ms_per_turn": round(cpu_ms, 3),
        "turns_per_s_on_8_cores_from_cpu": round(8 * 1000 / cpu_ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    results = [measure(n, args.sessions, args.turns) for n in (1, 2)]
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
