"""A Prometheus histogram kept by hand, for the custom collectors that export at scrape time.

Imports no gRPC: the engine observes its latencies with it, and the engine imports no transport.
"""
from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable

from prometheus_client.core import HistogramMetricFamily


class Histogram:
    """Bucket counts, sum and count of observations, by label values (no locking: one event loop)."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self._series: dict[tuple[str, ...], tuple[list[int], list[float]]] = {}

    def observe(self, seconds: float, labels: tuple[str, ...] = ()) -> None:
        counts, total = self._series.setdefault(labels, ([0] * (len(self.bounds) + 1), [0.0]))
        counts[bisect_left(self.bounds, seconds)] += 1
        total[0] += seconds

    def family(self, name: str, documentation: str, label_names: list[str],
               label_values: Callable[[tuple[str, ...]], list[str]]) -> HistogramMetricFamily:
        """The histogram as Prometheus reads it; `label_values` turns a series' labels into the
        values of `label_names` (adding constant labels)."""
        family = HistogramMetricFamily(name, documentation, labels=label_names)
        for labels, (counts, total) in sorted(self._series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*map(str, self.bounds), "+Inf"), counts):
                cumulative += count
                buckets.append((bound, cumulative))
            family.add_metric(label_values(labels), buckets, total[0])
        return family
