"""The load state machine: one Observation per tick in; phase, progress, ETA, stall and records out.

Pure on purpose (no I/O, threads or clock: time arrives inside each Observation), so a 15-minute
load replays in milliseconds in tests and only the sampler decides when things happen.

The rules, in short (the long form, with the reasons, is docs/how-it-decides.md); every threshold
is a named constant, with why it has its value: below for a load's boundaries and phases, in
exporter/load/progress.py for what the signals say of the weights and the cache temperature, in
exporter/load/eta.py for the rate and the ETA, the functions of those two applied here tick by
tick:

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
* A follower (one node of a model over several hosts that runs no API server) is never
  probed: its load ends `ready` at its log's end of start-up (node_up). Where that end cannot
  be seen (no log, or one read from after the load's start), its quiet after the weights is
  no stall (`end_unseen`), and nothing makes it ready.
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
from collections.abc import Mapping
from dataclasses import replace
from enum import Enum
from typing import NamedTuple, TypedDict

from exporter.load import eta
from exporter.load.activity import ActivityWatch
from exporter.load.book import LoadBook
from exporter.load.eta import Expectations
from exporter.load.events import EventKind
from exporter.load.observation import FileView, Observation
from exporter.load.progress import (
    advance_progress,
    evidence,
    moved,
    note_files,
    note_residency,
    note_storage,
    signals,
    value_at,
)
from exporter.load.records import LoadRecord, LoadState
from exporter.load.steps import tighten
from exporter.vocabulary import IN_PROGRESS, Activity, Outcome, Phase, ProbeResult, Step

# Distinct failed probes in a row that make a ready endpoint-only target a load (and a hung
# server with process matching worth a log line): one dropped probe is a network blip, not a load.
ENDPOINT_FAILURES_FOR_LOAD = 3
# A process first seen more than START_GRACE_INTERVALS sampling intervals plus START_GRACE_SECONDS
# after its start is seen_late: one the exporter watched start is seen within a tick or two
# (discovery, a slow tick), and the fixed second covers start-time rounding on short intervals.
START_GRACE_INTERVALS = 2.0
START_GRACE_SECONDS = 1.0
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
# A log line stamped this much before a load's start still belongs to it: log stamps and the
# process start time come from different clocks, and many servers stamp whole seconds.
LOG_SKEW_SECONDS = 1.0
# How much later than its stamp a line may have been written, against the exporter's clock: a
# server stamping the time since its start starts that clock after exec and its libraries load
# (llama-server: 30-50 ms after the process's start time on 2 busy cores, so its lines read that
# much early). A not-ready answer to a probe sent within this of a ready line does not refute it.
LINE_STAMP_SKEW_SECONDS = 0.25
FATAL_WITHOUT_DETAIL = "the server's log reported a fatal error"

# Answers that prove something listens but is not ready yet (a 503-style server while it loads).
_UP_NOT_READY = frozenset({ProbeResult.HTTP_ERROR, ProbeResult.BAD_RESPONSE, ProbeResult.TIMEOUT})
_RECENT = 64


class _Watched(TypedDict):
    """LoadState's fields of what the process visibly does (`Tracker._watched`)."""

    activity: Mapping[str, float]
    cpu_share: float | None
    process_state: str | None
    exited_at: float | None


class _Probe(NamedTuple):
    result: ProbeResult
    time: float  # when it was answered
    sent: float


