"""The load state machine: one Observation per tick in; phase, progress, ETA, stall and records out.

Pure on purpose (no I/O, threads or clock: time arrives inside each Observation), so a 15-minute
load replays in milliseconds in tests and only the sampler decides when things happen.

The rules, in short (the long form, with the reasons, is docs/how-it-decides.md); every threshold
is a named constant below, with why it has its value:

* A load starts when a new server process appears, at its own start time; without process
  matching, when a ready endpoint fails ENDPOINT_FAILURES_FOR_LOAD distinct probes in a row, or
  a never-ready one answers up-but-not-ready (then `partial`: never in the histograms). A
  process first seen more than START_GRACE_INTERVALS intervals + START_GRACE_SECONDS after its
  start is `seen_late`: exact duration, start residency rebuilt from /proc/PID/io, unseen phases
  left out. A running server's log load_begin (Triton) starts an `in_server` load; a model it
  unloads is counted (`unloads`, from that server's first load or unload seen on). Where a
  server's models are targets of their own (Scope), the server's target keeps its process's
  loads and each model's target has its log's loads of that model.
* It ends `ready` at the first ready probe after the start (or the log's earlier ready line),
  `failed` when the process goes first or the log reports a fatal error. A ready server whose
  probes fail while its process runs stays `ready` (a hang, logged once).
* Phases only move forward: starting -> loading_weights -> initializing -> ready; the log's
  markers, where there is a log, give exact boundaries and win.
* Where the tree's weight files can be seen (sources/weightfiles.py) they decide: the weights
  begin at the first open or map; progress is the bytes consumed, pushed by residency, storage
  and PCIe signals never past the files held. The weights end at DONE_RATIO, after
  QUIET_INTERVALS with no weight file held, or at QUIET_DONE_RATIO once progress stopped rising
  for QUIET_INTERVALS.
* Elsewhere progress is the best ratio of the counters of one group, chosen by the start's cache
  temperature (temperature(): WARM_SHARE, COLD_SHARE): storage signals for cold and mixed loads,
  whole-tree signals (GPU memory, read() bytes) for warm ones. Weights begin at BEGIN_RATIO
  (backdated to the last tick without a rise) and end as above.
* A tick moved when a byte signal changed by MOVE_BYTES, the probe result or the phase changed;
  CPU time is not progress. Stalled = in progress and nothing moved for `stall_after`.
* Throughput is the progress over RATE_WINDOW_SECONDS (at least RATE_MIN_INTERVALS intervals);
  ETA = remaining weights / throughput + history's medians for the phases ahead, from loads of
  the same temperature (CACHE_INDEPENDENT phases from any). None wherever a part has no basis.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import NamedTuple, Protocol, TypedDict

from exporter.activity import MOVE_BYTES, ActivityWatch
from exporter.loadreport import LoadReport
from exporter.logs.markers import EventKind, LogEvent, StepTimeline, tighten
from exporter.vocabulary import (
    IN_PROGRESS,
    Activity,
    Cache,
    Outcome,
    Phase,
    ProbeResult,
    Signal,
    Step,
)

# Tie-break order when two signals report the same progress.
PROGRESS_SOURCES = tuple(Signal)

# Distinct failed probes in a row that make a ready endpoint-only target a load (and a hung
# server with process matching worth a log line): one dropped probe is a network blip, not a load.
ENDPOINT_FAILURES_FOR_LOAD = 3
# A process first seen more than START_GRACE_INTERVALS sampling intervals plus START_GRACE_SECONDS
# after its start is seen_late: one the exporter watched start is seen within a tick or two
# (discovery, a slow tick), and the fixed second covers start-time rounding on short intervals.
START_GRACE_INTERVALS = 2.0
START_GRACE_SECONDS = 1.0
# Resident share of the weights at the start that makes a load warm (>=) or cold (<=), mixed
# between: a few pages either way (a stray read, some eviction) must not change the label.
WARM_SHARE = 0.9
COLD_SHARE = 0.1
# Progress at which starting becomes loading_weights: above the noise counters show while the
# interpreter imports, yet early enough that the weights phase loses almost nothing.
BEGIN_RATIO = 0.01
# Progress at which the weights are in: not 1.0, since sizes and counters rarely meet exactly.
DONE_RATIO = 0.999
# Progress at which weights that stopped rising for QUIET_INTERVALS count as in: a loader that
# skips some bytes (unused tensors, a file read in part) never reaches DONE_RATIO.
QUIET_DONE_RATIO = 0.9
# Intervals without a rise (or with no weight file held) that end the weights: long enough for a
# slow shard boundary, short enough that initializing is not mostly billed to the weights.
QUIET_INTERVALS = 5
# Throughput is the progress over the last RATE_WINDOW_SECONDS, and over no fewer than
# RATE_MIN_INTERVALS intervals: smooth enough for an ETA, still following a change of pace.
RATE_WINDOW_SECONDS = 10.0
RATE_MIN_INTERVALS = 3
# MOVE_BYTES (exporter/activity.py): a byte signal's change that counts as movement for stalls.
# Phases whose length does not depend on the page cache: ETAs may take them from any load.
FINE_STEPS = (Step.KV_CACHE, Step.COMPILE, Step.CUDA_GRAPH, Step.WARMUP)
CACHE_INDEPENDENT: tuple[str, ...] = (Phase.INITIALIZING, *FINE_STEPS)
# A log line stamped this much before a load's start still belongs to it: log stamps and the
# process start time come from different clocks, and many servers stamp whole seconds.
LOG_SKEW_SECONDS = 1.0
# How much later than its stamp a line may have been written, against the exporter's clock: a
# server stamping the time since its start starts that clock after exec and its libraries load
# (llama-server: 30-50 ms after the process's start time on 2 busy cores, so its lines read that
# much early). A not-ready answer to a probe sent within this of a ready line does not refute it.
LINE_STAMP_SKEW_SECONDS = 0.25
FATAL_WITHOUT_DETAIL = "the server's log reported a fatal error"

_STORAGE = (Signal.PAGE_CACHE, Signal.PROCESS_READS, Signal.DISK_READS)
_WHOLE = (Signal.GPU_MEMORY, Signal.PROCESS_READ_CHARS)
# Answers that prove something listens but is not ready yet (a 503-style server while it loads).
_UP_NOT_READY = frozenset({ProbeResult.HTTP_ERROR, ProbeResult.BAD_RESPONSE, ProbeResult.TIMEOUT})
_RECENT = 64


@dataclass(frozen=True)
class FileView:
    """What the server tree did with its weight files this process (sources/weightfiles.py)."""

    first_open_at: float | None  # a weight file first seen open or mapped: the weights began
    first_open_seen: bool  # an earlier look saw none held: the open happened while watched
    idle_since: float | None  # after the first open, no weight file held since then
    consumed_bytes: int  # of the weight files, file by file, whatever the loader
    seen_bytes: int  # sizes of the files held so far: the most the tree can have consumed
    total_bytes: int
    direct: bool = False  # a weight file was opened with O_DIRECT: reads around the page cache
    # Not looked at this process yet: nothing held, and not kept as the last view if the next
    # look cannot see (another user's tree): the counters take over then.
    pending: bool = False


@dataclass(frozen=True)
class Observation:
    """One tick's latest readings for one target, composed by the sampler."""

    time: float  # unix seconds
    endpoint_result: ProbeResult | None  # the newest probe's result
    endpoint_probe_time: float | None  # when that probe finished; a probe counts once
    process_configured: bool  # False: endpoint-only semantics
    process_found: bool
    process_pid: int | None
    process_start_time: float | None  # unix seconds: the process's own start time
    process_read_bytes: int | None  # storage bytes read by the tree, from 0 at its start
    process_read_chars: int | None  # bytes through read() by the tree (rchar), not mmap
    process_gpu_bytes: int | None  # GPU memory held by the tree, summed over GPUs
    weights_bytes: int | None  # total size of the weight files
    resident_bytes: int | None  # page-cache bytes of the weight files; None = not measurable
    resident_measured_at: float | None  # when resident_bytes was measured
    disk_read_bytes: int | None  # counter: reads of the devices backing the weights (host-wide)
    # When the newest probe was sent (None: when it finished): its answer is the server's word
    # at some moment between the two.
    endpoint_probe_sent: float | None = None
    log_events: tuple[LogEvent, ...] = ()  # the server log's markers new since the last tick
    log_lines: int | None = None  # lines of the server's log read, plus bytes skipped; None: no log
    log_read_at: float | None = None  # when the log was last read
    # The target follows a log, read or not yet: one just opened (a new process's) has no
    # reading before its first read, and lines it holds may date a load already over.
    log_followed: bool = False
    files: FileView | None = None  # None: the tree's weight files cannot be seen
    gpu_rx_bytes: int | None = None  # PCIe bytes received by the tree's GPUs (a counter)
    # What the storage under the weights says of the label (storage/description.py): bypass (reads
    # go around the page cache), unknown (the page cache is not what serves them), warm (in
    # memory by construction, tmpfs), or None: residency decides.
    storage_cache: Cache | None = None
    process_cpu_seconds: float | None = None  # CPU time the tree used (not a progress signal)
    process_state: str | None = None  # the tree's most telling scheduler state (T, D, R, S)


