"""Host memory from /proc/meminfo: how much room the page cache has to keep weights warm, and how
much has left it, which tells the residency sources when a serving model's weights may have gone.

The kernel counts pages leaving the page cache only in part: reclaim (`pgsteal_file` in
/proc/vmstat, also when it replaces pages while Cached stays level), but not `drop_caches`, an
fadvise eviction or a truncation; and Cached's fall alone hides an eviction behind whatever came
in meanwhile (on a busy host, hundreds of MB in seconds). What comes in is counted: pages read
from block devices (`pgpgin`) and pages written (`nr_dirtied`). So between two samples at least
what came in less Cached's growth left, and at least what reclaim took: the larger of the two.
Pages arriving uncounted (NFS or FUSE reads, tmpfs writes) can still hide an eviction of their
size; the serving refresh (exporter/sources/residency.py) catches that one later.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from exporter.sources.sample import Sample
from exporter.storage.pagecache import PAGE_SIZE

_FIELDS = {
    "MemTotal": "total_bytes",
    "MemAvailable": "available_bytes",
    "Cached": "page_cache_bytes",
}
_FLOWS = ("pgpgin", "nr_dirtied", "pgsteal_file")  # KiB, pages, pages (pgsteal_file: >= 5.8)


@dataclass(frozen=True)
class MemorySample(Sample):
    total_bytes: int
    available_bytes: int
    page_cache_bytes: int
    # Bytes that left the page cache since the source's first sample (MemorySource counts them
    # across samples; one read of meminfo knows of none).
    page_cache_departed_bytes: int = 0


@dataclass(frozen=True)
class CacheFlows:
    """Bytes since boot, from /proc/vmstat; None where this kernel does not count one."""

    came_in: int | None  # read from block devices, plus written (pgpgin + nr_dirtied)
    reclaimed: int | None  # file pages reclaimed (pgsteal_file)


def read_meminfo(proc_root: str = "/proc") -> MemorySample:
    """Read MemTotal, MemAvailable and Cached in bytes.

    Raises OSError when the file cannot be read and ValueError when a needed line is missing or
    malformed, so the sampler can report the source as down instead of exporting zeros.
    """
    path = os.path.join(proc_root, "meminfo")
    with open(path, encoding="ascii") as f:
        text = f.read()
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key not in _FIELDS:
            continue
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            raise ValueError(f"{path}: malformed line {line.strip()!r}")
        values[_FIELDS[key]] = int(parts[0]) * 1024
    missing = [key for key, name in _FIELDS.items() if name not in values]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return MemorySample(**values)


def read_cache_flows(proc_root: str = "/proc") -> CacheFlows:
    """What came into the page cache and what reclaim took from it; unknown parts None (a
    trigger for residency passes, so without /proc/vmstat Cached's fall alone counts)."""
    try:
        with open(os.path.join(proc_root, "vmstat"), encoding="ascii") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError):
        return CacheFlows(None, None)
    kib_in, dirtied, reclaimed = (_vmstat(text, name) for name in _FLOWS)
    came_in = None if kib_in is None or dirtied is None else kib_in * 1024 + dirtied * PAGE_SIZE
    return CacheFlows(came_in, None if reclaimed is None else reclaimed * PAGE_SIZE)


def _vmstat(text: str, name: str) -> int | None:
    """One counter of /proc/vmstat's text (found, not parsed whole: it has 180 lines)."""
    at = text.find(f"\n{name} ")
    value = text[at + len(name) + 2 :].partition("\n")[0] if at >= 0 else ""
    return int(value) if value.isdigit() else None


class MemorySource:
    """/proc/meminfo sampled like every other source, under an injectable proc root, with the
    bytes that left the page cache counted from one sample to the next (one sampling thread)."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._last: tuple[int, CacheFlows] | None = None  # Cached and the flows then
        self._departed = 0

    def sample(self) -> MemorySample:
        memory = read_meminfo(self._proc_root)
        flows = read_cache_flows(self._proc_root)
        if self._last is not None:
            cached, before = self._last
            self._departed += max(
                0,
                cached - memory.page_cache_bytes + _rise(before.came_in, flows.came_in),
                _rise(before.reclaimed, flows.reclaimed),
            )
        self._last = (memory.page_cache_bytes, flows)
        return MemorySample(
            memory.total_bytes,
            memory.available_bytes,
            memory.page_cache_bytes,
            page_cache_departed_bytes=self._departed,
        )


def _rise(before: int | None, now: int | None) -> int:
    return 0 if before is None or now is None else now - before
