"""The running exporter: wires config, sources, sampler, trackers and history together.

The sampler threads write readings; one tracker tick per interval turns the latest readings of each
target into an `Observation`, feeds the tracker and files finished loads. `snapshot()` hands the
HTTP side an immutable view, so a scrape never waits on a source.

Targets come from the config, and, with discovery on, from the model servers found in /proc:
a discovered target is added when its server first appears, follows it across restarts (same
name, same tracker and history, a new process is a new load) and is dropped `keep_for` after
its process went away. Discovery scans every `discovery.interval`, and every sample interval
while a discovered server is gone, so its restart is seen at once. Any local user can start a
process that looks like a server, so discovered targets are bounded (`_admit`: at most
`max_targets`, `max_targets_per_user` of one user, gone targets make room first) and their
files are only ever touched with their process's rights (`_on_behalf`).

How often each loop runs is exporter/pacing.py's: the runtime hands it what it last saw. An exit
or a failed probe wakes the loops at once (`_after_process`, `_after_probe`), and a ready
target's residency is refreshed every SERVING_REFRESH_SECONDS (a load's start measures it
afresh anyway).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import ModuleType
from typing import Any

from exporter import __version__
from exporter.asprocess import Actor, Borrowed, OnBehalf, rights_of
from exporter.config import Config, LogConfig, ProcessConfig, TargetConfig
from exporter.discovery import DiscoveredServer, Discoverer, endpoint_config, weights_config
from exporter.exitwatch import ExitWatch
from exporter.explain import Counters, baseline, report, storage_reads
from exporter.forecast import NO_RATES, Environment, Forecast, Rates, forecast, rates
from exporter.history import EXPECTATION_LOADS, HistoryStore
from exporter.loadstats import Histograms
from exporter.logfind import LogFinding, find_log
from exporter.pacing import QUIET_INTERVAL, Pacing, ProbeCadence
from exporter.refusals import Refusals
from exporter.safeio import Refused, open_checked
from exporter.sampler import Reading, Sampler
from exporter.servers import SERVERS
from exporter.snapshot import Snapshot, TargetView
from exporter.sources import (
    DISK,
    ENDPOINT,
    ENVIRONMENT,
    LOGS,
    MEMORY,
    NETFS,
    NVML,
    PAGECACHE,
    PROCESS,
    STORAGE,
    WEIGHT_FILES,
    ZFS,
    SourceKey,
)
from exporter.sources.disk import DiskSample, DiskSource
from exporter.sources.endpoint import EndpointProber, ProbeSample
from exporter.sources.environment import REFRESH_SECONDS as ENVIRONMENT_REFRESH_SECONDS
from exporter.sources.environment import EnvironmentSource
from exporter.sources.gpu import (
    GpuSample,
    NvmlSource,
    PcieMarks,
    mark_pcie,
    process_gpu_memory,
)
from exporter.sources.logs import LogSample, LogSource, new_events
from exporter.sources.memory import MemorySample, MemorySource
from exporter.sources.netfs import NetFsSource
from exporter.sources.nvml_pids import NvmlPidCheck
from exporter.sources.pagecache import ResidencySample
from exporter.sources.process import ProcessFinder, ProcessSample, read_stat
from exporter.sources.residency import (
    QUIET_REFRESH_SECONDS,
    SERVING_REFRESH_SECONDS,
    ResidencySource,
)
from exporter.sources.storage import StorageDescription, WeightStorage
from exporter.sources.weightfiles import WeightFilesSample, WeightFilesSource
from exporter.sources.zfs import ZfsSource
from exporter.startupwindow import ADVICE_LOADS, StartupAdvice, advise
from exporter.tracker import FileView, LoadRecord, Observation, TargetState, Tracker
from exporter.vocabulary import IN_PROGRESS, Cache, Phase, ProbeResult

log = logging.getLogger(__name__)

TRACKER_LOOP = "tracker"
DISCOVERY_LOOP = "discovery"
LOG_OPEN_TIMEOUT = 5.0  # seconds opening a discovered server's log may take (a hung mount)
# A tick earlier than the previous one by more than this is a wall-clock step, not jitter.
CLOCK_STEP_SECONDS = 1.0

# Distinct readings of the storage's read counters kept per target: more than the 2 intervals
# and 1 s after its process started within which a load is seen from its start.
READS_KEPT = 16
# Every temperature, unknown too: where residency cannot be measured all loads are unknown.
EXPECTED_CACHES = tuple(Cache)


@dataclass(frozen=True)
class _Marked:
    """Read counters, and when the oldest of the readings they come from was taken."""

    counters: Counters
    at: float


@dataclass
class TargetRuntime:
    """What the runtime holds for one target: its sources, its tracker, what the tick found."""

    config: TargetConfig
    tracker: Tracker
    prober: EndpointProber
    cadence: ProbeCadence
    finder: ProcessFinder | None
    residency: ResidencySource | None
    storage: WeightStorage | None = None  # what holds the weights; residency asks it too
    discovered: DiscoveredServer | None = None  # how discovery found it; None when configured
    gone_since: float | None = None  # a discovered server's process went away at this time
    logs: LogSource | None = None  # made once the process's start is known (a journal's start)
    log_seq: int = 0  # the last log event handed to the tracker
    log_for: tuple[int, float] | None = None  # the process (pid, start) its log was found for
    log_finding: LogFinding | None = None  # where that log was found, or why none was
    started_at: float | None = None  # start of the load the tick last saw
    state: TargetState | None = None
    gpu_memory: Mapping[int, int] = field(default_factory=dict)
    pcie_at_start: PcieMarks = field(default_factory=dict)  # each GPU's counter as the load began
    hung: bool = False  # ready, process running, endpoint failing: logged once
    watched_pid: int | None = None  # the server process whose exit a pidfd reports
    last_result: ProbeResult | None = None  # the last probe's answer, to notice a change
    # The weight files' first open, last let-go and whether all were consumed, as last acted on.
    files_news: tuple[float | None, float | None, bool] = (None, None, False)
    residency_seen: float | None = None  # when the residency pass the loops acted on ran
    # The read counters of the devices, mounts and pools under the weights (explain.Counters)
    # the last ticks saw (a load is first seen a tick or two after its process started), and
    # as the current (or last) load began: None when unknown.
    reads_seen: deque[_Marked] = field(default_factory=lambda: deque(maxlen=READS_KEPT))
    reads_at_start: Counters | None = None
    files: WeightFilesSource | None = None  # the weight-file view, restarted for in-server loads
    # The server's own files and their residency, learned from its tree (sources/environment.py).
    environment: EnvironmentSource | None = None

    @property
    def settled(self) -> bool:
        """Ready, and nothing can end that unseen: its process's exit is watched (or there is
        no process to watch, and the probe paces itself)."""
        ready = self.state is not None and self.state.phase is Phase.READY
        return ready and (self.finder is None or self.watched_pid is not None)


class Runtime:
    """start() spawns the sampling threads, snapshot() serves scrapes, stop() ends both."""

    def __init__(
        self,
        config: Config,
        *,
        nvml: ModuleType | None = None,
        gpu_pid_check: NvmlPidCheck | None = None,
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        host_root: str = "/",
        clock: Callable[[], float] = time.time,
        quiet_interval: float = QUIET_INTERVAL,
        sampler: Sampler | None = None,
    ) -> None:
        """`sampler` runs the sources' loops (its own threads unless a test steps them)."""
        self.config = config
        self._clock = clock
        self._proc_root = proc_root
        self._host_root = host_root  # where container runtimes' logs are (exporter/logfind.py)
        self.pacing = Pacing(config.sample_interval, quiet_interval)
        self.exits = ExitWatch()
        self.reload_successful = True  # set False by a failed reload while this one keeps running
        self.sampler = sampler or Sampler(config.sample_interval, clock)
        self.history = HistoryStore(config.history_path, retention=config.history_retention)
        self.refusals = Refusals()
        self.actor = Actor()  # the threads that touch discovered processes' files
        self.load_durations = Histograms()
        self.phase_durations = Histograms()
        self._lock = threading.Lock()
        self._expected: dict[tuple[str, Cache], float] = {}
        self._rates: dict[str, Rates] = {}  # what each target's past loads measured
        self._last: dict[str, float] = {}
        self._slower: dict[str, str] = {}  # the last load's reason, when it was slower
        self._advice: dict[str, StartupAdvice] = {}  # the startupProbe window each would need
        self._ticked = threading.Event()
        self._last_tick: float | None = None
        weights = {t.name: t.weights.paths for t in config.targets if t.weights is not None}
        self._sys_root = sys_root
        self.disk = DiskSource(weights, proc_root=proc_root, sys_root=sys_root)
        self.netfs = NetFsSource(weights, proc_root=proc_root, sys_root=sys_root)
        self.zfs = ZfsSource(weights, proc_root=proc_root, sys_root=sys_root)
        self.targets: dict[str, TargetRuntime] = {}
        for target in config.targets:
            self._add_target(target)
        self.nvml = NvmlSource(nvml, pid_check=gpu_pid_check or NvmlPidCheck(proc_root))
        self.sampler.add(DISK, "", self.disk.sample, every=self._pace_of(DISK))
        self.sampler.add(NETFS, "", self.netfs.sample, every=self._pace_of(NETFS))
        self.sampler.add(ZFS, "", self.zfs.sample, every=self._pace_of(ZFS))
        self.sampler.add(
            MEMORY,
            "",
            MemorySource(proc_root).sample,
            every=lambda: self.pacing.memory(self._failing(MEMORY, "")),
            after=self._after_memory,
        )
        # NVML retries a failed init on its own clock (every 60 s): the quiet pace will do.
        self.sampler.add(NVML, "", self.nvml.sample, every=self.pacing.loop)
        self.sampler.add_loop(TRACKER_LOOP, self.tick, every=self.pacing.loop)
        self.discoverer: Discoverer | None = None
        # With configured targets, discovery waits a tick: their process trees say which
        # servers they already watch.
        self._discovery_due = clock() + config.sample_interval if config.targets else 0.0
        if config.discovery.active(bool(config.targets)):
            self.discoverer = Discoverer(
                config.discovery.servers,
                proc_root=proc_root,
                actor=self.actor,
                refusals=self.refusals,
                users=config.discovery.users,
            )
            self.sampler.add_loop(DISCOVERY_LOOP, self.discover, every=self._discovery_wait)
        self._refresh_expectations()

    # -- targets -----------------------------------------------------------------------------

    def _add_target(self, target: TargetConfig, found: DiscoveredServer | None = None) -> None:
        runtime = TargetRuntime(
            config=target,
            tracker=self._tracker(target),
            prober=EndpointProber(target.endpoint),
            cadence=ProbeCadence(
                self.config.sample_interval,
                target.endpoint.ready_interval,
                process_matching=target.process is not None,
            ),
            finder=None,
            residency=None,
            discovered=found,
        )
        with self._lock:
            self.targets[target.name] = runtime
        self._wire(runtime)

    def _wire(self, runtime: TargetRuntime) -> None:
        """(Re)build the sources of a target from its config and register their loops."""
        target = runtime.config
        runtime.finder = (
            ProcessFinder(target.process, proc_root=self._proc_root) if target.process else None
        )
        behalf = self._on_behalf(runtime.discovered)
        runtime.storage = (
            WeightStorage(target.weights, proc_root=self._proc_root, sys_root=self._sys_root)
            if target.weights
            else None
        )
        runtime.residency = (
            ResidencySource(
                target.weights,
                cpu_budget=self.config.residency_cpu_budget,
                clock=self._clock,
                refresh_after=lambda: (
                    SERVING_REFRESH_SECONDS if runtime.settled else QUIET_REFRESH_SECONDS
                ),
                on_behalf=behalf,
                max_entries=self.config.discovery.max_files if behalf else None,
                on_refused=lambda exc: self._refused_tree(target.name, exc),
                storage=runtime.storage,
            )
            if target.weights
            else None
        )
        runtime.cadence.ready_interval = target.endpoint.ready_interval
        runtime.cadence.process_matching = target.process is not None
        self.sampler.add(
            ENDPOINT,
            target.name,
            runtime.prober.sample,
            every=lambda: runtime.cadence.delay(self._probe_result(target.name)),
            after=lambda reading: self._after_probe(runtime, reading),
        )
        if runtime.watched_pid is not None:  # another process from now on
            self.exits.forget(runtime.watched_pid)
            runtime.watched_pid = None

        if runtime.finder is not None:
            self.sampler.add(
                PROCESS,
                target.name,
                runtime.finder.sample,
                every=self._pace_of(PROCESS, runtime),
                after=lambda reading: self._after_process(runtime, reading),
            )
        else:
            self.sampler.discard(PROCESS, target.name)
        if runtime.residency is not None:
            self.sampler.add(
                PAGECACHE,
                target.name,
                runtime.residency.sample,
                every=self._pace_of(PAGECACHE, runtime),
                after=lambda reading: self._after_residency(runtime, reading),
            )
        else:
            self.sampler.discard(PAGECACHE, target.name)
        if runtime.storage is not None:
            describe = runtime.storage.describe
            self.sampler.add(
                STORAGE,
                target.name,
                (lambda: behalf.run(describe)) if behalf is not None else describe,
                every=self._storage_pace(target.name),
            )
        else:
            self.sampler.discard(STORAGE, target.name)
        if runtime.finder is not None and target.weights is not None:
            name = target.name
            files = runtime.files = WeightFilesSource(
                target.weights,
                lambda: self.sampler.value(PROCESS, name),
                proc_root=self._proc_root,
                clock=self._clock,
                on_behalf=behalf,
                max_entries=self.config.discovery.max_files if behalf else None,
            )
            self.sampler.add(
                WEIGHT_FILES,
                name,
                files.sample,
                every=self._files_pace(runtime),
                after=lambda reading: self._after_files(runtime, reading),
            )
        else:
            self.sampler.discard(WEIGHT_FILES, target.name)
            runtime.files = None
        self._wire_environment(runtime, behalf)
        for watcher in (self.disk, self.netfs, self.zfs):
            watcher.watch(target.name, target.weights.paths if target.weights else None, behalf)
        if self.pacing.unsettle():  # a new target, or a new process of one
            self.sampler.wake_all()

    def _wire_environment(self, runtime: TargetRuntime, behalf: OnBehalf | None) -> None:
        """The server's environment, learned from its tree: kept across its restarts (the next
        start maps the same files), so only made once per target."""
        target = runtime.config
        if runtime.finder is None:
            self.sampler.discard(ENVIRONMENT, target.name)
            runtime.environment = None
            return
        if runtime.environment is not None:
            runtime.environment.follow(target.weights, behalf)
            return
        name = target.name
        runtime.environment = EnvironmentSource(
            target.weights,
            lambda: self.sampler.value(PROCESS, name),
            proc_root=self._proc_root,
            clock=self._clock,
            cpu_budget=self.config.residency_cpu_budget,
            refresh_after=lambda: (
                SERVING_REFRESH_SECONDS if runtime.settled else ENVIRONMENT_REFRESH_SECONDS
            ),
            on_behalf=behalf,
        )
        self.sampler.add(
            ENVIRONMENT, name, runtime.environment.sample, every=self._pace_of(ENVIRONMENT, runtime)
        )

    def _on_behalf(self, found: DiscoveredServer | None) -> OnBehalf | None:
        """How a discovered target's sources touch its files: with its process's rights."""
        if found is None or found.rights is None:
            return None
        same = _same_process(self._proc_root, found.pid, found.start_ticks)
        return OnBehalf(self.actor, found.rights, found.pid, same, self._proc_root)

    def _refused_tree(self, name: str, exc: Refused) -> None:
        self.refusals.note(exc.reason, (name, exc.reason), "target %s: %s", name, exc)

    def _drop_target(self, name: str, why: str | None = None) -> None:
        with self._lock:
            runtime = self.targets.pop(name)
        runtime.prober.close()
        self.sampler.remove(name)
        for watcher in (self.disk, self.netfs, self.zfs):
            watcher.watch(name, None)
        self.load_durations.forget(name)
        self.phase_durations.forget(name)
        if runtime.watched_pid is not None:
            self.exits.forget(runtime.watched_pid)
        if runtime.logs is not None:
            runtime.logs.close()
        log.info("target %s: %s, no longer watched", name, why or
                 f"its server has been gone for {self.config.discovery.keep_for:g}s")  # fmt: skip

    def discover(self) -> None:
        """One discovery pass when due: add, follow and, after keep_for, drop discovered targets.

        The next pass is due on time whatever this one met: a pass that fails must not run
        again at once (a loop on /dev/zero would take a core).
        """
        assert self.discoverer is not None
        now = self._clock()
        if now < self._discovery_due:
            return
        self._discovery_due = now + self.config.discovery.interval
        try:
            found = self._claimable(self.discoverer.scan())
        except Exception as exc:
            self.refusals.note("error", "pass", "a discovery pass failed: %s", exc)
            log.debug("discovery pass failed", exc_info=True)
            return
        for name, server in found.items():
            runtime = self.targets.get(name)
            if runtime is None:
                if not self._admit(server):
                    continue
                log.info("target %s: discovered %s server, pid %d", name, server.kind, server.pid)
                self._add_target(_target_config(server), server)
                self._refresh_expectations()
            elif runtime.discovered is not None:
                runtime.gone_since = None
                if runtime.discovered != server:
                    self._refresh_discovered(runtime, server)
        for runtime in list(self.targets.values()):
            if runtime.discovered is None or runtime.config.name in found:
                continue
            if runtime.gone_since is None:
                runtime.gone_since = now
            elif now - runtime.gone_since >= self.config.discovery.keep_for:
                self._drop_target(runtime.config.name)
        waiting = any(rt.gone_since is not None for rt in self.targets.values())
        interval = self.config.sample_interval if waiting else self.config.discovery.interval
        self._discovery_due = now + interval

    def _admit(self, server: DiscoveredServer) -> bool:
        """Room for one more discovered target: under `max_targets` and the user's share, a
        gone target (the longest gone first) making room when needed; else refused."""
        limits = self.config.discovery
        owner = server.rights.uid if server.rights is not None else None
        discovered = [rt for rt in self.targets.values() if rt.discovered is not None]
        same_user = [rt for rt in discovered if _owner(rt) == owner]
        for pool, limit, reason in (
            (same_user, limits.max_targets_per_user, "user_share"),
            (discovered, limits.max_targets, "max_targets"),
        ):
            live = [rt for rt in pool if rt.config.name in self.targets]
            if len(live) < limit:
                continue
            gone = sorted(
                (rt for rt in live if rt.gone_since is not None), key=lambda rt: rt.gone_since or 0
            )
            if not gone:
                self.refusals.note(reason, server.key, "%s (pid %d, uid %s): %d targets already",
                                   server.name, server.pid, owner, limit)  # fmt: skip
                return False
            self._drop_target(gone[0].config.name, f"gone, making room for {server.name}")
        return True

    def _discovery_wait(self) -> float:
        return max(0.0, self._discovery_due - self._clock())

    def _claimable(self, servers: tuple[DiscoveredServer, ...]) -> dict[str, DiscoveredServer]:
        """The discovered servers no configured target watches, by name; configured ones win."""
        configured = [rt for rt in self.targets.values() if rt.discovered is None]
        pids: set[int] = set()
        for runtime in configured:
            process = self.sampler.value(PROCESS, runtime.config.name)
            if process is not None:
                pids.update(process.pids)
        urls = {rt.config.endpoint.url.rstrip("/") for rt in configured}
        claimable = {}
        for server in servers:
            if server.pid in pids or server.url in urls:
                continue
            if not server.reachable:
                why = next((e.source for e in server.evidence if e.what == "probe host"), "")
                self.refusals.note("unreachable", server.key, "%s at pid %d is not probed (%s); "
                                   "not watched", server.name, server.pid, why)  # fmt: skip
                continue
            claimable[server.name] = server
        return claimable

    def _refresh_discovered(self, runtime: TargetRuntime, server: DiscoveredServer) -> None:
        """The same server, changed: restarted (a new process, so a new load) or new weights."""
        runtime.discovered = server
        fresh = _target_config(server)
        if fresh.endpoint != runtime.config.endpoint:
            runtime.prober.close()
            runtime.prober = EndpointProber(fresh.endpoint)
        runtime.config = replace(runtime.config, endpoint=fresh.endpoint,
                                 weights=fresh.weights, process=fresh.process)  # fmt: skip
        self._wire(runtime)

    # -- sampling ----------------------------------------------------------------------------

    def _tracker(self, target: TargetConfig) -> Tracker:
        return Tracker(
            target.name,
            stall_after=target.stall_after,
            expectations=self.history,
            interval=self.config.sample_interval,
        )

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        for runtime in self.targets.values():
            runtime.prober.close()  # a probe in flight ends now, not at its timeout
        self.sampler.stop()
        self.actor.close()
        self.exits.close()
        for runtime in self.targets.values():
            if runtime.logs is not None:
                runtime.logs.close()
        self.nvml.close()
        self.history.close()

    @property
    def ready(self) -> bool:
        """True once the first tracker tick has run (what /-/ready reports)."""
        return self._ticked.is_set()

    def tick(self) -> None:
        """Feed every tracker one observation and file the loads that finished."""
        now = self._clock()
        self._note_clock_step(now)
        self.history.retry()  # loads a full disk could not take yet
        disk = self.sampler.value(DISK)
        with self._lock:
            runtimes = list(self.targets.values())
        moved = False  # a phase changed: paces change with it
        for runtime in runtimes:
            self._open_log(runtime, now)
            observation, gpu_memory = self._observe(runtime, now, disk)
            if runtime.residency is not None:
                runtime.residency.note_device_reads(self._storage_reads(runtime, disk))
            reads = self._read_counters(runtime.config.name)
            seen = runtime.reads_seen
            if reads is not None and (not seen or seen[-1].at != reads.at):
                seen.append(reads)
            record = runtime.tracker.observe(observation)
            if record is not None:
                runtime.tracker.reported(self._finish(runtime, record, reads))
                self._measure_now(runtime)  # what the next restart would find
            state = runtime.tracker.state(now)
            if state.in_progress and state.started_at != runtime.started_at:
                # A new load: its cache temperature needs a residency pass now, not when the
                # CPU budget next allows one.
                runtime.started_at = state.started_at
                runtime.pcie_at_start = {}
                runtime.reads_at_start = _counters_before(runtime.reads_seen, state)
                self._measure_now(runtime)
                self._files_afresh(runtime, state)
            gpus = self.sampler.latest(NVML)
            if state.in_progress and gpus is not None:  # each GPU's first counter in the load
                runtime.pcie_at_start = mark_pcie(
                    runtime.pcie_at_start, gpus.good, gpus.finished_at, state.started_at
                )
            if runtime.cadence.set_phase(state.phase, state.in_server and state.in_progress):
                moved = True
            self._note_hung(runtime, state)
            with self._lock:
                runtime.state, runtime.gpu_memory = state, gpu_memory
        if self.pacing.note((runtime.settled for runtime in runtimes), moved):
            self.sampler.wake_all()
        self._ticked.set()

    def _files_afresh(self, runtime: TargetRuntime, state: TargetState) -> None:
        """A model loaded into the running server reads its files again: the file view starts
        over (the tracker holds the older account off: what the load before consumed is no
        progress of this one)."""
        if state.in_server and runtime.files is not None:
            runtime.files.restart()
            self.sampler.sample_soon(WEIGHT_FILES, runtime.config.name)

    @property
    def quiet(self) -> bool:
        """Every target settled: the gauges' loops run at the quiet pace (exporter/pacing.py)."""
        return self.pacing.quiet

    def _failing(self, source: SourceKey[Any], target: str) -> bool:
        reading = self.sampler.latest(source, target)
        return reading is not None and not reading.ok

    def _pace_of(
        self, source: SourceKey[Any], runtime: TargetRuntime | None = None
    ) -> Callable[[], float]:
        """A source's loop asks exporter/pacing.py, with its target's state and its own."""
        if runtime is None:
            return lambda: self.pacing.host_source(self._failing(source, ""))
        name = runtime.config.name
        return lambda: self.pacing.source(runtime.settled, self._failing(source, name))

    def _files_pace(self, runtime: TargetRuntime) -> Callable[[], float]:
        name = runtime.config.name
        return lambda: self.pacing.weight_files(
            runtime.cadence.phase, runtime.settled, self._failing(WEIGHT_FILES, name)
        )

    def _storage_pace(self, target: str) -> Callable[[], float]:
        def pace() -> float:
            reading = self.sampler.latest(STORAGE, target)
            unplaced = reading is not None and reading.good is not None and reading.good.unplaced
            return self.pacing.storage(reading is None or not reading.ok or bool(unplaced))

        return pace

    def _storage_reads(self, runtime: TargetRuntime, disk: DiskSample | None) -> int | None:
        """Bytes read so far under a target's weights, from every counter that sees them
        (block devices, network mounts, ZFS pools); None where none does (tmpfs, FUSE)."""
        name = runtime.config.name
        counts = [
            sample.read_bytes_of(name)
            for sample in (disk, self.sampler.value(NETFS), self.sampler.value(ZFS))
            if sample is not None
        ]
        known = [count for count in counts if count is not None]
        return sum(known) if known else None

    def _after_process(self, runtime: TargetRuntime, reading: Reading[ProcessSample]) -> None:
        """Watch the exit of the server's root process, and tell the tracker when it changed."""
        process = reading.good
        root = process.root_pid if process is not None and process.found else None
        found_for = runtime.log_for
        gone = process is not None and found_for is not None and root != found_for[0]
        if gone and runtime.logs is not None:  # its log was found for that process: no more
            runtime.logs.finish()
        if root == runtime.watched_pid:
            return
        if runtime.watched_pid is not None:
            self.exits.forget(runtime.watched_pid)
            self.sampler.sample_soon(LOGS, runtime.config.name)  # its last lines say why
            self.sampler.run_soon(TRACKER_LOOP)  # gone, or replaced: the phase moves now
            if runtime.discovered is not None and self.discoverer is not None:
                # Its restart may be up before the next pass is due: look for it now.
                self._discovery_due = self._clock()
                self.sampler.run_soon(DISCOVERY_LOOP)
        name = runtime.config.name
        watched = root is not None and self.exits.watch(
            root, lambda: self.sampler.sample_soon(PROCESS, name)
        )
        runtime.watched_pid = root if watched else None

    def _note_clock_step(self, now: float) -> None:
        """A wall clock stepped back (NTP, a VM resumed): start tracking afresh.

        Trackers ignore observations older than their last one, so after a step back of an hour
        they would freeze for that hour. Fresh trackers pick loads in progress up again from the
        process start time, exactly as after an exporter restart.
        """
        last, self._last_tick = self._last_tick, now
        if last is None or now >= last - CLOCK_STEP_SECONDS:
            return
        log.warning(
            "wall clock stepped back by %.1fs: load tracking restarts, as after an exporter "
            "restart",
            last - now,
        )
        for runtime in self.targets.values():
            runtime.tracker = self._tracker(runtime.config)
            runtime.started_at = None

    def _after_files(self, runtime: TargetRuntime, reading: Reading[WeightFilesSample]) -> None:
        """A weight file first opened, every one let go, or every byte consumed (an mmap loader
        keeps its map): the phase moves, so tick now, not up to an interval later (a server
        whose start-up ends just after its weights, llama.cpp's, is ready by then and would be
        seen an interval late); and when they are let go, measure residency now, which says
        whether the files were read whole (those opened and closed between two looks too)."""
        files = reading.good
        if files is None:
            return
        consumed = 0 < files.total_bytes <= files.consumed_bytes
        news = (files.first_open_at, files.idle_since, consumed)
        if news == runtime.files_news:
            return
        runtime.files_news = news
        if files.idle_since is not None:
            self._measure_now(runtime)
        self.sampler.run_soon(TRACKER_LOOP)

    def _measure_now(self, runtime: TargetRuntime) -> None:
        """A residency pass now, whatever the CPU budget says: a load began (its cache
        temperature), its files were let go (read whole?) or it ended (the serving residency,
        else stale until the serving refresh, minutes away)."""
        if runtime.residency is not None:
            runtime.residency.request_full_pass()
            self.sampler.sample_soon(PAGECACHE, runtime.config.name)

    def _after_memory(self, reading: Reading[MemorySample]) -> None:
        """Pages left the host's page cache: a target's weights may be among them, so measure
        its residency now, not at its next refresh (minutes while it serves)."""
        memory = reading.good
        if memory is None:
            return
        with self._lock:
            runtimes = list(self.targets.values())
        for runtime in runtimes:
            residency = runtime.residency
            if residency is not None and residency.note_departures(
                memory.page_cache_departed_bytes
            ):
                self.sampler.sample_soon(PAGECACHE, runtime.config.name)
            environment = runtime.environment
            if environment is not None and environment.note_departures(
                memory.page_cache_departed_bytes
            ):
                self.sampler.sample_soon(ENVIRONMENT, runtime.config.name)

    def _after_residency(self, runtime: TargetRuntime, reading: Reading[ResidencySample]) -> None:
        """A fresh pass during a load may say the weights are in: tick now (passes are rare).
        A settled target's pass changes no phase, and the restart forecast is made from the
        latest pass at each snapshot: no tick (evictions while serving bring passes often)."""
        sample = reading.good
        if sample is None or sample.measured_at == runtime.residency_seen:
            return
        runtime.residency_seen = sample.measured_at
        if not runtime.settled:
            self.sampler.run_soon(TRACKER_LOOP)

    def _after_probe(self, runtime: TargetRuntime, reading: Reading[ProbeSample]) -> None:
        """Tick now, not up to an interval (or a quiet interval) later, when an answer matters:
        the first ready answer of a load in progress ends it at that answer; between loads,
        every failed answer (each counts towards a hung server or an endpoint-only load) and
        the first good one after them."""
        value = reading.good
        result = value.result if value is not None else None
        changed, runtime.last_result = result != runtime.last_result, result
        ready = result is ProbeResult.READY
        news = ready if runtime.cadence.phase in IN_PROGRESS else changed or not ready
        if news:
            if ready and runtime.logs is not None:
                self.sampler.sample_soon(LOGS, runtime.config.name)  # the lines up to it
            self.sampler.run_soon(TRACKER_LOOP)

    def _probe_result(self, name: str) -> ProbeResult | None:
        probe = self.sampler.value(ENDPOINT, name)
        return probe.result if probe is not None else None

    def _note_hung(self, runtime: TargetRuntime, state: TargetState) -> None:
        """Log once when the tracker calls a ready server hung (its process runs on, its
        endpoint stopped answering), and once when it answers again."""
        if state.hung == runtime.hung:
            return
        runtime.hung = state.hung
        name = runtime.config.name
        if not state.hung:
            log.info("target %s: the endpoint answers again", name)
            return
        probe = self.sampler.latest(ENDPOINT, name)
        value = probe.good if probe is not None else None
        process = self.sampler.value(PROCESS, name)
        log.warning(
            "target %s: the server process (pid %s) keeps running but its endpoint stopped "
            "answering (%s, %d probes in a row): hung? phase stays ready, endpoint_up is 0",
            name,
            process.root_pid if process is not None else "?",
            value.detail if value is not None else probe.error if probe is not None else "?",
            state.failed_probes,
        )

    def _open_log(self, runtime: TargetRuntime, now: float) -> None:
        """Follow a target's log: the configured one, else the one its server process writes.

        A configured log opens once it is known where to start reading a journal: from the server
        process's start (so an exporter started mid-load still reads the whole load's markers),
        or from now when there is no process or it is not running. Without `log:`, each new
        server process (a restart too) has its log found afresh (exporter/logfind.py).
        """
        name = runtime.config.name
        process = None
        if runtime.finder is not None:
            reading = self.sampler.latest(PROCESS, name)
            if reading is None:
                return  # the first process sample is not in yet
            process = reading.good
        start = process.start_time if process is not None and process.found else None
        configured = runtime.config.log
        if configured is not None:
            if runtime.logs is None:
                self._follow_log(runtime, configured, now if start is None else start)
            return
        if start is None or process is None or process.root_pid is None:
            return
        found_for = (process.root_pid, start)
        if found_for == runtime.log_for:
            return
        runtime.log_for = found_for
        if runtime.logs is not None:  # an older process's log
            self.sampler.discard(LOGS, name)
            runtime.logs.close()
            runtime.logs, runtime.log_seq = None, 0
        behalf: OnBehalf | None = None
        finding: LogFinding | None = None
        try:  # a found log is the process's: read with its rights, whoever configured the target
            behalf = self._on_behalf(runtime.discovered) or self._on_behalf_of(process.root_pid)
        except Borrowed as exc:
            finding = LogFinding(None, f"its log is not read: {exc}")
        except ProcessLookupError:
            pass  # a configured target's process whose credentials cannot be read (gone, or a
            # /proc tree without them): its log, if any is found, with the exporter's rights
        if finding is None:
            finding = find_log(
                process.root_pid, start, proc_root=self._proc_root, host_root=self._host_root
            )
        with self._lock:
            runtime.log_finding = finding
        if finding.config is None:
            log.info("target %s: no log found: %s", name, finding.why)
            return
        log.info("target %s: following its log: %s", name, finding.why)
        self._follow_log(runtime, finding.config, start, finding.whole_files, behalf, origin=start)

    def _on_behalf_of(self, pid: int) -> OnBehalf:
        """A configured target's process, read for with its own rights as a discovered one's
        (ProcessLookupError, Borrowed)."""
        rights = rights_of(pid, self._proc_root)
        proc = read_stat(self._proc_root, pid)
        if proc is None:
            raise ProcessLookupError(f"pid {pid} is gone")
        same = _same_process(self._proc_root, pid, proc.start_ticks)
        return OnBehalf(self.actor, rights, pid, same, self._proc_root)

    def _follow_log(
        self,
        runtime: TargetRuntime,
        config: LogConfig,
        since: float,
        whole_files: tuple[str, ...] = (),
        behalf: OnBehalf | None = None,
        origin: float | None = None,
    ) -> None:
        """Follow `config`: `behalf` of the process whose log it is, else (a configured `log:`)
        with the exporter's own rights; `origin`: the start of the one process the log belongs
        to (a found log), else None."""
        opener = None
        if behalf is not None:  # a discovered server's log is read with its own rights

            def opener(path: str) -> int:
                return behalf.run(lambda: open_checked(path)[0], LOG_OPEN_TIMEOUT)

        runtime.logs = LogSource(
            config,
            since=since,
            whole_files=whole_files,
            clock=self._clock,
            opener=opener,
            rights=behalf.current if behalf is not None else None,
            origin=origin,
        )
        self.sampler.add(
            LOGS,
            runtime.config.name,
            runtime.logs.sample,
            every=self._log_pace(runtime),
            after=lambda reading: self._after_log(runtime, reading),
        )

    def _log_pace(self, runtime: TargetRuntime) -> Callable[[], float]:
        """A gauge's pace, except for a server that loads models in place (Triton): only its log
        says at once that a load began inside it, so it is read every interval even when quiet
        (a pread of nothing new, some microseconds)."""
        name = runtime.config.name

        def pace() -> float:
            reading = self.sampler.latest(LOGS, name)
            kind = reading.good.format if reading is not None and reading.good else None
            in_place = kind is not None and SERVERS[kind].loads_in_place
            return self.pacing.source(runtime.settled and not in_place, self._failing(LOGS, name))

        return pace

    def _after_log(self, runtime: TargetRuntime, reading: Reading[LogSample]) -> None:
        """Tick now when the log has news the tracker acts on: a load that answered ready waits
        for a read of the log after the answer (it dates a short load's phases); between loads,
        a line may begin a load inside the running server, or say it unloaded a model."""
        in_progress = runtime.cadence.phase in IN_PROGRESS
        news = reading.good is not None and reading.good.last_seq > runtime.log_seq
        if (runtime.last_result is ProbeResult.READY) if in_progress else news:
            self.sampler.run_soon(TRACKER_LOOP)

    def _observe(
        self, runtime: TargetRuntime, now: float, disk: DiskSample | None
    ) -> tuple[Observation, dict[int, int]]:
        """The tick's observation of one target, and the GPU memory its tree holds per GPU."""
        name = runtime.config.name
        probe = self.sampler.latest(ENDPOINT, name)
        process = self.sampler.value(PROCESS, name) if runtime.finder is not None else None
        # Taken even when residency is unknown: the weights' size is still measured then.
        pagecache = self.sampler.latest(PAGECACHE, name) if runtime.residency else None
        residency = pagecache.value if pagecache is not None else None
        # Events even from a log that is down now (journalctl died after writing them).
        logs = self.sampler.latest(LOGS, name) if runtime.logs is not None else None
        log_sample = logs.value if logs is not None else None
        events = new_events(log_sample, runtime.log_seq) if log_sample is not None else ()
        if log_sample is not None:
            runtime.log_seq = log_sample.last_seq
        files: WeightFilesSample | None = None
        files_looked = False  # the view has reported on this target at least once
        if runtime.finder is not None:
            looked = self.sampler.latest(WEIGHT_FILES, name)
            files_looked = looked is not None
            files = looked.good if looked is not None else None
        gpu = self.sampler.value(NVML)
        probe_value = probe.good if probe is not None else None
        gpu_memory: dict[int, int] = {}
        if gpu is not None and process is not None and process.found:
            gpu_memory = process_gpu_memory(gpu, process.pids, runtime.config.gpus)
        gpus = gpu_memory if runtime.config.gpus == "auto" else runtime.config.gpus
        observation = Observation(
            time=now,
            endpoint_result=probe_value.result if probe_value is not None else None,
            # A reading stamped before the wall clock stepped back must not look like the future.
            endpoint_probe_time=min(probe.finished_at, now) if probe is not None else None,
            process_configured=runtime.finder is not None,
            process_found=bool(process and process.found),
            process_pid=process.root_pid if process else None,
            process_start_time=process.start_time if process else None,
            process_read_bytes=process.read_bytes if process else None,
            process_read_chars=process.read_chars if process else None,
            process_gpu_bytes=sum(gpu_memory.values()) if gpu_memory else None,
            weights_bytes=residency.total_bytes if residency else None,
            resident_bytes=residency.resident_bytes if residency else None,
            resident_measured_at=min(residency.measured_at, now) if residency else None,
            disk_read_bytes=disk.read_bytes_of(name) if disk is not None else None,
            log_events=events,
            log_lines=log_sample.activity if log_sample is not None else None,
            log_read_at=min(logs.finished_at, now) if logs is not None else None,
            files=_file_view(files, process, files_looked),
            gpu_rx_bytes=_tree_rx(gpu, gpus),
            storage_cache=_storage_cache(self.sampler.value(STORAGE, name)),
            process_cpu_seconds=process.cpu_seconds if process else None,
            process_state=process.state if process else None,
        )
        return observation, gpu_memory

    def _read_counters(self, name: str) -> _Marked | None:
        """The read counter of each device, network mount and ZFS pool under a target's weights,
        with the time of the oldest reading they come from; None before any reading."""
        counters: dict[tuple[str, str], int] = {}
        times = []
        for reading in (self.sampler.latest(DISK), self.sampler.latest(NETFS),
                        self.sampler.latest(ZFS)):  # fmt: skip
            if reading is not None and reading.good is not None:
                counters.update(reading.good.counters_of(name))
                times.append(reading.finished_at)
        return _Marked(counters, min(times)) if times else None

    def _finish(
        self, runtime: TargetRuntime, record: LoadRecord, reads: _Marked | None
    ) -> LoadRecord:
        """File a finished load with its report, built against history before it."""
        during = storage_reads(runtime.reads_at_start, reads.counters) if reads else None
        base = baseline(self.history, record.target, record.cache)
        record, unknown = _environment_at_start(runtime.environment, record)
        record = replace(record, report=report(record, base, during, unknown))
        log.info(
            "target %s: load %s after %.1fs (cache=%s%s)%s",
            record.target,
            record.outcome,
            record.duration_seconds,
            record.cache or Cache.UNKNOWN,
            ", partial" if record.partial else "",
            f": {record.fatal}" if record.fatal else "",
        )
        if record.report is not None and record.report.reason is not None:
            log.info("target %s: slower than expected: %s", record.target, record.report.reason)
        self.history.add(record)
        if not record.partial:
            cache = record.cache or Cache.UNKNOWN
            self.load_durations.observe(
                (record.target, cache, record.outcome), record.duration_seconds
            )
            for phase, seconds in record.phase_seconds.items():
                self.phase_durations.observe((record.target, phase), seconds)
        self._refresh_expectations()
        reason = record.report.reason if record.report is not None else None
        with self._lock:  # this load's, whether or not history could keep it
            self._slower.pop(record.target, None)
            if reason is not None:
                self._slower[record.target] = reason
        return record

    def _forecast(self, name: str, readings: dict[str, Reading[Any]]) -> Forecast:
        """A restart begun now, from the residency the snapshot shows and what past loads
        measured (called holding the lock, which guards the rates)."""
        reading = readings.get(PAGECACHE.name)
        residency = reading.good if reading is not None else None
        known = self._rates.get(name, NO_RATES)
        env_reading = readings.get(ENVIRONMENT.name)
        env = env_reading.good if env_reading is not None else None
        environment = (
            Environment(env.warm_bytes, min(env.resident_bytes, env.warm_bytes))
            if env is not None and env.resident_bytes is not None and env.warm_bytes is not None
            else None
        )
        if residency is None:
            return forecast(known, None, None, environment)
        return forecast(known, residency.total_bytes, residency.resident_bytes, environment)

    def _refresh_expectations(self) -> None:
        """Read history once per finished load (or new target), not once per scrape."""
        expected: dict[tuple[str, Cache], float] = {}
        last: dict[str, float] = {}
        slower: dict[str, str] = {}
        recent = {name: self.history.loads(name, EXPECTATION_LOADS) for name in list(self.targets)}
        known = {name: rates(loads) for name, loads in recent.items()}
        advice = {name: advise(self.history.loads(name, ADVICE_LOADS)) for name in recent}
        for name, loads in recent.items():
            newest = loads[0].report if loads else None
            if newest is not None and newest.reason is not None:
                slower[name] = newest.reason
            for cache in EXPECTED_CACHES:
                value = self.history.expected_duration(name, cache)
                if value is not None:
                    expected[(name, cache)] = value
            last_value = self.history.last_duration(name)
            if last_value is not None:
                last[name] = last_value
        with self._lock:
            self._expected, self._last, self._slower = expected, last, slower
            self._rates, self._advice = known, advice

    def snapshot(self) -> Snapshot:
        host: dict[str, Reading[Any]] = {}
        by_target: dict[str, dict[str, Reading[Any]]] = {}
        for reading in self.sampler.readings():
            if reading.target:
                by_target.setdefault(reading.target, {})[reading.source] = reading
            else:
                host[reading.source] = reading
        with self._lock:
            views = tuple(
                TargetView(
                    rt.config,
                    rt.state,
                    by_target.get(name, {}),
                    dict(rt.gpu_memory),
                    rt.discovered,
                    pcie_at_start=rt.pcie_at_start,
                    forecast=self._forecast(name, by_target.get(name, {})),
                    log_finding=rt.log_finding,
                    startup_advice=self._advice.get(name),
                )
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
                slower_reasons=dict(self._slower),
                history_enabled=self.history.enabled,
                history_problem=self.history.problem or self.history.write_problem,
                config_reload_successful=self.reload_successful,
                history_up=self.history.up if self.history.configured else None,
                discovery_refused=self.refusals.counts() if self.discoverer else None,
                metrics=self.config.metrics,
            )

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        return self.history.loads(target, limit)

    def load(self, load_id: int) -> LoadRecord | None:
        return self.history.load(load_id)


