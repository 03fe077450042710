"""What the host-wide counter sources (block devices, NFS mounts, Lustre and CephFS clients,
ZFS pools) share: the targets' weight paths placed on their layers, and per-second rates of
monotonic byte counters, keyed by what they count.

Every counter source reports its total and the rate over the last sample interval in the same
way: no rate on the first sample of a key, none after the counter went back (a device
re-attached, a mount remounted), never a negative one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Self

from exporter.sources import Host
from exporter.storage.watched import WatchedPaths
from exporter.trust.asprocess import OnBehalf


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


class CounterSource:
    """What the disk, network-filesystem and ZFS sources share: the targets' weight paths
    placed on their layers, a clock, and the rates of the counters they read. Each logs to its
    own module's logger."""

    def __init__(
        self,
        paths_by_target: Mapping[str, Sequence[str]],
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        logger = logging.getLogger(type(self).__module__)
        self._watched = WatchedPaths(paths_by_target, proc_root, sys_root, logger)
        self._proc_root = proc_root
        self._sys_root = sys_root
        self._clock = clock
        self._rates = CounterRates()

    @classmethod
    def started(cls, host: Host) -> Self:
        """One over `host`, watching no target's weights until the runtime wires them (its
        module's `HOST_SOURCE`)."""
        return host.watching_weights(cls({}, host.proc_root, host.sys_root))

    def watch(
        self, target: str, paths: Sequence[str] | None, on_behalf: OnBehalf | None = None
    ) -> None:
        """Watch another target's weight paths, or none; a discovered target's are looked at
        `on_behalf` of its process, with its rights (thread-safe)."""
        self._watched.watch(target, paths, on_behalf)
