"""How often each loop runs: DESIGN's cadences, as pure rules over what was last seen.

No threads and no clock: the runtime asks (a sampler loop's `every`), so a replay of phases and
readings checks every rule without sleeping (tests/test_pacing.py).

* The probe (`ProbeCadence`): probing a serving instance costs it work (the default probe is a
  1-token completion), and probing a loading one is how its end is seen. While `initializing`
  (weights in, endpoint not ready yet), and through a load inside a running server (a model
  loaded into Triton: the server answers throughout, and ends it in one answer): several probes
  per sample interval (every interval / 4, at least 50 ms apart), so the load's end is seen
  within a fraction of a second of the server's first answer. While `ready`, with process
  matching, and the last probe said ready: every `endpoint.ready_interval` (default 10 s); a
  restart or an exit is seen at once anyway (the runtime watches the process through a pidfd)
  and moves the phase, which brings the fast pace back. Otherwise, and from the first failed
  probe on: every sample interval. Without process matching a restart shows only as failing
  probes, so the endpoint is then probed every sample interval even while ready.
* The weight files: FILE_LOOKS_PER_INTERVAL looks per interval while a load is starting or
  loading its weights: a shard opened and closed between two looks is never seen held.
* Quiet mode (DESIGN, "idle costs next to nothing"): once every target is settled (ready, and
  its exit watched through a pidfd), nothing but that exit, a failing probe or evicted weights
  can change a phase; the first two wake every loop at once, so what only feeds gauges (disk,
  memory, GPU memory, residency, the process tree) and the tracker tick run every
  QUIET_INTERVAL; host memory, whose page cache shrinking brings a residency pass (an eviction),
  every EVICTION_LOOK_SECONDS. A source whose last sample failed keeps the sample interval, so
  that its recovery shows at once.
* The storage under a target's weights changes with a mount, not a load: every
  STORAGE_REFRESH_SECONDS, or every interval while a path could not be placed.
"""

from __future__ import annotations

from collections.abc import Iterable

from exporter.vocabulary import IN_PROGRESS, Phase, ProbeResult

INITIALIZING_PROBES_PER_INTERVAL = 4
MIN_PROBE_GAP = 0.05
# While every target is settled, gauges and the tracker are sampled every other 15-s scrape.
QUIET_INTERVAL = 30.0
# While a load is starting or loading its weights, the weight files are looked at this often
# per sample interval (a look of a TP-8 tree costs under a millisecond).
FILE_LOOKS_PER_INTERVAL = 4
STORAGE_REFRESH_SECONDS = 30.0
# While quiet, host memory is still read this often: its page cache shrinking is how an eviction
# of a serving model's weights is noticed (exporter/sources/memory.py), and DESIGN wants that in
# the eviction alert within 60 s, of which Prometheus's scrape and rule evaluation (15 s each in
# the shipped config) take up to 30.
EVICTION_LOOK_SECONDS = 15.0
_LOADING_FILES = frozenset({Phase.STARTING, Phase.LOADING_WEIGHTS})


class ProbeCadence:
    """The tracker tick sets the phase; the endpoint's sampling loop asks for the next delay."""

    def __init__(self, interval: float, ready_interval: float, process_matching: bool) -> None:
        self.interval = interval
        self.ready_interval = ready_interval
        self.process_matching = process_matching
        self.initializing_interval = min(
            interval, max(MIN_PROBE_GAP, interval / INITIALIZING_PROBES_PER_INTERVAL)
        )
        self._phase: Phase | None = None
        self._in_server = False

    @property
    def phase(self) -> Phase | None:
        return self._phase

    def delay(self, last: ProbeResult | None) -> float:
        """Seconds from one probe to the next, given the last probe's result."""
        phase = self._phase
        if phase is Phase.INITIALIZING or (self._in_server and phase in IN_PROGRESS):
            return self.initializing_interval
        if phase is Phase.READY and self.process_matching and last is ProbeResult.READY:
            return self.ready_interval
        return self.interval

    def set_phase(self, phase: Phase, in_server: bool = False) -> bool:
        """Record the tracker's phase (`in_server`: of a load inside the running server); True
        when the next probe is now due sooner than planned (the caller wakes the probing loop
        so the faster pace starts at once)."""
        before = self.delay(ProbeResult.READY)
        self._phase, self._in_server = phase, in_server
        return self.delay(ProbeResult.READY) < before


class Pacing:
    """The loops' delays from what the runtime last saw; `quiet` is the one state it keeps."""

    def __init__(self, interval: float, quiet_interval: float = QUIET_INTERVAL) -> None:
        self.interval = interval
        self.quiet_interval = quiet_interval
        self.quiet = False  # every target settled: the gauges' loops run at quiet_interval

    def loop(self) -> float:
        """The tracker tick and NVML (which retries a failed init on its own 60-s clock)."""
        return self.quiet_interval if self.quiet else self.interval

    def source(self, settled: bool, failing: bool) -> float:
        """A target's gauge source while its target is settled (a host-wide one: while the
        exporter is quiet), unless its last sample failed."""
        return self.quiet_interval if settled and not failing else self.interval

    def host_source(self, failing: bool) -> float:
        return self.source(self.quiet, failing)

    def memory(self, failing: bool) -> float:
        """Host memory feeds gauges and tells of evictions: never more than
        EVICTION_LOOK_SECONDS apart (two reads of /proc, some 100 µs)."""
        return min(self.host_source(failing), EVICTION_LOOK_SECONDS)

    def weight_files(self, phase: Phase | None, settled: bool, failing: bool) -> float:
        if phase in _LOADING_FILES:
            return self.interval / FILE_LOOKS_PER_INTERVAL
        return self.source(settled, failing)

    def storage(self, unsettled: bool) -> float:
        """`unsettled`: its last description failed or left a weights path unplaced."""
        return self.interval if unsettled else STORAGE_REFRESH_SECONDS

    def note(self, settled: Iterable[bool], moved: bool) -> bool:
        """After a tick: whether every loop must re-ask its pace now (a phase moved, so the
        probe's cadence did; or the exporter stops being quiet)."""
        quiet = all(settled)
        wake = moved or (self.quiet and not quiet)
        self.quiet = quiet
        return wake

    def unsettle(self) -> bool:
        """A new target, or a new process of one: not quiet until it settles; whether every
        loop must re-ask its pace now (it was quiet)."""
        was, self.quiet = self.quiet, False
        return was
