"""Idle costs next to nothing: every target ready, loops at the quiet pace, a main thread asleep;
yet an exit or a signal is acted on at once."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.hostile import ExporterProcess
from helpers.support import ModelServer, metrics_when, sample_value, wait_for

from exporter.runtime.exitwatch import ExitWatch

QUIET = 30.0  # longer than any wait below: what happens within it is not the quiet pace


def test_exit_watch_reports_an_exit_once_and_only_for_watched_processes() -> None:
    watch = ExitWatch()
    exited: list[str] = []
    done = threading.Event()
    first, second = subprocess.Popen(["sleep", "60"]), subprocess.Popen(["sleep", "60"])
    try:
        assert watch.watch(first.pid, lambda: (exited.append("first"), done.set()))
        assert watch.watch(second.pid, lambda: exited.append("second"))
        watch.forget(second.pid)
        second.kill()
        second.wait()
        time.sleep(0.2)
        assert exited == []
        started = time.monotonic()
        first.kill()
        assert done.wait(5) and time.monotonic() - started < 1.0
        first.wait()
        time.sleep(0.2)
        assert exited == ["first"]
        assert not watch.watch(first.pid, lambda: None)  # reaped: nothing to watch
    finally:
        watch.close()


@pytest.mark.system
def test_a_quiet_exporter_still_sees_an_exit_at_once(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    server = subprocess.Popen(["sleep", "120"])
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(f"{server.pid}\n")
    try:
        running = start_exporter(
            {"targets": [{"name": "m", "endpoint": {"url": model_server.url},
                          "process": {"pidfile": str(pidfile)}}]},
            quiet_interval=QUIET,
        )  # fmt: skip
        runtime = running.runtime
        wait_for(lambda: runtime.quiet)
        assert runtime.targets["m"].watched_pid == server.pid
        # Quiet: the host sources' readings stop renewing every sample interval (after the run
        # each loop had planned before it knew).
        time.sleep(0.5)
        memory = runtime.snapshot().host["memory"].finished_at
        time.sleep(1.0)
        assert runtime.snapshot().host["memory"].finished_at == memory
        killed = time.monotonic()
        server.kill()
        server.wait()
        wait_for(lambda: sample_value(running.metrics(), "model_load_phase", target="m",
                                      phase="down") == 1, timeout=5)  # fmt: skip
        assert time.monotonic() - killed < 2.0  # the pidfd, not the 30 s quiet pace
        assert not runtime.quiet
        renewed = runtime.snapshot().host["memory"].finished_at
        wait_for(lambda: runtime.snapshot().host["memory"].finished_at > renewed, timeout=2)
    finally:
        server.kill()
        server.wait()


def main_thread_wakeups(pid: int) -> int:
    """How many times the process's main thread has been scheduled in (schedstat's third field)."""
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[2])


@pytest.mark.system
def test_the_main_thread_sleeps_yet_acts_on_a_signal_any_thread_receives(
    model_server: ModelServer, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        json.dumps({"targets": [{"name": "m", "endpoint": {"url": model_server.url}}]})
    )
    exporter = ExporterProcess([f"--config.file={config}", "--history.path="])
    try:
        metrics_when(exporter.url, lambda t: sample_value(t, "model_load_endpoint_up") == 1)
        before = main_thread_wakeups(exporter.pid)
        time.sleep(2.0)
        assert main_thread_wakeups(exporter.pid) - before <= 1  # polling every 0.5 s: 4
        # The kernel hands a process-directed signal to any thread; send it to a sampler thread,
        # so only the wakeup fd can bring the main thread, asleep in a read, to run the handler.
        libc = ctypes.CDLL(None, use_errno=True)
        others = [
            int(t) for t in os.listdir(f"/proc/{exporter.pid}/task") if int(t) != exporter.pid
        ]
        sent = time.monotonic()
        assert libc.tgkill(exporter.pid, others[0], signal.SIGHUP) == 0
        wait_for(lambda: "config reloaded" in exporter.stderr(), timeout=5)
        assert time.monotonic() - sent < 1.0
        libc.tgkill(exporter.pid, others[-1], signal.SIGTERM)
        assert exporter.proc.wait(timeout=5) == 0
    finally:
        exporter.close()


@pytest.mark.system
def test_a_failing_source_of_a_quiet_exporter_retries_at_the_sample_interval(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    weights = tmp_path / "model"
    weights.mkdir()  # no weight files yet: the residency source fails
    running = start_exporter(
        {"targets": [{"name": "m", "endpoint": {"url": model_server.url},
                      "weights": {"paths": [str(weights)]}}]},
        quiet_interval=QUIET,
    )  # fmt: skip

    def pagecache_up() -> float | None:
        return sample_value(
            running.metrics(), "model_load_source_up", source="pagecache", target="m"
        )

    wait_for(lambda: running.runtime.quiet)
    time.sleep(1.5)  # past the sample each loop had planned before it was quiet
    assert pagecache_up() == 0
    (weights / "a.safetensors").write_bytes(b"\0" * 65536)
    wait_for(lambda: pagecache_up() == 1, timeout=5)  # not QUIET seconds later
