"""ZFS under the weights: bytes its pools read from their disks, and how often the ARC served.

ZFS caches file data in its ARC, not in the page cache, so page-cache residency says nothing of
a warm ZFS restart (exporter/sources/storage.py drops it) and /proc/diskstats counts the vdevs'
reads without saying which pool asked. The SPL kstats do:

* `/proc/spl/kstat/zfs/<pool>/io` (KSTAT_TYPE_IO): `nread`, bytes the pool read from its vdevs,
  what a cold load waits for;
* `/proc/spl/kstat/zfs/arcstats`: `demand_data_hits` and `demand_data_misses`, the file-data
  reads the ARC served or not (prefetch and metadata are ZFS's own). The ARC is one per host, so
  its share is the host's while the load runs, not the load's alone.

Files are read only while some target's weights are on ZFS.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from exporter.sources import HostSource, SourceKey
from exporter.sources.counters import CounterSource
from exporter.sources.sample import Health, Sample
from exporter.vocabulary import StorageKind

KSTAT_DIR = "spl/kstat/zfs"  # under /proc
T = TypeVar("T")


@dataclass(frozen=True)
class PoolReads:
    pool: str
    read_bytes_total: int
    read_bytes_per_second: float | None


@dataclass(frozen=True)
class ArcReads:
    """The ARC's demand data reads, and the share of them it served over the last interval."""

    hits_total: int
    misses_total: int
    hit_ratio: float | None  # None before a second sample, or when nothing was read between


@dataclass(frozen=True)
class ZfsSample(Sample):
    pools: tuple[PoolReads, ...]
    arc: ArcReads | None
    pools_by_target: Mapping[str, tuple[str, ...]]
    unmeasured: tuple[str, ...]  # "what: why", for status

    def health(self) -> Health:
        return Health(note="; ".join(self.unmeasured) or None)

    def read_bytes_of(self, target: str) -> int | None:
        """Bytes the pools under one target's weights read; None without any, or while one of
        them is not counted."""
        names = set(self.pools_by_target.get(target, ()))
        counted = self.counters_of(target)
        return sum(counted.values()) if names and len(counted) == len(names) else None

    def counters_of(self, target: str) -> dict[tuple[str, str], int]:
        """Each pool under one target's weights, as ("zfs", pool), and its bytes read."""
        names = set(self.pools_by_target.get(target, ()))
        return {("zfs", p.pool): p.read_bytes_total for p in self.pools if p.pool in names}


def parse_kstat_named(text: str) -> dict[str, int]:
    """A KSTAT_TYPE_NAMED file (`name type data` rows after two header lines), numbers only."""
    values: dict[str, int] = {}
    for line in text.splitlines()[2:]:
        fields = line.split()
        if len(fields) == 3 and fields[1] in ("3", "4") and fields[2].lstrip("-").isdigit():
            values[fields[0]] = int(fields[2])
    return values


def parse_kstat_io(text: str) -> int | None:
    """`nread` of a KSTAT_TYPE_IO file: a header line, a line of names, a line of values."""
    lines = text.splitlines()
    if len(lines) < 3:
        return None
    names, values = lines[1].split(), lines[2].split()
    if "nread" not in names or len(values) != len(names):
        return None
    value = values[names.index("nread")]
    return int(value) if value.isdigit() else None


def pool_of(source: str) -> str:
    """`tank/models/llama` -> `tank`: a dataset's pool is its first component."""
    return source.split("/", 1)[0]


class ZfsSource(CounterSource):
    """Pool reads and ARC hit share while some target's weights are on ZFS."""

    _arc_before: tuple[int, int] | None = None  # the ARC's counters at the last sample

    def sample(self) -> ZfsSample:
        by_target: dict[str, tuple[str, ...]] = {}
        for target, placed in self._watched.placed().items():
            names = [
                pool_of(p.layer.mount.source) for p in placed if p.layer.kind is StorageKind.ZFS
            ]
            by_target[target] = tuple(dict.fromkeys(names))
        wanted = sorted({pool for names in by_target.values() for pool in names})
        if not wanted:
            return ZfsSample((), None, by_target, ())
        now = self._clock()
        unmeasured: list[str] = []
        pools: list[PoolReads] = []
        for pool in wanted:
            path = os.path.join(self._proc_root, KSTAT_DIR, pool, "io")
            total = _read(path, parse_kstat_io, unmeasured)
            if total is not None:
                pools.append(PoolReads(pool, total, self._rates.rate(pool, total, now)))
        arcstats = os.path.join(self._proc_root, KSTAT_DIR, "arcstats")
        stats = _read(arcstats, parse_kstat_named, unmeasured)
        return ZfsSample(tuple(pools), self._arc(stats, unmeasured), by_target, tuple(unmeasured))

    def _arc(self, stats: Mapping[str, int] | None, unmeasured: list[str]) -> ArcReads | None:
        if stats is None:
            return None
        hits, misses = stats.get("demand_data_hits"), stats.get("demand_data_misses")
        if hits is None or misses is None:
            unmeasured.append("arcstats: no demand_data_hits / demand_data_misses")
            return None
        ratio = None
        before, self._arc_before = self._arc_before, (hits, misses)
        if before is not None and hits >= before[0] and misses >= before[1]:
            reads = (hits - before[0]) + (misses - before[1])
            ratio = (hits - before[0]) / reads if reads else None
        return ArcReads(hits, misses, ratio)


def _read(path: str, parse: Callable[[str], T | None], unmeasured: list[str]) -> T | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            value = parse(f.read())
    except OSError as exc:
        unmeasured.append(f"{path}: {exc.strerror}")
        return None
    if value is None:
        unmeasured.append(f"{path}: not a kstat this exporter can read")
    return value


ZFS: SourceKey[ZfsSample] = SourceKey("zfs", per_target=False)
HOST_SOURCE = HostSource(ZFS, lambda host: ZfsSource.started(host).sample)
