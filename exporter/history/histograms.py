"""Cumulative histograms of finished loads, kept as plain counts.

Scrapes build fresh metric families from a copy of these counts, so nothing registered with
prometheus_client is mutated from the tracker thread.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass

LOAD_BUCKETS: tuple[float, ...] = (
    5, 10, 15, 30, 45, 60, 90, 120, 180, 240,
    300, 420, 600, 900, 1200, 1800, 2700, 3600, 5400, 7200,
)  # fmt: skip


# Native histograms (metrics.native_histograms): each power of two split into 2^3 buckets, a
# bound every 9 % (finer than the classic bounds' 33-50 % steps), as client_golang's default
# factor 1.1 picks; durations from seconds to hours fill about 100 of them at most.
NATIVE_SCHEMA = 3
# Observations at or below this count in the zero bucket (client_golang's default); a duration
# is never that small, but the threshold marks the histogram as native even then.
NATIVE_ZERO_THRESHOLD = 2.0**-128
_NATIVE_BOUNDS = [2.0 ** (i / 2**NATIVE_SCHEMA - 1) for i in range(2**NATIVE_SCHEMA)]


def native_index(value: float) -> int:
    """The native bucket of a positive value: bucket i holds (2^((i-1)/8), 2^(i/8)]."""
    fraction, exponent = math.frexp(value)  # value = fraction * 2^exponent, fraction in [0.5, 1)
    return bisect.bisect_left(_NATIVE_BOUNDS, fraction) + (exponent - 1) * 2**NATIVE_SCHEMA


@dataclass(frozen=True)
class HistogramCounts:
    """One label set: cumulative count per bucket bound, then the +Inf count and the sum; and
    the same observations in native buckets (index, count), ascending, for native exposition."""

    cumulative: tuple[int, ...]
    count: int
    sum: float
    native: tuple[tuple[int, int], ...] = ()
    native_zero: int = 0


class Histograms:
    """A family of histograms keyed by label values."""

    def __init__(self, buckets: tuple[float, ...] = LOAD_BUCKETS) -> None:
        self.buckets = buckets
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, ...], list[int]] = {}
        self._sums: dict[tuple[str, ...], float] = {}
        self._native: dict[tuple[str, ...], dict[int | None, int]] = {}  # None: zero bucket

    def observe(self, labels: tuple[str, ...], value: float) -> None:
        with self._lock:
            counts = self._counts.setdefault(labels, [0] * (len(self.buckets) + 1))
            counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sums[labels] = self._sums.get(labels, 0.0) + value
            native = self._native.setdefault(labels, {})
            index = native_index(value) if value > NATIVE_ZERO_THRESHOLD else None
            native[index] = native.get(index, 0) + 1

    def forget(self, target: str) -> None:
        """Drop every label set of one target (the first label): a dropped discovered target's
        series go with it, so a flood of short-lived fake servers cannot grow them."""
        with self._lock:
            for labels in [k for k in self._counts if k[:1] == (target,)]:
                del self._counts[labels], self._sums[labels], self._native[labels]

    def snapshot(self) -> dict[tuple[str, ...], HistogramCounts]:
        with self._lock:
            result = {}
            for labels, counts in self._counts.items():
                cumulative, running = [], 0
                for c in counts:
                    running += c
                    cumulative.append(running)
                native = self._native[labels]
                result[labels] = HistogramCounts(
                    cumulative=tuple(cumulative[:-1]),
                    count=running,
                    sum=self._sums[labels],
                    native=tuple(sorted((i, c) for i, c in native.items() if i is not None)),
                    native_zero=native.get(None, 0),
                )
            return result
