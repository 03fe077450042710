"""The running exporter: wires config, sources, sampler, trackers and history together.

The sampler threads write readings; one tracker tick per interval turns the latest readings of each
target into an `Observation` (exporter/observation.py), feeds the tracker and files finished
loads. `snapshot()` hands the HTTP side an immutable view, so a scrape never waits on a source.
Which targets there are, configured or discovered, is exporter/admission.py's, and which log each
follows exporter/logs/follow.py's; this module builds each target's sources and registers their
loops.

How often each loop runs is exporter/pacing.py's: the runtime hands it what it last saw. An exit
or a news reading (exporter/observation.py says which) wakes the loops at once (`_after_process`,
`_after_probe`), and a ready target's residency is refreshed every SERVING_REFRESH_SECONDS (a
load's start measures it afresh anyway).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace
from types import ModuleType
from typing import Any

from exporter import __version__
from exporter.config.schema import Config, TargetConfig
from exporter.discovery.found import DiscoveredServer
from exporter.discovery.refusals import Refusals
from exporter.discovery.scan import Discoverer
from exporter.history.explain import baseline, report, storage_reads
from exporter.history.forecast import Environment, Forecast, forecast
from exporter.history.histograms import Histograms
from exporter.history.store import HistoryStore
from exporter.history.targethistory import TargetHistory, read_history
from exporter.load.records import LoadRecord, TargetState
from exporter.load.tracker import Scope, Tracker
from exporter.runtime.admission import Admission, model_of, models_apart, on_behalf, on_behalf_of
from exporter.runtime.exitwatch import ExitWatch
from exporter.runtime.logfollow import TargetLog, read_every_interval
from exporter.runtime.observe import (
    Marked,
    TargetReadings,
    bytes_read_under,
    counters_before,
    files_news,
    log_is_news,
    observe,
    probe_is_news,
    read_counters,
)
from exporter.runtime.pacing import QUIET_INTERVAL, Pacing, ProbeCadence
from exporter.runtime.sampler import Reading, Sampler
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.runtime.target import TargetRuntime
from exporter.runtime.targetnames import uid_of
from exporter.sources import (
    ENDPOINT,
    ENVIRONMENT,
    LOGS,
    MEMORY,
    NVML,
    PAGECACHE,
    PROCESS,
    STORAGE,
    WEIGHT_FILES,
    Host,
    SourceKey,
    host_sources,
)
from exporter.sources.disk import DISK, DiskSample
from exporter.sources.endpoint import EndpointProber, ProbeSample
from exporter.sources.environment import REFRESH_SECONDS as ENVIRONMENT_REFRESH_SECONDS
from exporter.sources.environment import EnvironmentSource
from exporter.sources.gpu import NvmlSource, mark_pcie
from exporter.sources.logs import LogSample
from exporter.sources.memory import MemorySample, MemorySource
from exporter.sources.netfs import NETFS
from exporter.sources.nvml_pids import NvmlPidCheck
from exporter.sources.process import ProcessFinder, ProcessSample
from exporter.sources.residency import (
    QUIET_REFRESH_SECONDS,
    SERVING_REFRESH_SECONDS,
    ResidencySample,
    ResidencySource,
)
from exporter.sources.storage import WeightStorage
from exporter.sources.weightfiles import WeightFilesSample, WeightFilesSource
from exporter.sources.zfs import ZFS
from exporter.trust.asprocess import Actor, OnBehalf
from exporter.trust.safeio import Refused
from exporter.trust.untrusted import clean
from exporter.vocabulary import IN_PROGRESS, Cache, ProbeResult

log = logging.getLogger(__name__)

TRACKER_LOOP = "tracker"
DISCOVERY_LOOP = "discovery"
# A tick earlier than the previous one by more than this is a wall-clock step, not jitter.
CLOCK_STEP_SECONDS = 1.0


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
        self._host_root = host_root  # where container runtimes' logs are (exporter/logs/find.py)
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
        self._ticked = threading.Event()
        self._last_tick: float | None = None
        self._sys_root = sys_root
        self.host = Host(proc_root, sys_root)
        # Started before any target is wired: wiring tells the host's sources of its weights.
        for source in host_sources():  # each declared in its own module (exporter/sources)
            start = source.start(self.host)
            self.sampler.add(source.key, "", start, every=self._pace_of(source.key))
        discoverer = (
            Discoverer(
                config.discovery.servers,
                proc_root=proc_root,
                actor=self.actor,
                refusals=self.refusals,
                users=config.discovery.users,
            )
            if config.discovery.active(bool(config.targets))
            else None
        )
        self.admission = Admission(
            config,
            self,
            discoverer=discoverer,
            refusals=self.refusals,
            clock=clock,
            lock=self._lock,
        )
        for target in config.targets:
            self.admission.add(target)
        self.nvml = NvmlSource(nvml, pid_check=gpu_pid_check or NvmlPidCheck(proc_root))
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
        if discoverer is not None:
            self.sampler.add_loop(
                DISCOVERY_LOOP, self.admission.discover, every=self.admission.wait
            )
        self.read_histories()

    @property
    def targets(self) -> dict[str, TargetRuntime]:
        """The targets watched now, by name (exporter/admission.py keeps the set)."""
        return self.admission.targets

    # -- what admission asks of the wiring (exporter/admission.Wiring) ------------------------

    def new_target(self, config: TargetConfig, found: DiscoveredServer | None) -> TargetRuntime:
        """A target's tracker, prober, probe cadence and log; wire() builds its sources."""

        def log_rights(pid: int) -> OnBehalf | None:  # a found log is read as its process reads
            return self._process_rights(runtime, pid)

        runtime = TargetRuntime(
            config=config,
            tracker=self._tracker(config, found),
            prober=EndpointProber(config.endpoint),
            cadence=ProbeCadence(
                self.config.sample_interval,
                config.endpoint.ready_interval,
                process_matching=config.process is not None,
            ),
            finder=None,
            residency=None,
            log=TargetLog(
                config.name,
                config.log,
                log_rights,
                clock=self._clock,
                proc_root=self._proc_root,
                host_root=self._host_root,
            ),
            discovered=found,
        )
        self.history.own(config.name, uid_of(found) if found is not None else None)
        return runtime

    def wire(self, runtime: TargetRuntime) -> None:
        """(Re)build the sources of a target from its config and register their loops."""
        target = runtime.config
        # A repository that came to hold several models (poll mode): they are targets of their
        # own from now on, and the server's keeps its process's loads.
        runtime.tracker.scope = _scope(target, runtime.discovered)
        runtime.finder = (
            ProcessFinder(target.process, proc_root=self._proc_root) if target.process else None
        )
        behalf = on_behalf(self.actor, self._proc_root, runtime.discovered)
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
        self._wire_environment(runtime)
        self.host.watch(target.name, target.weights.paths if target.weights else None, behalf)
        if self.pacing.unsettle():  # a new target, or a new process of one
            self.sampler.wake_all()

    def _process_rights(self, runtime: TargetRuntime, pid: int) -> OnBehalf:
        """How a target's server process `pid` is read for: a discovered server's rights as
        found, a configured target's process's own (ProcessLookupError, Borrowed)."""
        found = on_behalf(self.actor, self._proc_root, runtime.discovered)
        return found or on_behalf_of(self.actor, self._proc_root, pid)

    def _wire_environment(self, runtime: TargetRuntime) -> None:
        """The server's environment, learned from its tree with its root process's rights:
        kept across its restarts by the same user (the next start maps the same files), so only
        made once per target."""
        target = runtime.config
        if runtime.finder is None:
            self.sampler.discard(ENVIRONMENT, target.name)
            runtime.environment = None
            return
        if runtime.environment is not None:
            runtime.environment.follow(target.weights)
            return
        name = target.name
        runtime.environment = EnvironmentSource(
            target.weights,
            lambda: self.sampler.value(PROCESS, name),
            lambda pid: self._process_rights(runtime, pid),
            proc_root=self._proc_root,
            clock=self._clock,
            cpu_budget=self.config.residency_cpu_budget,
            refresh_after=lambda: (
                SERVING_REFRESH_SECONDS if runtime.settled else ENVIRONMENT_REFRESH_SECONDS
            ),
        )
        self.sampler.add(
            ENVIRONMENT, name, runtime.environment.sample, every=self._pace_of(ENVIRONMENT, runtime)
        )

    def _refused_tree(self, name: str, exc: Refused) -> None:
        self.refusals.note(exc.reason, (name, exc.reason), "target %s: %s", name, exc)

    def unwire(self, runtime: TargetRuntime) -> None:
        """Stop a dropped target's sources and forget what was measured of it."""
        name = runtime.config.name
        runtime.prober.close()
        self.sampler.remove(name)
        self.host.watch(name, None)
        self.load_durations.forget(name)
        self.phase_durations.forget(name)
        if runtime.watched_pid is not None:
            self.exits.forget(runtime.watched_pid)
        runtime.log.close()
        self.history.own(name, None)

    def pids_watched(self, name: str) -> Collection[int]:
        """The processes a target's tree holds now, as its last process sample found them."""
        process = self.sampler.value(PROCESS, name)
        return process.pids if process is not None else ()

    def past_owner(self, name: str) -> int | None:
        """The user whose load history filed last under `name`."""
        return self.history.owner(name)

    def _tracker(self, target: TargetConfig, found: DiscoveredServer | None) -> Tracker:
        return Tracker(
            target.name,
            stall_after=target.stall_after,
            expectations=self.history,
            interval=self.config.sample_interval,
            scope=_scope(target, found),
        )

    # -- the loops ---------------------------------------------------------------------------

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        for runtime in self.targets.values():
            runtime.prober.close()  # a probe in flight ends now, not at its timeout
        self.sampler.stop()
        self.actor.close()
        self.exits.close()
        for runtime in self.targets.values():
            runtime.log.close()
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
            self._follow_log(runtime, now)
            seen_now = observe(self._readings(runtime, disk), now)
            runtime.log.seq = seen_now.log_seq
            observation, gpu_memory = seen_now.observation, seen_now.gpu_memory
            name = runtime.config.name
            if runtime.residency is not None:
                counted = (disk, self.sampler.value(NETFS), self.sampler.value(ZFS))
                runtime.residency.note_device_reads(bytes_read_under(name, counted))
            host_reads = (self.sampler.latest(src) for src in (DISK, NETFS, ZFS))
            reads = read_counters(name, host_reads)
            seen = runtime.reads_seen
            if reads is not None and (not seen or seen[-1].at != reads.at):
                seen.append(reads)
            record = runtime.tracker.observe(observation)
            for model in runtime.tracker.unloaded_now:
                log.info(  # the server's own name for the model: untrusted text
                    "target %s: the server unloaded model %s", runtime.config.name, clean(model)
                )
            if record is not None:
                runtime.tracker.reported(self._finish(runtime, record, reads))
                self._measure_now(runtime)  # what the next restart would find
            state = runtime.tracker.state(now)
            if state.in_progress and state.started_at != runtime.started_at:
                # A new load: its cache temperature needs a residency pass now, not when the
                # CPU budget next allows one.
                runtime.started_at = state.started_at
                runtime.pcie_at_start = {}
                runtime.reads_at_start = counters_before(runtime.reads_seen, state)
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

    def _after_process(self, runtime: TargetRuntime, reading: Reading[ProcessSample]) -> None:
        """Watch the exit of the server's root process, and tell the tracker when it changed."""
        process = reading.good
        root = process.root_pid if process is not None and process.found else None
        runtime.log.process_seen(process)
        if root == runtime.watched_pid:
            return
        if runtime.watched_pid is not None:
            self.exits.forget(runtime.watched_pid)
            self.sampler.sample_soon(LOGS, runtime.config.name)  # its last lines say why
            self.sampler.run_soon(TRACKER_LOOP)  # gone, or replaced: the phase moves now
            if runtime.discovered is not None and self.admission.discoverer is not None:
                # Its restart may be up before the next pass is due: look for it now.
                self.admission.look_now()
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
            runtime.tracker = self._tracker(runtime.config, runtime.discovered)
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
        news = files_news(files)
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
        last, runtime.last_result = runtime.last_result, result
        if probe_is_news(result, last, runtime.cadence.phase in IN_PROGRESS):
            if result is ProbeResult.READY and runtime.log.source is not None:
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

    def _follow_log(self, runtime: TargetRuntime, now: float) -> None:
        """Sample the log exporter/logs/follow.py says the target follows now."""
        name = runtime.config.name
        watched = runtime.finder is not None
        process = self.sampler.latest(PROCESS, name) if watched else None
        found = runtime.discovered
        switch = runtime.log.update(
            now, process, watched=watched, found=found, model=model_of(runtime.config, found)
        )
        if switch is None:
            return
        if switch.stopped:
            self.sampler.discard(LOGS, name)
        if switch.opened is not None:
            self.sampler.add(
                LOGS,
                name,
                switch.opened.sample,
                every=self._log_pace(runtime),
                after=lambda reading: self._after_log(runtime, reading),
            )

    def _log_pace(self, runtime: TargetRuntime) -> Callable[[], float]:
        """A gauge's pace, except for a server whose log alone says a load began inside it."""
        name = runtime.config.name

        def pace() -> float:
            every = read_every_interval(self.sampler.latest(LOGS, name))
            return self.pacing.source(runtime.settled and not every, self._failing(LOGS, name))

        return pace

    def _after_log(self, runtime: TargetRuntime, reading: Reading[LogSample]) -> None:
        """Tick now when the log has news the tracker acts on: a load that answered ready waits
        for a read of the log after the answer (it dates a short load's phases); between loads,
        a line may begin a load inside the running server, or say it unloaded a model."""
        in_progress = runtime.cadence.phase in IN_PROGRESS
        if log_is_news(reading.good, runtime.log.seq, in_progress, runtime.last_result):
            self.sampler.run_soon(TRACKER_LOOP)

    def _readings(self, runtime: TargetRuntime, disk: DiskSample | None) -> TargetReadings:
        """The latest readings of one target's sources, for the tick's observation."""
        name = runtime.config.name
        process_configured = runtime.finder is not None
        followed = runtime.log.source is not None
        return TargetReadings(
            name=name,
            gpus=runtime.config.gpus,
            process_configured=process_configured,
            probe=self.sampler.latest(ENDPOINT, name),
            process=self.sampler.value(PROCESS, name) if process_configured else None,
            pagecache=self.sampler.latest(PAGECACHE, name) if runtime.residency else None,
            logs=self.sampler.latest(LOGS, name) if followed else None,
            log_followed=followed,
            files=self.sampler.latest(WEIGHT_FILES, name) if process_configured else None,
            gpu=self.sampler.value(NVML),
            disk=disk,
            storage=self.sampler.value(STORAGE, name),
            log_seq=runtime.log.seq,
        )

    def _finish(
        self, runtime: TargetRuntime, record: LoadRecord, reads: Marked | None
    ) -> LoadRecord:
        """File a finished load with its report, built against history before it."""
        during = storage_reads(runtime.reads_at_start, reads.counters) if reads else None
        base = baseline(self.history, record.target, record.cache)
        if runtime.discovered is not None:  # filed as its user's (exporter/runtime/targetnames.py)
            record = replace(record, owner=uid_of(runtime.discovered))
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
        self.read_histories()
        reason = record.report.reason if record.report is not None else None
        with self._lock:  # this load's, whether or not history could keep it
            runtime.past = replace(runtime.past, slower=reason)
        return record

    def read_histories(self) -> None:
        """Read history once per finished load (or new target), not once per scrape."""
        with self._lock:
            runtimes = list(self.targets.values())
        past = [read_history(self.history, runtime.config.name) for runtime in runtimes]
        with self._lock:
            for runtime, view in zip(runtimes, past, strict=True):
                runtime.past = view

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
                    forecast=_forecast(rt.past, by_target.get(name, {})),
                    log_finding=rt.log.finding,
                    past=rt.past,
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
                history_enabled=self.history.enabled,
                history_problem=self.history.problem or self.history.write_problem,
                config_reload_successful=self.reload_successful,
                history_up=self.history.up if self.history.configured else None,
                discovery_refused=self.refusals.counts() if self.admission.discoverer else None,
                metrics=self.config.metrics,
            )

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        return self.history.loads(target, limit)

    def load(self, load_id: int) -> LoadRecord | None:
        return self.history.load(load_id)


