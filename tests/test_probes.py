"""The kubelet's probes (exporter/exposition/liveness.py), the stall's reasons
(exporter/load/activity.py) and the startupProbe advice (exporter/history/startupwindow.py), driven
through the real tracker tick by tick."""

from __future__ import annotations

import math
from dataclasses import replace
from http import HTTPStatus
from typing import Any

import pytest

from exporter.config.schema import EndpointConfig, ProcessConfig, TargetConfig
from exporter.exposition.liveness import Question, alive, answer, ready
from exporter.history.startupwindow import MARGIN, PERIOD_SECONDS, advise, percentile
from exporter.load.activity import ActivityWatch
from exporter.load.observation import Observation
from exporter.load.records import LoadRecord
from exporter.load.tracker import Tracker
from exporter.runtime.snapshot import TargetView
from exporter.vocabulary import Activity, Cache, Outcome, ProbeResult

MIB = 1 << 20
T0 = 1_700_000_000.0
STALL = 30.0


class Server:
    """A watched server's observations, one per second: what a sampler would compose."""

    def __init__(self, *, logged: bool = True, gpu: bool = True, configured: bool = True) -> None:
        self.tracker = Tracker("m", stall_after=STALL, interval=1.0)
        self.config = TargetConfig(
            "m",
            EndpointConfig("http://127.0.0.1:1"),
            process=ProcessConfig(pidfile="/run/m.pid") if configured else None,
        )
        self.configured = configured
        self.time = T0
        self.pid: int | None = None
        self.reads = 0
        self.cpu = 0.0
        self.state = "S"
        self.lines = 0 if logged else None
        self.gpu = 0 if gpu else None
        self.probe: ProbeResult | None = ProbeResult.REFUSED

    def start(self) -> None:
        self.pid, self.reads, self.cpu = 100, 0, 0.0
        self.tick()

    def tick(
        self, n: int = 1, *, read: int = 0, cpu: float = 0.0, lines: int = 0, gpu: int = 0
    ) -> None:
        for _ in range(n):
            self.time += 1.0
            self.reads += read
            self.cpu += cpu
            if self.lines is not None:
                self.lines += lines
            if self.gpu is not None:
                self.gpu += gpu
            found = self.pid is not None and self.configured
            self.tracker.observe(
                Observation(
                    time=self.time,
                    endpoint_result=self.probe,
                    endpoint_probe_time=self.time,
                    process_configured=self.configured,
                    process_found=found,
                    process_pid=self.pid if found else None,
                    process_start_time=T0 + 1 if found else None,
                    process_read_bytes=self.reads if found else None,
                    process_read_chars=self.reads if found else None,
                    process_gpu_bytes=self.gpu if found else None,
                    weights_bytes=1000 * MIB,
                    resident_bytes=None,
                    resident_measured_at=None,
                    disk_read_bytes=None,
                    log_lines=self.lines,
                    log_read_at=self.time,
                    process_cpu_seconds=self.cpu if found else None,
                    process_state=self.state if found else None,
                )
            )

    def view(self) -> TargetView:
        return TargetView(self.config, self.tracker.state(self.time), {}, {})

    def alive(self) -> tuple[bool, str]:
        verdict = alive(self.view(), self.time, 1.0)
        return verdict.ok, verdict.line


def loading(server: Server, seconds: int = 20) -> None:
    """A cold load reading 40 MiB/s at full CPU, logging and filling GPU memory."""
    server.start()
    server.tick(seconds, read=40 * MIB, cpu=1.0, lines=2, gpu=30 * MIB)


def test_alive_while_a_load_progresses_and_says_what_moves() -> None:
    server = Server()
    loading(server)
    ok, line = server.alive()
    assert ok, line
    assert line.startswith("starting at") or line.startswith("loading_weights at"), line
    assert "storage reads" in line and "log lines" in line and "still move" in line
    assert "CPU busy (100 % of a core)" in line
    assert not ready(server.view()).ok


def test_a_cpu_that_ran_within_the_window_but_not_lately_is_not_called_busy() -> None:
    """llama.cpp waiting on its mapping's reads: CPU spent seconds ago, none in the last 10 s
    (the real server's line said `CPU busy (0 % of a core)`)."""
    server = Server()
    loading(server)
    server.tick(12, read=40 * MIB, cpu=0.0, lines=2)
    server.tick(1, read=40 * MIB, cpu=0.1, lines=2)  # a tenth of a second of CPU in 10 s
    ok, line = server.alive()
    assert ok, line
    assert "CPU at 1 % of a core" in line and "CPU busy" not in line, line


