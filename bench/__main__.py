"""Every benchmark in one run: writes bench/results.json and the table in README.md.

Run: .venv/bin/python -m bench [--quick]
"""

from __future__ import annotations

import argparse
import json
import platform
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import (
    concurrency,
    floor,
    replicas,
    rerender,
    storage_export,
    streaming_ttft,
    turn_latency,
    workers,
)

ROOT = Path(__file__).resolve().parent.parent
TABLE = re.compile(r"(<!-- bench:start -->\n).*?(<!-- bench:end -->)", re.DOTALL)


def run(quick: bool) -> dict[str, Any]:
    scale = 0.25 if quick else 1.0
    print("turn latency ...", flush=True)
    latency = turn_latency.measure(max(2, round(10 * scale)), 64, (1, 64))
    print("time to first token ...", flush=True)
    ttft = streaming_ttft.measure(max(2, round(10 * scale)))
    print("full re-render vs fixed-base delta ...", flush=True)
    render = rerender.measure()
    print("concurrency and memory ...", flush=True)
    load = concurrency.measure(256, 8, round(10_000 * scale))
    print("the floor: pass-through proxy, tito-proxy, engine alone ...", flush=True)
    side_by_side = floor.measure(256, 4, 64)
    print("storage and export ...", flush=True)
    storage = storage_export.measure(max(2, round(8 * scale)))
    print("workers (SQLite, PostgreSQL) and two replicas on one PostgreSQL ...", flush=True)
    scale_out = {
        "workers": workers.measure(round(256 * scale), 4),
        "replicas": replicas.measure(round(256 * scale), 4),
    }
    return {
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        "turn_latency": latency,
        "streaming_ttft": ttft,
        "rerender": render,
        "concurrency": load,
        "storage_export": storage,
        "floor": side_by_side,
        "scale_out": scale_out,
    }


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


def table(results: dict[str, Any]) -> str:
    latency = results["turn_latency"]["turns"]
    ttft = results["streaming_ttft"]["turns"]
    render = results["rerender"]["turns"]
    load = results["concurrency"]
    storage = results["storage_export"]
    rows = [
        ("| Measure | Turn 1 | Turn 64 | Target |", "|---|---|---|---|"),
    ]
    lines = [*rows[0]]

    def pair(source: dict[str, Any], key: str, unit: str = " ms") -> str:
        return " | ".join(f"{source[t][key]:.2f}{unit}" for t in ("1", "64"))

    lines += [
        f"| Prompt tokens | {latency['1']['prompt_tokens']} | {latency['64']['prompt_tokens']} | |",
        f"| Engine alone, p50 | {pair(latency, 'direct_p50_ms')} | |",
        f"| Added by the proxy, p50 | {pair(latency, 'added_p50_ms')} | ≤ 2.0 ms, ≤ 2.5 ms |",
        f"| Through the proxy, p99 | {pair(latency, 'proxy_p99_ms')} | |",
        f"| Streaming: time to first token added, p50 | {pair(ttft, 'added_p50_ms')} | |",
        f"| Tokenizing the turn: full re-render (other gateways) | {pair(render, 'full_render_ms')} | |",
        f"| Tokenizing the turn: tito-proxy | {pair(render, 'tito_ms')} | flat |",
        "",
        "| Measure | Value | Target |",
        "|---|---|---|",
        f"| Turns per second, {load['concurrent_sessions']} concurrent sessions, each committed | "
        f"{load['turns_per_s']:.0f} | ≥ 2,000 on 8 cores (scale-out below) |",
        f"| Resident memory with {load['open_sessions']:,} sessions open | "
        f"{load['rss_mib_with_open_sessions']} MiB | |",
        f"| Bytes on disk per token (whole SQLite file; without the empty schema's pages) | "
        f"{storage['db_bytes_per_token']} ({storage.get('recorded_bytes_per_token')}) | ≤ 10 |",
        f"| Bytes per token of the token arrays alone | {storage['token_blob_bytes_per_token']} | |",
        f"| Bytes per token of the stored export summaries | {storage.get('summary_bytes_per_token', 0)} | |",
        *export_rows(storage),
    ]
    if "floor" in results:
        lines += ["", *floor_table(results["floor"])]
    if "scale_out" in results:
        lines += ["", *scale_out_table(results["scale_out"])]
    machine = results["machine"]
    lines.append("")
    lines.append(
        f"Measured {results['measured_at']} on {machine['cpus']} cores (Python {machine['python']}), "
        "client, proxy and engine stand-in on the same machine: `.venv/bin/python -m bench`."
    )
    if storage.get("measured_at", results["measured_at"]) != results["measured_at"]:
        lines.append(
            f"Storage and export rows: {storage['sessions']} sessions of {storage['turns']} turns, measured "
            f"{storage['measured_at']} with `.venv/bin/python -m bench.storage_export`."
        )
    return "\n".join(lines) + "\n"


