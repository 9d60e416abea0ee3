"""Bytes on disk per recorded token, and export throughput, for 64-turn tool trajectories.

Drives SESSIONS tool conversations of 64 turns (each tool result ~500 tokens) through the proxy,
finishes them, then measures: the SQLite file (after a WAL checkpoint) and the token blobs alone,
per token of the exported streams; and the tokens per second of GET /export in both modes.

Run: .venv/bin/python -m bench.storage_export [--sessions 8]
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.harness import TOOLS, running_stack, tool_result

TURNS = 64


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


def _export(url: str, mode: str) -> tuple[int, int, float]:
    started = time.perf_counter()
    rows = 0
    tokens = 0
    with httpx.stream("GET", f"{url}/export", params={"mode": mode}, timeout=None) as response:
        for line in response.iter_lines():
            if line:
                row = orjson.loads(line)
                rows += 1
                tokens += len(row["prompt_ids"]) + len(row["response_ids"])
    return rows, tokens, time.perf_counter() - started


def measure(sessions: int) -> dict[str, Any]:
    result = tool_result(20)
    with tempfile.TemporaryDirectory() as work, running_stack(Path(work)) as stack:
        for n in range(sessions):
            _drive(stack.proxy_url, f"s{n}", result)
        merged_rows, stream_tokens, merged_s = _export(stack.proxy_url, "merged")
        step_rows, step_tokens, step_s = _export(stack.proxy_url, "stepwise")
        with sqlite3.connect(stack.db_path) as db:
            db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            blob_bytes = db.execute(
                "select sum(length(prompt_added) + length(output_ids) + length(output_logprobs)) from calls"
            ).fetchone()[0]
        file_bytes = stack.db_path.stat().st_size
    return {
        "sessions": sessions,
        "turns": TURNS,
        "stream_tokens": stream_tokens,
        "db_bytes_per_token": round(file_bytes / stream_tokens, 2),
        "token_blob_bytes_per_token": round(blob_bytes / stream_tokens, 2),
        "export_merged_tokens_per_s": round(stream_tokens / merged_s),
        "export_merged_rows": merged_rows,
        "export_stepwise_tokens_per_s": round(step_tokens / step_s),
        "export_stepwise_rows": step_rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("results.json"))
    args = parser.parse_args()
    results = measure(args.sessions)
    existing = json.loads(args.out.read_text()) if args.out.is_file() else {}
    existing["storage_export"] = results
    args.out.write_text(json.dumps(existing, indent=2) + "\n")
    for key, value in results.items():
        print(f"{key:>32}  {value}")


if __name__ == "__main__":
    main()