@pytest.mark.parametrize("stall", [STALL, STALL + 17])
def test_a_stall_in_compile_reads_differently_from_a_dead_mount(stall: float) -> None:
    """Same stall, two causes: bytes and logs stop in both; the CPU spins in one (compile, a
    hung collective), the tree sits in uninterruptible I/O in the other (a dead NFS mount)."""
    compile_, mount = Server(), Server()
    for server in (compile_, mount):
        loading(server)
    compile_.state, mount.state = "R", "D"
    compile_.tick(int(stall), cpu=1.0)
    mount.tick(int(stall), cpu=0.0)
    for server in (compile_, mount):
        ok, line = server.alive()
        assert not ok, line
        assert f"nothing moved for {int(stall)}s" in line
        for quiet in ("no storage reads", "no log lines", "GPU memory unchanged"):
            assert quiet in line, line
        assert "still move" not in line
    assert "CPU busy (100 % of a core)" in compile_.alive()[1]
    _, nfs = mount.alive()
    assert f"CPU idle for {int(stall)}s" in nfs and "uninterruptible I/O" in nfs
    assert "uninterruptible" not in compile_.alive()[1]


def test_one_stall_short_of_the_limit_is_alive_and_a_move_clears_it() -> None:
    server = Server()
    loading(server)
    server.tick(int(STALL) - 1)
    assert server.alive()[0]
    server.tick(1)
    assert not server.alive()[0]
    server.tick(1, lines=1)  # a log line is movement
    ok, line = server.alive()
    assert ok and "log lines still move" in line, line


def test_unmeasured_signals_are_left_out_never_shown_quiet() -> None:
    server = Server(logged=False, gpu=False)
    loading(server)
    server.tick(int(STALL))
    _, line = server.alive()
    assert "log lines" not in line and "GPU memory" not in line
    assert "no storage reads for" in line


def test_a_stopped_server_says_so() -> None:
    server = Server()
    loading(server)
    server.state = "T"
    server.tick(int(STALL))
    ok, line = server.alive()
    assert not ok and "stopped (SIGSTOP or a debugger)" in line, line


def test_a_process_that_exits_mid_load_is_dead_at_once() -> None:
    server = Server(logged=False)
    loading(server, 5)
    server.pid = None
    server.tick()
    ok, line = server.alive()
    assert not ok and line.startswith("load failed; process exited"), line


def test_ready_then_exited_then_hung() -> None:
    server = Server(logged=False)
    loading(server, 3)
    server.probe = ProbeResult.READY
    server.tick()
    assert server.alive() == (True, "ready") and ready(server.view()).ok
    # Its endpoint stops answering while the process runs on: 3 failed probes make it hung.
    server.probe = ProbeResult.TIMEOUT
    server.tick(2)
    assert server.alive()[0]
    server.tick()
    ok, line = server.alive()
    assert not ok and line.startswith("hung: process up, endpoint failed 3 probes"), line
    assert not ready(server.view()).ok
    server.pid = None
    server.tick()
    ok, line = server.alive()
    assert not ok and line.startswith("process exited"), line


def test_no_basis_is_alive_and_never_ready() -> None:
    server = Server()
    view = TargetView(server.config, None, {}, {})
    assert alive(view, T0, 1.0).ok and not ready(view).ok
    server.tick(3)  # no process seen yet
    ok, line = server.alive()
    assert ok and line == "no basis yet: no server process seen yet"
    endpoint_only = Server(configured=False)
    endpoint_only.tick(3)
    ok, line = endpoint_only.alive()
    assert ok and line.startswith("no basis yet: endpoint not answering"), line


def test_a_load_first_seen_late_is_alive_until_watched_for_the_stall_time() -> None:
    """An exporter restarted mid-load: nothing moves while it watches for less than stall_after."""
    server = Server()
    server.pid = 100
    server.time += 600  # the process started 10 minutes before the exporter's first look
    server.tick(int(STALL) - 1)
    assert server.tracker.state(server.time).seen_late
    assert server.alive()[0]
    server.tick(2)
    assert not server.alive()[0]


