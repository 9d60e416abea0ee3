"""Turns per second and CPU per turn with `serve --workers N`, for N = 1 and 2, on SQLite (WAL,
synchronous=FULL) and on PostgreSQL (fsync on).

The load is bench.concurrency's: 256 concurrent sessions of short tool conversations, every turn
committed before it is answered. CPU is the proxy processes' own (the supervisor and its workers,
utime + stime from /proc), divided by the turns, and PostgreSQL's server's apart; a bigger host's
turns/s follow from it: cores / CPU per turn, while the database keeps up.

Run: .venv/bin/python -m bench.workers [--sessions 256] [--turns 4] [--databases sqlite postgresql]
"""

from __future__ import annotations

import argparse
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from bench.replicas import database, measure_load, process_tree, proxies


def measure_one(kind: str, workers: int, sessions: int, turns: int) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as folder,
        database(kind, Path(folder)) as (db, db_pid),
        proxies(Path(folder), db, 1, "--workers", str(workers)) as (urls, [pid]),
    ):
        load = measure_load(urls, [pid], db_pid, sessions, turns)
        return {"database": kind, "workers": workers, "processes": len(process_tree(pid)), **load}


def measure(
    sessions: int, turns: int, databases: Sequence[str] = ("sqlite", "postgresql")
) -> list[dict[str, Any]]:
    return [measure_one(kind, n, sessions, turns) for kind in databases for n in (1, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--databases", nargs="+", default=["sqlite", "postgresql"])
    args = parser.parse_args()
    results = measure(args.sessions, args.turns, args.databases)
    print(orjson.dumps(results, option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