def _environment_at_start(
    environment: EnvironmentSource | None, record: LoadRecord
) -> tuple[LoadRecord, str | None]:
    """The load with its environment's residency as it began (the last pass before its start),
    or as it was and why that is not known."""
    if environment is None:
        return record, "no server process is matched: its files cannot be seen"
    if record.partial:
        return record, "its start is not known"
    if record.seen_late:
        return record, "the exporter started after the server: nothing was measured before"
    found = environment.before(record.started_at)
    if found is None or found.resident_bytes is None or found.warm_bytes is None:
        why = found.reason if found is not None else None
        return (
            record,
            why
            or "no measurement before its start: its files are learned from the "
            "server's own mappings, at its first load",
        )
    return replace(
        record,
        environment_bytes=found.warm_bytes,
        environment_resident_bytes=min(found.resident_bytes, found.warm_bytes),
    ), None


def _counters_before(seen: Iterable[_Marked], state: TargetState) -> Counters | None:
    """The last counters read before a load's start; None when none was (the exporter started
    after it, or the counters were read too seldom to hold one from before it)."""
    start = state.started_at
    before = [marked for marked in seen if start is not None and marked.at <= start]
    return before[-1].counters if before else None


def _storage_cache(storage: StorageDescription | None) -> Cache | None:
    """The cache label the storage decides, if it does (in memory by construction: warm)."""
    if storage is None:
        return None
    fixed = storage.fixed_cache()
    return fixed if fixed is not None else Cache.WARM if storage.in_memory else None


