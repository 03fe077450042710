"""A finished load's report as values: what exporter/history/explain.py finds, what history keeps
with the load, and what api_build.py shows as /api/v1's `report` (the only module meeting both)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseTime:
    """A phase or fine step of a finished load against its median over the loads before it."""

    phase: str  # starting, loading_weights, initializing, or a fine step (compile, ...)
    seconds: float
    median_seconds: float | None  # None: no earlier load to compare with


@dataclass(frozen=True)
class StorageRead:
    """What one device, network mount or ZFS pool under the weights read while a load ran."""

    kind: str  # disk, nfs, lustre, cephfs, zfs
    name: str  # the block device, the mount point, the pool
    read_bytes: int  # its counter at the load's end less at its start (host-wide)


@dataclass(frozen=True)
class ReadRate:
    """The rate a load's weights came at, against the best the loads before it saw there."""

    source: str  # storage (a cold load) or page_cache (a warm one)
    bytes_per_second: float
    best_before_bytes_per_second: float | None  # None: no earlier load read from there


@dataclass(frozen=True)
class LoadReport:
    """Where a finished load's time went and why, against the loads before it; each part None
    where it has no basis."""

    expected_seconds: float | None  # median duration of the earlier loads of its temperature
    phases: tuple[PhaseTime, ...]
    page_cache_bytes: int | None  # of the weights, in the page cache as the load began
    storage_bytes: int | None  # read from storage by the server's process tree
    storage_reads: tuple[StorageRead, ...] | None  # None: the counters at its start are unknown
    read_rate: ReadRate | None
    reason: str | None  # why it was slower than expected; None unless it was
    # Read from storage by the server's tree before its first weight file: its own environment.
    startup_storage_bytes: int | None = None
    # The server's own files (interpreter, packages, libraries) as a run keeps them in the page
    # cache, and the bytes of that cached as it began; or why they are not known.
    environment_bytes: int | None = None
    environment_resident_bytes: int | None = None
    environment_unknown: str | None = None