@dataclass(frozen=True)
class LoadRecord:
    """One finished load, as history stores it."""

    target: str
    started_at: float
    ended_at: float
    outcome: Outcome
    cache: Cache | None  # None when residency at the start is unknown
    partial: bool  # start not known (no process matching): kept out of histograms
    phase_seconds: Mapping[str, float]  # the in-progress phases the load went through
    weights_bytes: int | None
    bytes_read: int | None  # storage bytes the process tree read during the load
    gpu_bytes_at_weights_end: int | None  # the GPU size to expect next time
    seen_late: bool = False  # first seen mid-way: duration exact, only watched phases recorded
    fatal: str | None = None  # the server's own fatal message, when its log gave one
    resident_bytes_at_start: int | None = None  # weights in the page cache as it began
    # Storage bytes the tree read before its first weight file: its own environment (the
    # interpreter, packages, libraries), gigabytes when they had left the page cache.
    startup_read_bytes: int | None = None
    # The server's own files (sources/environment.py) as a run keeps them in the page cache
    # (what a start needs), and the bytes of that cached as it began, by the last pass before
    # its start; None where none was made.
    environment_bytes: int | None = None
    environment_resident_bytes: int | None = None
    id: int | None = None  # history's row id, once stored and read back
    report: LoadReport | None = None  # where its time went and why (exporter/explain.py)

    @property
    def duration_seconds(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True)
class TargetState:
    """Everything /metrics and /api/v1/status show for a target."""

    target: str
    phase: Phase
    in_progress: bool
    started_at: float | None  # start of the current (or last) load
    elapsed_seconds: float  # since the current load started; 0 when none is in progress
    progress_ratio: float | None  # weights progress, 0..1, monotonic within a load
    throughput_bytes_per_second: float | None  # smoothed, while weights load
    weights_eta_seconds: float | None  # remaining weights / throughput
    eta_seconds: float | None  # until ready; None when any part has no basis
    seconds_since_progress: float | None  # None when no load is in progress
    stalled: bool
    cache: Cache | None
    partial: bool
    seen_late: bool
    progress_source: Signal | None  # the signal that last drove progress
    signals: Mapping[str, float | int | None]  # the raw evidence, for /api/v1/status
    last_record: LoadRecord | None
    step: Step | None  # the fine step the server's log says; None without log markers
    fatal: str | None  # why the last load failed, in the server's own words (from its log)
    failed_probes: int = 0  # distinct failed probes in a row
    # Ready, its process running, and ENDPOINT_FAILURES_FOR_LOAD probes in a row failed: no
    # new process, so no load, but the endpoint stopped answering (the ModelServerHung alert).
    hung: bool = False
    in_server: bool = False  # the load is a running server's (a model loaded into it)
    # What the running server last unloaded (its log's name for it), until its next load.
    unloaded: str | None = None
    # Models the running server unloaded since the exporter started; None until it showed it
    # loads models in place (a load or an unload inside it), so other servers carry no series.
    unloads: int | None = None
    # Seconds since each measured signal last moved (exporter/activity.py): what a stall's
    # reason is made of. A signal not measured is absent.
    activity: Mapping[str, float] = field(default_factory=dict)
    cpu_share: float | None = None  # the tree's CPU over the last 10 s, share of one core
    process_state: str | None = None  # the tree's most telling scheduler state (T, D, R, S)
    exited_at: float | None = None  # the watched process was seen gone then; None: running


class _Watched(TypedDict):
    """TargetState's fields of what the process visibly does (`Tracker._watched`)."""

    activity: Mapping[str, float]
    cpu_share: float | None
    process_state: str | None
    exited_at: float | None


class Expectations(Protocol):
    """What history expects of a target's next load (implemented by history.HistoryStore)."""

    def expected_phase_seconds(self, target: str, cache: Cache | None) -> Mapping[str, float]:
        """Median seconds per phase of recent good loads of this cache temperature (None: any)."""
        ...

    def expected_weights_gpu_bytes(self, target: str) -> int | None: ...


class _Probe(NamedTuple):
    result: ProbeResult
    time: float  # when it was answered
    sent: float


class _Evidence(NamedTuple):
    ratio: float
    basis: float | None  # bytes that make a ratio of 1.0; None: not bytes (shards of a log)


