"""Per-second rates of monotonic byte counters, keyed by what they count.

Every counter source (block devices, NFS mounts, Lustre and CephFS clients, ZFS pools) reports
its total and the rate over the last sample interval in the same way: no rate on the first sample
of a key, none after the counter went back (a device re-attached, a mount remounted), never a
negative one.
"""

from __future__ import annotations

from collections.abc import Hashable


class CounterRates:
    """The previous (time, total) of each key; `rate` replaces it. One sampling thread only."""

    def __init__(self) -> None:
        self._previous: dict[Hashable, tuple[float, int]] = {}

    def rate(self, key: Hashable, total: int, now: float) -> float | None:
        previous = self._previous.get(key)
        self._previous[key] = (now, total)
        if previous is None:
            return None
        then, before = previous
        if now <= then or total < before:
            return None
        return (total - before) / (now - then)
