"""The data sources, each named once with the type its `sample()` returns.

A `SourceKey[T]` is how the runtime registers a source, how the sampler files its readings, and
how the collector and the web side ask for them: `snapshot.host(DISK)` is a `DiskSample | None`,
with no string keys to misspell and no `isinstance` to recover the type. Adding a source is a
module with a `sample()`, one key here, and one line in the runtime that registers it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from exporter.sources.disk import DiskSample
    from exporter.sources.endpoint import ProbeSample
    from exporter.sources.environment import EnvironmentSample
    from exporter.sources.gpu import GpuSample
    from exporter.sources.logs import LogSample
    from exporter.sources.memory import MemorySample
    from exporter.sources.netfs import NetFsSample
    from exporter.sources.process import ProcessSample
    from exporter.sources.residency import ResidencySample
    from exporter.sources.weightfiles import WeightFilesSample
    from exporter.sources.zfs import ZfsSample
    from exporter.storage.description import StorageDescription

T = TypeVar("T")


@dataclass(frozen=True)
class SourceKey(Generic[T]):
    """A source's name (the `source` label) and whether it samples per target or per host."""

    name: str
    per_target: bool


DISK: SourceKey[DiskSample] = SourceKey("disk", per_target=False)
MEMORY: SourceKey[MemorySample] = SourceKey("memory", per_target=False)
NVML: SourceKey[GpuSample] = SourceKey("nvml", per_target=False)
NETFS: SourceKey[NetFsSample] = SourceKey("netfs", per_target=False)
ZFS: SourceKey[ZfsSample] = SourceKey("zfs", per_target=False)
ENDPOINT: SourceKey[ProbeSample] = SourceKey("endpoint", per_target=True)
PROCESS: SourceKey[ProcessSample] = SourceKey("process", per_target=True)
PAGECACHE: SourceKey[ResidencySample] = SourceKey("pagecache", per_target=True)
LOGS: SourceKey[LogSample] = SourceKey("logs", per_target=True)
WEIGHT_FILES: SourceKey[WeightFilesSample] = SourceKey("weight_files", per_target=True)
STORAGE: SourceKey[StorageDescription] = SourceKey("storage", per_target=True)
ENVIRONMENT: SourceKey[EnvironmentSample] = SourceKey("environment", per_target=True)