@dataclass
class _Load:
    """Mutable bookkeeping of the current (or last) load."""

    started_at: float
    seen_at: float  # the first tick of this load
    partial: bool
    seen_late: bool
    seen_failing: bool
    expected_gpu: int | None
    disk_base: int | None
    gpu_base: int | None
    last_move: float
    weights_began: float | None = None
    weights_ended: float | None = None
    # Whether those boundaries were watched; a load seen late may have crossed them before.
    weights_began_seen: bool = False
    weights_ended_seen: bool = False
    progress: float | None = None
    source: Signal | None = None
    basis: float | None = None
    cache: Cache | None = None
    resident_start: int | None = None
    last_rise: float = 0.0
    flat_time: float = 0.0
    flat_progress: float = 0.0
    gpu_prev: int | None = None
    gpu_at_rise: int | None = None
    gpu_at_weights_end: int | None = None
    log_weights_open: bool = False  # the log said the weights began and has not said they ended
    log_from_start: bool = False  # the log showed this load's weights begin: its steps are whole
    log_shards: tuple[int, int] | None = None  # (done, total) from the log's progress lines
    # Storage bytes the tree had read when its first weight file opened: reads before it are
    # start-up (imports), never weights.
    reads_at_open: int | None = None
    rx_at_open: int | None = None  # the GPUs' PCIe receive counter then
    startup_reads: int | None = None  # storage bytes read at the last look before that open
    files: FileView | None = None  # the last view of the weight files in this load
    files_looked: bool = False  # the view has looked at this load's process (not pending)
    # First seen mid-way with no weight file held: the weights may be behind or ahead of it,
    # so its phases are unknown unless a weight file is seen opening after all.
    phases_unknown: bool = False
    steps: StepTimeline = field(default_factory=StepTimeline)  # the log's fine steps, this load
    fatal: str | None = None
    fatal_at: float | None = None
    ready_at: float | None = None  # the first ready answer, while the log is read up to it
    log_weights_began: float | None = None  # when the log's weights-begin line was dated
    unready_at: float | None = None  # when the last answer that said not ready was asked
    in_server: bool = False  # a running server's load: its process started before it
    reads_base: int | None = None  # the tree's storage reads as an in-server load began
    bytes_read: int | None = None
    weights_bytes: int | None = None
    evidence: dict[Signal, _Evidence] = field(default_factory=dict)
    rate: deque[tuple[float, float]] = field(default_factory=deque)
    expected: dict[Cache | None, Mapping[str, float]] = field(default_factory=dict)


class Scope(Enum):
    """What of a server a target watches (exporter/admission.py: targets_of)."""

    SERVER = "server"  # the whole server: its process's loads, and models loaded into it
    # A server whose models are targets of their own: its process's loads only.
    PROCESS = "process"
    # One model of a server serving several: its loads are the log's load_begin for it (while
    # the server starts too), never the process's start; between them it is ready or down by
    # its own ready answer (down: not loaded). Its observations carry its lines only.
    MODEL = "model"


