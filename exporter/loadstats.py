"""Cumulative histograms of finished loads, kept as plain counts.

Scrapes build fresh metric families from a copy of these counts, so nothing registered with
prometheus_client is mutated from the tracker thread.
"""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass

LOAD_BUCKETS: tuple[float, ...] = (
    5, 10, 15, 30, 45, 60, 90, 120, 180, 240,
    300, 420, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200,
)  # fmt: skip


@dataclass(frozen=True)
class HistogramCounts:
    """One label set: cumulative count per bucket bound, then the +Inf count and the sum."""

    cumulative: tuple[int, ...]
    count: int
    sum: float


class Histograms:
    """A family of histograms keyed by label values."""

    def __init__(self, buckets: tuple[float, ...] = LOAD_BUCKETS) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            counts = self._counts.setdefault(labels, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[labels] = self._sums.get(labels, 0.0) + value

    def forget(self, target: str) -> None:
        """Drop every label set of one target (the first label): a dropped discovered target's
        series go with it, so a flood of short-lived fake servers cannot grow them."""
        with self._lock:
            for labels in [k for k in self._counts if k[:1] == (target,)]:
                del self._counts[labels], self._sums[labels]

    def snapshot(self) -> dict[tuple[str, ...], HistogramCounts]:
        with self._lock:
            result = {}
            for labels, counts in self._counts.items():
                cumulative, running = [], 0
                for c in counts:
                    running += c
                    cumulative.append(running)
                result[labels] = HistogramCounts(
                    cumulative=tuple(cumulative[:-1]), count=running, sum=self._sums[labels]
                )
            return result
