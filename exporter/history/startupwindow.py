"""The fixed startupProbe window a kubelet would need for a target, from its own cold loads.

Without the exporter's probe endpoints a kubelet guesses a load's length once, in the manifest
(`periodSeconds` x `failureThreshold`), and kills every load that runs longer: KServe's vLLM
runtime allows ten minutes. The loads that need the longest window are the cold ones (weights
from storage), so the advice is the 99th percentile of this target's finished cold loads with
a margin, rounded up to whole probe periods. No cold load in history: no advice, and why.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.load.records import LoadRecord
from exporter.vocabulary import Cache, Outcome

PERIOD_SECONDS = 10  # the kubelet's default periodSeconds
MARGIN = 1.25  # above the p99: a slower disk day must not be a restart loop
PERCENTILE = 0.99  # the load the window must cover: all but the rarest, MARGIN covers the rest
ADVICE_LOADS = 200  # the most recent loads the advice reads


@dataclass(frozen=True)
class StartupAdvice:
    """A startupProbe window, or None and the reason there is none."""

    period_seconds: int | None
    failure_threshold: int | None
    cold_loads: int  # the finished cold loads it comes from
    cold_p99_seconds: float | None  # nearest rank: the slowest of fewer than 100 loads
    reason: str | None  # why there is no advice

    @property
    def window_seconds(self) -> int | None:
        if self.period_seconds is None or self.failure_threshold is None:
            return None
        return self.period_seconds * self.failure_threshold


def advise(records: Sequence[LoadRecord]) -> StartupAdvice:
    """The advice from a target's recent loads (any order)."""
    cold = sorted(
        r.duration_seconds
        for r in records
        if r.cache == Cache.COLD and r.outcome == Outcome.READY and not r.partial
    )
    if not cold:
        return StartupAdvice(None, None, 0, None, _why_none(records))
    p99 = percentile(cold, PERCENTILE)
    threshold = max(1, math.ceil(p99 * MARGIN / PERIOD_SECONDS))
    return StartupAdvice(PERIOD_SECONDS, threshold, len(cold), round(p99, 3), None)


def percentile(ordered: Sequence[float], share: float) -> float:
    """Nearest-rank percentile of sorted values: a value that happened, never interpolated."""
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def _why_none(records: Sequence[LoadRecord]) -> str:
    if not records:
        return "no finished load in history yet"
    kinds = Counter(
        "partial" if r.partial else f"{r.cache or Cache.UNKNOWN} {r.outcome}" for r in records
    )
    seen = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
    return f"no cold load finished ready in history ({seen})"