class Tracker:
    """Follows one target through its loads; feed it one Observation per tick, in time order."""

    def __init__(
        self,
        target: str,
        stall_after: float,
        expectations: Expectations | None = None,
        interval: float = 1.0,
        scope: Scope = Scope.SERVER,
    ) -> None:
        self.target = target
        self.stall_after = stall_after
        self.expectations = expectations
        self.interval = interval
        self.scope = scope
        self._phase = Phase.DOWN
        self._load: _Load | None = None
        self._last_record: LoadRecord | None = None
        self._last_obs: Observation | None = None
        self._recent: deque[Observation] = deque(maxlen=_RECENT)
        self._proc_key: tuple[int | None, float | None] | None = None
        self._proc_gone_at: float | None = None
        self._probe: _Probe | None = None
        self._failed_probes = 0  # distinct failed probes in a row
        self._fail_start = 0.0  # when the first of them finished
        self._logged = False  # whether the target has a log source (observations carry lines)
        # The last load's ready answer (or an in-server load's end): a load_begin line stamped
        # before it is no load inside the running server.
        self._serving_since: float | None = None
        self._unloaded: str | None = None
        self._first_seen: float | None = None  # the time of the first observation
        self._unloads: int | None = None  # see TargetState.unloads
        self._unloaded_now: tuple[str, ...] = ()
        self._activity = ActivityWatch()

    @property
    def unloaded_now(self) -> tuple[str, ...]:
        """The models the last observation's log said the running server unloaded (its log's
        names for them): what the runtime logs, one line each."""
        return self._unloaded_now

    def observe(self, obs: Observation) -> LoadRecord | None:
        """Advance by one tick; returns the record when a load finished on this observation."""
        prev = self._last_obs
        if prev is not None and obs.time < prev.time:
            return None
        self._logged = obs.log_lines is not None
        self._unloaded_now = ()
        if self._first_seen is None:
            self._first_seen = obs.time
        last_probe = self._probe
        probe = self._take_probe(obs)
        if probe is not None:
            self._count_failure(probe)
        record = None
        if obs.process_configured:
            record = self._track_process(obs)
            if record is None:
                self._in_server(obs)
        else:
            self._track_endpoint(obs, probe)
        load = self._load
        if load is not None and self._phase in IN_PROGRESS:
            answer_changed = (
                probe is not None and last_probe is not None and probe.result != last_probe.result
            )
            self._follow(load, obs, prev, answer_changed)
            if load.fatal_at is not None and record is None:
                # The server said it cannot start: failed now, not when its process exits.
                record = self._finish(load, load.fatal_at, Outcome.FAILED)
            elif probe is not None and probe.result != ProbeResult.READY:
                load.seen_failing = True
                load.unready_at = probe.sent
            elif probe is not None and probe.time > load.started_at and load.ready_at is None:
                load.ready_at = probe.time  # when it first answered
            if (
                load.ready_at is not None
                and record is None
                and not self._awaits_log(obs, load)
                and not self._awaits_residency(obs, load)
            ):
                record = self._finish(load, self._served_from(load), Outcome.READY)
        else:
            self._settle(obs)
        self._watch_activity(obs)
        self._last_obs = obs
        self._recent.append(obs)
        return record

    @staticmethod
    def _served_from(load: _Load) -> float:
        """The first ready answer, or the log's ready line where that is earlier and no probe
        sent after the line was answered otherwise: a load over before it was first asked (a
        warm start found by discovery a second late), or between a probe that came too early
        and the next, ends when the server said it serves. A probe sent before the line and
        answered after it (llama-server marks itself ready, then writes the line) says nothing
        against it, nor does one sent within the line stamp's skew after it."""
        answered = load.ready_at
        assert answered is not None
        said = load.steps.ready_at
        if said is None or not load.started_at <= said < answered:
            return answered
        unready = load.unready_at
        if unready is not None and unready >= said + LINE_STAMP_SKEW_SECONDS:
            return answered
        # Not ready when asked just after the line: ready between that request and the line's
        # true time, its stamp's skew at most later; the request is the nearer bound.
        return said if unready is None else max(said, unready)

    def _awaits_log(self, obs: Observation, load: _Load) -> bool:
        """A ready answer waits for a read of the log after it, an interval at most: the lines
        written before it date the phases of a load shorter than an interval (a warm start).
        A log opened for a new process but not read yet is waited for too: it holds the lines
        of a load over before the exporter found the process (a router's model server)."""
        at = load.ready_at
        assert at is not None
        read = obs.log_read_at
        followed = obs.log_followed or self._logged
        return followed and (read is None or read < at) and obs.time < at + self.interval

    def _awaits_residency(self, obs: Observation, load: _Load) -> bool:
        """A ready answer waits for the residency pass requested at the start, an interval at
        most: a warm start can answer before that pass lands, and its record would say
        "unknown" for want of it. Only where a pass could tell (weights known, residency
        measured before, and the tree's reads known for a load seen late: `_note_residency`)."""
        at = load.ready_at
        assert at is not None
        return (
            load.cache is None
            and load.resident_start is None
            and not load.partial
            and not (load.seen_late and obs.process_read_bytes is None)
            and bool(load.weights_bytes)
            and obs.resident_bytes is not None
            and obs.time < at + self.interval
        )

    def _watch_activity(self, obs: Observation) -> None:
        """Each signal's own movement, for the stall's reason (the stall rule is `_moved`'s)."""
        load = self._load
        weights: float | None = None
        if obs.files is not None:
            weights = obs.files.consumed_bytes
        elif load is not None and load.progress is not None and load.basis is not None:
            weights = load.progress * load.basis
        reads = obs.process_read_bytes
        if reads is None and obs.process_read_chars is None:
            reads = obs.disk_read_bytes  # the tree cannot be read: the weights' devices
        self._activity.update(
            obs.time,
            {
                Activity.WEIGHT_BYTES: weights,
                Activity.STORAGE_READS: reads,
                Activity.LOG_LINES: obs.log_lines,
                Activity.GPU_MEMORY: obs.process_gpu_bytes,
                Activity.CPU: obs.process_cpu_seconds if obs.process_found else None,
            },
        )

    def reported(self, record: LoadRecord) -> None:
        """The last finished load with its report (exporter/explain.py), for what shows it."""
        last = self._last_record
        # The same load, with what the runtime adds as it files it: its report and environment.
        added = (
            replace(
                last,
                report=record.report,
                environment_bytes=record.environment_bytes,
                environment_resident_bytes=record.environment_resident_bytes,
            )
            if last is not None
            else None
        )
        if added == record:
            self._last_record = record

    def state(self, now: float) -> TargetState:
        """What /metrics and /api/v1/status show for this target at `now`."""
        load, phase = self._load, self._phase
        if load is None or phase not in IN_PROGRESS:
            return TargetState(
                target=self.target,
                phase=phase,
                in_progress=False,
                started_at=load.started_at if load else None,
                elapsed_seconds=0.0,
                progress_ratio=_idle_progress(phase, load),
                throughput_bytes_per_second=None,
                weights_eta_seconds=None,
                eta_seconds=None,
                seconds_since_progress=None,
                stalled=False,
                cache=load.cache if load else None,
                partial=load.partial if load else False,
                seen_late=load.seen_late if load else False,
                progress_source=load.source if load and phase is Phase.FAILED else None,
                signals=self._signals(load),
                last_record=self._last_record,
                step=Step.NONE if self._logged else None,
                fatal=load.fatal if load and phase is Phase.FAILED else None,
                failed_probes=self._failed_probes,
                hung=self._hung(),
                in_server=load.in_server if load else False,
                unloaded=self._unloaded,
                unloads=self._unloads,
                **self._watched(now),
            )
        rate = self._rate(load)
        throughput = rate * load.basis if rate is not None and load.basis is not None else None
        weights_eta: float | None = None
        if phase is Phase.INITIALIZING:
            weights_eta = 0.0
        elif rate and load.progress is not None:
            weights_eta = (1.0 - load.progress) / rate
        since = max(0.0, now - load.last_move)
        return TargetState(
            target=self.target,
            phase=phase,
            in_progress=True,
            started_at=load.started_at,
            elapsed_seconds=max(0.0, now - load.started_at),
            progress_ratio=load.progress,
            throughput_bytes_per_second=throughput if phase is Phase.LOADING_WEIGHTS else None,
            weights_eta_seconds=weights_eta,
            eta_seconds=self._eta(load, now, weights_eta),
            seconds_since_progress=since,
            stalled=since >= self.stall_after,
            cache=load.cache,
            partial=load.partial,
            seen_late=load.seen_late,
            progress_source=load.source,
            signals=self._signals(load),
            last_record=self._last_record,
            step=load.steps.step if self._logged else None,
            fatal=None,
            failed_probes=self._failed_probes,
            in_server=load.in_server,
            unloads=self._unloads,
            **self._watched(now),
        )

    def _watched(self, now: float) -> _Watched:
        """The TargetState fields of what the process visibly does, for any phase."""
        obs = self._last_obs
        found = obs is not None and obs.process_found
        return _Watched(
            activity=self._activity.quiet_seconds(now),
            cpu_share=self._activity.cpu_share(),
            process_state=obs.process_state if obs is not None and found else None,
            exited_at=self._proc_gone_at,
        )

    def _hung(self) -> bool:
        obs = self._last_obs
        watched = obs is not None and obs.process_configured and obs.process_found
        return (
            watched
            and self._phase is Phase.READY
            and self._failed_probes >= ENDPOINT_FAILURES_FOR_LOAD
        )

    # -- load boundaries ---------------------------------------------------------------------

    def _take_probe(self, obs: Observation) -> _Probe | None:
        """The newest probe if it was not counted yet (probes can be slower than ticks)."""
        if obs.endpoint_result is None:
            return None
        at = obs.endpoint_probe_time if obs.endpoint_probe_time is not None else obs.time
        if self._probe is not None and at <= self._probe.time:
            return None
        sent = obs.endpoint_probe_sent
        self._probe = _Probe(obs.endpoint_result, at, min(sent, at) if sent is not None else at)
        return self._probe

    def _track_process(self, obs: Observation) -> LoadRecord | None:
        load = self._load
        running = load is not None and self._phase in IN_PROGRESS
        if not obs.process_found:
            if self._proc_key is not None and self._proc_gone_at is None:
                self._proc_gone_at = obs.time
            if load is None or not running:
                return None
            gone = self._proc_gone_at if self._proc_gone_at is not None else obs.time
            read = obs.log_read_at
            if self._logged and (read is None or read <= gone) and obs.time < gone + self.interval:
                # The log's last lines say why: wait for a read of it after the exit (the log is
                # sampled on its own thread), an interval at most.
                return None
            for event in obs.log_events:
                if (
                    event.kind is EventKind.FATAL
                    and event.time >= load.started_at - LOG_SKEW_SECONDS
                ):
                    load.fatal = event.detail or FATAL_WITHOUT_DETAIL
                    gone = min(gone, max(event.time, load.started_at))
                    break
            return self._finish(load, gone, Outcome.FAILED)
        self._proc_gone_at = None
        key = (obs.process_pid, obs.process_start_time)
        if key == self._proc_key:
            return None
        record = None
        start = (
            obs.time if obs.process_start_time is None else min(obs.process_start_time, obs.time)
        )
        if load is not None and running:
            # The old process died between two ticks and a new one took its place.
            record = self._finish(load, min(max(start, load.started_at), obs.time), Outcome.FAILED)
        self._proc_key = key
        if self.scope is Scope.MODEL:
            return record  # the process's start is no load of one model: its log line is
        late = obs.time - start > START_GRACE_INTERVALS * self.interval + START_GRACE_SECONDS
        unknown_age = obs.process_start_time is None and self._last_obs is None
        self._begin(obs, start, partial=unknown_age, seen_failing=False, seen_late=late)
        return record

    def _in_server(self, obs: Observation) -> None:
        """A running server that loads a model (its log's load_begin after it served): a load of
        this target from that line, its process the same. A model it unloads is said so and
        counted, whatever the phase (one model may go while another loads)."""
        if not obs.process_found or self.scope is Scope.PROCESS:
            return
        load = self._load
        # A model that failed to load leaves the server serving the others: the next one loads.
        after_failed = self._phase is Phase.FAILED and load is not None and load.in_server
        may_begin = self._phase is Phase.READY or after_failed
        since = 0.0
        if self.scope is Scope.MODEL:  # its own loads, the first while the server starts too
            may_begin = self._phase not in IN_PROGRESS
            first = self._first_seen if self._first_seen is not None else obs.time
            # A line from long before the target was first watched (an exporter started while
            # the server served) is a load that was over unwatched, as a process seen late.
            since = first - START_GRACE_INTERVALS * self.interval - START_GRACE_SECONDS
        for event in obs.log_events:
            if event.kind is EventKind.UNLOADED:
                who = event.who or event.detail
                self._unloaded = who
                self._unloads = (self._unloads or 0) + 1
                self._unloaded_now = (*self._unloaded_now, who)
            elif (
                may_begin
                and event.kind is EventKind.LOAD_BEGIN
                and (
                    event.time >= since
                    if self.scope is Scope.MODEL
                    else self._serving_since is None or event.time > self._serving_since
                )
            ):
                may_begin = False
                self._unloaded = None
                self._unloads = self._unloads or 0
                self._begin(obs, min(event.time, obs.time), partial=False, seen_failing=False)
                assert self._load is not None
                self._load.in_server = True
                self._load.reads_base = obs.process_read_bytes

    def _count_failure(self, probe: _Probe) -> None:
        """Failed probes in a row: 3 start an endpoint-only load, or make a watched server hung."""
        if probe.result == ProbeResult.READY:
            self._failed_probes = 0
            return
        if self._failed_probes == 0:
            self._fail_start = probe.time
        self._failed_probes += 1

    def _track_endpoint(self, obs: Observation, probe: _Probe | None) -> None:
        """Endpoint-only loads: a ready endpoint failing repeatedly, or one seen loading."""
        if probe is None or self._phase in IN_PROGRESS or probe.result == ProbeResult.READY:
            return
        if self._phase is Phase.READY:
            if self._failed_probes >= ENDPOINT_FAILURES_FOR_LOAD:
                self._begin(obs, self._fail_start, partial=False, seen_failing=True)
        elif probe.result in _UP_NOT_READY:
            self._begin(obs, probe.time, partial=True, seen_failing=True)

    def _begin(
        self,
        obs: Observation,
        start: float,
        partial: bool,
        seen_failing: bool,
        seen_late: bool = False,
    ) -> None:
        expected_gpu = (
            self.expectations.expected_weights_gpu_bytes(self.target) if self.expectations else None
        )
        unseen = partial or seen_late
        self._load = _Load(
            started_at=start,
            seen_at=obs.time,
            partial=partial,
            seen_late=seen_late,
            seen_failing=seen_failing,
            expected_gpu=expected_gpu,
            disk_base=_value_at([*self._recent, obs], start),
            # A load seen late already holds weights on its GPUs: count all of it.
            gpu_base=0 if unseen else None,
            last_move=obs.time if unseen else start,
            last_rise=start,
            flat_time=start,
        )
        self._phase = Phase.STARTING

    def _finish(self, load: _Load, at: float, outcome: Outcome) -> LoadRecord | None:
        if outcome is Outcome.READY and (load.partial or load.seen_late) and not load.seen_failing:
            # Ready at the first chance to ask: the exporter watched no load at all.
            self._load = None
            self._phase = Phase.READY
            self._serving_since = at
            return None
        # (phase, its start, whether that start was watched); the load's start always is.
        marks = [
            (name, mark, seen)
            for name, mark, seen in (
                (Phase.STARTING, load.started_at, True),
                (Phase.LOADING_WEIGHTS, load.weights_began, load.weights_began_seen),
                (Phase.INITIALIZING, load.weights_ended, load.weights_ended_seen),
            )
            if mark is not None
        ]
        ends = [(mark, seen) for _, mark, seen in marks[1:]] + [(at, True)]
        record = LoadRecord(
            target=self.target,
            started_at=load.started_at,
            ended_at=at,
            outcome=outcome,
            cache=load.cache,
            partial=load.partial,
            seen_late=load.seen_late,
            # A boundary the exporter was not there to see is unknown, and so are both phases
            # beside it: left out rather than reported as 0 s.
            phase_seconds={}
            if load.phases_unknown
            else {
                **{
                    name: max(0.0, end - mark)
                    for (name, mark, seen), (end, end_seen) in zip(marks, ends, strict=True)
                    if seen and end_seen
                },
                **self._fine_steps(load, at),
            },
            weights_bytes=load.weights_bytes,
            bytes_read=load.bytes_read,
            gpu_bytes_at_weights_end=load.gpu_at_weights_end if load.weights_ended_seen else None,
            fatal=load.fatal,
            resident_bytes_at_start=load.resident_start,
            startup_read_bytes=None if load.seen_late else load.startup_reads,
        )
        self._phase = Phase(outcome)
        if outcome is Outcome.READY or load.in_server:
            self._serving_since = at  # the lines before are this load's
        self._last_record = record
        return record

    @staticmethod
    def _fine_steps(load: _Load, at: float) -> dict[str, float]:
        """Seconds per fine step the log showed (KV cache, compile, CUDA graphs, warm-up).

        Weights are the coarse phase already. A load first seen late whose log did not show
        its weights begin (a file is read from its end) has steps cut short: none are kept.
        """
        if load.seen_late and not load.log_from_start:
            return {}
        load.steps.close(at)
        return {str(k): v for k, v in load.steps.durations.items() if k is not Step.WEIGHTS}

    def _settle(self, obs: Observation) -> None:
        """The phase between loads."""
        if self._phase is Phase.FAILED and obs.process_configured:
            return
        probe = self._probe
        ready = probe is not None and probe.result == ProbeResult.READY
        if not obs.process_configured:
            if ready:
                self._phase = Phase.READY
            elif self._phase is not Phase.READY:
                self._phase = Phase.DOWN
        elif obs.process_found and self.scope is Scope.MODEL:
            self._phase = Phase.READY if ready else Phase.DOWN  # down: not loaded, or unloaded
        elif obs.process_found:
            self._phase = Phase.READY  # finished its load, or was ready on arrival
            if self._serving_since is None:
                self._serving_since = obs.time  # log lines before it are no load of ours
        else:
            gone = self._proc_gone_at
            fresh = ready and probe is not None and (gone is None or probe.time > gone)
            self._phase = Phase.READY if fresh else Phase.DOWN

    # -- within a load -----------------------------------------------------------------------

    def _follow(
        self, load: _Load, obs: Observation, prev: Observation | None, answer_changed: bool
    ) -> None:
        files = obs.files
        if (
            load.in_server
            and files is not None
            and (files.first_open_at or load.started_at) < (load.started_at)
        ):
            # The account of the load before (the runtime starts the view over): its consumed
            # files are no progress of this one.
            obs = replace(obs, files=FileView(None, False, None, 0, 0, files.total_bytes, True))
        if obs.files is None and load.files is not None and not load.files.pending:
            # Out of view for a moment (a sample failed): the last view holds, rather than the
            # counters that would count start-up reads as weights.
            obs = replace(obs, files=load.files)
        load.files = obs.files
        logged = bool(obs.log_events) or (
            prev is not None and obs.log_lines is not None and prev.log_lines != obs.log_lines
        )
        if answer_changed or logged or _moved(prev, obs):
            load.last_move = obs.time
        if obs.weights_bytes is not None:
            load.weights_bytes = obs.weights_bytes
        if obs.process_read_bytes is not None:
            load.bytes_read = max(load.bytes_read or 0, obs.process_read_bytes)
        if load.disk_base is None:
            load.disk_base = obs.disk_read_bytes
        if load.gpu_base is None and obs.process_gpu_bytes:
            load.gpu_base = obs.process_gpu_bytes
        self._note_files(load, obs, prev)
        self._note_residency(load, obs)
        self._note_storage(load, obs)
        self._follow_log(load, obs)
        load.evidence = self._evidence(load, obs)
        self._advance_progress(load, obs)
        self._advance_phase(load, obs)
        load.gpu_prev = obs.process_gpu_bytes

    def _follow_log(self, load: _Load, obs: Observation) -> None:
        """The server's own markers: exact phase boundaries, shard progress, a fatal error.

        They win over the byte heuristics: a boundary the heuristics crossed first is moved to
        the time the log gives, and while the log says the weights are still loading, no
        heuristic ends them. Lines stamped before the load's start are the previous process's.
        """
        for event in obs.log_events:
            if event.time < load.started_at - LOG_SKEW_SECONDS:
                continue
            at = min(max(event.time, load.started_at), obs.time)
            if load.ready_at is not None:
                at = min(at, load.ready_at)  # read while waiting for the log: the load has ended
            if event.implied:
                at = self._let_go_by(load, obs, at)
            load.steps.apply(replace(event, time=at))
            kind = event.kind
            # The log dates a boundary exactly, even one crossed before the exporter arrived.
            if kind is EventKind.WEIGHTS_BEGIN:
                # Lines read after the heuristics had crossed both boundaries (a log opened
                # late): the load's first begin line still dates its weights.
                late = load.log_weights_began is None and self._phase is Phase.INITIALIZING
                load.log_weights_open = load.log_from_start = True
                load.log_weights_began = at
                if self._phase is Phase.STARTING:
                    self._begin_weights(load, at, load.progress or 0.0, obs.time, seen=True)
                elif self._phase is Phase.LOADING_WEIGHTS or (
                    late and at <= (load.weights_ended or at)
                ):
                    load.weights_began, load.weights_began_seen = at, True
            elif kind is EventKind.WEIGHTS_PROGRESS and event.total:
                load.log_shards = (event.done or 0, event.total)
            elif kind is EventKind.WEIGHTS_END:
                load.log_weights_open = False
                load.progress = 1.0
                began = load.log_weights_began
                if began is not None and self._phase is Phase.LOADING_WEIGHTS:
                    # "Load weight end. elapsed=4.98 s" dates both lines to the millisecond.
                    load.weights_began, at = tighten(began, at, event.seconds)
                if self._phase is Phase.STARTING and event.seconds is not None:
                    # "Loading weights took 2.65 seconds" with no begin line seen: it dates both.
                    began = max(at - event.seconds, load.started_at)
                    seen = not load.seen_late or began >= load.seen_at
                    self._begin_weights(load, began, 0.0, obs.time, seen)
                if self._phase in (Phase.STARTING, Phase.LOADING_WEIGHTS):
                    gpu = load.gpu_prev if load.gpu_prev is not None else obs.process_gpu_bytes
                    self._end_weights(load, at, gpu, obs.time, seen=True)
                elif self._phase is Phase.INITIALIZING:
                    load.weights_ended, load.weights_ended_seen = at, True
            elif kind is EventKind.FATAL and load.fatal_at is None:
                load.fatal = event.detail or FATAL_WITHOUT_DETAIL
                load.fatal_at = at

    @staticmethod
    def _let_go_by(load: _Load, obs: Observation, at: float) -> float:
        """A later step's line says the weights were in by `at`, not when. Where the tree let go
        of every weight file before it, they were in then: vLLM's ranks after the first write
        no end line of their own (measured on 0.32 at TP 2: the tree let go 5 s before the line
        that implied their end)."""
        idle = obs.files.idle_since if obs.files is not None else None
        if idle is None:
            return at
        return min(at, max(idle, load.weights_began or load.started_at))

    def _note_files(self, load: _Load, obs: Observation, prev: Observation | None) -> None:
        """The storage reads at the first weight-file open (and at the look before it: what
        start-up read), and whether a late load's phases can be told at all."""
        files = obs.files
        if files is None or files.pending:
            return
        first_look, load.files_looked = not load.files_looked, True
        if files.first_open_at is None:
            if load.seen_late and first_look:
                load.phases_unknown = True  # nothing held on arrival: before or after its weights?
            return
        if load.reads_at_open is None:
            load.reads_at_open = obs.process_read_bytes
            before = prev.process_read_bytes if prev is not None else None
            load.startup_reads = obs.process_read_bytes if before is None else before
        if load.rx_at_open is None:
            load.rx_at_open = obs.gpu_rx_bytes
        if files.first_open_seen:
            load.phases_unknown = False

    def _note_storage(self, load: _Load, obs: Observation) -> None:
        """Where residency is not the cache temperature, the label says what is instead: a load
        whose weights are read with O_DIRECT or through a direct-I/O mount bypassed the cache
        (whatever was resident), one on ZFS is unknown (its ARC served it), one from tmpfs was
        in memory all along."""
        files = obs.files
        if files is not None and files.direct:
            load.cache = Cache.BYPASS
        elif obs.storage_cache is not None and load.cache is not Cache.BYPASS:
            load.cache = obs.storage_cache

    def _note_residency(self, load: _Load, obs: Observation) -> None:
        """Cache temperature and the storage baseline come from the first pass after the start.

        The pass lands up to a couple of intervals after the start (or, for a load first seen
        mid-way, long after it). What the tree has read from storage since it started was not
        cached at the start, so it is taken back out: otherwise the first second of a cold load
        at 240 MB/s would already read as "mixed", and a cold load seen half-way as "mixed" too.
        A load seen late whose tree's storage reads are unknown keeps an unknown temperature.
        """
        if load.resident_start is not None or load.partial or obs.resident_bytes is None:
            return
        measured = obs.resident_measured_at if obs.resident_measured_at is not None else obs.time
        if measured < load.started_at:
            return
        read_since_start = obs.process_read_bytes if obs.process_found else None
        if read_since_start is not None and load.reads_base is not None:
            read_since_start -= load.reads_base  # an in-server load: since it began
        if load.seen_late and read_since_start is None:
            return
        load.resident_start = max(0, obs.resident_bytes - (read_since_start or 0))
        if load.weights_bytes:
            load.cache = temperature(load.resident_start / load.weights_bytes)

    def _evidence(self, load: _Load, obs: Observation) -> dict[Signal, _Evidence]:
        """Every progress estimate this tick can make, whether or not it drives progress."""
        weights = load.weights_bytes
        out: dict[Signal, _Evidence] = {}
        uncached = None
        if load.resident_start is not None and weights:
            uncached = max(0, weights - load.resident_start)
        storage_basis = uncached if uncached is not None else weights
        files = obs.files
        # With the files in view, the tree's storage bytes count only from the first weight-file
        # open and only up to the files held so far: never ahead of the file view. Residency
        # growth is the weight files' own pages: it counts even for files opened and closed
        # between two looks.
        cap = files.seen_bytes if files is not None else None
        if storage_basis:
            if uncached is not None and obs.resident_bytes is not None:
                growth = _capped(obs.resident_bytes - (load.resident_start or 0), None)
                out[Signal.PAGE_CACHE] = _Evidence(growth / storage_basis, storage_basis)
            if obs.process_read_bytes is not None:
                reads = obs.process_read_bytes
                if files is not None:
                    at_open = load.reads_at_open if load.reads_at_open is not None else reads
                    reads = _capped(reads - at_open, cap)
                out[Signal.PROCESS_READS] = _Evidence(reads / storage_basis, storage_basis)
            tree_unknown = obs.process_read_bytes is None and obs.process_read_chars is None
            if tree_unknown and obs.disk_read_bytes is not None and load.disk_base is not None:
                reads = obs.disk_read_bytes - load.disk_base
                out[Signal.DISK_READS] = _Evidence(reads / storage_basis, storage_basis)
        if obs.process_read_chars is not None and weights:
            out[Signal.PROCESS_READ_CHARS] = _Evidence(obs.process_read_chars / weights, weights)
        files_basis = weights or (files.total_bytes if files is not None else None)
        if files is not None and files_basis:
            out[Signal.WEIGHT_FILES] = _Evidence(files.consumed_bytes / files_basis, files_basis)
            if obs.gpu_rx_bytes is not None and load.rx_at_open is not None:
                # Bytes reaching the GPUs since the first weight file opened: each rank's GPU
                # receives its own slice, so the sum is the tree's, capped by the files held.
                rx = _capped(obs.gpu_rx_bytes - load.rx_at_open, cap)
                out[Signal.GPU_PCIE] = _Evidence(rx / files_basis, files_basis)
        if load.log_shards is not None:
            done, total = load.log_shards
            out[Signal.LOG_SHARDS] = _Evidence(done / total, weights or None)
        base = load.gpu_base
        if obs.process_gpu_bytes is not None and base is not None:
            expected = load.expected_gpu
            gpu_basis = expected - base if expected is not None and expected > base else weights
            if gpu_basis:
                held = obs.process_gpu_bytes - base
                out[Signal.GPU_MEMORY] = _Evidence(held / gpu_basis, gpu_basis)
        return out

    def _driving(self, load: _Load, obs: Observation) -> tuple[Signal, ...]:
        """Which signals may drive progress, given what residency says about this load.

        Where the weight files are in view, they drive; storage reads (capped by them, see
        `_evidence`) count too where the load reads from storage, for a loader that maps a file
        whole and lets readahead fill it (llama.cpp). Read() bytes and GPU memory never do:
        ranks read every file, and GPUs are allocated before anything is read.
        """
        if obs.files is not None:
            warm = load.cache is Cache.WARM
            seen = (Signal.WEIGHT_FILES, Signal.GPU_PCIE)
            return seen if warm else (*seen, *_STORAGE)
        if load.resident_start is not None and load.weights_bytes:
            warm = load.cache is Cache.WARM
            preferred, other = (_WHOLE, _STORAGE) if warm else (_STORAGE, _WHOLE)
            return preferred if any(s in load.evidence for s in preferred) else other
        if obs.resident_bytes is not None:
            # Residency is measurable but the first pass of this load has not landed yet: until
            # the cache temperature is known, only storage reads count. read() bytes would also
            # count the interpreter reading its own libraries from the page cache.
            return _STORAGE
        unknown = (*_STORAGE, Signal.PROCESS_READ_CHARS)
        return unknown if any(s in load.evidence for s in unknown) else (Signal.GPU_MEMORY,)

    def _advance_progress(self, load: _Load, obs: Observation) -> None:
        best: tuple[Signal, _Evidence] | None = None
        # Shards the log has counted are this load's whatever the cache says; but shards differ
        # in size (vLLM's test checkpoint: 648, 24, 24 and 648 MB), so where the files are in
        # view, their bytes say it better and the count would run ahead of them.
        allowed = self._driving(load, obs)
        if obs.files is None:
            allowed = (*allowed, Signal.LOG_SHARDS)
        for source in PROGRESS_SOURCES:
            ev = load.evidence.get(source)
            if source in allowed and ev is not None and (best is None or ev.ratio > best[1].ratio):
                best = (source, ev)
        rose = False
        if best is not None:
            source, ev = best
            ratio = min(1.0, max(0.0, ev.ratio))
            before = load.progress
            if before is None or ratio > before:
                gained = ratio - (before or 0.0)
                rose = ev.basis is None or gained * ev.basis >= MOVE_BYTES
                load.progress, load.source, load.basis = ratio, source, ev.basis
        if rose:
            load.last_rise = obs.time
            load.gpu_at_rise = obs.process_gpu_bytes
        else:
            load.flat_time = obs.time
            load.flat_progress = load.progress or 0.0

    def _advance_phase(self, load: _Load, obs: Observation) -> None:
        now, progress = obs.time, load.progress
        if progress is None:
            return
        files = obs.files
        if self._phase is Phase.STARTING and files is not None and files.first_open_at is not None:
            # The first weight file opened: whatever the tree read before was start-up.
            at = min(max(files.first_open_at, load.started_at), now)
            seen = files.first_open_seen or not load.seen_late
            self._begin_weights(load, at, 0.0, now, seen)
        elif self._phase is Phase.STARTING and progress >= BEGIN_RATIO:
            # Backdated to the last flat tick: watched only if that tick was (a load seen late
            # may have begun before the exporter's first tick).
            at = max(load.flat_time, load.started_at)
            seen = not load.seen_late or at >= load.seen_at
            self._begin_weights(load, at, load.flat_progress, now, seen)
        if self._phase is not Phase.LOADING_WEIGHTS:
            return
        quiet = now - load.last_rise >= QUIET_INTERVALS * self.interval
        idle = files.idle_since if files is not None else None
        if load.log_weights_open:
            pass  # the server's log says the weights are still loading: it will say when not
        elif idle is not None and now - idle >= QUIET_INTERVALS * self.interval:
            # The tree let go of every weight file it held and took no other: the loader is
            # done with them (files opened and closed between two looks were not seen at all).
            at = max(idle, load.weights_began or load.started_at)
            self._end_weights(load, at, load.gpu_at_rise, now, seen=at > load.seen_at)
            return
        elif progress >= DONE_RATIO:
            # KV-cache allocation can follow the last weight within one tick: take the tick before.
            gpu = load.gpu_prev if load.gpu_prev is not None else obs.process_gpu_bytes
            # Seen complete now (a residency pass may land a tick late), but the tree let go of
            # its weight files earlier: they were in by then.
            at = max(idle, load.weights_began or load.started_at) if idle is not None else now
            # A finish first seen on the load's first tick may have happened long before.
            self._end_weights(load, at, gpu, now, seen=not load.seen_late or at > load.seen_at)
            return
        elif progress >= QUIET_DONE_RATIO and quiet:
            at = max(load.last_rise, load.weights_began or load.started_at)
            seen = not load.seen_late or at > load.seen_at  # a rise on the first tick: unknown
            self._end_weights(load, at, load.gpu_at_rise, now, seen)
            return
        load.rate.append((now, progress))
        horizon = now - max(RATE_WINDOW_SECONDS, RATE_MIN_INTERVALS * self.interval)
        while len(load.rate) >= 2 and load.rate[1][0] <= horizon:
            load.rate.popleft()

    def _begin_weights(
        self, load: _Load, at: float, progress_then: float, now: float, seen: bool
    ) -> None:
        load.weights_began, load.weights_began_seen = at, seen
        load.rate = deque([(at, progress_then)])
        self._enter(load, Phase.LOADING_WEIGHTS, now)

    def _end_weights(self, load: _Load, at: float, gpu: int | None, now: float, seen: bool) -> None:
        load.weights_ended, load.weights_ended_seen = at, seen
        load.gpu_at_weights_end = gpu
        self._enter(load, Phase.INITIALIZING, now)

    def _enter(self, load: _Load, phase: Phase, now: float) -> None:
        self._phase = phase
        load.last_move = now  # a phase change is movement

    # -- derived numbers ---------------------------------------------------------------------

    def _rate(self, load: _Load) -> float | None:
        """Progress per second over the rate window; None until it spans 3 intervals."""
        if self._phase is not Phase.LOADING_WEIGHTS or len(load.rate) < 2:
            return None
        (t0, p0), (t1, p1) = load.rate[0], load.rate[-1]
        if t1 - t0 < RATE_MIN_INTERVALS * self.interval:
            return None
        return max(0.0, p1 - p0) / (t1 - t0)

    def _eta(self, load: _Load, now: float, weights_eta: float | None) -> float | None:
        expected = self._expected(load)
        init = expected.get(Phase.INITIALIZING)
        if init is None:
            return None
        if self._phase is Phase.INITIALIZING:
            left = init - (now - (load.weights_ended or load.started_at))
            steps = self._steps_left(load, expected, now)
            return max(0.0, left if steps is None else max(left, steps))
        if self._phase is Phase.LOADING_WEIGHTS:
            return None if weights_eta is None else weights_eta + init
        starting, weights = expected.get(Phase.STARTING), expected.get(Phase.LOADING_WEIGHTS)
        if starting is None or weights is None:
            return None
        return max(0.0, starting - (now - load.started_at)) + weights + init

    def _steps_left(self, load: _Load, expected: Mapping[str, float], now: float) -> float | None:
        """Seconds the log's fine steps still need: the rest of the current step's median and
        the medians of the steps history knows that this load has not begun yet.

        An initializing phase running over its median still has the steps it has not done;
        None without a log that showed this load from its weights on.
        """
        if not self._logged or not load.log_from_start:
            return None
        timeline = load.steps
        left = 0.0
        for step in FINE_STEPS:
            median = expected.get(step)
            if median is None or step in timeline.durations:
                continue
            if step is timeline.step and timeline.since is not None:
                left += max(0.0, median - (now - timeline.since))
            else:
                left += median
        return left

    def _expected(self, load: _Load) -> Mapping[str, float]:
        """History's phase medians for this load's cache (`expected_phases`), read once per
        load and cache value."""
        history = self.expectations
        if history is None:
            return {}
        if load.cache not in load.expected:
            load.expected[load.cache] = expected_phases(history, self.target, load.cache)
        return load.expected[load.cache]

    def _signals(self, load: _Load | None) -> dict[str, float | int | None]:
        obs = self._last_obs
        out: dict[str, float | int | None] = {}
        if obs is not None:
            out.update(
                weights_bytes=obs.weights_bytes,
                resident_bytes=obs.resident_bytes,
                process_read_bytes=obs.process_read_bytes,
                process_read_chars=obs.process_read_chars,
                process_gpu_bytes=obs.process_gpu_bytes,
                disk_read_bytes=obs.disk_read_bytes,
            )
            if obs.files is not None:
                out.update(
                    weight_files_consumed_bytes=obs.files.consumed_bytes,
                    weight_files_seen_bytes=obs.files.seen_bytes,
                    weight_files_first_open_at=obs.files.first_open_at,
                )
        if load is not None:
            out.update(
                resident_bytes_at_start=load.resident_start,
                gpu_bytes_at_start=load.gpu_base,
                expected_weights_gpu_bytes=load.expected_gpu,
                disk_read_bytes_at_start=load.disk_base,
            )
            out.update({f"progress_{k}": ev.ratio for k, ev in load.evidence.items()})
        return out


