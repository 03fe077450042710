"""The running exporter: wires config, sources, sampler, trackers and history together.

The sampler threads write readings; one tracker tick per interval turns the latest readings of
each target into an `Observation` (runtime/observe.py), feeds the tracker and hands finished
loads to the filing (runtime/filing.py). `snapshot()` hands the HTTP side an immutable view, so a
scrape never waits on a source. Which targets there are, configured or discovered, is
runtime/admission.py's, and which log each follows runtime/logfollow.py's; this module builds
each target's sources and registers their loops.

How often each loop runs is runtime/pacing.py's: the runtime hands it what it last saw. An exit
or a news reading (runtime/observe.py says which) wakes the loops at once (runtime/reactions.py),
and a ready target's residency is refreshed every SERVING_REFRESH_SECONDS (a load's start
measures it afresh anyway).
"""

from __future__ import annotations

import logging
import platform
import threading
import time
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

from exporter import __version__
from exporter.config.schema import Config, TargetConfig
from exporter.discovery.found import DiscoveredServer
from exporter.discovery.refusals import Refusals
from exporter.discovery.scan import Discoverer
from exporter.history.store import HistoryStore
from exporter.load.records import LoadRecord, LoadState
from exporter.load.tracker import Scope, Tracker
from exporter.runtime.admission import Admission, model_of, models_apart, on_behalf, on_behalf_of
from exporter.runtime.exitwatch import ExitWatch
from exporter.runtime.filing import Filing, restart_forecast
from exporter.runtime.logfollow import TargetLog, read_every_interval
from exporter.runtime.observe import (
    TargetReadings,
    bytes_read_under,
    counters_before,
    observe,
    read_counters,
)
from exporter.runtime.pacing import QUIET_INTERVAL, Pacing, ProbeCadence
from exporter.runtime.reactions import DISCOVERY_LOOP, TRACKER_LOOP, Reactions
from exporter.runtime.sampler import Reading, Sampler
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.runtime.target import WatchedTarget
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
from exporter.sources.endpoint import EndpointProber
from exporter.sources.environment import REFRESH_SECONDS as ENVIRONMENT_REFRESH_SECONDS
from exporter.sources.environment import EnvironmentSource
from exporter.sources.gpu import NvmlSource, mark_pcie
from exporter.sources.memory import MemorySource
from exporter.sources.netfs import NETFS
from exporter.sources.nvml_pids import NvmlPidCheck
from exporter.sources.process import ProcessFinder
from exporter.sources.residency import (
    QUIET_REFRESH_SECONDS,
    SERVING_REFRESH_SECONDS,
    ResidencySource,
)
from exporter.sources.storage import WeightStorage
from exporter.sources.weightfiles import WeightFilesSource
from exporter.sources.zfs import ZFS
from exporter.trust.asprocess import Actor, OnBehalf
from exporter.trust.safeio import Refused
from exporter.trust.untrusted import clean
from exporter.vocabulary import ProbeResult, TargetRole