def _forecast(past: TargetHistory, readings: Mapping[str, Reading[Any]]) -> Forecast:
    """A restart begun now, from the residency the snapshot shows and what past loads
    measured."""
    reading = readings.get(PAGECACHE.name)
    residency = reading.good if reading is not None else None
    env_reading = readings.get(ENVIRONMENT.name)
    env = env_reading.good if env_reading is not None else None
    environment = (
        Environment(env.warm_bytes, min(env.resident_bytes, env.warm_bytes))
        if env is not None and env.resident_bytes is not None and env.warm_bytes is not None
        else None
    )
    if residency is None:
        return forecast(past.rates, None, None, environment)
    return forecast(past.rates, residency.total_bytes, residency.resident_bytes, environment)


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
        return record, why or (
            "no measurement before its start: its files are learned from the server's own "
            "mappings, at its first load"
        )
    return replace(
        record,
        environment_bytes=found.warm_bytes,
        environment_resident_bytes=min(found.resident_bytes, found.warm_bytes),
    ), None


def _scope(target: TargetConfig, found: DiscoveredServer | None) -> Scope:
    """What of its server a target watches (exporter/admission.py: targets_of)."""
    if model_of(target, found) is not None:
        return Scope.MODEL
    return Scope.PROCESS if models_apart(found) else Scope.SERVER
