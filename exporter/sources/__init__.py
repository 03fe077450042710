"""The data sources, each named once with the type its `sample()` returns, and the registry that
starts the host-wide ones without a line in the runtime.

A `SourceKey[T]` is how the runtime registers a source, how the sampler files its readings, and
how the collector and the web side ask for them: `snapshot.host(DISK)` is a `DiskSample | None`,
with no string keys to misspell and no `isinstance` to recover the type.

A host-wide source sampled at the host pace (exporter/runtime/pacing.py) declares itself in its own
module: its key, and `HOST_SOURCE = HostSource(KEY, start)`, where `start` builds the source over
the `Host` (its /proc and /sys; `watching_weights` if it measures only what is under the targets'
weights, as the disk, netfs and zfs sources do) and returns what its loop calls. The runtime starts
every `HOST_SOURCE` that `host_sources()` finds in this package's modules, so such a source is its
module, its families in exporter/exposition/collector.py and its row in docs/metrics.md, with its
tests (docs/development.md, "Adding a source": 7 files, 14 before). Its key lives in its module
because the keys here name their sample types: a module declaring itself with a key from here would
import this module that imports it (scripts/module_graph.py counts type-only imports too). The
sources that need more of the runtime (memory's eviction hook, NVML's library, every per-target
source) keep their keys here and are started by exporter/runtime/wiring.py.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:
    from exporter.sources.endpoint import ProbeSample
    from exporter.sources.environment import EnvironmentSample
    from exporter.sources.gpu import GpuSample
    from exporter.sources.logs import LogSample
    from exporter.sources.memory import MemorySample
    from exporter.sources.process import ProcessSample
    from exporter.sources.residency import ResidencySample
    from exporter.sources.storage import StorageDescription
    from exporter.sources.weightfiles import WeightFilesSample
    from exporter.trust.asprocess import OnBehalf

T = TypeVar("T")


@dataclass(frozen=True)
class SourceKey(Generic[T]):
    """A source's name (the `source` label) and whether it samples per target or per host."""

    name: str
    per_target: bool


MEMORY: SourceKey[MemorySample] = SourceKey("memory", per_target=False)
NVML: SourceKey[GpuSample] = SourceKey("nvml", per_target=False)
ENDPOINT: SourceKey[ProbeSample] = SourceKey("endpoint", per_target=True)
PROCESS: SourceKey[ProcessSample] = SourceKey("process", per_target=True)
PAGECACHE: SourceKey[ResidencySample] = SourceKey("pagecache", per_target=True)
LOGS: SourceKey[LogSample] = SourceKey("logs", per_target=True)
WEIGHT_FILES: SourceKey[WeightFilesSample] = SourceKey("weight_files", per_target=True)
STORAGE: SourceKey[StorageDescription] = SourceKey("storage", per_target=True)
ENVIRONMENT: SourceKey[EnvironmentSample] = SourceKey("environment", per_target=True)


class WeightWatcher(Protocol):
    """A host source that measures only what is under the targets' weights."""

    def watch(
        self, target: str, paths: Sequence[str] | None, on_behalf: OnBehalf | None = None
    ) -> None: ...


W = TypeVar("W", bound=WeightWatcher)


@dataclass
class Host:
    """What host sources start over: the host's /proc and /sys (a fixture tree in tests), and
    the sources to tell of the targets' weight paths as targets come, change and go."""

    proc_root: str
    sys_root: str
    weight_watchers: list[WeightWatcher] = field(default_factory=list)

    def watching_weights(self, watcher: W) -> W:
        """`watcher`, told of every target's weight paths from now on."""
        self.weight_watchers.append(watcher)
        return watcher

    def watch(
        self, target: str, paths: Sequence[str] | None, on_behalf: OnBehalf | None = None
    ) -> None:
        """A target's weight paths (None: it has none, or went), to every watcher."""
        for watcher in self.weight_watchers:
            watcher.watch(target, paths, on_behalf)


@dataclass(frozen=True)
class HostSource(Generic[T]):
    """A host-wide source the runtime starts by itself: `start` builds it over the host and
    returns what its loop calls, once per runtime."""

    key: SourceKey[T]
    start: Callable[[Host], Callable[[], T]]


def host_sources() -> list[HostSource[Any]]:
    """The `HOST_SOURCE` of every module of this package that declares one, by module name."""
    found = []
    for module in pkgutil.iter_modules(__path__):
        declared = getattr(
            importlib.import_module(f"{__name__}.{module.name}"), "HOST_SOURCE", None
        )
        if declared is not None:
            found.append(declared)
    return found