class Scope(Enum):
    """What of a server a target watches (exporter/runtime/admission.py: targets_of)."""

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
        follower: bool = False,
    ) -> None:
        """`follower`: one node of a model served over several hosts that runs no API server
        (vocabulary.TargetRole.FOLLOWER): never probed, ready at its log's end of start-up."""
        self.target = target
        self.stall_after = stall_after
        self.expectations = expectations
        self.interval = interval
        self.scope = scope
        self.follower = follower
        self._phase = Phase.DOWN
        self._load: LoadBook | None = None
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
        self._unloads: int | None = None  # see LoadState.unloads
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
                record = self._end_load(load, load.fatal_at, Outcome.FAILED)
            elif load.node_up_at is not None and record is None:
                # A follower serves nothing itself: its part of the model is up at its log's
                # end of start-up (the model is ready when its head serves too). An end after
                # the exporter's first look is one it saw coming: a load it watched.
                load.seen_failing = load.seen_failing or load.node_up_at > load.seen_at
                record = self._end_load(load, load.node_up_at, Outcome.READY)
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
                record = self._end_load(load, self._served_from(load), Outcome.READY)
        else:
            self._settle(obs)
        self._watch_activity(obs)
        self._last_obs = obs
        self._recent.append(obs)
        return record

    @staticmethod
    def _served_from(load: LoadBook) -> float:
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

    def _awaits_log(self, obs: Observation, load: LoadBook) -> bool:
        """A ready answer waits for a read of the log after it, an interval at most: the lines
        written before it date the phases of a load shorter than an interval (a warm start).
        A log opened for a new process but not read yet is waited for too: it holds the lines
        of a load over before the exporter found the process (a router's model server)."""
        at = load.ready_at
        assert at is not None
        read = obs.log_read_at
        followed = obs.log_followed or self._logged
        return followed and (read is None or read < at) and obs.time < at + self.interval

    def _awaits_residency(self, obs: Observation, load: LoadBook) -> bool:
        """A ready answer waits for the residency pass requested at the start, an interval at
        most: a warm start can answer before that pass lands, and its record would say
        "unknown" for want of it. Only where a pass could tell (weights known, residency
        measured before, and the tree's reads known for a load seen late: `note_residency`)."""
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
        """Each signal's own movement, for the stall's reason (the stall rule is `moved`'s)."""
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
        """The last finished load with its report (exporter/history/explain.py), for what shows
        it."""
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

    def state(self, now: float) -> LoadState:
        """What /metrics and /api/v1/status show for this target at `now`."""
        load, phase = self._load, self._phase
        if load is None or phase not in IN_PROGRESS:
            return LoadState(
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
                signals=signals(load, self._last_obs),
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
        rate = eta.rate(load, phase, self.interval)
        throughput = rate * load.basis if rate is not None and load.basis is not None else None
        weights_eta: float | None = None
        if phase is Phase.INITIALIZING:
            weights_eta = 0.0
        elif rate and load.progress is not None:
            weights_eta = (1.0 - load.progress) / rate
        since = max(0.0, now - load.last_move)
        unseen = self._end_unseen(load, phase)
        return LoadState(
            target=self.target,
            phase=phase,
            in_progress=True,
            started_at=load.started_at,
            elapsed_seconds=max(0.0, now - load.started_at),
            progress_ratio=load.progress,
            throughput_bytes_per_second=throughput if phase is Phase.LOADING_WEIGHTS else None,
            weights_eta_seconds=weights_eta,
            eta_seconds=eta.eta(
                load,
                phase,
                now,
                weights_eta,
                eta.expected(load, self.expectations, self.target),
                self._logged,
            ),
            seconds_since_progress=since,
            stalled=since >= self.stall_after and not unseen,
            cache=load.cache,
            partial=load.partial,
            seen_late=load.seen_late,
            progress_source=load.source,
            signals=signals(load, self._last_obs),
            last_record=self._last_record,
            step=load.steps.step if self._logged else None,
            fatal=None,
            failed_probes=self._failed_probes,
            in_server=load.in_server,
            unloads=self._unloads,
            end_unseen=unseen,
            **self._watched(now),
        )

    def _end_unseen(self, load: LoadBook, phase: Phase) -> bool:
        """Whether this is a follower past its weights whose end of start-up the exporter
        cannot see: no log is read, or not from this load's start (an exporter started after
        the follower, reading its log from the end). Its quiet is then no evidence of a stall
        (it may have been up for hours); its weights' bytes still are."""
        if not self.follower or phase is Phase.LOADING_WEIGHTS:
            return False
        return not self._logged or (load.seen_late and not load.log_from_start)

    def _watched(self, now: float) -> _Watched:
        """The LoadState fields of what the process visibly does, for any phase."""
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
            return self._end_load(load, gone, Outcome.FAILED)
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
            record = self._end_load(
                load, min(max(start, load.started_at), obs.time), Outcome.FAILED
            )
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
        self._load = LoadBook(
            started_at=start,
            seen_at=obs.time,
            partial=partial,
            seen_late=seen_late,
            seen_failing=seen_failing,
            expected_gpu=expected_gpu,
            disk_base=value_at([*self._recent, obs], start),
            # A load seen late already holds weights on its GPUs: count all of it.
            gpu_base=0 if unseen else None,
            last_move=obs.time if unseen else start,
            last_rise=start,
            flat_time=start,
        )
        self._phase = Phase.STARTING

    def _end_load(self, load: LoadBook, at: float, outcome: Outcome) -> LoadRecord | None:
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
    def _fine_steps(load: LoadBook, at: float) -> dict[str, float]:
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
        self, load: LoadBook, obs: Observation, prev: Observation | None, answer_changed: bool
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
        if answer_changed or logged or moved(prev, obs):
            load.last_move = obs.time
        if obs.weights_bytes is not None:
            load.weights_bytes = obs.weights_bytes
        if obs.process_read_bytes is not None:
            load.bytes_read = max(load.bytes_read or 0, obs.process_read_bytes)
        if load.disk_base is None:
            load.disk_base = obs.disk_read_bytes
        if load.gpu_base is None and obs.process_gpu_bytes:
            load.gpu_base = obs.process_gpu_bytes
        note_files(load, obs, prev)
        note_residency(load, obs)
        note_storage(load, obs)
        self._take_log_events(load, obs)
        load.evidence = evidence(load, obs)
        advance_progress(load, obs)
        self._advance_phase(load, obs)
        load.gpu_prev = obs.process_gpu_bytes

    def _take_log_events(self, load: LoadBook, obs: Observation) -> None:
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
                at = load.weights_in_by(obs.files, at)
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
            elif kind is EventKind.NODE_UP and self.follower and load.node_up_at is None:
                load.node_up_at = at

    def _advance_phase(self, load: LoadBook, obs: Observation) -> None:
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
        eta.note_rate(load, now, progress, self.interval)

    def _begin_weights(
        self, load: LoadBook, at: float, progress_then: float, now: float, seen: bool
    ) -> None:
        load.weights_began, load.weights_began_seen = at, seen
        load.rate = deque([(at, progress_then)])
        self._enter(load, Phase.LOADING_WEIGHTS, now)

    def _end_weights(
        self, load: LoadBook, at: float, gpu: int | None, now: float, seen: bool
    ) -> None:
        load.weights_ended, load.weights_ended_seen = at, seen
        load.gpu_at_weights_end = gpu
        self._enter(load, Phase.INITIALIZING, now)

    def _enter(self, load: LoadBook, phase: Phase, now: float) -> None:
        self._phase = phase
        load.last_move = now  # a phase change is movement


def _idle_progress(phase: Phase, load: LoadBook | None) -> float | None:
    """A ready server has its weights in; a failed load shows where it died; down shows none."""
    if phase is Phase.READY:
        return 1.0
    return load.progress if phase is Phase.FAILED and load is not None else None
