"""/probe/alive and /probe/ready through the real HTTP server, probed as a kubelet probes, while
the real simulator loads real shards: a cold load, a stall, SIGSTOP and SIGCONT, SIGKILL, a crash,
and the exporter itself restarted in the middle of a load.

The periods here are short (0.5 s, where a pod would use 10 s) so that each bound below is tight:
a 503 within `stall_after` plus one period (plus the exporter's sampling lag of two intervals),
a 200 within one period of the server moving again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.kubelet import Prober
from helpers.processes import Simulator, cold_checkpoint
from helpers.support import RunningExporter, free_port, sim_target, wait_for

pytestmark = pytest.mark.system

SHARDS, SHARD_SIZE = 4, 16 << 20
INTERVAL = 0.25
PERIOD = 0.5
STALL_AFTER = 2.0
LAG = 2 * INTERVAL  # a reading lands up to an interval late, the tracker ticks an interval later
# 64 MiB at 16 MB/s: about 4 s of weights, long enough to stop the server in the middle.
PACE = ("--read-rate", "16MB/s", "--cached-read-rate", "16MB/s", "--init-seconds", "1",
        "--startup-seconds", "0.5")  # fmt: skip


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return cold_checkpoint(tmp_path / "model", SHARDS, SHARD_SIZE)


@pytest.fixture
def host(tmp_path: Path, weights: Path, start_exporter: Any) -> Iterator[Any]:
    """(exporter(), simulate(*flags)): the exporter in this process watching the simulator."""
    port = free_port()
    sims: list[Simulator] = []

    def exporter() -> RunningExporter:
        target = sim_target(port, weights, tmp_path / "server.pid", stall_after="2s")
        target["endpoint"]["ready_interval"] = "1s"  # a hang is seen within a second or so
        config = {
            "sample_interval": f"{int(INTERVAL * 1000)}ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [target],
        }
        running: RunningExporter = start_exporter(config)
        return running

    def simulate(*extra: str) -> Simulator:
        sim = Simulator(tmp_path, weights, port, *PACE, *extra, pace=())
        sims.append(sim)
        return sim

    yield exporter, simulate
    for sim in sims:
        if sim.proc.poll() is None:
            sim.proc.send_signal(signal.SIGCONT)
        sim.stop()


def probers(running: RunningExporter) -> tuple[Prober, Prober]:
    alive = Prober(f"{running.url}/probe/alive", PERIOD, timeout=1.0, failure_threshold=3)
    ready = Prober(f"{running.url}/probe/ready?target=sim", PERIOD, timeout=1.0)
    return alive.start(), ready.start()


def phase(running: RunningExporter) -> str:
    return str(running.status()["targets"][0].get("phase"))


def progress(running: RunningExporter) -> float:
    return float(running.status()["targets"][0].get("progress_ratio") or 0.0)


def test_alive_through_a_cold_load_and_ready_only_once_ready(host: Any) -> None:
    exporter, simulate = host
    running = exporter()
    alive, ready = probers(running)
    try:
        time.sleep(2 * PERIOD)  # before the server: no basis, alive
        sim = simulate()
        wait_for(lambda: phase(running) == "ready", 30)
        ready_at = time.time()
        time.sleep(3 * PERIOD)
    finally:
        alive.stop()
        ready.stop()
    assert sim.result()["outcome"] == "ready"
    seen = alive.seen()
    assert seen and all(p.code == 200 for p in seen), [
        (p.code, p.body) for p in seen if p.code != 200
    ]
    assert seen[0].body == "no basis yet: no server process seen yet"
    lines = {p.body.split(" at ")[0].split(";")[0] for p in seen}
    assert {"loading_weights", "ready"} <= lines, lines
    # Ready: 503 while loading, 200 from the first probe after the endpoint answered.
    before, after = ready.between(0, ready_at - INTERVAL), ready.between(ready_at + PERIOD)
    assert before and all(p.code == 503 for p in before)
    assert before[-1].body.startswith("not ready: ")
    assert after and all(p.code == 200 and p.body == "ready" for p in after)


def test_sigstop_mid_weights_then_sigcont(host: Any) -> None:
    exporter, simulate = host
    running = exporter()
    alive, _ = probers(running)
    try:
        sim = simulate()
        wait_for(lambda: phase(running) == "loading_weights" and progress(running) >= 0.2, 30)
        stopped_at = time.time()
        os.kill(sim.proc.pid, signal.SIGSTOP)
        dead = alive.wait_for(False, stopped_at, STALL_AFTER + PERIOD + 10)
        time.sleep(3 * PERIOD)
        continued_at = time.time()
        os.kill(sim.proc.pid, signal.SIGCONT)
        back = alive.wait_for(True, continued_at, 10)
        wait_for(lambda: phase(running) == "ready", 30)
    finally:
        alive.stop()
    print(f"\nSIGSTOP: 503 after {dead.at - stopped_at:.2f}s (stall_after {STALL_AFTER}s,"
          f" period {PERIOD}s); 200 {back.at - continued_at:.2f}s after SIGCONT")  # fmt: skip
    # Alive until the stall is due, 503 within stall_after + a period of the stop, saying why.
    early = alive.between(0, stopped_at + STALL_AFTER - LAG)
    assert early and all(p.code == 200 for p in early), [(p.code, p.body) for p in early]
    assert dead.code == 503 and dead.at - stopped_at <= STALL_AFTER + PERIOD + LAG, (
        dead.at - stopped_at
    )
    assert dead.body.startswith("stalled in loading_weights at "), dead.body
    assert "no weight bytes for" in dead.body and "stopped (SIGSTOP or a debugger)" in dead.body
    assert "CPU idle" in dead.body
    # 200 within a period of SIGCONT (and the sampling lag); then alive to the end.
    assert back.at - continued_at <= PERIOD + LAG, back.at - continued_at
    assert all(p.ok for p in alive.between(back.at)), [p.body for p in alive.between(back.at)]
    assert sim.result()["outcome"] == "ready"


def test_a_scripted_stall_fails_alive_and_its_end_clears_it(host: Any) -> None:
    """--stall-at: the simulator sleeps mid-weights (no signal from outside): the same 503."""
    exporter, simulate = host
    running = exporter()
    alive, _ = probers(running)
    try:
        simulate("--stall-at", "0.5", "--stall-for", "5s")
        dead = alive.wait_for(False, 0, 30)
        back = alive.wait_for(True, dead.at, 10)
        wait_for(lambda: phase(running) == "ready", 30)
    finally:
        alive.stop()
    assert "no weight bytes for" in dead.body and "CPU idle" in dead.body, dead.body
    assert "stopped" not in dead.body  # sleeping, not stopped
    assert all(p.ok for p in alive.between(0, dead.at))
    assert all(p.ok for p in alive.between(back.at))
    # The kubelet (3 failures of a 0.5 s period) would have restarted it: the stall was 5 s.
    assert alive.restart_at() is not None


def test_sigkill_is_dead_within_a_period(host: Any) -> None:
    exporter, simulate = host
    running = exporter()
    alive, ready = probers(running)
    try:
        sim = simulate()
        wait_for(lambda: phase(running) == "loading_weights", 30)
        killed_at = time.time()
        sim.proc.kill()
        dead = alive.wait_for(False, killed_at, 10)
        time.sleep(2 * PERIOD)
    finally:
        alive.stop()
        ready.stop()
    print(f"\nSIGKILL: 503 after {dead.at - killed_at:.2f}s (period {PERIOD}s)")
    assert dead.at - killed_at <= PERIOD + LAG, dead.at - killed_at
    assert dead.body.startswith("load failed; process exited"), dead.body
    assert all(not p.ok for p in alive.between(dead.at))
    assert all(p.code == 503 for p in ready.seen())


def test_a_crash_fails_alive_with_the_servers_words(host: Any) -> None:
    exporter, simulate = host
    running = exporter()
    alive, _ = probers(running)
    try:
        sim = simulate("--crash-at", "0.5")
        dead = alive.wait_for(False, 0, 30)
        assert sim.proc.wait(timeout=10) == 1
        time.sleep(PERIOD)
    finally:
        alive.stop()
    assert dead.body.startswith("load failed"), dead.body
    assert all(p.ok for p in alive.between(0, dead.at))


def test_an_exporter_restarted_mid_load_answers_no_503_without_a_basis(host: Any) -> None:
    """The sidecar restarted while its server loads: the new exporter knows nothing of the
    stall time already spent, so it answers alive until it has watched for stall_after."""
    exporter, simulate = host
    first = exporter()
    sim = simulate("--stall-at", "0.4", "--stall-for", "3s")
    # Stop the first exporter 1.5 s into the stall (as it saw it), so the stall outlives it by
    # 1.5 s at most: the new exporter, watching for stall_after (2 s), sees the weights move
    # again with half a second to spare for its sampling lag, where a stall_after counted from
    # the stall's start would fail alive within half a second and for a second (two probes).
    wait_for(lambda: (first.status()["targets"][0].get("seconds_since_progress") or 0) >= 1.5, 30)
    first.stop()
    second = exporter()
    alive, _ = probers(second)
    try:
        wait_for(lambda: phase(second) == "ready", 30)
        time.sleep(PERIOD)
    finally:
        alive.stop()
    seen = alive.seen()
    assert seen and all(p.code == 200 for p in seen), [
        (p.code, p.body) for p in seen if p.code != 200
    ]
    assert sim.result()["outcome"] == "ready"
    state = second.status()["targets"][0]
    assert state["phase"] == "ready"
    loads = requests.get(f"{second.url}/api/v1/loads", timeout=5).json()["loads"]
    assert loads[0]["seen_late"] is True


def test_a_server_that_stops_answering_while_ready_is_hung(host: Any) -> None:
    """Ready, then frozen: its process runs on but its endpoint times out; 3 failed probes in a
    row make it hung (503), the first answer after SIGCONT alive again."""
    exporter, simulate = host
    running = exporter()
    sim = simulate()
    wait_for(lambda: phase(running) == "ready", 30)
    alive, _ = probers(running)
    try:
        time.sleep(2 * PERIOD)
        stopped_at = time.time()
        os.kill(sim.proc.pid, signal.SIGSTOP)
        dead = alive.wait_for(False, stopped_at, 20)
        continued_at = time.time()
        os.kill(sim.proc.pid, signal.SIGCONT)
        back = alive.wait_for(True, continued_at, 10)
    finally:
        alive.stop()
    assert all(p.ok for p in alive.between(0, stopped_at))
    assert dead.body.startswith("hung: process up, endpoint failed 3 probes in a row (timeout"), (
        dead.body
    )
    print(f"\nhung: 503 after {dead.at - stopped_at:.2f}s; 200 {back.at - continued_at:.2f}s"
          " after SIGCONT")  # fmt: skip
    # Three probes of a second's timeout, the first up to ready_interval after the freeze.
    assert dead.at - stopped_at <= 1.0 + 3 * (1.0 + INTERVAL) + PERIOD + LAG, dead.at - stopped_at
    assert back.at - continued_at <= PERIOD + 1.0 + LAG, back.at - continued_at
    assert phase(running) == "ready"


def test_names_and_methods(host: Any) -> None:
    exporter, _ = host
    running = exporter()
    wait_for(lambda: phase(running) == "down", 10)
    unknown = requests.get(f"{running.url}/probe/alive?target=nope", timeout=5)
    assert unknown.status_code == 200
    assert unknown.text == "no basis yet: no target 'nope' watched (yet)\n"
    assert requests.get(f"{running.url}/probe/ready?target=nope", timeout=5).status_code == 404
    assert requests.head(f"{running.url}/probe/alive", timeout=5).status_code == 200
    posted = requests.post(f"{running.url}/probe/alive", timeout=5)
    assert posted.status_code == 405 and posted.headers["Allow"] == "GET, HEAD"
    assert requests.get(f"{running.url}/probe/ready", timeout=5).text.startswith("not ready: ")
