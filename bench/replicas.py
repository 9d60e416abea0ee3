"""Turns per second and CPU per turn of two `tito-proxy serve` replicas on one PostgreSQL, every
session's turns alternating between them (turn 1 on A, turn 2 on B, ...).

The load is bench.concurrency's (256 concurrent sessions of short tool conversations, each turn
committed before it is answered). PostgreSQL runs with fsync on, as SQLite runs with
synchronous=FULL. CPU is measured from /proc: the two proxy processes', and the database server's
(the postmaster and its backends), each divided by the turns.

Run: .venv/bin/python -m bench.replicas [--sessions 256] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import orjson

from bench.concurrency import run_sessions
from bench.floor import long_conversation
from bench.harness import REPLY, STEADY_STATE, cpu_seconds, free_port, wait_healthy
from proxy.demo_model import copy_qwen_tokenizer
from tests import postgres_server


def process_tree(pid: int) -> list[int]:
    """The process and its descendants, from /proc/<pid>/task/*/children."""
    found = [pid]
    with contextlib.suppress(FileNotFoundError):  # exited while listed (PostgreSQL's autovacuum workers)
        for task in Path(f"/proc/{pid}/task").iterdir():
            for child in (task / "children").read_text().split():
                found += process_tree(int(child))
    return found


def reaped_cpu_seconds(pid: int) -> float:
    """The CPU time of the process's children that exited and were waited for (cutime + cstime):
    PostgreSQL's backend of a closed connection, which the live tree no longer lists."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[13]) + int(fields[14])) / os.sysconf("SC_CLK_TCK")


def tree_cpu_seconds(pid: int) -> float:
    """The CPU time of a process and its descendants, alive now or exited and reaped (a connection
    pool that closes its spare connections would otherwise hide their backends' time)."""
    total = 0.0
    for member in process_tree(pid):
        with contextlib.suppress(FileNotFoundError):  # exited between the listing and the read
            total += cpu_seconds(member) + reaped_cpu_seconds(member)
    return total


@contextmanager
def database(kind: str, work: Path) -> Iterator[tuple[str, int | None]]:
    """The database URL, and its server's pid (None for SQLite, which runs inside the proxy)."""
    if kind == "sqlite":
        yield f"sqlite:///{work / 'bench.db'}", None
        return
    root = work / "postgres"
    root.mkdir()
    if os.geteuid() == 0:
        os.chmod(work, 0o755)  # the server runs as the `postgres` user
    with postgres_server.postgres_server(root, durable=True) as server:
        yield postgres_server.new_database(server), postgres_server.server_pid(root)


@contextmanager
def proxies(work: Path, db: str, count: int, *extra: str) -> Iterator[tuple[list[str], list[int]]]:
    """The SGLang stand-in and `count` proxy processes on one database: their URLs and pids."""
    tokenizer = work / "tokenizer"
    copy_qwen_tokenizer(tokenizer)
    engine_port = free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    with ExitStack() as processes:

        def spawn(name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
            log = processes.enter_context((work / f"{name}.log").open("wb"))
            process = subprocess.Popen([sys.executable, "-m", *args], env=env, stdout=log, stderr=log)
            processes.callback(process.wait, 30)
            processes.callback(process.terminate)
            return process

        engine = spawn(
            "engine",
            [
                "tests.fakes.sglang",
                "--tokenizer",
                str(tokenizer),
                "--port",
                str(engine_port),
                "--reply",
                REPLY,
            ],
        )
        wait_healthy(engine_url, engine)
        env = {**os.environ, "TITO_DB": db, "TITO_LOG_LEVEL": "warning", **STEADY_STATE}
        urls, pids = [], []
        for n in range(count):
            port = free_port()
            args = ["proxy", "serve", "--engine-url", engine_url, "--tokenizer", str(tokenizer)]
            process = spawn(f"proxy-{n}", [*args, "--port", str(port), *extra], env)
            urls.append(f"http://127.0.0.1:{port}")
            try:
                wait_healthy(urls[-1], process)
            except (RuntimeError, TimeoutError):
                print((work / f"proxy-{n}.log").read_text()[-3000:], file=sys.stderr)
                raise
            pids.append(process.pid)
        yield urls, pids


def measure_load(
    urls: Sequence[str], proxy_pids: Sequence[int], db_pid: int | None, sessions: int, turns: int
) -> dict[str, Any]:
    """Turns/s and CPU per turn (proxies, database server) under the load, after a warm-up."""
    asyncio.run(run_sessions(urls, 32, 2, "warm-up", 32, timeout_s=300))

    def cpu() -> tuple[float, float]:
        proxy = sum(tree_cpu_seconds(pid) for pid in proxy_pids)
        return proxy, tree_cpu_seconds(db_pid) if db_pid is not None else 0.0

    before = cpu()
    turns_per_s = asyncio.run(run_sessions(urls, sessions, turns, "load", sessions, timeout_s=300))
    after = cpu()
    count = sessions * turns
    proxy_ms = (after[0] - before[0]) * 1000 / count
    db_ms = (after[1] - before[1]) * 1000 / count if db_pid is not None else None
    return {
        "sessions": sessions,
        "turns_per_session": turns,
        "turns_per_s": round(turns_per_s, 1),
        "cpu_ms_per_turn": round(proxy_ms, 3),
        "db_server_cpu_ms_per_turn": None if db_ms is None else round(db_ms, 3),
        # A bigger host: every core turning at this CPU per turn (the engine elsewhere, the
        # database keeping up); with a PostgreSQL server on the same host its CPU counts too.
        "turns_per_s_on_8_cores_from_cpu": round(8 * 1000 / proxy_ms),
        "turns_per_s_on_8_cores_with_db_server": round(8 * 1000 / (proxy_ms + (db_ms or 0.0))),
    }


def long_conversations(urls: Sequence[str], turns: int, rounds: int = 3) -> dict[str, Any]:
    """Turn 1 and the last turn of a long conversation on one replica and alternating, medians of
    `rounds`: a replica rebuilds a context the other recorded from the database (it is not cached)."""
    result: dict[str, Any] = {"turns": turns}
    for label, used in (("one_replica", urls[:1]), ("alternating", urls)):
        runs = [asyncio.run(long_conversation(used, f"long-{label}-{n}", turns)) for n in range(rounds)]
        result[label] = {
            "turn_1_ms": round(sorted(run[0] for run in runs)[rounds // 2], 2),
            "turn_last_ms": round(sorted(run[-1] for run in runs)[rounds // 2], 2),
        }
    return result


def measure(sessions: int, turns: int, long_turns: int = 64) -> dict[str, Any]:
    with (
        tempfile.TemporaryDirectory() as folder,
        database("postgresql", Path(folder)) as (db, db_pid),
        proxies(Path(folder), db, 2) as (urls, pids),
    ):
        load = measure_load(urls, pids, db_pid, sessions, turns)
        long = long_conversations(urls, long_turns)
        return {"replicas": 2, "database": "postgresql", **load, "long_conversation": long}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    args = parser.parse_args()
    print(orjson.dumps(measure(args.sessions, args.turns), option=orjson.OPT_INDENT_2).decode())


if __name__ == "__main__":
    main()
