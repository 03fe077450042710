"""Wire config, sources, sampler, trackers and history into one running exporter.

The sampler threads write readings; one tracker tick per interval turns the latest readings of each
target into an `Observation`, feeds the tracker and files finished loads. `snapshot()` hands
the HTTP side an immutable view, so a scrape never waits on a source.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import TypeVar

from exporter import __version__
from exporter.config import Config, TargetConfig
from exporter.history import HistoryStore
from exporter.loadstats import HistogramCounts, Histograms
from exporter.sampler import Reading, Sampler
from exporter.sources.disk import DiskSample, DiskSource
from exporter.sources.endpoint import EndpointProber, ProbeSample
from exporter.sources.gpu import GpuSample, NvmlSource, process_gpu_memory
from exporter.sources.memory import read_meminfo
from exporter.sources.pagecache import ResidencySample, ResidencySource
from exporter.sources.process import ProcessFinder, ProcessSample
from exporter.tracker import LoadRecord, Observation, TargetState, Tracker

log = logging.getLogger(__name__)

CACHE_LABELS = ("cold", "warm", "mixed")
_T = TypeVar("_T")
MIN_READS_FOR_PASS = 1 << 20  # device bytes read before residency is worth measuring again
READS_SHARE_FOR_PASS = 0.001  # ... or this share of the weights, whichever is more


@dataclass
class TargetRuntime:
    """What the exporter holds for one target."""

    config: TargetConfig
    tracker: Tracker
    prober: EndpointProber
    finder: ProcessFinder | None
    residency: ResidencySource | None
    probe_counts: Counter[str] = field(default_factory=Counter)
    server: str = "unknown"
    started_at: float | None = None
    disk_reads_at_pass: int | None = None  # device read counter when a pass was last asked for


@dataclass(frozen=True)
class Snapshot:
    """Everything one scrape or status request shows, taken at one instant."""

    time: float
    config: Config
    readings: Mapping[tuple[str, str], Reading]
    states: Mapping[str, TargetState]
    servers: Mapping[str, str]
    probe_counts: Mapping[str, Mapping[str, int]]
    process_gpu_bytes: Mapping[str, Mapping[int, int]]
    load_durations: Mapping[tuple[str, ...], HistogramCounts]
    phase_durations: Mapping[tuple[str, ...], HistogramCounts]
    expected_durations: Mapping[tuple[str, str], float]
    last_durations: Mapping[str, float]
    history_enabled: bool
    config_reload_successful: bool
    history_problem: str | None
    build: Mapping[str, str]

    def reading(self, source: str, target: str = "") -> Reading | None:
        return self.readings.get((source, target))

    def value(self, source: str, target: str = "") -> object | None:
        """The latest successful sample of a source, or None."""
        reading = self.readings.get((source, target))
        return reading.value if reading is not None and reading.ok else None


class Exporter:
    """The running exporter: start() spawns the sampling threads, snapshot() serves scrapes."""

    def __init__(
        self,
        config: Config,
        *,
        nvml: ModuleType | None = None,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self._clock = clock
        self.reload_successful = True  # set False by a failed reload while this one keeps running
        self.sampler = Sampler(config.sample_interval, clock)
        self.history = HistoryStore(config.history_path)
        self.load_durations = Histograms()
        self.phase_durations = Histograms()
        self._lock = threading.Lock()
        self._states: dict[str, TargetState] = {}
        self._expected: dict[tuple[str, str], float] = {}
        self._last: dict[str, float] = {}
        self._gpu_by_target: dict[str, dict[int, int]] = {}
        self._ticked = threading.Event()
        self.targets: dict[str, TargetRuntime] = {}
        for target in config.targets:
            self.targets[target.name] = self._build_target(target, proc_root)
        weights = {t.name: t.weights.paths for t in config.targets if t.weights is not None}
        self.disk = DiskSource(weights, proc_root=proc_root, sys_root=sys_root)
        self.nvml = NvmlSource(nvml)
        self.sampler.add("disk", "", self.disk.sample)
        self.sampler.add("memory", "", lambda: read_meminfo(proc_root))
        self.sampler.add("nvml", "", self.nvml.sample)
        self.sampler.add_loop("tracker", self.tick)
        self._refresh_expectations()

    def _build_target(self, target: TargetConfig, proc_root: str) -> TargetRuntime:
        runtime = TargetRuntime(
            config=target,
            tracker=Tracker(
                target.name,
                stall_after=target.stall_after,
                expectations=self.history,
                interval=self.config.sample_interval,
            ),
            prober=EndpointProber(target.endpoint),
            finder=ProcessFinder(target.process, proc_root=proc_root) if target.process else None,
            residency=(
                ResidencySource(target.weights, cpu_budget=self.config.residency_cpu_budget)
                if target.weights
                else None
            ),
        )
        self.sampler.add("endpoint", target.name, lambda: self._probe(runtime))
        if runtime.finder is not None:
            self.sampler.add("process", target.name, runtime.finder.sample)
        if runtime.residency is not None:
            self.sampler.add("pagecache", target.name, runtime.residency.sample)
        if target.log is not None:
            log.warning(
                "target %s: log markers are not read yet; phases come from heuristics", target.name
            )
        return runtime

    def _probe(self, runtime: TargetRuntime) -> ProbeSample:
        sample = runtime.prober.sample()
        with self._lock:
            runtime.probe_counts[str(sample.result)] += 1
            if sample.server:
                runtime.server = sample.server
        return sample

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        self.sampler.stop()
        self.nvml.close()
        self.history.close()

    @property
    def ready(self) -> bool:
        """True once the first tracker tick has run (what /-/ready reports)."""
        return self._ticked.is_set()

    def tick(self) -> None:
        """Feed every tracker one observation and file the loads that finished."""
        now = self._clock()
        for name, runtime in self.targets.items():
            observation = self._observe(runtime, now)
            if runtime.residency is not None:
                self._note_reads(runtime, observation)
            record = runtime.tracker.observe(observation)
            if record is not None:
                self._finish(record)
            state = runtime.tracker.state(now)
            if state.in_progress and state.started_at != runtime.started_at:
                # A new load: its cache temperature needs a residency pass now, not when the
                # CPU budget next allows one.
                runtime.started_at = state.started_at
                if runtime.residency is not None:
                    runtime.residency.request_full_pass()
            with self._lock:
                self._states[name] = state
        self._ticked.set()

    @staticmethod
    def _note_reads(runtime: TargetRuntime, observation: Observation) -> None:
        """Ask for a residency pass once the weights' devices have read a meaningful amount.

        Pages arrive only through reads, so without reads a pass would measure nothing new;
        but the devices also serve the rest of the host, and a 16 KB log read must not buy a
        30 ms pass over 8 GB. Without a block device (NFS, tmpfs) reads cannot be seen: always ask.
        """
        assert runtime.residency is not None
        reads = observation.disk_read_bytes
        if reads is None:
            runtime.residency.note_device_reads()
            return
        if runtime.disk_reads_at_pass is None or reads < runtime.disk_reads_at_pass:
            runtime.disk_reads_at_pass = reads
        threshold = max(MIN_READS_FOR_PASS, (observation.weights_bytes or 0) * READS_SHARE_FOR_PASS)
        if reads - runtime.disk_reads_at_pass >= threshold:
            runtime.residency.note_device_reads()
            runtime.disk_reads_at_pass = reads

    def _observe(self, runtime: TargetRuntime, now: float) -> Observation:
        name = runtime.config.name
        probe = self.sampler.latest("endpoint", name)
        process = self._value("process", name, ProcessSample)
        # Taken even when residency is unknown: the weights' size is still measured then.
        residency = self._value("pagecache", name, ResidencySample, require_up=False)
        disk = self._value("disk", "", DiskSample)
        gpu = self._value("nvml", "", GpuSample)
        probe_value = probe.value if probe is not None else None
        gpu_by_index: dict[int, int] = {}
        if gpu is not None and process is not None and process.found:
            gpu_by_index = process_gpu_memory(gpu, process.pids, runtime.config.gpus)
        with self._lock:
            self._gpu_by_target[name] = gpu_by_index
        return Observation(
            time=now,
            endpoint_result=str(probe_value.result) if probe_value is not None else None,
            endpoint_probe_time=probe.finished_at if probe is not None else None,
            process_configured=runtime.finder is not None,
            process_found=bool(process and process.found),
            process_pid=process.root_pid if process else None,
            process_start_time=process.start_time if process else None,
            process_read_bytes=process.read_bytes if process else None,
            process_read_chars=process.read_chars if process else None,
            process_gpu_bytes=sum(gpu_by_index.values()) if gpu_by_index else None,
            weights_bytes=residency.total_bytes if residency else None,
            resident_bytes=residency.resident_bytes if residency else None,
            resident_measured_at=residency.measured_at if residency else None,
            disk_read_bytes=self._target_disk_reads(disk, name),
        )

    def _value(
        self, source: str, target: str, kind: type[_T], require_up: bool = True
    ) -> _T | None:
        reading = self.sampler.latest(source, target)
        if reading is None or (require_up and not reading.ok):
            return None
        return reading.value if isinstance(reading.value, kind) else None

    @staticmethod
    def _target_disk_reads(disk: DiskSample | None, target: str) -> int | None:
        if disk is None or not disk.devices_by_target.get(target):
            return None
        names = set(disk.devices_by_target[target])
        return sum(d.read_bytes_total for d in disk.devices if d.device in names)

    def _finish(self, record: LoadRecord) -> None:
        log.info(
            "target %s: load %s after %.1fs (cache=%s%s)",
            record.target,
            record.outcome,
            record.duration_seconds,
            record.cache or "unknown",
            ", partial" if record.partial else "",
        )
        self.history.add(record)
        if not record.partial:
            cache = record.cache or "unknown"
            self.load_durations.observe(
                (record.target, cache, record.outcome), record.duration_seconds
            )
            for phase, seconds in record.phase_seconds.items():
                self.phase_durations.observe((record.target, phase), seconds)
        self._refresh_expectations()

    def _refresh_expectations(self) -> None:
        """Read history once per finished load, not once per scrape."""
        expected: dict[tuple[str, str], float] = {}
        last: dict[str, float] = {}
        for name in self.targets:
            for cache in CACHE_LABELS:
                value = self.history.expected_duration(name, cache)
                if value is not None:
                    expected[(name, cache)] = value
            last_value = self.history.last_duration(name)
            if last_value is not None:
                last[name] = last_value
        with self._lock:
            self._expected, self._last = expected, last

    def snapshot(self) -> Snapshot:
        readings = {(r.source, r.target): r for r in self.sampler.readings()}
        with self._lock:
            return Snapshot(
                time=self._clock(),
                config=self.config,
                readings=readings,
                states=dict(self._states),
                servers={n: rt.server for n, rt in self.targets.items()},
                probe_counts={n: dict(rt.probe_counts) for n, rt in self.targets.items()},
                process_gpu_bytes={n: dict(v) for n, v in self._gpu_by_target.items()},
                load_durations=self.load_durations.snapshot(),
                phase_durations=self.phase_durations.snapshot(),
                expected_durations=dict(self._expected),
                last_durations=dict(self._last),
                history_enabled=self.history.enabled,
                config_reload_successful=self.reload_successful,
                history_problem=self.history.problem,
                build={"version": __version__, "python_version": platform.python_version()},
            )

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        return self.history.loads(target, limit)
