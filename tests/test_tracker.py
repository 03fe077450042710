"""The load state machine, driven through whole loads second by second on synthetic timelines.

`Sim` is a stand-in server and host whose counters a test moves; every tick it hands the tracker
one Observation, exactly as the sampler does, and keeps the state the tracker reported. Expected
numbers are computed from the script of each timeline, not copied from the tracker.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest

from exporter.history.store import HistoryStore
from exporter.load.events import EventKind, LogEvent
from exporter.load.observation import FileView, Observation
from exporter.load.records import LoadRecord, LoadState
from exporter.load.tracker import LINE_STAMP_SKEW_SECONDS, Scope, Tracker
from exporter.vocabulary import IN_PROGRESS

MB = 10**6
MIB = 2**20
GB = 10**9
T0 = 1_750_000_000.0
WEIGHTS = 120 * GB
COLD_RATE = 240 * MB  # the field's cold read rate


@dataclass
class Sim:
    """A synthetic model server and host, advanced one second per tick."""

    tracker: Tracker
    weights: int = WEIGHTS
    time: float = T0
    configured: bool = True
    nvml: bool = False
    io_readable: bool = True  # False: /proc/PID/io of the tree may not be read
    pid: int | None = None
    started: float | None = None
    read_bytes: int = 0
    read_chars: int = 0
    gpu: int = 0
    resident: int = 0
    disk: int | None = 7 * GB  # None: no block device behind the weights
    endpoint: str = "refused"
    probe_every: int = 1
    ticks: int = 0
    probe: tuple[str, float] | None = None
    probe_takes: float = 0.0  # seconds from a probe's request to its answer
    logged: bool = False  # the target has a log source
    log_unread: bool = False  # it has one, opened but not read yet (no reading, no lines)
    files: bool = False  # the tree's weight files are in view (sources/weightfiles.py)
    pending: int = 0  # ticks before the file view's first look at the process (it is pending)
    consumed: int = 0  # bytes of the weight files the tree has consumed
    seen: int = 0  # sizes of the weight files it has held
    first_open: float | None = None
    first_open_seen: bool = True
    idle: float | None = None  # no weight file held since
    rx: int | None = None  # PCIe bytes received by the tree's GPUs; None: no such counter
    log_lines: int = 0
    log_lag: float = 0.0  # how long before each tick the log was last read
    measured_at: float | None = None  # when the last residency pass ran; None: every tick
    log: list[LogEvent] = field(default_factory=list)  # markers the next tick hands over
    states: list[LoadState] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    records: list[LoadRecord] = field(default_factory=list)

    def spawn(self, pid: int = 1000) -> None:
        """Start a server process now; a new tree's counters start at zero."""
        self.pid, self.started = pid, self.time
        self.read_bytes = self.read_chars = self.gpu = 0
        self.consumed = self.seen = 0
        self.first_open = self.idle = None

    def hold(self, seen: int) -> None:
        """From the next tick the tree holds weight files of `seen` bytes in all."""
        if self.first_open is None:
            self.first_open = self.time + 1
        self.seen, self.idle = seen, None

    def let_go(self) -> None:
        """From the next tick the tree holds no weight file."""
        self.idle = self.time + 1

    def say(self, kind: EventKind, ago: float = 0.0, **fields: Any) -> None:
        """The server logs a marker, stamped `ago` seconds before the next tick."""
        self.logged = True
        self.log_lines += 1
        self.log.append(LogEvent(kind, self.time + 1 - ago, **fields))

    def kill(self) -> None:
        self.pid = self.started = None

    def restart_exporter(self, tracker: Tracker) -> None:
        """A fresh exporter: a new tracker that has seen nothing, not even a probe."""
        self.tracker, self.probe = tracker, None
        self.records.clear()

    def observation(self) -> Observation:
        alive = self.pid is not None
        io = alive and self.configured and self.io_readable
        return Observation(
            time=self.time,
            endpoint_result=self.probe[0] if self.probe else None,
            endpoint_probe_time=self.probe[1] if self.probe else None,
            endpoint_probe_sent=self.probe[1] - self.probe_takes if self.probe else None,
            process_configured=self.configured,
            process_found=alive,
            process_pid=self.pid,
            process_start_time=self.started,
            process_read_bytes=self.read_bytes if io else None,
            process_read_chars=self.read_chars if io else None,
            process_gpu_bytes=self.gpu if alive and self.configured and self.nvml else None,
            weights_bytes=self.weights,
            resident_bytes=self.resident,
            resident_measured_at=self.time if self.measured_at is None else self.measured_at,
            disk_read_bytes=self.disk,
            log_events=() if self.log_unread else tuple(self.log),
            log_lines=self.log_lines if self.logged and not self.log_unread else None,
            log_read_at=self.time - self.log_lag if self.logged and not self.log_unread else None,
            log_followed=self.logged,
            files=(
                FileView(None, False, None, 0, 0, 0, pending=True)
                if self.files and alive and self.ticks <= self.pending
                else FileView(
                    self.first_open,
                    self.first_open_seen,
                    self.idle,
                    self.consumed,
                    self.seen,
                    self.weights,
                )
                if self.files and alive
                else None
            ),
            gpu_rx_bytes=self.rx,
        )

    def tick(
        self,
        n: int = 1,
        *,
        read: int = 0,
        cache: int | None = None,
        chars: int = 0,
        gpu: int = 0,
        consume: int = 0,
        rx: int = 0,
    ) -> None:
        """n seconds; `read` storage bytes/s (into the page cache unless `cache` says otherwise),
        `consume` bytes/s of the weight files consumed (what the file view shows)."""
        for _ in range(n):
            self.time += 1
            self.ticks += 1
            self.consumed = min(self.seen, self.consumed + consume)
            if self.rx is not None:
                self.rx += rx
            self.read_bytes += read
            self.read_chars += chars
            self.gpu += gpu
            if self.disk is not None:
                self.disk += read
            self.resident = min(self.weights, self.resident + (read if cache is None else cache))
            if self.ticks % self.probe_every == 0:
                self.probe = (self.endpoint, self.time)
            record = self.tracker.observe(self.observation())
            self.log.clear()
            if record is not None:
                self.records.append(record)
            self.states.append(self.tracker.state(self.time))
            self.times.append(self.time)

    @property
    def state(self) -> LoadState:
        return self.states[-1]

    def state_at(self, t: float) -> LoadState:
        return self.states[self.times.index(t)]

    def until_record(self, limit: int = 100) -> LoadRecord:
        for _ in range(limit):
            if self.records:
                return self.records[-1]
            self.tick()
        raise AssertionError("no load finished")


def tracker(stall_after: float = 300.0, expectations: HistoryStore | None = None) -> Tracker:
    return Tracker("kimi", stall_after=stall_after, expectations=expectations, interval=1.0)


def phases(states: list[LoadState]) -> list[str]:
    out: list[str] = []
    for s in states:
        if not out or out[-1] != s.phase:
            out.append(s.phase)
    return out


@dataclass(frozen=True)
class ColdScript:
    starting: int = 20
    noise: int = 5  # seconds of the interpreter reading its own libraries, 10 MB/s
    weights_seconds: int = 500
    init: int = 120


