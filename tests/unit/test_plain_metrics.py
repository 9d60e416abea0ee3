"""The turn path's plain counters and histograms expose what prometheus_client's would."""

from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.observe.plain_metrics import PlainCounter, PlainHistogram

BUCKETS = (0.001, 0.01, 0.5, 2.0)
# Bounds themselves (le: less than or equal), between them, past the last, zero.
VALUES = (0.0, 0.001, 0.0010001, 0.01, 0.3, 2.0, 2.5, 700.0)


def _text(registry: CollectorRegistry) -> str:
    return re.sub(r"(_created(\{[^}]*\})?) \S+", r"\1 T", generate_latest(registry).decode())


def test_plain_metrics_read_as_prometheus_clients() -> None:
    reference, plain = CollectorRegistry(), CollectorRegistry()
    calls = Counter("t_calls", "Calls", ["kind"], registry=reference)
    tokens = Counter("t_tokens", "Tokens", registry=reference)
    phase = Histogram("t_phase_seconds", "Phase", ["phase"], buckets=BUCKETS, registry=reference)
    size = Histogram("t_size", "Size", buckets=BUCKETS, registry=reference)
    children = [calls.labels(kind) for kind in ("a", "b")], [phase.labels(p) for p in ("x", "y")]
    plain_calls = PlainCounter("t_calls", "Calls", plain, labelnames=["kind"], children=[("a",), ("b",)])
    plain_tokens = PlainCounter("t_tokens", "Tokens", plain)
    plain_phase = PlainHistogram(
        "t_phase_seconds", "Phase", plain, BUCKETS, labelnames=["phase"], children=[("x",), ("y",)]
    )
    plain_size = PlainHistogram("t_size", "Size", plain, BUCKETS)
    for n, value in enumerate(VALUES):
        children[0][n % 2].inc()
        plain_calls.values[("a", "b")[n % 2],] += 1
        tokens.inc(n)
        plain_tokens.values[()] += n
        phase.labels("x").observe(value)
        plain_phase.observe(value, ("x",))
        size.observe(value * 3)
        plain_size.observe(value * 3)
    assert _text(plain) == _text(reference)
