"""What the runtime does as a reading arrives, between ticks: tick now, sample a source now,
watch a process's exit, look for a restarted server now, measure residency now; and the notes
the tick takes of a wall-clock step back and of a ready server gone hung.

An exit or a news reading (exporter/runtime/observe.py says which) wakes the loops at once, so a
phase moves within a reading, not an interval (or a quiet interval) later.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from exporter.config.schema import TargetConfig
from exporter.discovery.found import DiscoveredServer
from exporter.load.records import LoadState
from exporter.load.tracker import Tracker
from exporter.runtime.admission import Admission
from exporter.runtime.exitwatch import ExitWatch
from exporter.runtime.observe import files_news, log_is_news, probe_is_news
from exporter.runtime.sampler import Reading, Sampler
from exporter.runtime.target import WatchedTarget
from exporter.sources import ENDPOINT, ENVIRONMENT, LOGS, PAGECACHE, PROCESS
from exporter.sources.endpoint import ProbeSample
from exporter.sources.logs import LogSample
from exporter.sources.memory import MemorySample
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.weightfiles import WeightFilesSample
from exporter.vocabulary import IN_PROGRESS, ProbeResult

log = logging.getLogger(__name__)

TRACKER_LOOP = "tracker"
DISCOVERY_LOOP = "discovery"
# A tick earlier than the previous one by more than this is a wall-clock step, not jitter.
CLOCK_STEP_SECONDS = 1.0


class Reactions:
    """The runtime's answers to readings, called on the sampler's threads (`after=`) and by the
    tick; `lock` guards the targets against the snapshot, `tracker` makes a target's tracker."""

    def __init__(
        self,
        sampler: Sampler,
        exits: ExitWatch,
        admission: Admission,
        lock: threading.Lock,
        tracker: Callable[[TargetConfig, DiscoveredServer | None], Tracker],
    ) -> None:
        self.sampler = sampler
        self.exits = exits
        self.admission = admission
        self._lock = lock
        self._tracker = tracker
        self._last_tick: float | None = None

    def after_process(self, target: WatchedTarget, reading: Reading[ProcessSample]) -> None:
        """Watch the exit of the server's root process, and tell the tracker when it changed."""
        process = reading.good
        root = process.root_pid if process is not None and process.found else None
        target.log.process_seen(process)
        if root == target.watched_pid:
            return
        if target.watched_pid is not None:
            self.exits.forget(target.watched_pid)
            self.sampler.sample_soon(LOGS, target.config.name)  # its last lines say why
            self.sampler.run_soon(TRACKER_LOOP)  # gone, or replaced: the phase moves now
            if target.discovered is not None and self.admission.discoverer is not None:
                # Its restart may be up before the next pass is due: look for it now.
                self.admission.look_now()
                self.sampler.run_soon(DISCOVERY_LOOP)
        name = target.config.name
        watched = root is not None and self.exits.watch(
            root, lambda: self.sampler.sample_soon(PROCESS, name)
        )
        target.watched_pid = root if watched else None

    def note_clock_step(self, now: float) -> None:
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
        for target in self.admission.targets.values():
            target.tracker = self._tracker(target.config, target.discovered)
            target.started_at = None

    def after_files(self, target: WatchedTarget, reading: Reading[WeightFilesSample]) -> None:
        """A weight file first opened, every one let go, or every byte consumed (an mmap loader
        keeps its map): the phase moves, so tick now, not up to an interval later (a server
        whose start-up ends just after its weights, llama.cpp's, is ready by then and would be
        seen an interval late); and when they are let go, measure residency now, which says
        whether the files were read whole (those opened and closed between two looks too)."""
        files = reading.good
        if files is None:
            return
        news = files_news(files)
        if news == target.files_news:
            return
        target.files_news = news
        if files.idle_since is not None:
            self.measure_now(target)
        self.sampler.run_soon(TRACKER_LOOP)

    def measure_now(self, target: WatchedTarget) -> None:
        """A residency pass now, whatever the CPU budget says: a load began (its cache
        temperature), its files were let go (read whole?) or it ended (the serving residency,
        else stale until the serving refresh, minutes away)."""
        if target.residency is not None:
            target.residency.request_full_pass()
            self.sampler.sample_soon(PAGECACHE, target.config.name)

    def after_memory(self, reading: Reading[MemorySample]) -> None:
        """Pages left the host's page cache: a target's weights may be among them, so measure
        its residency now, not at its next refresh (minutes while it serves)."""
        memory = reading.good
        if memory is None:
            return
        with self._lock:
            targets = list(self.admission.targets.values())
        for target in targets:
            residency = target.residency
            if residency is not None and residency.note_departures(
                memory.page_cache_departed_bytes
            ):
                self.sampler.sample_soon(PAGECACHE, target.config.name)
            environment = target.environment
            if environment is not None and environment.note_departures(
                memory.page_cache_departed_bytes
            ):
                self.sampler.sample_soon(ENVIRONMENT, target.config.name)

    def after_residency(self, target: WatchedTarget, reading: Reading[ResidencySample]) -> None:
        """A fresh pass during a load may say the weights are in: tick now (passes are rare).
        A settled target's pass changes no phase, and the restart forecast is made from the
        latest pass at each snapshot: no tick (evictions while serving bring passes often)."""
        sample = reading.good
        if sample is None or sample.measured_at == target.residency_seen:
            return
        target.residency_seen = sample.measured_at
        if not target.settled:
            self.sampler.run_soon(TRACKER_LOOP)

    def after_probe(self, target: WatchedTarget, reading: Reading[ProbeSample]) -> None:
        """Tick now, not up to an interval (or a quiet interval) later, when an answer matters:
        the first ready answer of a load in progress ends it at that answer; between loads,
        every failed answer (each counts towards a hung server or an endpoint-only load) and
        the first good one after them."""
        value = reading.good
        result = value.result if value is not None else None
        last, target.last_result = target.last_result, result
        if probe_is_news(result, last, target.cadence.phase in IN_PROGRESS):
            if result is ProbeResult.READY and target.log.source is not None:
                self.sampler.sample_soon(LOGS, target.config.name)  # the lines up to it
            self.sampler.run_soon(TRACKER_LOOP)

    def note_hung(self, target: WatchedTarget, state: LoadState) -> None:
        """Log once when the tracker calls a ready server hung (its process runs on, its
        endpoint stopped answering), and once when it answers again."""
        if state.hung == target.hung:
            return
        target.hung = state.hung
        name = target.config.name
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

    def after_log(self, target: WatchedTarget, reading: Reading[LogSample]) -> None:
        """Tick now when the log has news the tracker acts on: a load that answered ready waits
        for a read of the log after the answer (it dates a short load's phases); between loads,
        a line may begin a load inside the running server, or say it unloaded a model."""
        in_progress = target.cadence.phase in IN_PROGRESS
        if log_is_news(reading.good, target.log.seq, in_progress, target.last_result):
            self.sampler.run_soon(TRACKER_LOOP)
