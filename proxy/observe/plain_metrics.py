"""Counters and histograms of the turn path kept as plain numbers, exposed like prometheus_client's.

A prometheus_client update takes a lock per value it touches: the seven of a recorded turn cost
~20 µs, a commit's two ~7 µs. These are plain additions, read only when /metrics is scraped. Each
metric is updated by one thread at a time (the event loop for turns; for commits, whoever holds the
SQLite turn store's write lock, or the loop on PostgreSQL), so no update is lost; a scrape may see
a turn half counted, as it may with prometheus_client's per-value locks.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable, Sequence

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

Labels = tuple[str, ...]


class PlainCounter:
    """A counter per label set, every label set made up front (as prometheus_client's children)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        *,
        labelnames: Sequence[str] = (),
        children: Iterable[Labels] = ((),),
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.values: dict[Labels, float] = dict.fromkeys(children, 0.0)
        self.created = time.time()
        registry.register(self)

    def collect(self) -> list[Metric]:
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, value in list(self.values.items()):
            family.add_metric(labels, value, created=self.created)
        return [family]


class PlainHistogram:
    """A histogram per label set: a count per bucket (`le` bounds, +Inf added) and a sum."""

    def __init__(
        self,
        name: str,
        documentation: str,
        registry: CollectorRegistry,
        buckets: Sequence[float],
        *,
        labelnames: Sequence[str] = (),
        children: Iterable[Labels] = ((),),
    ) -> None:
        self.name, self.documentation, self.labelnames = name, documentation, list(labelnames)
        self.bounds = [*buckets, float("inf")]
        self.les = [floatToGoString(bound) for bound in self.bounds]  # type: ignore[no-untyped-call]
        self.counts: dict[Labels, list[int]] = {labels: [0] * len(self.bounds) for labels in children}
        self.sums: dict[Labels, float] = dict.fromkeys(self.counts, 0.0)
        self.created = time.time()
        registry.register(self)

    def observe(self, value: float, labels: Labels = ()) -> None:
        # The first bucket whose bound is at least the value: le means "less than or equal".
        self.counts[labels][bisect_left(self.bounds, value)] += 1
        self.sums[labels] += value

    def collect(self) -> list[Metric]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self.labelnames)
        for labels, counts in list(self.counts.items()):
            cumulative, buckets = 0, []
            for le, count in zip(self.les, list(counts), strict=True):
                cumulative += count
                buckets.append((le, float(cumulative)))
            family.add_metric(labels, buckets, self.sums[labels])
            named = dict(zip(self.labelnames, labels, strict=True))
            family.samples.append(Sample(self.name + "_created", named, self.created, None))
        return [family]