def test_answer_by_name() -> None:
    one, two = Server(), Server()
    two.config = replace(two.config, name="other")
    for server in (one, two):
        loading(server)
    views = (one.view(), two.view())
    verdict, unknown = answer(Question.ALIVE, views[:1], None, T0, 1.0)
    assert verdict.ok and not unknown and verdict.line.startswith(("starting", "loading"))
    verdict, unknown = answer(Question.ALIVE, views, "other", T0, 1.0)
    assert verdict.ok and not unknown
    verdict, unknown = answer(Question.ALIVE, views, "typo\x1b[31m", T0, 1.0)
    assert verdict.ok and unknown and "\x1b" not in verdict.line
    assert verdict.line == "no basis yet: no target 'typo[31m' watched (yet)"
    verdict, unknown = answer(Question.READY, views, "typo", T0, 1.0)
    assert not verdict.ok and verdict.status == "404 Not Found" and unknown
    verdict, _ = answer(Question.ALIVE, views, None, T0, 1.0)
    assert verdict.ok and "2 targets watched (m, other)" in verdict.line
    verdict, _ = answer(Question.READY, views, None, T0, 1.0)
    assert verdict.code is HTTPStatus.BAD_REQUEST
    verdict, _ = answer(Question.ALIVE, (), None, T0, 1.0)
    assert verdict.ok and verdict.line == "no basis yet: no model server found yet"
    verdict, _ = answer(Question.READY, (), None, T0, 1.0)
    assert verdict.status == "503 Service Unavailable"


def test_activity_counts_slow_movement_and_counter_restarts() -> None:
    watch = ActivityWatch()
    t = T0
    # 0.4 MiB a second: no single tick moves 1 MiB, three together do.
    for i in range(10):
        t += 1
        watch.update(t, {Activity.STORAGE_READS: i * 0.4 * MIB, Activity.CPU: i * 0.5})
    quiet = watch.quiet_seconds(t)
    assert quiet[Activity.STORAGE_READS] <= 2.0
    assert watch.cpu_share() == pytest.approx(0.5)
    t += 1
    watch.update(t, {Activity.STORAGE_READS: 0, Activity.CPU: 0.0})  # a new process's counters
    t += 5
    watch.update(t, {Activity.STORAGE_READS: 0.5 * MIB, Activity.CPU: None})
    assert watch.quiet_seconds(t)[Activity.STORAGE_READS] >= 6.0
    assert Activity.CPU not in watch.quiet_seconds(t) and watch.cpu_share() is None


def _load(seconds: float, cache: Cache | None, outcome: Outcome = Outcome.READY, **kw: Any) -> Any:
    return LoadRecord("m", T0, T0 + seconds, outcome, cache, False, {}, None, None, None, **kw)


@pytest.mark.parametrize("n", [1, 7, 100, 250])
def test_advice_is_the_cold_p99_with_a_margin_in_whole_periods(n: int) -> None:
    durations = [100.0 + 3.7 * i for i in range(n)]
    records = [_load(s, Cache.COLD) for s in reversed(durations)]
    # Warm loads, failed cold loads and partial ones say nothing of the window.
    records += [_load(5000.0, Cache.WARM), _load(9000.0, Cache.COLD, Outcome.FAILED)]
    records += [replace(_load(8000.0, Cache.COLD), partial=True)]
    advice = advise(records)
    p99 = sorted(durations)[math.ceil(0.99 * n) - 1]
    assert advice.cold_loads == n and advice.cold_p99_seconds == pytest.approx(p99)
    assert advice.period_seconds == PERIOD_SECONDS
    window = advice.window_seconds
    assert window is not None and window >= p99 * MARGIN > window - PERIOD_SECONDS


def test_no_cold_load_no_advice_and_why() -> None:
    assert advise([]).reason == "no finished load in history yet"
    advice = advise([_load(30.0, Cache.WARM), _load(30.0, Cache.WARM), _load(60.0, None)])
    assert advice.window_seconds is None and advice.failure_threshold is None
    assert advice.reason == "no cold load finished ready in history (1 unknown ready, 2 warm ready)"


def test_percentile_is_a_value_that_happened() -> None:
    values = [float(v) for v in range(1, 201)]
    assert percentile(values, 0.99) == 198.0 and percentile(values[:1], 0.99) == 1.0
