"""The proxy's Prometheus metrics, one registry per app (tests run several apps in one process).

The turn path's counters and histograms are plain numbers (plain_metrics.py): a recorded turn
costs a few additions and never creates a label set (labels come from small fixed sets only).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from proxy.observe import context
from proxy.observe.plain_metrics import PlainCounter, PlainHistogram

CONTENT_TYPE = CONTENT_TYPE_LATEST
PHASES = ("render", "engine", "record", "total")
DIALECTS = ("chat", "completions", "responses", "anthropic")
# Seconds: from sub-millisecond renders to ten-minute engine calls.
_LATENCY = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)
_GROUPS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Metrics:
    """The metrics of one proxy app and the few calls that update them."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        turn_children = [(dialect, status) for dialect in DIALECTS for status in ("ok", "aborted", "error")]
        self.turns = PlainCounter(
            "tito_turns",
            "Engine calls recorded (status ok/aborted) or turns refused (error)",
            r,
            labelnames=["dialect", "status"],
            children=turn_children,
        )
        self.phase = PlainHistogram(
            "tito_turn_phase_seconds",
            "Time spent in each phase of a turn",
            r,
            _LATENCY,
            labelnames=["phase"],
            children=[(phase,) for phase in PHASES],
        )
        self.ttft = Histogram(
            "tito_time_to_first_token_seconds",
            "From request to the first sampled token of a stream",
            buckets=_LATENCY,
            registry=r,
        )
        self.tokens_in = PlainCounter("tito_prompt_tokens", "Prompt tokens sent to the engine", r)
        self.tokens_out = PlainCounter("tito_completion_tokens", "Tokens the engine sampled", r)
        self.active_sessions = Gauge("tito_active_sessions", "Sessions not finished", registry=r)
        self.segments = Counter(
            "tito_segments_opened",
            "New segments (fresh renders), by the reason each opened",
            ["reason"],
            registry=r,
        )
        self.drift = Counter("tito_drift_entries", "Drift entries exported, by kind", ["kind"], registry=r)
        self.engine_errors = Counter("tito_engine_errors", "Engine failures, by kind", ["kind"], registry=r)
        self.errors = Counter(
            "tito_errors", "Error answers, by HTTP status and code", ["status", "code"], registry=r
        )
        self.commit_group = PlainHistogram(
            "tito_commit_group_size", "Turns committed in one transaction", r, _GROUPS
        )
        self.commit_seconds = PlainHistogram(
            "tito_commit_seconds", "Time to commit one group of turns", r, _LATENCY
        )
        self.export_rows = Counter("tito_export_rows", "Rows exported", ["mode"], registry=r)
        self.export_bytes = Counter("tito_export_bytes", "Bytes exported", ["format"], registry=r)

    def turn_recorded(
        self, dialect: str, statuses: Iterable[str], timings: Mapping[str, float], tokens: tuple[int, int]
    ) -> None:
        """One request's calls committed: `timings` in seconds per phase, `tokens` (in, out)."""
        context.calls_recorded.set(True)
        turns = self.turns.values
        for status in statuses:
            turns[dialect, status] += 1
        for phase, seconds in timings.items():
            self.phase.observe(seconds, (phase,))
        self.tokens_in.values[()] += tokens[0]
        self.tokens_out.values[()] += tokens[1]

    def refused(self, path: str, status: int, code: str | None, *, engine: bool = False) -> None:
        """A request answered with an error envelope: counted by status and code and, on a turn route,
        as a refused turn, unless its calls were recorded (they count as ok/aborted turns, once)."""
        self.failed(status, code, engine)
        dialect = _dialect(path)
        if dialect is not None and not context.calls_recorded.get():
            self.turns.values[dialect, "error"] += 1

    def failed(self, status: int, code: str | None, engine: bool) -> None:
        """An error answer (envelope or stream error event); engine failures by kind too."""
        self.errors.labels(str(status), code or "none").inc()
        if engine:
            self.engine_errors.labels(code or "bad_gateway").inc()

    def committed(self, group_size: int, seconds: float) -> None:
        """Called by the turn store after each commit, one at a time: on SQLite from its writer thread or,
        for a turn committed alone, the event loop, both under the store's write lock."""
        self.commit_group.observe(group_size)
        self.commit_seconds.observe(seconds)

    def exported_drift(self, rows: Iterable[Mapping[str, Any]]) -> None:
        for row in rows:
            drift = row.get("drift")
            for kind, count in (drift or {}).get("counts", {}).items():
                self.drift.labels(kind).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _dialect(path: str) -> str | None:
    if path.endswith("/chat/completions"):
        return "chat"
    if path.endswith("/completions"):
        return "completions"
    if path.endswith("/responses"):
        return "responses"
    if path.endswith("/messages"):
        return "anthropic"
    return None