def cold_load(sim: Sim, script: ColdScript = ColdScript(), pid: int = 1000) -> None:
    """Cold start: libraries, weights from storage at 240 MB/s, init (refused, then 503), ready."""
    sim.spawn(pid)
    sim.endpoint = "refused"
    sim.tick(script.noise, read=10 * MB, cache=0, chars=20 * MB)
    sim.tick(script.starting - script.noise)
    rate = sim.weights // script.weights_seconds
    sim.tick(script.weights_seconds, read=rate, chars=rate, gpu=rate)
    sim.tick(script.init // 2, gpu=40 * GB if sim.nvml else 0)
    sim.endpoint = "http_error"
    sim.tick(script.init - script.init // 2)
    sim.endpoint = "ready"
    sim.tick()


def test_cold_load_goes_through_every_phase_and_ends_with_a_true_record() -> None:
    sim = Sim(tracker())
    script = ColdScript()
    cold_load(sim, script)

    assert phases(sim.states) == ["starting", "loading_weights", "initializing", "ready"]
    progress = [s.progress_ratio for s in sim.states if s.in_progress]
    known = [p for p in progress if p is not None]
    assert len(known) == len(progress)
    assert known == sorted(known)
    assert known[-1] == 1.0
    [record] = sim.records
    total = script.starting + script.weights_seconds + script.init + 1
    assert record.outcome == "ready"
    assert record.cache == "cold"
    assert not record.partial
    assert record.started_at == T0
    assert record.duration_seconds == total
    assert record.phase_seconds == {
        "starting": script.starting,
        "loading_weights": script.weights_seconds,
        "initializing": script.init + 1,
    }
    assert record.weights_bytes == WEIGHTS
    assert record.bytes_read == sim.read_bytes
    assert record.gpu_bytes_at_weights_end is None  # no NVML in this timeline
    assert sim.state.phase == "ready" and sim.state.last_record == record


def test_cold_load_throughput_and_weights_eta_without_history() -> None:
    sim = Sim(tracker())
    script = ColdScript()
    cold_load(sim, script)
    rate = WEIGHTS // script.weights_seconds
    weights_began = T0 + script.starting
    mid = sim.state_at(weights_began + 250)
    assert mid.phase == "loading_weights"
    assert mid.cache == "cold"
    assert mid.throughput_bytes_per_second == pytest.approx(rate, rel=1e-6)
    read_then = script.noise * 10 * MB + 250 * rate
    assert mid.progress_ratio == pytest.approx(read_then / WEIGHTS)
    assert mid.weights_eta_seconds == pytest.approx((WEIGHTS - read_then) / rate, rel=1e-6)
    assert mid.progress_source in ("page_cache", "process_reads")
    assert mid.eta_seconds is None  # no history: the initializing part has no basis
    assert mid.signals["resident_bytes_at_start"] == 0
    assert all(
        s.throughput_bytes_per_second is None for s in sim.states if s.phase != "loading_weights"
    )
    init = [s for s in sim.states if s.phase == "initializing"]
    assert init and all(s.eta_seconds is None for s in init)
    assert all(s.weights_eta_seconds == 0 for s in init)


def test_eta_comes_from_history_once_throughput_is_known(tmp_path) -> None:
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    first = Sim(tracker(expectations=store))
    script = ColdScript()
    cold_load(first, script)
    [previous] = first.records
    store.add(previous)
    expected = previous.phase_seconds

    sim = Sim(tracker(expectations=store), time=first.time + 3600)
    start = sim.time
    sim.resident = 0  # evicted since: cold again
    cold_load(sim, script, pid=2000)

    early = sim.state_at(start + 5)
    assert early.phase == "starting"
    assert early.eta_seconds == pytest.approx(
        expected["starting"] - 5 + expected["loading_weights"] + expected["initializing"]
    )
    weights_began = start + script.starting
    loading = [s for s in sim.states if s.phase == "loading_weights"]
    for state in loading:
        assert state.weights_eta_seconds is not None
        assert state.eta_seconds == pytest.approx(
            state.weights_eta_seconds + expected["initializing"]
        )
    rate = WEIGHTS // script.weights_seconds
    remaining = WEIGHTS - (script.noise * 10 * MB + 100 * rate)
    mid = sim.state_at(weights_began + 100)
    assert mid.eta_seconds == pytest.approx(remaining / rate + expected["initializing"])
    weights_end = weights_began + script.weights_seconds
    assert sim.state_at(weights_end + 30).eta_seconds == pytest.approx(
        expected["initializing"] - 30
    )
    store.close()


def test_warm_load_shows_progress_from_gpu_memory_and_read_chars() -> None:
    sim = Sim(tracker(), nvml=True, resident=WEIGHTS)
    sim.spawn()
    sim.tick(10)
    contexts = 2 * GB
    sim.tick(1, gpu=contexts)
    sim.tick(9)
    seconds = 40
    rate = WEIGHTS // seconds  # 3 GB/s from page cache
    sim.tick(seconds, chars=rate, gpu=rate)
    gpu_before_last_tick = contexts + (seconds - 1) * rate
    sim.tick(1, gpu=40 * GB)  # KV cache
    sim.tick(59)
    sim.endpoint = "ready"
    sim.tick()

    weights = [s for s in sim.states if s.phase == "loading_weights"]
    values = [s.progress_ratio for s in weights]
    assert len(values) == seconds - 1
    assert all(a is not None and b is not None and b > a for a, b in itertools.pairwise(values))
    assert {s.progress_source for s in weights} <= {"gpu_memory", "process_read_chars"}
    assert weights[len(weights) // 2].throughput_bytes_per_second == pytest.approx(rate)
    [record] = sim.records
    assert record.cache == "warm"
    assert record.phase_seconds["starting"] == 20
    assert record.phase_seconds["loading_weights"] == seconds
    assert record.bytes_read == 0
    assert record.gpu_bytes_at_weights_end == gpu_before_last_tick


def test_warm_mmap_load_measures_gpu_against_the_size_history_expects(tmp_path) -> None:
    """No read() bytes (mmap) and fewer GPU bytes than file bytes (quantized on load)."""
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    contexts, on_gpu, kv = GB, WEIGHTS // 2, 80 * GB

    def warm_mmap(sim: Sim) -> None:
        sim.spawn()
        sim.tick(4)
        sim.tick(1, gpu=contexts)
        sim.tick(20, gpu=on_gpu // 20)
        sim.tick(10)
        sim.tick(1, gpu=kv)
        sim.tick(20)
        sim.endpoint = "ready"
        sim.tick()

    first = Sim(tracker(expectations=store), nvml=True, resident=WEIGHTS)
    warm_mmap(first)
    [previous] = first.records
    # Without history the weights size is the yardstick: half of it reached the GPU.
    assert first.state_at(T0 + 35).progress_ratio == pytest.approx(on_gpu / WEIGHTS)
    assert previous.gpu_bytes_at_weights_end == contexts + on_gpu
    store.add(previous)

    sim = Sim(tracker(expectations=store), nvml=True, resident=WEIGHTS, time=first.time + 600)
    start = sim.time
    warm_mmap(sim)
    [record] = sim.records
    assert sim.state_at(start + 15).progress_ratio == pytest.approx(0.5)
    assert sim.state_at(start + 25).phase == "initializing"
    assert record.cache == "warm"
    assert record.phase_seconds["loading_weights"] == 20
    assert record.gpu_bytes_at_weights_end == contexts + on_gpu - on_gpu // 20
    store.close()


def test_cold_load_stays_cold_when_the_first_residency_pass_lands_after_reads_began() -> None:
    # A small model read at 240 MB/s: 12 % is cached by the time the first pass after the
    # start lands. Those bytes came from storage during this load, so the start was cold.
    weights = 2 * GB
    sim = Sim(tracker(), weights=weights)
    sim.tick(3)
    sim.spawn()
    sim.tick(read=COLD_RATE)
    assert sim.resident / weights > 0.1
    assert sim.state.cache == "cold"


def test_library_reads_before_the_first_residency_pass_are_not_weights() -> None:
    # A small model: the interpreter reading its own libraries from the page cache (rchar) is
    # 10 % of the weights. Until the first residency pass of the load says how cold it is, that
    # must not count as weights arriving.
    weights = 64 * 2**20
    t = tracker()
    common = {
        "endpoint_result": "refused",
        "endpoint_probe_time": None,
        "process_configured": True,
        "process_gpu_bytes": None,
        "weights_bytes": weights,
        "resident_bytes": 0,
        "resident_measured_at": T0 - 5,  # the pass requested at the start has not landed
        "disk_read_bytes": None,
    }
    none = {"process_pid": None, "process_start_time": None}
    t.observe(Observation(time=T0, process_found=False, process_read_bytes=None,
                          process_read_chars=None, **none, **common))  # fmt: skip
    alive = {"process_found": True, "process_pid": 42, "process_start_time": T0 + 0.5}
    t.observe(Observation(time=T0 + 1, process_read_bytes=0, process_read_chars=weights // 10,
                          **alive, **common))  # fmt: skip
    assert t.state(T0 + 1).phase == "starting"
    # The pass lands: cold. Storage reads then move the load into its weights phase.
    common["resident_measured_at"] = T0 + 1.5
    chars = weights // 10 + weights // 5
    t.observe(Observation(time=T0 + 2, process_read_bytes=weights // 5, process_read_chars=chars,
                          **alive, **common))  # fmt: skip
    state = t.state(T0 + 2)
    assert (state.cache, state.phase) == ("cold", "loading_weights")


def test_pages_cached_before_the_start_still_count_as_warm() -> None:
    weights = 2 * GB
    sim = Sim(tracker(), weights=weights, resident=weights)
    sim.tick(3)
    sim.spawn()
    sim.tick(chars=COLD_RATE)
    assert sim.state.cache == "warm"


@pytest.mark.parametrize("weights", [64 * 2**20, 2 * GB])
def test_a_load_ready_before_its_first_residency_pass_waits_for_it(weights: int) -> None:
    """A warm start can answer before the pass requested at its start lands: its record waits
    an interval for that pass and takes its temperature from it, its duration unchanged."""
    sim = Sim(tracker(), weights=weights, resident=weights, measured_at=T0 - 30)
    sim.tick(2)
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick()
    assert sim.records == []
    sim.measured_at = sim.time + 0.3
    sim.tick()
    (record,) = sim.records
    assert record.cache == "warm"
    assert record.duration_seconds == pytest.approx(1.0)


def test_a_residency_pass_that_never_lands_delays_the_record_one_interval_at_most() -> None:
    sim = Sim(tracker(), resident=WEIGHTS // 2, measured_at=T0 - 30)
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick()
    assert sim.records == []
    sim.tick()
    (record,) = sim.records
    assert record.cache is None
    assert record.duration_seconds == pytest.approx(1.0)


def test_mixed_load_counts_progress_against_the_uncached_part() -> None:
    sim = Sim(tracker(), resident=WEIGHTS // 2)
    sim.spawn()
    sim.tick(10)
    seconds = (WEIGHTS // 2) // COLD_RATE
    sim.tick(seconds, read=COLD_RATE)
    sim.tick(30)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.cache == "mixed"
    assert record.phase_seconds == {"starting": 10, "loading_weights": seconds, "initializing": 31}
    half = sim.state_at(T0 + 10 + seconds // 2)
    assert half.progress_ratio == pytest.approx((seconds // 2) * COLD_RATE / (WEIGHTS // 2))


def test_stall_is_flagged_exactly_after_stall_after_and_clears_on_movement() -> None:
    sim = Sim(tracker(stall_after=300))
    sim.spawn()
    sim.tick(10)
    sim.tick(200, read=COLD_RATE)  # 40 % of the weights
    last_move = sim.time
    sim.tick(400)
    stalled_at = [t for s, t in zip(sim.states, sim.times, strict=True) if s.stalled]
    assert stalled_at[0] == last_move + 300
    assert stalled_at == [t for t in sim.times if t >= last_move + 300]
    during = sim.state
    assert during.phase == "loading_weights"
    assert during.seconds_since_progress == sim.time - last_move
    assert during.throughput_bytes_per_second == 0
    assert during.weights_eta_seconds is None and during.eta_seconds is None
    sim.tick(1, read=COLD_RATE)
    assert not sim.state.stalled
    assert sim.state.seconds_since_progress == 0
    assert sim.state.progress_ratio == pytest.approx(201 * COLD_RATE / WEIGHTS)


def test_process_that_never_moves_stays_starting_and_stalls() -> None:
    sim = Sim(tracker(stall_after=120))
    sim.spawn()
    sim.tick(400)
    assert phases(sim.states) == ["starting"]
    assert not sim.state_at(T0 + 119).stalled
    assert sim.state_at(T0 + 120).stalled
    assert sim.state.elapsed_seconds == 400
    assert sim.state.progress_ratio == 0.0
    assert sim.records == []


def test_endpoint_only_target_that_never_answers_is_down() -> None:
    sim = Sim(tracker(stall_after=60), configured=False)
    sim.tick(1000)
    assert phases(sim.states) == ["down"]
    assert not any(s.in_progress or s.stalled for s in sim.states)
    assert sim.state.progress_ratio is None and sim.records == []


def test_crash_mid_weights_records_a_failed_load_and_stays_failed() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(20)
    sim.tick(250, read=COLD_RATE)
    sim.kill()
    sim.tick()
    crashed = sim.time
    sim.tick(30)
    [record] = sim.records
    assert record.outcome == "failed"
    assert record.ended_at == crashed
    assert record.phase_seconds == {"starting": 20, "loading_weights": crashed - T0 - 20}
    assert record.bytes_read == 250 * COLD_RATE
    assert phases(sim.states)[-1] == "failed"
    assert sim.state.progress_ratio == pytest.approx(0.5)
    assert not sim.state.in_progress
    sim.spawn(pid=2000)
    restarted = sim.time
    sim.tick()
    assert sim.state.phase == "starting" and sim.state.started_at == restarted


def test_crash_during_initializing_records_failed_with_gpu_size() -> None:
    sim = Sim(tracker(), nvml=True)
    script = ColdScript()
    sim.spawn()
    sim.tick(script.starting)
    rate = WEIGHTS // script.weights_seconds
    sim.tick(script.weights_seconds, read=rate, gpu=rate)
    gpu_before_last_tick = (script.weights_seconds - 1) * rate
    sim.tick(1, gpu=40 * GB)
    sim.tick(29)
    sim.kill()
    sim.tick()
    [record] = sim.records
    assert record.outcome == "failed"
    assert record.phase_seconds == {
        "starting": script.starting,
        "loading_weights": script.weights_seconds,
        "initializing": 31,
    }
    assert record.gpu_bytes_at_weights_end == gpu_before_last_tick
    assert sim.state.phase == "failed"


def test_process_replaced_between_two_ticks_fails_the_old_load_and_starts_a_new_one() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(30, read=COLD_RATE)
    sim.time += 0.5
    sim.spawn(pid=2000)
    replaced = sim.time
    sim.tick()
    [record] = sim.records
    assert record.outcome == "failed" and record.ended_at == replaced
    assert sim.state.phase == "starting" and sim.state.started_at == replaced


def test_endpoint_flapping_while_ready_is_not_a_new_load() -> None:
    sim = Sim(tracker())
    cold_load(sim, ColdScript(weights_seconds=100, init=20))
    for result in ("refused", "ready", "timeout", "timeout", "timeout", "timeout", "ready"):
        sim.endpoint = result
        sim.tick()
        assert sim.state.phase == "ready"
    assert len(sim.records) == 1
    sim.kill()  # stopped after being ready: down, not a failed load
    sim.tick()
    assert sim.state.phase == "down"
    sim.endpoint = "refused"
    sim.tick(3)
    assert sim.state.phase == "down" and len(sim.records) == 1


def test_endpoint_only_load_starts_after_three_distinct_failed_probes() -> None:
    sim = Sim(tracker(), configured=False, endpoint="ready", resident=0)
    sim.tick(5)
    assert phases(sim.states) == ["ready"] and sim.records == []
    for result in ("refused", "ready", "refused", "refused", "ready"):  # flapping
        sim.endpoint = result
        sim.tick()
        assert sim.state.phase == "ready"
    sim.probe_every = 3  # probes slower than ticks: each counts once
    sim.endpoint = "refused"
    sim.tick(3 - sim.ticks % 3)
    first_failure = sim.time
    sim.tick(5)
    assert sim.state.phase == "ready"  # two distinct failed probes in six ticks
    sim.tick()
    assert sim.state.in_progress and sim.state.started_at == first_failure
    assert not sim.state.partial
    sim.tick(100, read=COLD_RATE)
    assert sim.state.phase == "loading_weights"
    assert sim.state.progress_source == "page_cache"
    sim.endpoint = "ready"
    record = sim.until_record()
    assert record.outcome == "ready" and not record.partial
    assert record.started_at == first_failure
    assert record.duration_seconds == sim.time - first_failure
    assert record.bytes_read is None  # no process information


def test_exporter_started_mid_cold_load_measures_it_whole_from_the_process_start() -> None:
    sim = Sim(Tracker("other", stall_after=300))  # the exporter is not running yet
    sim.spawn()
    sim.tick(20)
    sim.tick(200, read=COLD_RATE)
    sim.restart_exporter(tracker())
    sim.tick()
    arrived = sim.state
    assert arrived.seen_late and not arrived.partial and arrived.in_progress
    assert arrived.started_at == T0
    assert arrived.elapsed_seconds == sim.time - T0
    # Residency now (all of it read by the tree from storage) less the tree's reads: 0 at start.
    assert arrived.cache == "cold"
    assert arrived.signals["resident_bytes_at_start"] == 0
    assert arrived.progress_ratio == pytest.approx(sim.read_bytes / WEIGHTS)
    sim.tick(300, read=COLD_RATE)
    weights_done = sim.time
    sim.tick(30)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert not record.partial and record.seen_late and record.outcome == "ready"
    assert record.duration_seconds == sim.time - T0
    assert record.cache == "cold"
    # When the weights began was not watched: starting and loading_weights are unknown, not 0 s.
    assert record.phase_seconds == {"initializing": sim.time - weights_done}


def test_exporter_started_mid_warm_load_reads_warm() -> None:
    sim = Sim(Tracker("other", stall_after=300), nvml=True, resident=WEIGHTS)
    sim.spawn()
    sim.tick(10)
    sim.tick(20, chars=WEIGHTS // 40, gpu=WEIGHTS // 40)
    sim.restart_exporter(tracker())
    sim.tick(1, chars=WEIGHTS // 40, gpu=WEIGHTS // 40)
    assert (sim.state.cache, sim.state.seen_late) == ("warm", True)
    assert sim.state.progress_ratio == pytest.approx(21 / 40)  # all GPU memory counts


def test_mid_load_with_unreadable_tree_counters_has_an_unknown_temperature() -> None:
    """Residency alone cannot tell pages cached before the start from pages the load read."""
    sim = Sim(Tracker("other", stall_after=300), io_readable=False)
    sim.spawn()
    sim.tick(100, read=COLD_RATE)
    sim.restart_exporter(tracker())
    sim.tick(100, read=COLD_RATE)
    assert sim.state.seen_late and sim.state.cache is None
    sim.endpoint = "ready"
    record = sim.until_record()
    assert record.cache is None and not record.partial


@pytest.mark.parametrize(("first_tick", "late"), [(3.0, False), (3.5, True)])
def test_start_grace_is_two_intervals_and_a_second(first_tick: float, late: bool) -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.time += first_tick - 1  # tick() adds the last second
    sim.tick(read=COLD_RATE)
    assert sim.state.seen_late is late and not sim.state.partial


def test_server_already_ready_when_the_exporter_arrives_is_no_load() -> None:
    sim = Sim(Tracker("other", stall_after=300))
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick(3600)
    sim.restart_exporter(tracker())
    sim.probe_every = 2
    sim.tick(2 - sim.ticks % 2)  # ticks before the first probe answers, then that probe
    assert sim.states[-2].phase == "starting" and sim.states[-2].seen_late
    sim.tick(4)
    assert sim.records == []
    assert sim.state.phase == "ready" and not sim.state.in_progress


def test_endpoint_only_server_seen_loading_is_a_partial_load() -> None:
    sim = Sim(tracker(), configured=False, endpoint="http_error")  # llama.cpp's 503
    sim.tick()
    loading_seen = sim.time
    assert sim.state.phase in IN_PROGRESS and sim.state.partial
    sim.tick(60, read=COLD_RATE)
    assert sim.state.phase == "loading_weights"
    assert sim.state.progress_source == "disk_reads"
    assert sim.state.progress_ratio == pytest.approx(60 * COLD_RATE / WEIGHTS)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.partial and record.started_at == loading_seen
    assert record.cache is None


# -- the rules at their boundaries -------------------------------------------------------------


@pytest.mark.parametrize(
    ("share", "cache"),
    [
        (0.0, "cold"),
        (0.1, "cold"),
        (0.1001, "mixed"),
        (0.2, "mixed"),
        (0.5, "mixed"),
        (0.8999, "mixed"),
        (0.9, "warm"),
        (0.95, "warm"),
        (1.0, "warm"),
    ],
)
def test_cache_temperature_at_the_start_at_and_beside_its_thresholds(
    share: float, cache: str
) -> None:
    sim = Sim(tracker(), resident=round(share * WEIGHTS))
    sim.spawn()
    sim.tick()
    assert sim.state.cache == cache


@pytest.mark.parametrize(("stop_at", "quiet_done"), [(0.9, True), (0.95, True), (0.8999, False)])
def test_weights_are_in_after_five_quiet_intervals_from_ninety_percent(
    stop_at: float, quiet_done: bool
) -> None:
    """Quantized weights, or files the server does not read: progress stops short of 100 %."""
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(10)
    target = round(stop_at * WEIGHTS)
    sim.tick(99, read=target // 100)
    sim.tick(1, read=target - 99 * (target // 100))
    last_rise = sim.time
    sim.tick(4)
    assert sim.state.phase == "loading_weights"
    sim.tick()
    assert sim.state.phase == ("initializing" if quiet_done else "loading_weights")
    sim.endpoint = "ready"
    record = sim.until_record()
    if quiet_done:  # backdated to the last rise
        assert record.phase_seconds["initializing"] == record.ended_at - last_rise
    else:
        assert "initializing" not in record.phase_seconds


def test_throughput_follows_a_new_rate_within_the_ten_second_window() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(5)
    sim.tick(60, read=COLD_RATE)
    sim.tick(10, read=COLD_RATE // 4)  # the disk is shared now
    assert sim.state.throughput_bytes_per_second == pytest.approx(COLD_RATE // 4)
    assert sim.state_at(sim.time - 1).throughput_bytes_per_second > COLD_RATE // 4


def test_a_change_of_probe_answer_is_movement() -> None:
    """A server compiling for minutes shows nothing but its port: 503 after refused is life."""
    sim = Sim(tracker(stall_after=60))
    sim.spawn()
    sim.tick(5)
    sim.tick(100, read=WEIGHTS // 100)
    assert sim.state.phase == "initializing"
    quiet_since = sim.time
    sim.tick(50)
    sim.endpoint = "http_error"
    sim.tick()
    answered = sim.time
    sim.tick(59)
    assert sim.time - quiet_since > 60 and not sim.state.stalled
    sim.tick()
    assert sim.state.stalled and sim.state.seconds_since_progress == sim.time - answered


@pytest.mark.parametrize(("per_tick", "moving"), [(MIB, True), (MIB - 1, False)])
def test_a_mebibyte_per_tick_is_movement_and_less_is_not(per_tick: int, moving: bool) -> None:
    sim = Sim(tracker(stall_after=30))
    sim.spawn()
    sim.tick(5)
    sim.tick(10, read=COLD_RATE)
    sim.tick(40, read=per_tick)
    assert sim.state.phase == "loading_weights"
    assert sim.state.stalled is not moving


def test_progress_never_falls_when_page_cache_evidence_drops() -> None:
    """Pages evicted mid-load (memory pressure, DAMON) are not weights leaving the GPU."""
    sim = Sim(tracker(), io_readable=False, disk=None)  # residency is the only evidence
    sim.spawn()
    sim.tick(5)
    sim.tick(100, read=COLD_RATE)
    before = sim.state.progress_ratio
    assert sim.state.progress_source == "page_cache" and before is not None and before > 0.1
    sim.tick(1, cache=-50 * COLD_RATE)
    sim.tick(3, read=COLD_RATE)
    assert [s.progress_ratio for s in sim.states[-4:]] == [before] * 4


def test_progress_never_falls_when_the_driving_signal_switches() -> None:
    """Warm: GPU memory leads; a freed staging buffer drops it below what read() bytes show."""
    sim = Sim(tracker(), nvml=True, resident=WEIGHTS)
    sim.spawn()
    sim.tick(5)
    sim.tick(20, gpu=WEIGHTS // 40, chars=WEIGHTS // 80)
    assert sim.state.progress_source == "gpu_memory"
    before = sim.state.progress_ratio
    sim.tick(1, gpu=-WEIGHTS // 4, chars=WEIGHTS // 80)
    assert sim.state.progress_ratio == before
    sim.tick(10, chars=WEIGHTS // 80)
    assert sim.state.progress_ratio == before  # read() bytes (31/80) still below
    sim.tick(10, chars=WEIGHTS // 80)  # ... until they pass it and take over
    assert sim.state.progress_source == "process_read_chars"
    assert sim.state.progress_ratio == pytest.approx(41 / 80)


def test_second_load_of_another_temperature_has_a_ready_eta(tmp_path) -> None:
    """Initializing does not depend on the page cache: a cold load's tells a warm one's."""
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    first = Sim(tracker(expectations=store))
    script = ColdScript(init=90)
    cold_load(first, script)
    [cold] = first.records
    store.add(cold)
    init = cold.phase_seconds["initializing"]

    sim = Sim(tracker(expectations=store), nvml=True, resident=WEIGHTS, time=first.time + 600)
    start = sim.time
    sim.spawn()
    sim.tick(10)
    assert sim.state.eta_seconds is None  # how long warm weights take: no warm load yet
    rate = WEIGHTS // 40
    sim.tick(40, gpu=rate, chars=rate)
    loading = [s for s in sim.states if s.phase == "loading_weights"]
    assert loading and all(s.cache == "warm" for s in loading)
    measured = [s for s in loading if s.weights_eta_seconds is not None]
    assert measured and all(
        s.eta_seconds == pytest.approx(s.weights_eta_seconds + init) for s in measured
    )
    sim.tick(30)
    assert sim.state.phase == "initializing"
    weights_end = start + 10 + 40
    assert sim.state.eta_seconds == pytest.approx(init - (sim.time - weights_end), abs=1)
    store.close()


# -- the server's own log ----------------------------------------------------------------------


def test_log_markers_give_exact_boundaries_and_fine_steps() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(8)
    sim.say(EventKind.WEIGHTS_BEGIN, ago=0.4)  # before any byte moved: the log knows first
    sim.tick()
    began = sim.time - 0.4
    assert sim.state.phase == "loading_weights" and sim.state.step == "weights"
    rate = WEIGHTS // 100
    sim.tick(60, read=rate)
    sim.say(EventKind.WEIGHTS_PROGRESS, done=40, total=64)
    sim.tick(1, read=rate)
    assert sim.state.progress_ratio == pytest.approx(40 / 64)  # shards lead the bytes (61 %)
    assert sim.state.progress_source == "log_shards"
    sim.tick(38, read=rate)  # bytes all in: only the log may end the weights
    assert sim.state.phase == "loading_weights"
    sim.say(EventKind.WEIGHTS_END, ago=0.25)
    sim.tick()
    weights_end = sim.time - 0.25
    assert sim.state.phase == "initializing" and sim.state.progress_ratio == 1.0
    sim.say(EventKind.KV_CACHE)
    sim.tick(3)
    sim.say(EventKind.CUDA_GRAPH_BEGIN)
    sim.tick(10)
    assert sim.state.step == "cuda_graph"
    sim.say(EventKind.CUDA_GRAPH_END)
    sim.tick()
    sim.say(EventKind.WARMUP_BEGIN)
    sim.tick(2)
    sim.say(EventKind.READY, ago=0.5)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    # The last refused answer came before the ready line: the load ended at the line.
    assert record.ended_at == sim.time - 0.5
    assert record.phase_seconds == pytest.approx(
        {
            "starting": began - T0,
            "loading_weights": weights_end - began,
            "initializing": sim.time - 0.5 - weights_end,
            "kv_cache": 3.0,
            "cuda_graph": 10.0,
            "warmup": 1.5,
        }
    )
    assert sim.state.step == "none"


def test_a_load_over_before_it_was_first_asked_ends_at_the_logs_ready_line() -> None:
    """A warm llama-server is serving 70 ms after its start, before discovery has found it: the
    first answer comes a second late, and its log's ready line says when it served. An answer
    after that line that said not ready makes the line too early: the answer decides."""
    sim = Sim(tracker(), logged=True, probe_every=3)
    sim.spawn()
    sim.endpoint = "ready"
    sim.say(EventKind.WEIGHTS_BEGIN, ago=0.99)
    sim.say(EventKind.WEIGHTS_END, ago=0.98)
    sim.say(EventKind.READY, ago=0.93)
    sim.tick(3)  # the first answer, 3 s after the start
    [record] = sim.records
    assert record.ended_at == pytest.approx(T0 + 0.07, abs=1e-3)
    assert record.phase_seconds == pytest.approx(
        {"starting": 0.01, "loading_weights": 0.01, "initializing": 0.05}
    )

    early = Sim(tracker(), logged=True)
    early.spawn()
    early.tick(2)  # refused
    early.say(EventKind.READY, ago=0.9)  # "ready" in the log, yet refused after it:
    early.tick()
    early.endpoint = "ready"
    early.tick()
    [record] = early.records
    assert record.ended_at == T0 + 4  # the answer


@pytest.mark.parametrize("first_read", [1, 2])
def test_a_load_found_over_waits_for_the_first_read_of_the_log_just_opened(first_read: int) -> None:
    """A router's model server started again, warm: serving 70 ms after its start and found
    1.5 s later, its log (the router's, opened for it on that tick) not read yet. The answer
    waits for that read, whose lines date the load; a read that does not come within an
    interval leaves the answer to end it."""
    sim = Sim(tracker(), logged=True, log_unread=True)
    sim.spawn()
    sim.time += 0.5
    sim.endpoint = "ready"
    sim.tick()  # found, answering; its log opened
    answered = sim.time
    assert sim.records == [] and sim.state.in_progress
    sim.log_unread = first_read > 1
    sim.say(EventKind.WEIGHTS_BEGIN, ago=2.49)  # written 10 ms after its start
    sim.say(EventKind.WEIGHTS_END, ago=2.48)
    sim.say(EventKind.READY, ago=2.43)
    sim.tick()
    [record] = sim.records
    if first_read > 1:  # an interval went by unread: the answer ends it
        assert record.ended_at == answered and record.phase_seconds == {"starting": 1.5}
        return
    assert record.ended_at == pytest.approx(T0 + 0.07, abs=1e-3)
    assert record.phase_seconds == pytest.approx(
        {"starting": 0.01, "loading_weights": 0.01, "initializing": 0.05}
    )


def test_a_begin_line_read_after_the_heuristics_crossed_both_boundaries_dates_the_weights() -> None:
    """A warm model server found with its weights already mapped and in the page cache: the
    first look takes them as loaded on that tick. Its log, read on the next, says when they
    began and ended: both come from the lines, not from the tick."""
    sim = Sim(tracker(), weights=4 * GB, files=True, logged=True, log_unread=True)
    sim.spawn()
    sim.hold(4 * GB)
    sim.consumed = 4 * GB
    sim.let_go()
    sim.endpoint = "ready"
    sim.tick()
    assert sim.state.phase == "initializing" and sim.records == []
    sim.log_unread = False
    sim.say(EventKind.WEIGHTS_BEGIN, ago=1.99)
    sim.say(EventKind.WEIGHTS_END, ago=1.98)
    sim.say(EventKind.READY, ago=1.93)
    sim.tick()
    [record] = sim.records
    assert record.ended_at == pytest.approx(T0 + 0.07, abs=1e-3)
    assert record.phase_seconds == pytest.approx(
        {"starting": 0.01, "loading_weights": 0.01, "initializing": 0.05}
    )


@pytest.mark.parametrize(
    ("line_ago", "takes", "ended"),
    [
        (0.2, 0.3, 3.8),  # sent before the line, answered after it: the line
        (0.2, 0.15, 3.85),  # sent 50 ms after the line's stamp: within its skew, the request
        (LINE_STAMP_SKEW_SECONDS, 0.0, 5.0),  # sent a whole skew after it: the next answer
        (0.8, 0.0, 5.0),  # sent 0.8 s after it: the line was early, the next answer
    ],
)
def test_a_not_ready_answer_outweighs_the_ready_line_only_if_asked_after_it(
    line_ago: float, takes: float, ended: float
) -> None:
    """llama-server marks itself ready, then writes `model loaded`: a 503 to a probe sent before
    the line and answered after it (slowly, the server busy) says nothing against the line,
    which ends the load. Its stamps count from a clock it starts after exec, tens of ms after
    the process's start time, so a line reads that much early: a 503 to a probe sent within
    that skew after the line dates the end at the request. One sent later makes the line too
    early (the server said ready before it served), and the next ready answer ends the load."""
    sim = Sim(tracker(), logged=True)
    sim.spawn()
    sim.endpoint = "http_error"  # 503 Loading model
    sim.tick(3)
    sim.probe_takes = takes
    sim.say(EventKind.READY, ago=line_ago)  # written this long before the next answer
    sim.tick()
    sim.probe_takes = 0.0
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.ended_at == pytest.approx(T0 + ended, abs=1e-3)


def test_a_fatal_line_fails_the_load_at_once_with_the_servers_words() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(5)
    sim.tick(100, read=WEIGHTS // 100)
    message = "RuntimeError: CUDA out of memory; cause: ValueError: KV cache too large"
    sim.say(EventKind.FATAL, ago=0.5, detail=message)
    sim.tick()
    [record] = sim.records
    assert (record.outcome, record.fatal) == ("failed", message)
    assert record.ended_at == sim.time - 0.5  # the process is still there: failed anyway
    assert sim.state.phase == "failed" and sim.state.fatal == message


def test_markers_of_the_previous_process_are_not_this_loads() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(3)
    sim.say(EventKind.FATAL, ago=10, detail="the old server's last words")
    sim.tick()
    assert sim.state.in_progress and sim.records == []


def test_new_log_lines_are_movement() -> None:
    """Compiling kernels for minutes moves no byte, but the server keeps logging."""
    sim = Sim(tracker(stall_after=30), logged=True)
    sim.spawn()
    sim.tick(5)
    sim.tick(100, read=WEIGHTS // 100)
    for _ in range(60):
        sim.log_lines += 1
        sim.tick()
    assert sim.state.phase == "initializing" and not sim.state.stalled
    sim.tick(30)
    assert sim.state.stalled


def test_without_a_log_there_is_no_step() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(3)
    assert sim.state.step is None


def test_an_exit_waits_a_tick_for_the_logs_last_words() -> None:
    sim = Sim(tracker(), logged=True)
    sim.spawn()
    sim.tick(5)
    sim.tick(50, read=COLD_RATE)
    sim.kill()
    sim.tick()
    assert sim.records == [] and sim.state.in_progress  # the log may still say why
    exited = sim.time
    sim.say(EventKind.FATAL, ago=1.5, detail="torch.OutOfMemoryError: CUDA out of memory")
    sim.tick()
    [record] = sim.records
    assert record.fatal == "torch.OutOfMemoryError: CUDA out of memory"
    assert record.ended_at == exited - 0.5  # the fatal line, just before the exit was seen


def test_a_ready_answer_waits_for_the_log_read_after_it() -> None:
    """A warm start shorter than an interval: the answer comes before the log's lines that
    date its weights were read. The record waits for that read (an interval at most) and ends
    at the answer, with the weights where the log put them."""
    sim = Sim(tracker(), logged=True, log_lag=0.5)
    sim.spawn()
    sim.tick()
    sim.endpoint = "ready"
    sim.tick()
    answered = sim.time
    assert sim.records == [] and sim.state.in_progress  # the log was read before the answer
    sim.log_lag = 0.0
    sim.say(EventKind.WEIGHTS_BEGIN, ago=1.6)
    sim.say(EventKind.WEIGHTS_END, ago=1.2)
    sim.tick()
    [record] = sim.records
    assert record.outcome == "ready" and record.ended_at == answered
    assert record.phase_seconds == pytest.approx(
        {"starting": 1.4, "loading_weights": 0.4, "initializing": 0.2}
    )

    unread = Sim(tracker(), logged=True, log_lag=5.0)  # a log not read for a while
    unread.spawn()
    unread.tick()
    unread.endpoint = "ready"
    unread.tick(2)
    [record] = unread.records  # an interval at most: then it ends without the log
    assert record.ended_at == T0 + 2


def test_an_exit_without_a_log_fails_at_once() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(5)
    sim.kill()
    sim.tick()
    [record] = sim.records
    assert record.outcome == "failed" and record.ended_at == sim.time and record.fatal is None


# -- the weight files in view ----------------------------------------------------------------


@dataclass(frozen=True)
class PythonServerScript:
    """A Python server's start: imports reading like weights, then shards, then compile."""

    imports: int = 20  # seconds of imports: 533 MB through read(), 27 MB of it from storage
    shards: int = 4
    shard_seconds: int = 5
    init: int = 35


def python_server_load(sim: Sim, script: PythonServerScript = PythonServerScript()) -> None:
    sim.files = True
    sim.spawn()
    sim.tick(script.imports, read=27 * MB // script.imports, cache=0, chars=533 * MB)
    shard = sim.weights // script.shards
    rate = shard // script.shard_seconds
    for index in range(1, script.shards + 1):
        sim.hold(index * shard)
        sim.tick(script.shard_seconds, read=rate, consume=rate, chars=rate)
    sim.let_go()
    sim.tick(script.init)
    sim.endpoint = "ready"
    sim.tick()


def test_imports_are_starting_and_the_weights_begin_at_the_first_weight_file() -> None:
    sim = Sim(tracker(), weights=1_340 * MB)
    script = PythonServerScript()
    python_server_load(sim, script)

    assert phases(sim.states) == ["starting", "loading_weights", "initializing", "ready"]
    starting = [s for s in sim.states if s.phase == "starting"]
    assert len(starting) == script.imports
    assert all(not s.progress_ratio and s.weights_eta_seconds is None for s in starting)
    assert all(s.eta_seconds is None for s in starting)  # no history: no basis at all
    began = T0 + script.imports + 1
    loading = [(t, s) for t, s in zip(sim.times, sim.states, strict=True) if t >= began][
        : script.shards * script.shard_seconds
    ]
    rate = sim.weights // script.shards // script.shard_seconds
    for t, state in loading:
        assert state.progress_source == "weight_files"
        assert state.progress_ratio == pytest.approx(rate * (t - began + 1) / sim.weights)
    [record] = sim.records
    weights = script.shards * script.shard_seconds
    assert record.phase_seconds == {
        "starting": script.imports + 1,
        "loading_weights": weights - 1,
        "initializing": script.init + 1,
    }


def test_imports_before_the_file_views_first_look_are_not_weights() -> None:
    """A target just discovered ticks before the file view has looked at its process. A warm
    start's read() bytes then are imports (5 % of a small model's size: Triton's stubs), never
    weights; once the view looks, it decides. A view that turns out blind (another user's tree)
    hands over to the counters instead of holding its empty pending view."""
    size = 400 * MB
    sim = Sim(tracker(), weights=size, files=True, resident=size)
    sim.spawn()
    sim.pending = 2
    sim.tick(2, chars=10 * MB)
    assert [s.phase for s in sim.states] == ["starting"] * 2
    assert not sim.state.progress_ratio
    sim.tick(1, chars=10 * MB)  # the view's first look: nothing held yet
    assert sim.state.phase == "starting"
    sim.hold(size)
    sim.tick(2, consume=size // 4)
    assert sim.state.phase == "loading_weights"
    assert sim.state.progress_source == "weight_files"
    assert sim.state.progress_ratio == pytest.approx(0.5)
    assert sim.state_at(T0 + 3).phase == "starting"

    blind = Sim(tracker(), weights=size, files=True, resident=size)
    blind.spawn()
    blind.pending = 1
    blind.tick(1, chars=10 * MB)
    blind.files = False  # the first look could not see: the counters drive from here
    blind.tick(2, chars=100 * MB)
    assert blind.state.progress_source == "process_read_chars"
    assert blind.state.progress_ratio == pytest.approx(210 * MB / size)


def test_before_the_weights_the_eta_is_historys_and_no_weights_eta_from_imports(
    tmp_path,
) -> None:
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    first = Sim(tracker(expectations=store), weights=1_340 * MB)
    python_server_load(first, PythonServerScript())
    store.add(first.records[-1])
    expected = first.records[-1].phase_seconds

    sim = Sim(tracker(expectations=store), weights=1_340 * MB, time=first.time + 600)
    start = sim.time
    python_server_load(sim, PythonServerScript())
    for t in (5, 10, 19):
        state = sim.state_at(start + t)
        assert state.phase == "starting"
        assert state.weights_eta_seconds is None
        assert state.eta_seconds == pytest.approx(
            expected["starting"] - t + expected["loading_weights"] + expected["initializing"]
        )


def test_storage_reads_never_run_ahead_of_the_weight_files_held() -> None:
    sim = Sim(tracker(), weights=8 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(3)
    sim.hold(2 * GB)
    # A library imported lazily reads 3 GB from storage while the first shard loads (into the
    # page cache, but not the weight files' pages).
    sim.tick(1, read=3 * GB + 100 * MB, cache=100 * MB, consume=100 * MB)
    sim.tick(4, read=100 * MB, consume=100 * MB)
    for state in sim.states[3:]:
        assert state.phase == "loading_weights"
        assert state.progress_ratio is not None
        assert state.progress_ratio <= 2 * GB / sim.weights


def test_weights_end_when_the_tree_lets_go_of_every_weight_file() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(5)
    # A warm load so fast that two of its four shards came and went between two looks.
    sim.hold(2 * GB)
    sim.tick(2, consume=GB)
    sim.let_go()
    idle = sim.time + 1
    sim.tick(5)
    assert sim.state.phase == "loading_weights"  # held nothing for four intervals: not yet
    sim.tick()
    assert sim.state.phase == "initializing"  # for five: the loader is done with them
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.phase_seconds["loading_weights"] == idle - (T0 + 6)
    assert record.phase_seconds["initializing"] == sim.time - idle


@pytest.mark.parametrize("files", [True, False])
def test_an_implied_end_of_the_weights_is_dated_by_the_files_let_go(files: bool) -> None:
    """vLLM at TP 2 (0.32): both ranks log their begin, only the first its end, so the weights
    stay open in the log until the warm-up line implies they are in; the tree had let go of
    every weight file seconds before: they were in then. Without the file view, the implied
    line is all there is."""
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = files
    sim.spawn()
    sim.tick(5)
    sim.say(EventKind.WEIGHTS_BEGIN, who="Worker_TP0")
    sim.hold(4 * GB)
    sim.tick(4, read=GB, consume=GB)
    began = T0 + 6
    sim.let_go()
    idle = sim.time + 1
    sim.tick(7)
    assert sim.state.phase == "loading_weights"  # the log says the weights are still open
    sim.say(EventKind.WEIGHTS_END, ago=0.5, who="Worker_TP0", implied=True)
    sim.tick()
    implied = sim.time - 0.5
    assert sim.state.phase == "initializing"
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    ended = idle if files else implied
    assert record.phase_seconds["loading_weights"] == pytest.approx(ended - began)
    assert record.phase_seconds["initializing"] == pytest.approx(sim.time - ended)


def test_a_stated_end_of_the_weights_wins_over_the_files_let_go() -> None:
    """An end line that states the end dates it, whatever the files say (a loader that
    processes the weights after closing its files is still loading them)."""
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(5)
    sim.say(EventKind.WEIGHTS_BEGIN)
    sim.hold(4 * GB)
    sim.tick(4, read=GB, consume=GB)
    sim.let_go()
    sim.tick(3)
    sim.say(EventKind.WEIGHTS_END, ago=0.5)
    sim.tick()
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.phase_seconds["loading_weights"] == pytest.approx(sim.time - 1.5 - (T0 + 6))


def test_a_late_load_with_no_weight_file_held_on_arrival_has_unknown_phases() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(30)  # before the exporter: imports, or weights already loaded and closed?
    sim.restart_exporter(tracker())
    sim.tick(10)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.seen_late and record.phase_seconds == {}


def test_a_late_load_that_opens_its_weights_later_was_starting_until_then() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(30)
    sim.restart_exporter(tracker())
    sim.tick(10)
    sim.hold(4 * GB)
    sim.tick(4, consume=GB)
    sim.let_go()
    sim.tick(10)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.phase_seconds["starting"] == 41
    assert record.phase_seconds["loading_weights"] == 3  # all 4 GB in at the 4th tick
    assert "initializing" in record.phase_seconds


def test_a_late_load_holding_weights_on_arrival_began_them_unseen() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(30)
    sim.hold(4 * GB)
    sim.first_open_seen = False  # the exporter's first look already finds them held
    sim.tick(2, consume=GB // 2)
    sim.restart_exporter(tracker())
    sim.tick(6, consume=GB // 2)
    sim.let_go()
    sim.tick(10)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert "starting" not in record.phase_seconds
    assert "loading_weights" not in record.phase_seconds
    assert "initializing" in record.phase_seconds


def test_initializing_over_its_median_still_has_the_steps_it_has_not_done(tmp_path) -> None:
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    init, compile_s, warmup = 40, 20, 10

    def load(sim: Sim, compile_for: int) -> None:
        sim.files = True
        sim.spawn()
        sim.tick(5)
        sim.say(EventKind.WEIGHTS_BEGIN)
        sim.hold(sim.weights)
        sim.tick(4, consume=sim.weights // 4)
        sim.say(EventKind.WEIGHTS_END)
        sim.let_go()
        sim.tick(init - compile_s - warmup)
        sim.say(EventKind.COMPILE_BEGIN)
        sim.tick(compile_for)
        sim.say(EventKind.COMPILE_END)
        sim.say(EventKind.WARMUP_BEGIN)
        sim.tick(warmup)
        sim.endpoint = "ready"
        sim.tick()

    first = Sim(tracker(expectations=store), weights=4 * GB)
    load(first, compile_s)
    store.add(first.records[-1])
    assert first.records[-1].phase_seconds["compile"] == compile_s

    sim = Sim(tracker(expectations=store), weights=4 * GB, time=first.time + 600)
    load(sim, compile_s + 15)  # this compile takes 15 s longer
    weights_end = next(t for t, s in zip(sim.times, sim.states, strict=True)
                       if s.phase == "initializing")  # fmt: skip
    compile_began = weights_end + init - compile_s - warmup
    at = compile_began + 25  # 25 s into a 20-s median compile, 45 s into a 40-s init
    state = sim.state_at(at)
    assert state.phase == "initializing" and state.step == "compile"
    assert state.eta_seconds == pytest.approx(warmup)  # compile's median spent, warm-up ahead
    early = sim.state_at(weights_end + 5)
    assert early.eta_seconds == pytest.approx(init - 5)


def test_bytes_reaching_the_gpus_count_from_the_first_weight_file_up_to_the_files_held() -> None:
    sim = Sim(tracker(), weights=8 * GB, rx=5 * GB)  # the counter's value from earlier work
    sim.files = True
    sim.spawn()
    sim.tick(5, rx=GB)  # CUDA contexts and a warm-up copy before any weight: not weights
    sim.hold(4 * GB)
    sim.tick()
    assert sim.state.progress_ratio == 0
    # GPUDirect-style: the files are open, their offsets and pages say nothing, PCIe does.
    sim.tick(2, rx=GB)
    assert sim.state.progress_source == "gpu_pcie"
    assert sim.state.progress_ratio == pytest.approx(2 * GB / sim.weights)
    sim.tick(5, rx=GB)
    assert sim.state.progress_ratio == pytest.approx(4 * GB / sim.weights)  # no further than held


def test_a_weights_end_line_with_its_duration_dates_the_weights_begin_it_never_logged() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True  # the files were opened and closed between two looks: never seen held
    sim.spawn()
    sim.tick(20)
    sim.say(EventKind.WEIGHTS_END, ago=0.5, seconds=2.65)
    sim.tick()
    assert sim.state.phase == "initializing"
    sim.tick(10)
    sim.endpoint = "ready"
    sim.tick()
    [record] = sim.records
    assert record.phase_seconds["loading_weights"] == pytest.approx(2.65)
    assert record.phase_seconds["starting"] == pytest.approx(20.5 - 2.65)


def test_weights_read_between_two_looks_are_seen_in_the_page_cache() -> None:
    sim = Sim(tracker(), weights=8 * MIB * 100)
    sim.files = True
    sim.spawn()
    sim.tick(3, chars=50 * MB)  # imports
    # Both shards opened, read cold and closed between two looks: never seen held.
    sim.tick(1, read=sim.weights)
    assert sim.state.phase == "initializing"
    assert sim.state.progress_source == "page_cache"


def test_a_ready_server_whose_probes_fail_three_times_in_a_row_is_hung_not_loading() -> None:
    sim = Sim(tracker())
    cold_load(sim, ColdScript(starting=2, noise=1, weights_seconds=5, init=2))
    assert sim.state.phase == "ready" and not sim.state.hung
    sim.endpoint = "timeout"
    sim.tick(2)
    assert (sim.state.failed_probes, sim.state.hung) == (2, False)
    sim.tick()
    assert (sim.state.phase, sim.state.failed_probes, sim.state.hung) == ("ready", 3, True)
    sim.probe_every = 2
    sim.tick(4)  # the same probe seen twice counts once: two more
    assert sim.state.failed_probes == 5
    sim.endpoint = "ready"
    sim.tick(2)
    assert (sim.state.phase, sim.state.hung, sim.state.failed_probes) == ("ready", False, 0)
    assert len(sim.records) == 1  # no load: the process never changed


def test_the_logs_shard_count_does_not_run_ahead_of_the_weight_files_bytes() -> None:
    sim = Sim(tracker(), weights=4 * GB)
    sim.files = True
    sim.spawn()
    sim.tick(3)
    sim.say(EventKind.WEIGHTS_BEGIN)
    sim.hold(4 * GB)
    sim.tick(2, consume=GB)
    # Three of four shards done by the log's count, but they were the three small ones.
    sim.say(EventKind.WEIGHTS_PROGRESS, done=3, total=4)
    sim.tick()
    assert sim.state.progress_ratio == pytest.approx(2 * GB / sim.weights)  # not 3/4
    assert sim.state.progress_source == "weight_files"


@pytest.mark.parametrize("lag", [0.3, 0.9])
def test_a_ready_answer_waits_for_the_log_read_after_it_and_ends_the_load_at_the_answer(
    lag: float,
) -> None:
    """The port opens right after the last step's end line, before the log's thread read it:
    the load still ends at the answer, with the step that line states (issue 32, row 1)."""
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(5)
    sim.say(EventKind.WEIGHTS_BEGIN)
    sim.tick(3)
    sim.say(EventKind.WEIGHTS_END, seconds=3.0)
    sim.tick()
    sim.say(EventKind.KV_CACHE)
    sim.tick(3)
    sim.log_lag = lag  # the next read of the log comes after the answer
    sim.endpoint = "ready"
    sim.tick()
    answered = sim.time
    assert sim.records == [] and sim.state.phase == "initializing"
    sim.log_lag = 0.0
    sim.say(EventKind.CUDA_GRAPH_END, ago=1.0 + 0.05, seconds=2.5)  # written just before it
    sim.tick()
    [record] = sim.records
    assert record.ended_at == answered
    assert record.phase_seconds["cuda_graph"] == pytest.approx(2.5)
    assert record.phase_seconds["kv_cache"] == pytest.approx(3.0 - 0.05 - 2.5)


def test_without_a_read_of_the_log_a_ready_answer_ends_the_load_an_interval_later() -> None:
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(3)
    sim.say(EventKind.KV_CACHE)
    sim.tick(2)
    sim.log_lag = 5.0  # the log's reads have stopped (a hung journalctl)
    sim.endpoint = "ready"
    sim.tick()
    answered = sim.time
    assert sim.records == []
    sim.tick()
    [record] = sim.records
    assert record.ended_at == answered and record.outcome == "ready"


def test_the_elapsed_a_weights_end_line_states_dates_the_weights_to_the_millisecond() -> None:
    """SGLang's lines are stamped to the second and may be read a second late: "Load weight
    end. elapsed=5.30 s" says where within those seconds the weights ended."""
    sim = Sim(tracker())
    sim.spawn()
    sim.tick(10)
    sim.say(EventKind.WEIGHTS_BEGIN)  # dated 11.0 s after the start
    sim.tick(6)
    sim.say(EventKind.WEIGHTS_END, seconds=5.3)  # dated 17.0: written at 16.3, read late
    sim.tick(3)
    sim.endpoint = "ready"
    record = sim.until_record()
    assert record.phase_seconds["starting"] == pytest.approx(11.0)
    assert record.phase_seconds["loading_weights"] == pytest.approx(5.3)


def test_a_load_records_what_start_up_read_from_storage_before_its_first_weight_file() -> None:
    """The tree's storage reads up to the look before a weight file first opened: the server's
    own environment (27 MB here; gigabytes for SGLang once its packages left the page cache)."""
    sim = Sim(tracker(), weights=1_340 * MB)
    python_server_load(sim)
    [record] = sim.records
    assert record.startup_read_bytes == 27 * MB


# -- loads inside a running server ---------------------------------------------------------------


def test_a_model_loaded_into_a_running_server_is_a_load_of_its_own() -> None:
    """Triton in explicit mode: up and ready at once with nothing loaded, then a model loaded
    on request. Its log's load_begin starts a load of the target (the same process) with its
    own phases, progress and record; a stall is a stall; a model unloaded is said so."""
    size = 400 * MB
    sim = Sim(tracker(stall_after=5.0), weights=size, files=True, logged=True)
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick(2)
    [started] = sim.records
    assert sim.state.phase == "ready" and not sim.state.in_server
    sim.endpoint = "http_error"  # /v2/health/ready says 400 while the model loads
    sim.say(EventKind.LOAD_BEGIN, ago=0.5, who="tiny")
    sim.tick()
    began = sim.time - 0.5
    state = sim.state
    assert (state.phase, state.in_progress, state.in_server) == ("starting", True, True)
    assert state.started_at == began and state.elapsed_seconds == 0.5
    sim.tick()  # the backend's stub starts
    sim.say(EventKind.WEIGHTS_BEGIN, ago=0.25, who="tiny")
    sim.hold(size)
    sim.tick(2, consume=size // 4)
    assert sim.state.phase == "loading_weights"
    assert sim.state.progress_ratio == pytest.approx(0.5)
    assert sim.state.progress_source == "weight_files"
    sim.tick(2, consume=size // 4)
    sim.let_go()
    sim.say(EventKind.WEIGHTS_END, ago=0.75, who="tiny")
    sim.tick()
    assert sim.state.phase == "initializing"
    sim.tick(6)  # nothing moves: a stall like any load's
    assert sim.state.stalled
    sim.endpoint = "ready"
    sim.tick()
    record = sim.records[-1]
    assert record is not started and record.outcome == "ready" and not record.partial
    assert (record.started_at, record.ended_at) == (began, sim.time)
    assert record.phase_seconds == pytest.approx(
        {"starting": 2.25, "loading_weights": 3.5, "initializing": 7.75}
    )
    assert sim.state.phase == "ready" and not sim.state.in_progress
    sim.say(EventKind.UNLOADED, who="tiny", detail="successfully unloaded 'tiny' version 1")
    sim.tick()
    assert sim.state.unloaded == "tiny" and sim.state.phase == "ready"
    sim.say(EventKind.LOAD_BEGIN, who="tiny")  # loaded again: no longer unloaded
    sim.tick()
    assert sim.state.in_server and sim.state.unloaded is None


def test_models_a_running_server_unloads_are_counted_and_named_once_each() -> None:
    """Each `successfully unloaded` line counts once and is named once (the runtime logs one
    line each), whether the server is ready, between two models or loading another; a server
    that never loaded or unloaded in place carries no count at all (no series)."""
    sim = Sim(tracker(), logged=True)
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick(2)
    assert sim.state.unloads is None and sim.tracker.unloaded_now == ()
    sim.endpoint = "http_error"
    sim.say(EventKind.LOAD_BEGIN, ago=0.5, who="a")
    sim.tick()
    assert sim.state.in_progress and sim.state.unloads == 0  # loads in place: counted from 0
    sim.endpoint = "ready"
    sim.tick()
    sim.say(EventKind.UNLOADED, who="a")
    sim.say(EventKind.UNLOADED, who="b")  # two in one read of the log
    sim.tick()
    assert sim.state.unloads == 2 and sim.state.unloaded == "b"
    assert sim.tracker.unloaded_now == ("a", "b")
    sim.tick()
    assert sim.tracker.unloaded_now == () and sim.state.unloads == 2
    sim.endpoint = "http_error"
    sim.say(EventKind.LOAD_BEGIN, ago=0.5, who="c")
    sim.tick()
    sim.say(EventKind.UNLOADED, who="a")  # one model goes while another loads
    sim.tick()
    assert sim.state.in_progress and sim.state.unloads == 3
    assert sim.tracker.unloaded_now == ("a",)

    other = Sim(tracker(), logged=True)  # a server that loads its model at start only
    other.spawn()
    other.tick(2)
    other.endpoint = "ready"
    other.tick(2)
    assert other.state.phase == "ready" and other.state.unloads is None


def test_one_models_target_has_that_models_loads_and_the_servers_its_process() -> None:
    """A repository of several models: each model's target (Scope.MODEL, fed its own lines) has
    a load from its log's load_begin, while the server starts too, to its own ready answer;
    the process's start is none of its loads, and before its load and after its unload it is
    down. The server's own target (Scope.PROCESS) keeps the process's load and starts none on
    a model's line."""
    size = 100 * MB
    model = Sim(
        Tracker("triton/a", 300.0, interval=1.0, scope=Scope.MODEL),
        weights=size,
        files=True,
        logged=True,
    )
    model.spawn()
    model.endpoint = "refused"  # the server starts: its ports closed
    model.tick(2)
    assert model.state.phase == "down" and not model.records
    model.say(EventKind.LOAD_BEGIN, ago=0.5, who="a")
    model.tick()
    began = model.time - 0.5
    assert model.state.in_progress and model.state.in_server and model.state.started_at == began
    model.say(EventKind.WEIGHTS_BEGIN, who="a")
    model.hold(size)
    model.tick(2, consume=size // 2)
    assert model.state.phase == "loading_weights"
    model.let_go()
    model.say(EventKind.WEIGHTS_END, who="a")
    model.tick()
    model.endpoint = "ready"  # its own /v2/models/a/ready
    model.tick()
    [record] = model.records
    assert record.outcome == "ready" and (record.started_at, record.ended_at) == (began, model.time)
    model.say(EventKind.UNLOADED, who="a")
    model.endpoint = "http_error"  # unloaded: its ready answer is 400
    model.tick()
    assert model.state.phase == "down" and model.state.unloads == 1
    model.say(EventKind.LOAD_BEGIN, ago=0.2, who="a")
    model.tick()
    model.kill()  # the server dies while the model loads: that load failed
    model.tick(3)
    assert model.records[-1].outcome == "failed" and len(model.records) == 2

    server = Sim(Tracker("triton", 300.0, interval=1.0, scope=Scope.PROCESS), logged=True)
    server.spawn()
    server.tick(2)
    server.endpoint = "ready"
    server.tick()
    assert [r.outcome for r in server.records] == ["ready"]  # the process's own start
    server.say(EventKind.LOAD_BEGIN, ago=0.5, who="a")
    server.say(EventKind.UNLOADED, who="b")
    server.tick(2)
    assert server.state.phase == "ready" and not server.state.in_progress
    assert len(server.records) == 1 and server.state.unloads is None  # the models' own


def test_one_models_target_first_watched_long_after_its_load_records_none() -> None:
    """Its log read from the server's start by a target first watched later (an exporter
    started while the server served): a load_begin from long before is a load that was over
    unwatched, not one that lasted until now."""
    model = Sim(Tracker("triton/a", 300.0, interval=1.0, scope=Scope.MODEL), logged=True)
    model.spawn()
    model.endpoint = "ready"
    model.say(EventKind.LOAD_BEGIN, ago=100.0, who="a")
    model.tick(2)
    assert model.state.phase == "ready" and not model.records


def test_a_model_that_fails_to_load_into_a_running_server_fails_that_load_only() -> None:
    """Triton's `failed to load 'tiny'` in explicit mode: that load failed, with the server's
    words; the server runs on, and the next model it loads is a load again."""
    sim = Sim(tracker(), logged=True)
    sim.spawn()
    sim.endpoint = "ready"
    sim.tick(2)
    sim.endpoint = "http_error"  # 400 while a model loads
    sim.say(EventKind.LOAD_BEGIN, ago=0.5, who="tiny")
    sim.tick()
    sim.say(EventKind.FATAL, ago=0.5, detail="failed to load 'tiny' version 1: Internal: boom")
    sim.tick()
    failed = sim.records[-1]
    assert failed.outcome == "failed" and "boom" in (failed.fatal or "")
    assert sim.state.phase == "failed" and sim.state.in_server
    sim.endpoint = "ready"
    sim.tick(2)
    sim.endpoint = "http_error"
    sim.say(EventKind.LOAD_BEGIN, ago=0.5, who="other")
    sim.tick()
    assert sim.state.in_progress and sim.state.started_at == sim.time - 0.5
    sim.endpoint = "ready"
    sim.tick()
    assert sim.records[-1].outcome == "ready" and len(sim.records) == 3


def test_a_load_line_from_before_the_server_answered_is_no_load_inside_it() -> None:
    """The default mode logs `loading: NAME` before its ports open: read after the answer
    (or by an exporter that arrived later), it is the start's, not a load of its own."""
    sim = Sim(tracker(), logged=True)
    sim.spawn()
    sim.tick(3)
    sim.endpoint = "ready"
    sim.tick()
    assert len(sim.records) == 1 and sim.state.phase == "ready"
    sim.say(EventKind.LOAD_BEGIN, ago=3.5, who="tiny")  # stamped during the start
    sim.tick()
    assert sim.state.phase == "ready" and not sim.state.in_progress and len(sim.records) == 1
