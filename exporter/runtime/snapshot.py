"""The immutable view that one scrape or one status request reads.

Taken at one instant under the runtime's lock and never changed afterwards, so the collector and
the web side need no locks, and a source thread that hangs cannot delay them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from exporter.config.schema import MetricsConfig, TargetConfig
from exporter.discovery.found import DiscoveredServer
from exporter.history.forecast import Forecast
from exporter.history.histograms import HistogramCounts
from exporter.history.pastloads import PastLoads
from exporter.load.records import LoadState
from exporter.logs.find import LogFinding
from exporter.runtime.sampler import Reading
from exporter.sources import ENDPOINT, LOGS, SourceKey
from exporter.sources.gpu import PcieMarks
from exporter.vocabulary import ServerKind

T = TypeVar("T")


def _get(readings: Mapping[str, Reading[Any]], key: SourceKey[T]) -> Reading[T] | None:
    return cast("Reading[T] | None", readings.get(key.name))


@dataclass(frozen=True)
class TargetView:
    """One target as a scrape sees it: config, load state, its sources' latest readings."""

    config: TargetConfig
    state: LoadState | None  # None until the first tracker tick
    readings: Mapping[str, Reading[Any]]  # this target's per-target sources, by source name
    gpu_memory: Mapping[int, int]  # bytes the server's process tree holds, per GPU index
    discovered: DiscoveredServer | None = None  # how discovery found it; None when configured
    # Each GPU's PCIe RX counter when the current (or last) load began.
    pcie_at_start: PcieMarks = field(default_factory=dict)
    log_finding: LogFinding | None = None  # where its unconfigured log was found, or why not
    forecast: Forecast | None = None  # how long a restart begun now would take
    # What its past loads say (medians, the last one, the startupProbe window); what /metrics
    # and /api/v1/status show of history is read from here.
    past: PastLoads = field(default_factory=PastLoads)

    @property
    def name(self) -> str:
        return self.config.name

    def reading(self, key: SourceKey[T]) -> Reading[T] | None:
        return _get(self.readings, key)

    def value(self, key: SourceKey[T]) -> T | None:
        """The latest successful sample of one of this target's sources, or None."""
        reading = self.reading(key)
        return reading.good if reading is not None else None

    @property
    def server(self) -> str:
        """The server kind, from the best evidence: its command line, its log, its answers."""
        if self.discovered is not None:
            return self.discovered.kind
        logs = self.reading(LOGS)
        if logs is not None and logs.value is not None and logs.value.format is not None:
            return logs.value.format
        probe = self.value(ENDPOINT)
        return probe.server if probe is not None else ServerKind.UNKNOWN


@dataclass(frozen=True)
class Snapshot:
    """Everything one scrape or status request shows, taken at one instant."""

    time: float
    build: Mapping[str, str]  # version, python_version
    host: Mapping[str, Reading[Any]]  # host-wide sources, by source name
    targets: tuple[TargetView, ...]
    load_durations: Mapping[tuple[str, ...], HistogramCounts]  # (target, cache, outcome)
    phase_durations: Mapping[tuple[str, ...], HistogramCounts]  # (target, phase)
    history_enabled: bool
    history_problem: str | None
    config_reload_successful: bool
    history_up: bool | None = None  # None: history_path "" (off by choice, not broken)
    discovery_refused: Mapping[str, int] | None = None  # by reason; None: discovery off
    metrics: MetricsConfig = field(default_factory=MetricsConfig)  # beyond the default budget

    def host_reading(self, key: SourceKey[T]) -> Reading[T] | None:
        return _get(self.host, key)

    def host_value(self, key: SourceKey[T]) -> T | None:
        """The latest successful sample of a host-wide source, or None."""
        reading = self.host_reading(key)
        return reading.good if reading is not None else None

    def readings(self) -> Iterator[Reading[Any]]:
        """Every source's latest reading, host-wide first, in a stable order."""
        yield from (self.host[name] for name in sorted(self.host))
        for view in self.targets:
            yield from (view.readings[name] for name in sorted(view.readings))
