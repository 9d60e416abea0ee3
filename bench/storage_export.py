"""Bytes on disk per recorded token, and export throughput, for 64-turn tool trajectories.

Drives SESSIONS tool conversations of 64 turns (each tool result ~500 tokens) through the proxy,
finishes them, then measures: the SQLite file (after a WAL checkpoint), the token blobs and the stored
segment summaries, per token of the exported streams; and the tokens per second GET /export
delivers in both modes, as JSON lines and as Parquet (best of three; token counts from the bodies,
parsed outside the timing), with the proxy's peak resident memory during each export.

Run: .venv/bin/python -m bench.storage_export [--sessions 8]
"""

from __future__ import annotations

import argparse
import http.client
import io
import os
import sqlite3
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import orjson
import pyarrow.compute as pc

from bench.harness import TOOLS, keep_results, rss_mib, running_stack, tool_result

TURNS = 64
MIN_TIMED_S = 2.0  # each export is repeated for this long: enough ticks of process CPU time


def _drive(url: str, session: str, result: str) -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a coding agent."},
        {"role": "user", "content": "Fix the bug."},
    ]
    with httpx.Client(base_url=url, timeout=60) as client:
        for _ in range(TURNS):
            reply = client.post(
                f"/sessions/{session}/v1/chat/completions",
                json={"model": "m", "messages": messages, "tools": TOOLS, "max_tokens": 256},
            )
            reply.raise_for_status()
            message = reply.json()["choices"][0]["message"]
            messages += [
                message,
                {"role": "tool", "tool_call_id": message["tool_calls"][0]["id"], "content": result},
            ]
        client.post(f"/sessions/{session}/finish").raise_for_status()


def _peak_reset(pid: int) -> bool:
    """Reset the process's peak resident memory (Linux: 5 > clear_refs), so VmHWM is this export's."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024, 1)
    raise RuntimeError(f"no VmHWM for process {pid}")


def _get(url: str, path: str) -> bytes:
    """One GET read whole with http.client (its reads are C; httpx's HTTP parsing in Python would
    cap the figure at the client's speed, well below what the proxy sends)."""
    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=600)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"GET {path}: {response.status} {body[:200]!r}")
        return body
    finally:
        connection.close()


def _cpu_s(pid: int) -> float:
    """The process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _export(url: str, pid: int, mode: str, fmt: str) -> dict[str, Any]:
    """The body; the seconds the proxy took to deliver it (best of the runs; the client only reads
    the bytes, its parsing is left out: it would measure the client); the proxy's own CPU time per
    export (a figure a busy machine does not inflate); its peak RSS during an export."""
    path = f"/export?mode={mode}&format={fmt}"
    body = _get(url, path)  # warm: the first export of a session would store missing summaries
    best = float("inf")
    peak: float | None = None
    runs = 0
    cpu_started, wall_started = _cpu_s(pid), time.perf_counter()
    while runs < 3 or time.perf_counter() - wall_started < MIN_TIMED_S:
        measured = _peak_reset(pid)
        started = time.perf_counter()
        _get(url, path)
        best = min(best, time.perf_counter() - started)
        runs += 1
        if measured:
            peak = max(peak or 0.0, _peak_mib(pid))
    return {"body": body, "wall_s": best, "cpu_s": (_cpu_s(pid) - cpu_started) / runs, "peak_rss_mib": peak}


def _tokens(body: bytes, fmt: str) -> tuple[int, int]:
    if fmt == "parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(io.BytesIO(body), columns=["prompt_ids", "response_ids"])
        lengths = [pc.sum(pc.list_value_length(table[c])).as_py() or 0 for c in table.column_names]
        return table.num_rows, sum(lengths)
    rows = [orjson.loads(line) for line in body.splitlines() if line]
    return len(rows), sum(len(row["prompt_ids"]) + len(row["response_ids"]) for row in rows)


def _throughput(url: str, pid: int) -> dict[str, Any]:
    results: dict[str, Any] = {"proxy_rss_mib_before_export": rss_mib(pid)}
    for mode in ("merged", "stepwise"):
        for fmt in ("jsonl", "parquet"):
            export = _export(url, pid, mode, fmt)
            rows, tokens = _tokens(export["body"], fmt)
            suffix = "" if fmt == "jsonl" else "_parquet"
            results[f"export_{mode}{suffix}_rows"] = rows
            results[f"export_{mode}{suffix}_tokens"] = tokens
            results[f"export_{mode}{suffix}_tokens_per_s"] = round(tokens / export["wall_s"])
            results[f"export_{mode}{suffix}_tokens_per_cpu_s"] = round(tokens / export["cpu_s"])
            results[f"export_{mode}{suffix}_bytes"] = len(export["body"])
            results[f"export_{mode}{suffix}_peak_rss_mib"] = export["peak_rss_mib"]
    return results


def _file_bytes(db_path: Path) -> int:
    """The SQLite file's size once its write-ahead log is checkpointed into it."""
    with sqlite3.connect(db_path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db_path.stat().st_size


def measure(sessions: int) -> dict[str, Any]:
    result = tool_result(20)
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        schema_bytes = _file_bytes(stack.db_path)  # the empty tables' and indexes' first pages
        for n in range(sessions):
            _drive(stack.proxy_url, f"s{n}", result)
        throughput = _throughput(stack.proxy_url, stack.proxy_pid)
        stream_tokens = throughput["export_merged_tokens"]
        file_bytes = _file_bytes(stack.db_path)
        with sqlite3.connect(stack.db_path) as db:
            blob_bytes = db.execute(
                "select sum(length(prompt_added) + length(output_ids) + length(output_logprobs)) from calls"
            ).fetchone()[0]
            summary_bytes = db.execute(
                "select coalesce(sum(length(summary)), 0) from segment_summaries"
            ).fetchone()[0]
    return {
        "sessions": sessions,
        "turns": TURNS,
        "stream_tokens": stream_tokens,
        "db_bytes_per_token": round(file_bytes / stream_tokens, 2),
        # Without the pages an empty database already has (a fixed ~100 KB): what recording costs.
        "recorded_bytes_per_token": round((file_bytes - schema_bytes) / stream_tokens, 2),
        "token_blob_bytes_per_token": round(blob_bytes / stream_tokens, 2),
        "summary_bytes_per_token": round(summary_bytes / stream_tokens, 3),
        **throughput,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.sessions)
    # Run on its own, this module's figures carry their own date (the table says so).
    measured_at = datetime.now(UTC).isoformat(timespec="seconds")
    keep_results(args.out, "storage_export", {"measured_at": measured_at, **results})
    for key, value in results.items():
        print(f"{key:>32}  {value}")


if __name__ == "__main__":
    main()