log = logging.getLogger(__name__)


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
        # The threads that read processes' files while discovery looks at them (each target
        # has its own: WatchedTarget.actor).
        self._discovery_actor = Actor()
        self._lock = threading.Lock()
        self._ticked = threading.Event()
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
                actor=self._discovery_actor,
                refusals=self.refusals,
                users=config.discovery.users,
            )
            if config.discovery.active(bool(config.targets))
            else None
        )
        self.filing = Filing(self.history, self._lock, lambda: self.targets)
        self.admission = Admission(
            config,
            self,
            self.filing,
            discoverer=discoverer,
            refusals=self.refusals,
            clock=clock,
            lock=self._lock,
        )
        self.reactions = Reactions(
            self.sampler, self.exits, self.admission, self._lock, self._tracker
        )
        for configured in config.targets:
            self.admission.add(configured)
        self.nvml = NvmlSource(nvml, pid_check=gpu_pid_check or NvmlPidCheck(proc_root))
        self.sampler.add(
            MEMORY,
            "",
            MemorySource(proc_root).sample,
            every=lambda: self.pacing.memory(self._failing(MEMORY, "")),
            after=self.reactions.after_memory,
        )
        # NVML retries a failed init on its own clock (every 60 s): the quiet pace will do.
        self.sampler.add(NVML, "", self.nvml.sample, every=self.pacing.loop)
        self.sampler.add_loop(TRACKER_LOOP, self.tick, every=self.pacing.loop)
        if discoverer is not None:
            self.sampler.add_loop(
                DISCOVERY_LOOP, self.admission.discover, every=self.admission.wait
            )
        self.filing.read_past_loads()

    @property
    def targets(self) -> dict[str, WatchedTarget]:
        """The targets watched now, by name (exporter/runtime/admission.py keeps the set)."""
        return self.admission.targets

    # -- what admission asks of the wiring (runtime/admission.py: Wiring) --------------------

    def new_target(self, config: TargetConfig, found: DiscoveredServer | None) -> WatchedTarget:
        """A target's tracker, prober, probe cadence and log; wire() builds its sources."""

        def log_rights(pid: int) -> OnBehalf | None:  # a found log is read as its process reads
            return self._process_rights(target, pid)

        target = WatchedTarget(
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
        return target

    def wire(self, target: WatchedTarget) -> None:
        """(Re)build the sources of a target from its config and register their loops."""
        config = target.config
        # A repository that came to hold several models (poll mode): they are targets of their
        # own from now on, and the server's keeps its process's loads.
        target.tracker.scope = _scope(config, target.discovered)
        target.tracker.follower = config.role is TargetRole.FOLLOWER
        target.finder = (
            ProcessFinder(config.process, proc_root=self._proc_root) if config.process else None
        )
        behalf = on_behalf(target.actor, self._proc_root, target.discovered)
        target.storage = (
            WeightStorage(config.weights, proc_root=self._proc_root, sys_root=self._sys_root)
            if config.weights
            else None
        )
        target.residency = (
            ResidencySource(
                config.weights,
                cpu_budget=self.config.residency_cpu_budget,
                clock=self._clock,
                refresh_after=lambda: (
                    SERVING_REFRESH_SECONDS if target.settled else QUIET_REFRESH_SECONDS
                ),
                on_behalf=behalf,
                max_entries=self.config.discovery.max_files if behalf else None,
                on_refused=lambda exc: self._refused_tree(config.name, exc),
                storage=target.storage,
            )
            if config.weights
            else None
        )
        target.cadence.ready_interval = config.endpoint.ready_interval
        target.cadence.process_matching = config.process is not None
        if config.role is TargetRole.FOLLOWER:  # it serves nothing: nothing to ask
            self.sampler.discard(ENDPOINT, config.name)
        else:
            self.sampler.add(
                ENDPOINT,
                config.name,
                target.prober.sample,
                every=lambda: target.cadence.delay(self._probe_result(config.name)),
                after=lambda reading: self.reactions.after_probe(target, reading),
            )
        if target.watched_pid is not None:  # another process from now on
            self.exits.forget(target.watched_pid)
            target.watched_pid = None

        if target.finder is not None:
            self.sampler.add(
                PROCESS,
                config.name,
                target.finder.sample,
                every=self._pace_of(PROCESS, target),
                after=lambda reading: self.reactions.after_process(target, reading),
            )
        else:
            self.sampler.discard(PROCESS, config.name)
        if target.residency is not None:
            self.sampler.add(
                PAGECACHE,
                config.name,
                target.residency.sample,
                every=self._pace_of(PAGECACHE, target),
                after=lambda reading: self.reactions.after_residency(target, reading),
            )
        else:
            self.sampler.discard(PAGECACHE, config.name)
        if target.storage is not None:
            describe = target.storage.describe
            self.sampler.add(
                STORAGE,
                config.name,
                (lambda: behalf.run(describe)) if behalf is not None else describe,
                every=self._storage_pace(config.name),
            )
        else:
            self.sampler.discard(STORAGE, config.name)
        if target.finder is not None and config.weights is not None:
            name = config.name
            files = target.files = WeightFilesSource(
                config.weights,
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
                every=self._files_pace(target),
                after=lambda reading: self.reactions.after_files(target, reading),
            )
        else:
            self.sampler.discard(WEIGHT_FILES, config.name)
            target.files = None
        self._wire_environment(target)
        self.host.watch(config.name, config.weights.paths if config.weights else None, behalf)
        if self.pacing.unsettle():  # a new target, or a new process of one
            self.sampler.wake_all()

    def _process_rights(self, target: WatchedTarget, pid: int) -> OnBehalf:
        """How a target's server process `pid` is read for: a discovered server's rights as
        found, a configured target's process's own (ProcessLookupError, Borrowed)."""
        found = on_behalf(target.actor, self._proc_root, target.discovered)
        return found or on_behalf_of(target.actor, self._proc_root, pid)

    def _wire_environment(self, target: WatchedTarget) -> None:
        """The server's environment, learned from its tree with its root process's rights:
        kept across its restarts by the same user (the next start maps the same files), so only
        made once per target."""
        config = target.config
        if target.finder is None:
            self.sampler.discard(ENVIRONMENT, config.name)
            target.environment = None
            return
        if target.environment is not None:
            target.environment.follow(config.weights)
            return
        name = config.name
        target.environment = EnvironmentSource(
            config.weights,
            lambda: self.sampler.value(PROCESS, name),
            lambda pid: self._process_rights(target, pid),
            proc_root=self._proc_root,
            clock=self._clock,
            cpu_budget=self.config.residency_cpu_budget,
            refresh_after=lambda: (
                SERVING_REFRESH_SECONDS if target.settled else ENVIRONMENT_REFRESH_SECONDS
            ),
        )
        self.sampler.add(
            ENVIRONMENT, name, target.environment.sample, every=self._pace_of(ENVIRONMENT, target)
        )

    def _refused_tree(self, name: str, exc: Refused) -> None:
        self.refusals.note(exc.reason, (name, exc.reason), "target %s: %s", name, exc)

    def unwire(self, target: WatchedTarget) -> None:
        """Stop a dropped target's sources and forget what was measured of it."""
        name = target.config.name
        target.prober.close()
        self.sampler.remove(name)
        self.host.watch(name, None)
        self.filing.load_durations.forget(name)
        self.filing.phase_durations.forget(name)
        if target.watched_pid is not None:
            self.exits.forget(target.watched_pid)
        target.log.close()
        target.actor.close()
        self.history.own(name, None)

    def pids_watched(self, name: str) -> Collection[int]:
        """The processes a target's tree holds now, as its last process sample found them."""
        process = self.sampler.value(PROCESS, name)
        return process.pids if process is not None else ()

    def _tracker(self, config: TargetConfig, found: DiscoveredServer | None) -> Tracker:
        return Tracker(
            config.name,
            stall_after=config.stall_after,
            expectations=self.history,
            interval=self.config.sample_interval,
            scope=_scope(config, found),
            follower=config.role is TargetRole.FOLLOWER,
        )

    # -- the loops ---------------------------------------------------------------------------

    def start(self) -> None:
        self.sampler.start()

    def stop(self) -> None:
        for target in self.targets.values():
            target.prober.close()  # a probe in flight ends now, not at its timeout
        self.sampler.stop()
        self._discovery_actor.close()
        for target in self.targets.values():
            target.actor.close()
        self.exits.close()
        for target in self.targets.values():
            target.log.close()
        self.nvml.close()
        self.history.close()

    @property
    def ready(self) -> bool:
        """True once the first tracker tick has run (what /-/ready reports)."""
        return self._ticked.is_set()

    def tick(self) -> None:
        """Feed every tracker one observation and file the loads that finished."""
        now = self._clock()
        self.reactions.note_clock_step(now)
        self.history.retry()  # loads a full disk could not take yet
        disk = self.sampler.value(DISK)
        with self._lock:
            targets = list(self.targets.values())
        moved = False  # a phase changed: paces change with it
        for target in targets:
            self._follow_log(target, now)
            seen_now = observe(self._readings(target, disk), now)
            target.log.seq = seen_now.log_seq
            observation, gpu_memory = seen_now.observation, seen_now.gpu_memory
            name = target.config.name
            if target.residency is not None:
                counted = (disk, self.sampler.value(NETFS), self.sampler.value(ZFS))
                target.residency.note_device_reads(bytes_read_under(name, counted))
            host_reads = (self.sampler.latest(src) for src in (DISK, NETFS, ZFS))
            reads = read_counters(name, host_reads)
            seen = target.reads_seen
            if reads is not None and (not seen or seen[-1].at != reads.at):
                seen.append(reads)
            record = target.tracker.observe(observation)
            for model in target.tracker.unloaded_now:
                log.info(  # the server's own name for the model: untrusted text
                    "target %s: the server unloaded model %s", target.config.name, clean(model)
                )
            if record is not None:
                target.tracker.reported(self.filing.file(target, record, reads))
                self.reactions.measure_now(target)  # what the next restart would find
            state = target.tracker.state(now)
            if state.in_progress and state.started_at != target.started_at:
                # A new load: its cache temperature needs a residency pass now, not when the
                # CPU budget next allows one.
                target.started_at = state.started_at
                target.pcie_at_start = {}
                target.reads_at_start = counters_before(target.reads_seen, state)
                self.reactions.measure_now(target)
                self._files_afresh(target, state)
            gpus = self.sampler.latest(NVML)
            if state.in_progress and gpus is not None:  # each GPU's first counter in the load
                target.pcie_at_start = mark_pcie(
                    target.pcie_at_start, gpus.good, gpus.finished_at, state.started_at
                )
            if target.cadence.set_phase(state.phase, state.in_server and state.in_progress):
                moved = True
            self.reactions.note_hung(target, state)
            with self._lock:
                target.state, target.gpu_memory = state, gpu_memory
        if self.pacing.note((target.settled for target in targets), moved):
            self.sampler.wake_all()
        self._ticked.set()

    def _files_afresh(self, target: WatchedTarget, state: LoadState) -> None:
        """A model loaded into the running server reads its files again: the file view starts
        over (the tracker holds the older account off: what the load before consumed is no
        progress of this one)."""
        if state.in_server and target.files is not None:
            target.files.restart()
            self.sampler.sample_soon(WEIGHT_FILES, target.config.name)

    @property
    def quiet(self) -> bool:
        """Every target settled: the gauges' loops run at the quiet pace (runtime/pacing.py)."""
        return self.pacing.quiet

    def _failing(self, source: SourceKey[Any], target: str) -> bool:
        reading = self.sampler.latest(source, target)
        return reading is not None and not reading.ok

    def _pace_of(
        self, source: SourceKey[Any], target: WatchedTarget | None = None
    ) -> Callable[[], float]:
        """A source's loop asks exporter/runtime/pacing.py, with its target's state and its own."""
        if target is None:
            return lambda: self.pacing.host_source(self._failing(source, ""))
        name = target.config.name
        return lambda: self.pacing.source(target.settled, self._failing(source, name))

    def _files_pace(self, target: WatchedTarget) -> Callable[[], float]:
        name = target.config.name
        return lambda: self.pacing.weight_files(
            target.cadence.phase, target.settled, self._failing(WEIGHT_FILES, name)
        )

    def _storage_pace(self, target: str) -> Callable[[], float]:
        def pace() -> float:
            reading = self.sampler.latest(STORAGE, target)
            unplaced = reading is not None and reading.good is not None and reading.good.unplaced
            return self.pacing.storage(reading is None or not reading.ok or bool(unplaced))

        return pace

    def _probe_result(self, name: str) -> ProbeResult | None:
        probe = self.sampler.value(ENDPOINT, name)
        return probe.result if probe is not None else None

    def _follow_log(self, target: WatchedTarget, now: float) -> None:
        """Sample the log exporter/runtime/logfollow.py says the target follows now."""
        name = target.config.name
        watched = target.finder is not None
        process = self.sampler.latest(PROCESS, name) if watched else None
        found = target.discovered
        switch = target.log.update(
            now, process, watched=watched, found=found, model=model_of(target.config, found)
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
                every=self._log_pace(target),
                after=lambda reading: self.reactions.after_log(target, reading),
            )

    def _log_pace(self, target: WatchedTarget) -> Callable[[], float]:
        """A gauge's pace, except for a server whose log alone says a load began inside it."""
        name = target.config.name

        def pace() -> float:
            every = read_every_interval(self.sampler.latest(LOGS, name))
            return self.pacing.source(target.settled and not every, self._failing(LOGS, name))

        return pace

    def _readings(self, target: WatchedTarget, disk: DiskSample | None) -> TargetReadings:
        """The latest readings of one target's sources, for the tick's observation."""
        name = target.config.name
        process_configured = target.finder is not None
        followed = target.log.source is not None
        return TargetReadings(
            name=name,
            gpus=target.config.gpus,
            process_configured=process_configured,
            probe=self.sampler.latest(ENDPOINT, name),
            process=self.sampler.value(PROCESS, name) if process_configured else None,
            pagecache=self.sampler.latest(PAGECACHE, name) if target.residency else None,
            logs=self.sampler.latest(LOGS, name) if followed else None,
            log_followed=followed,
            files=self.sampler.latest(WEIGHT_FILES, name) if process_configured else None,
            gpu=self.sampler.value(NVML),
            disk=disk,
            storage=self.sampler.value(STORAGE, name),
            log_seq=target.log.seq,
        )

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
                    target.config,
                    target.state,
                    by_target.get(name, {}),
                    dict(target.gpu_memory),
                    target.discovered,
                    pcie_at_start=target.pcie_at_start,
                    forecast=restart_forecast(target.past, by_target.get(name, {})),
                    log_finding=target.log.finding,
                    past=target.past,
                )
                for name, target in self.targets.items()
            )
            return Snapshot(
                time=self._clock(),
                build={"version": __version__, "python_version": platform.python_version()},
                host=host,
                targets=views,
                load_durations=self.filing.load_durations.snapshot(),
                phase_durations=self.filing.phase_durations.snapshot(),
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


def _scope(config: TargetConfig, found: DiscoveredServer | None) -> Scope:
    """What of its server a target watches (exporter/runtime/admission.py: targets_of)."""
    if model_of(config, found) is not None:
        return Scope.MODEL
    return Scope.PROCESS if models_apart(found) else Scope.SERVER