def export_rows(storage: dict[str, Any]) -> list[str]:
    """GET /export per mode and format: tokens per second of wall time (best run) and per second of
    the proxy's own CPU time, and its peak resident memory during the export."""
    lines = []
    for mode, label in (("merged", "merged"), ("stepwise", "step-wise")):
        for suffix, fmt in (("", "JSON lines"), ("_parquet", "Parquet")):
            key = f"export_{mode}{suffix}"
            wall = storage.get(f"{key}_tokens_per_s", 0)
            cpu = storage.get(f"{key}_tokens_per_cpu_s", 0)
            peak = storage.get(f"{key}_peak_rss_mib")
            lines.append(
                f"| Export, {label}, {fmt}: tokens per second (per CPU second of the proxy; peak RSS) | "
                f"{wall:,} ({cpu:,}; {peak} MiB) | ≥ 20 M |"
            )
    return lines


def floor_table(side: dict[str, Any]) -> list[str]:
    """tito-proxy next to the pass-through floor and the engine alone, measured in one run."""
    ratios = side["ratios"]
    lines = [
        f"| Side by side, one run ({side['sessions']} sessions x {side['turns_per_session']} turns; "
        f"a {side['long_turns']}-turn tool conversation) | Engine alone | Pass-through floor | tito-proxy |"
        " tito / floor |",
        "|---|---|---|---|---|",
    ]
    systems = (side["engine_alone"], side["floor"], side["tito"])

    def row(label: str, key: str, ratio: str | None, unit: str = "") -> str:
        cells = " | ".join("" if s[key] is None else f"{s[key]:,}{unit}" for s in systems)
        return f"| {label} | {cells} | {ratios[ratio] if ratio else ''} |"

    lines += [
        row("Turns per second", "turns_per_s", "turns_per_s_tito_over_floor"),
        row(
            "Proxy CPU per turn (process CPU time)", "cpu_ms_per_turn", "cpu_per_turn_tito_over_floor", " ms"
        ),
        row("Turn latency p50", "p50_ms", "p50_tito_over_floor", " ms"),
        row("Turn latency p99", "p99_ms", None, " ms"),
        row("p99 / p50", "p99_over_p50", None),
        row("First turn of the long conversation", "turn_1_ms", None, " ms"),
        row("Last turn of the long conversation", "turn_last_ms", "last_turn_over_first_tito", " ms"),
        "| Outlier turns (> 10x p50: turn, ms) | "
        + " | ".join(str(s["outliers"] or "none") for s in systems)
        + " | |",
    ]
    return lines


def scale_out_table(scale_out: dict[str, Any]) -> list[str]:
    """Workers on SQLite and PostgreSQL, two replicas on one PostgreSQL, and what 8 cores would do."""
    runs = [*scale_out["workers"], scale_out["replicas"]]
    first = runs[0]
    lines = [
        f"| Scale-out ({first['sessions']} sessions x {first['turns_per_session']} turns) |"
        " Turns per second | Proxy CPU per turn | Database server CPU per turn |"
        " Turns/s on 8 cores, from CPU per turn"
        " (proxy only; with the database server on the same host) | Target |",
        "|---|---|---|---|---|---|",
    ]
    for run in runs:
        database = "SQLite" if run["database"] == "sqlite" else "PostgreSQL"
        label = (
            f"{database}, 2 replicas, turns alternating"
            if "replicas" in run
            else f"{database}, {run['workers']} worker{'s' if run['workers'] > 1 else ''}"
        )
        db_cpu = (
            "in the proxy"
            if run["db_server_cpu_ms_per_turn"] is None
            else (f"{run['db_server_cpu_ms_per_turn']} ms")
        )
        lines.append(
            f"| {label} | {run['turns_per_s']:,.0f} | {run['cpu_ms_per_turn']} ms | {db_cpu} | "
            f"{run['turns_per_s_on_8_cores_from_cpu']:,}; {run['turns_per_s_on_8_cores_with_db_server']:,} "
            "| ≥ 2,000 |"
        )
    long = scale_out["replicas"].get("long_conversation")
    if long:
        one, alternating = long["one_replica"], long["alternating"]
        lines.append(
            f"| {long['turns']}-turn tool conversation through 2 replicas: turn 1, turn {long['turns']} "
            f"(p50 of 3) | alternating {alternating['turn_1_ms']} ms, {alternating['turn_last_ms']} ms; "
            f"one replica {one['turn_1_ms']} ms, {one['turn_last_ms']} ms | | | | |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sessions: a smoke run, not the figures")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md as it is")
    args = parser.parse_args()
    results = run(args.quick)
    (ROOT / "bench" / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    rendered = table(results)
    print(rendered)
    if not args.no_readme and not args.quick:
        readme = ROOT / "README.md"
        text = readme.read_text()
        if not TABLE.search(text):
            raise SystemExit("README.md has no <!-- bench:start --> ... <!-- bench:end --> block")
        readme.write_text(TABLE.sub(lambda m: m.group(1) + rendered + m.group(2), text))


if __name__ == "__main__":
    main()
