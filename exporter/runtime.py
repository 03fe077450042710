"""The running exporter: wires config, sources, sampler, trackers and history together.

The sampler threads write readings; one tracker tick per interval turns the latest readings of each
target into an `Observation`, feeds the tracker and files finished loads. `snapshot()` hands the
HTTP side an immutable view, so a scrape never waits on a source.
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from exporter import __version__
from exporter.config import Config, TargetConfig
from exporter.history import HistoryStore
from exporter.loadstats import Histograms
from exporter.sampler import Reading, Sampler
from exporter.snapshot import Snapshot, TargetView
from exporter.sources import DISK, ENDPOINT, MEMORY, NVML, PAGECACHE, PROCESS
from exporter.sources.disk import DiskSample, DiskSource
from exporter.sources.endpoint import EndpointProber
from exporter.sources.gpu import NvmlSource, process_gpu_memory
from exporter.sources.memory import MemorySource
from exporter.sources.pagecache import ResidencySource
from exporter.sources.process import ProcessFinder
from exporter.tracker import LoadRecord, Observation, TargetState, Tracker
from exporter.vocabulary import Cache

log = logging.getLogger(__name__)

# Every temperature, unknown too: where residency cannot be measured all loads are unknown.
EXPECTED_CACHES = tuple(Cache)


@dataclass
class TargetRuntime:
    """What the runtime holds for one target: its sources, its tracker, what the tick found."""

    config: TargetConfig
    tracker: Tracker
    prober: EndpointProber
    finder: ProcessFinder | None
    residency: ResidencySource | None
    started_at: float | None = None  # start of the load the tick last saw
    state: TargetState | None = None
    gpu_memory: Mapping[int, int] = field(default_factory=dict)


class Runtime:
    """start() spawns the sampling threads, snapshot() serves scrapes, stop() ends both."""

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
        self._expected: dict[tuple[str, Cache], float] = {}
        self._last: dict[str, float] = {}
        self._ticked = threading.Event()
        self.targets = {t.name: self._build_target(t, proc_root) for t in config.targets}
        weights = {t.name: t.weights.paths for t in config.targets if t.weights is not None}
        self.disk = DiskSource(weights, proc_root=proc_root, sys_root=sys_root)
        self.nvml = NvmlSource(nvml)
        self.sampler.add(DISK, "", self.disk.sample)
        self.sampler.add(MEMORY, "", MemorySource(proc_root).sample)
        self.sampler.add(NVML, "", self.nvml.sample)
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
        self.sampler.add(ENDPOINT, target.name, runtime.prober.sample)
        if runtime.finder is not None:
            self.sampler.add(PROCESS, target.name, runtime.finder.sample)
        if runtime.residency is not None:
            self.sampler.add(PAGECACHE, target.name, runtime.residency.sample)
        if target.log is not None:
            log.warning(
                "target %s: log markers are not read yet; phases come from heuristics", target.name
            )
        return runtime

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
        disk = self.sampler.value(DISK)
        for runtime in self.targets.values():
            observation, gpu_memory = self._observe(runtime, now, disk)
            if runtime.residency is not None:
                runtime.residency.note_device_reads(observation.disk_read_bytes)
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
                runtime.state, runtime.gpu_memory = state, gpu_memory
        self._ticked.set()

    def _observe(
        self, runtime: TargetRuntime, now: float, disk: DiskSample | None
    ) -> tuple[Observation, dict[int, int]]:
        """The tick's observation of one target, and the GPU memory its tree holds per GPU."""
        name = runtime.config.name
        probe = self.sampler.latest(ENDPOINT, name)
        process = self.sampler.value(PROCESS, name)
        # Taken even when residency is unknown: the weights' size is still measured then.
        pagecache = self.sampler.latest(PAGECACHE, name)
        residency = pagecache.value if pagecache is not None else None
        gpu = self.sampler.value(NVML)
        probe_value = probe.good if probe is not None else None
        gpu_memory: dict[int, int] = {}
        if gpu is not None and process is not None and process.found:
            gpu_memory = process_gpu_memory(gpu, process.pids, runtime.config.gpus)
        observation = Observation(
            time=now,
            endpoint_result=probe_value.result if probe_value is not None else None,
            endpoint_probe_time=probe.finished_at if probe is not None else None,
            process_configured=runtime.finder is not None,
            process_found=bool(process and process.found),
            process_pid=process.root_pid if process else None,
            process_start_time=process.start_time if process else None,
            process_read_bytes=process.read_bytes if process else None,
            process_read_chars=process.read_chars if process else None,
            process_gpu_bytes=sum(gpu_memory.values()) if gpu_memory else None,
            weights_bytes=residency.total_bytes if residency else None,
            resident_bytes=residency.resident_bytes if residency else None,
            resident_measured_at=residency.measured_at if residency else None,
            disk_read_bytes=disk.read_bytes_of(name) if disk is not None else None,
        )
        return observation, gpu_memory

    def _finish(self, record: LoadRecord) -> None:
        log.info(
            "target %s: load %s after %.1fs (cache=%s%s)",
            record.target,
            record.outcome,
            record.duration_seconds,
            record.cache or Cache.UNKNOWN,
            ", partial" if record.partial else "",
        )
        self.history.add(record)
        if not record.partial:
            cache = record.cache or Cache.UNKNOWN
            self.load_durations.observe(
                (record.target, cache, record.outcome), record.duration_seconds
            )
            for phase, seconds in record.phase_seconds.items():
                self.phase_durations.observe((record.target, phase), seconds)
        self._refresh_expectations()

    def _refresh_expectations(self) -> None:
        """Read history once per finished load, not once per scrape."""
        expected: dict[tuple[str, Cache], float] = {}
        last: dict[str, float] = {}
        for name in self.targets:
            for cache in EXPECTED_CACHES:
                value = self.history.expected_duration(name, cache)
                if value is not None:
                    expected[(name, cache)] = value
            last_value = self.history.last_duration(name)
            if last_value is not None:
                last[name] = last_value
        with self._lock:
            self._expected, self._last = expected, last

    def snapshot(self) -> Snapshot:
        host: dict[str, Reading[Any]] = {}
        by_target: dict[str, dict[str, Reading[Any]]] = {name: {} for name in self.targets}
        for reading in self.sampler.readings():
            if reading.target:
                by_target[reading.target][reading.source] = reading
            else:
                host[reading.source] = reading
        with self._lock:
            views = tuple(
                TargetView(rt.config, rt.state, by_target[name], dict(rt.gpu_memory))
                for name, rt in self.targets.items()
            )
            return Snapshot(
                time=self._clock(),
                build={"version": __version__, "python_version": platform.python_version()},
                host=host,
                targets=views,
                load_durations=self.load_durations.snapshot(),
                phase_durations=self.phase_durations.snapshot(),
                expected_durations=dict(self._expected),
                last_durations=dict(self._last),
                history_enabled=self.history.enabled,
                history_problem=self.history.problem,
                config_reload_successful=self.reload_successful,
            )

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        return self.history.loads(target, limit)