def _tree_rx(gpu: GpuSample | None, gpus: Collection[int]) -> int | None:
    """PCIe bytes received so far by the GPUs the tree uses, summed; None unless every one of
    them has the counter (a part would read as the whole)."""
    if gpu is None or not gpus:
        return None
    counters = [d.pcie_rx_bytes for d in gpu.devices if d.index in gpus]
    if len(counters) != len(gpus) or None in counters:
        return None
    return sum(c for c in counters if c is not None)


def _file_view(
    files: WeightFilesSample | None, process: ProcessSample | None, looked: bool = True
) -> FileView | None:
    """The weight files as the tracker sees them, None where they cannot be seen (the tracker
    then falls back on the tree's counters). A process the file view has not looked at yet (a
    target just discovered, a new process) holds nothing known: its imports must not read as
    weights while the view catches up, so the view is `pending` rather than absent."""
    if process is None or not process.found:
        return None
    if files is None and not looked:
        return FileView(None, False, None, 0, 0, 0, pending=True)
    if files is None or not files.visible:
        return None
    if files.root_pid != process.root_pid:
        return FileView(None, False, None, 0, 0, files.total_bytes, pending=True)
    return FileView(
        first_open_at=files.first_open_at,
        first_open_seen=files.first_open_seen,
        idle_since=files.idle_since,
        consumed_bytes=files.consumed_bytes,
        seen_bytes=files.seen_bytes,
        total_bytes=files.total_bytes,
        direct=any(f.direct for f in files.files),
    )


def _same_process(proc_root: str, pid: int, start_ticks: int) -> Callable[[], bool]:
    """Whether `pid` is still the process that started at `start_ticks` (pids are reused)."""

    def same() -> bool:
        proc = read_stat(proc_root, pid)
        return proc is not None and proc.start_ticks == start_ticks

    return same


def _owner(runtime: TargetRuntime) -> int | None:
    found = runtime.discovered
    return found.rights.uid if found is not None and found.rights is not None else None


def _target_config(server: DiscoveredServer) -> TargetConfig:
    """A discovered server as if it had been configured, its process matched by identity."""
    return TargetConfig(
        name=server.name,
        endpoint=endpoint_config(server),
        weights=weights_config(server),
        process=ProcessConfig(pid=server.pid, start_ticks=server.start_ticks),
    )