def expected_phases(history: Expectations, target: str, cache: Cache | None) -> dict[str, float]:
    """History's phase medians for a load of this cache temperature: those of loads of the same
    temperature, and for the phases after the weights (which do not depend on the page cache)
    those of any temperature where the same temperature has none."""
    same = history.expected_phase_seconds(target, cache or Cache.UNKNOWN)
    anywhere = history.expected_phase_seconds(target, None)
    return {**{p: anywhere[p] for p in CACHE_INDEPENDENT if p in anywhere}, **same}


def _capped(value: int, cap: int | None) -> int:
    return max(0, value if cap is None else min(value, cap))


def temperature(resident_share: float) -> Cache:
    """Cache temperature of a load from the share of its weights cached at its start."""
    if resident_share >= WARM_SHARE:
        return Cache.WARM
    return Cache.COLD if resident_share <= COLD_SHARE else Cache.MIXED


def _idle_progress(phase: Phase, load: _Load | None) -> float | None:
    """A ready server has its weights in; a failed load shows where it died; down shows none."""
    if phase is Phase.READY:
        return 1.0
    return load.progress if phase is Phase.FAILED and load is not None else None


def _value_at(observations: Iterable[Observation], at: float) -> int | None:
    """Device-read counter at `at`: the last reading before it, else the first one after."""
    before = after = None
    for obs in observations:
        if obs.disk_read_bytes is None:
            continue
        if obs.time <= at:
            before = obs.disk_read_bytes
        elif after is None:
            after = obs.disk_read_bytes
    return before if before is not None else after


def _moved(prev: Observation | None, obs: Observation) -> bool:
    """Whether any byte signal moved by MOVE_BYTES since the previous tick."""
    if prev is None:
        return False
    counters = [
        (prev.process_read_bytes, obs.process_read_bytes),
        (prev.process_read_chars, obs.process_read_chars),
    ]
    if obs.process_read_bytes is None and obs.process_read_chars is None:
        # Host-wide device reads are noise when the tree's own counters exist.
        counters.append((prev.disk_read_bytes, obs.disk_read_bytes))
    if prev.files is not None and obs.files is not None:
        counters.append((prev.files.consumed_bytes, obs.files.consumed_bytes))
    levels = [
        (prev.process_gpu_bytes, obs.process_gpu_bytes),
        (prev.resident_bytes, obs.resident_bytes),
    ]
    return any(a is not None and b is not None and b - a >= MOVE_BYTES for a, b in counters) or any(
        a is not None and b is not None and abs(b - a) >= MOVE_BYTES for a, b in levels
    )
