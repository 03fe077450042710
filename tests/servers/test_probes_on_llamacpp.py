"""The kubelet's probes against the real llama.cpp server (llama-cpp-python's), one server's life:
a cold load stopped mid-weights (SIGSTOP, then SIGCONT) to ready and serving, a cold restart,
a warm restart, and a cold load killed mid-weights (SIGKILL).

A prober that follows the kubelet's rules (tests/helpers/kubelet.py: a period, a timeout, a
failure threshold, 2xx/3xx success) asks /probe/alive throughout, one prober per server process
as the kubelet has one per container; its first probe comes a second after the process starts
(the exporter looks for a new process every half second: a kubelet's first probe can come as
early as the container's start, and would then hear the old process's exit, which
`failureThreshold: 3` absorbs). As in tests/servers/test_forecast_on_llamacpp.py the server reads
its GGUF from a blkio cgroup throttled to THROTTLE, so a cold load lasts about 11 s.

What it must show: alive 200 at every probe of a cold load, a warm restart and serving; after
SIGSTOP mid-weights 503 within `stall_after` plus one period, 200 within one period of SIGCONT;
after SIGKILL 503 within one period; and the startupProbe advice beside the true p99 of the cold
loads (from each process's start to the first answer of /v1/models, polled by the test). The
numbers land in .servers/reports/probes-on-llamacpp.json.

llama.cpp mlocks the mapping of its GGUF, and the kernel fills it inside that one call whether
the process is stopped or not: after SIGSTOP the weights go on arriving until the mapping is
whole. So the 503 is timed from when the file's residency (fincore, the kernel's truth) stopped
growing, and never comes before `stall_after` after the stop.
"""

from __future__ import annotations

import json
import math
import os
import signal
import time
from pathlib import Path
from typing import Any

import requests
from helpers.filesystems import fincore_bytes, scratch
from helpers.kubelet import Prober
from helpers.support import RunningExporter, free_port, wait_for
from test_disk import lsblk_whole_disk

from exporter.history.startupwindow import MARGIN, PERIOD_SECONDS
from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict, prewarm
from servers.llamacpp_server import LlamaCppServer
from servers.vllm_server import SERVERS

THROTTLE = 100_000_000  # bytes per second from the disk: about 11 s for a cold load
INTERVAL = 0.5  # the exporter's sample interval
STALL_AFTER = 6.0
PERIOD, TIMEOUT, FAILURES = 2.0, 1.0, 3  # the prober's periodSeconds, timeoutSeconds, threshold
FIRST_PROBE = 1.0  # after the process starts
LAG = 2 * INTERVAL  # a reading lands up to an interval late, the tracker ticks an interval later
SERVE_SECONDS = 3 * PERIOD
REPORTS = SERVERS / "reports"


class Life:
    """The server's life under one exporter: each process with its own prober."""

    def __init__(self, start_exporter: Any, python: str, model: Path, tmp: Path) -> None:
        self.python, self.model, self.tmp = python, model, tmp
        self.port, self.pidfile = free_port(), tmp / "server.pid"
        self.exporter: RunningExporter = start_exporter(
            {
                "sample_interval": f"{int(INTERVAL * 1000)}ms",
                "history_path": str(tmp / "history.sqlite"),
                "targets": [
                    {
                        "name": "llama",
                        "endpoint": {"url": f"http://127.0.0.1:{self.port}", "probe": "models"},
                        "weights": {"paths": [str(model)]},
                        "process": {"pidfile": str(self.pidfile)},
                        "stall_after": f"{int(STALL_AFTER)}s",
                    }
                ],
            }
        )
        self.loads: list[dict[str, Any]] = []

    def entry(self) -> dict[str, Any]:
        return dict(self.exporter.status()["targets"][0])

    def start(self, procs: Path) -> tuple[LlamaCppServer, Prober, float]:
        server = LlamaCppServer(
            self.python, self.model, self.port, self.tmp / "llama.log", self.pidfile, procs
        )
        started = process_start_time(server.proc.pid)
        assert started is not None
        time.sleep(max(0.0, started + FIRST_PROBE - time.time()))
        url = f"{self.exporter.url}/probe/alive?target=llama"
        prober = Prober(url, PERIOD, TIMEOUT, FAILURES).start()
        return server, prober, started

    def serve(self, server: LlamaCppServer) -> None:
        """Completions for a while, as traffic would come."""
        until = time.monotonic() + SERVE_SECONDS
        while time.monotonic() < until:
            answer = requests.post(
                f"{server.url}/v1/completions",
                json={"prompt": "The weights", "max_tokens": 4},
                timeout=30,
            )
            assert answer.status_code == 200, answer.text

    def finish(self, server: LlamaCppServer, prober: Prober, started: float, label: str) -> None:
        prober.stop()
        code = server.stop()
        assert code in (0, -15), server.tail()
        wait_for(lambda: self.entry().get("phase") in ("down", "failed"), timeout=10)
        self.loads.append({"label": label, "started": started, "probes": summary(prober)})

    def through_ready(self, procs: Path, label: str) -> dict[str, Any]:
        """A load to ready and serving; every probe 200."""
        server, prober, started = self.start(procs)
        ready_at = server.wait_ready()
        wait_for(lambda: self.entry().get("phase") == "ready", timeout=10)
        self.serve(server)
        self.finish(server, prober, started, label)
        seen = prober.seen()
        assert len(seen) >= 3 and all(p.code == 200 for p in seen), [
            (round(p.at - started, 1), p.code, p.body) for p in seen if not p.ok
        ]
        record = self.exporter.runtime.loads("llama", 1)[0]
        self.loads[-1].update(truth=ready_at - started, measured=record.duration_seconds,
                              cache=str(record.cache))  # fmt: skip
        return self.loads[-1]


def last_growth(path: Path, prober: Prober, since: float, timeout: float) -> float:
    """When the file's page-cache residency last grew, polled every 0.1 s from `since` until
    the prober's first failure after it."""
    deadline = time.monotonic() + timeout
    resident, grew_at = fincore_bytes(path), since
    while prober.first(False, since) is None:
        assert time.monotonic() < deadline, summary(prober)[-5:]
        now, value = time.time(), fincore_bytes(path)
        if value > resident:
            resident, grew_at = value, now
        time.sleep(0.1)
    return grew_at


def summary(prober: Prober) -> list[list[Any]]:
    """Each probe: seconds since the first, status, the line."""
    seen = prober.seen()
    first = seen[0].at if seen else 0.0
    return [[round(p.at - first, 2), p.code, p.body] for p in seen]


def test_alive_follows_the_real_llamacpp_through_its_life(
    llamacpp_python: str, gguf_model: Path, tmp_path: Path, start_exporter: Any
) -> None:
    life = Life(start_exporter, llamacpp_python, gguf_model, tmp_path)
    with scratch(tmp_path / "scratch") as s:
        procs = s.throttle(lsblk_whole_disk(gguf_model), THROTTLE)

        # 1. A cold load, stopped mid-weights until alive fails, then let go.
        evict(str(gguf_model))
        server, prober, started = life.start(procs)
        wait_for(
            lambda: (e := life.entry()).get("phase") == "loading_weights"
            and (e.get("progress_ratio") or 0) >= 0.2,
            timeout=60, interval=0.05,
        )  # fmt: skip
        stopped_at = time.time()
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            # llama.cpp mlocks its mapping: the kernel goes on reading the file into it inside
            # that one call, stopped or not, until the mapping is whole. The truth of when the
            # weights stopped moving is the file's residency (fincore), polled until the 503.
            quiet_at = last_growth(gguf_model, prober, stopped_at, STALL_AFTER + PERIOD + 30)
            dead = prober.wait_for(False, stopped_at, 1)
        finally:
            continued_at = time.time()
            os.kill(server.proc.pid, signal.SIGCONT)
        ready_at = server.wait_ready()  # polled from SIGCONT on: the truth of its readiness
        back = prober.wait_for(True, continued_at, 10)
        wait_for(lambda: life.entry().get("phase") == "ready", timeout=10)
        life.serve(server)
        life.finish(server, prober, started, "cold, stopped mid-weights")
        before = prober.between(0, stopped_at + STALL_AFTER - LAG)
        assert before and all(p.code == 200 for p in before), [p.body for p in before]
        assert dead.at - quiet_at <= STALL_AFTER + PERIOD + LAG, (dead.at - quiet_at, quiet_at)
        assert dead.at - stopped_at >= STALL_AFTER  # never before the stall time
        # Stopped mid-weights; the kernel may have filled the mapping meanwhile: then the
        # weights are in and the stall is the initializing that cannot run.
        assert dead.body.startswith(("stalled in loading_weights at ",
                                     "stalled in initializing at 100 %")), dead.body  # fmt: skip
        assert "no weight bytes" in dead.body and "stopped (SIGSTOP" in dead.body, dead.body
        assert back.at - continued_at <= PERIOD + LAG, back.at - continued_at
        assert all(p.code == 200 for p in prober.between(back.at)), summary(prober)[-8:]
        first = life.exporter.runtime.loads("llama", 1)[0]
        life.loads[-1].update(
            truth=ready_at - started, measured=first.duration_seconds, cache=str(first.cache),
            stopped_after=stopped_at - started, failed_probe_after_stop=dead.at - stopped_at,
            weights_moved_after_stop=quiet_at - stopped_at,
            failed_probe_after_weights_stopped=dead.at - quiet_at,
            first_success_after_sigcont=back.at - continued_at, failed_line=dead.body,
        )  # fmt: skip
        assert first.cache == "cold"

        # 2. A cold restart and 3. a warm one: alive at every probe, loading and serving.
        evict(str(gguf_model))
        assert life.through_ready(procs, "cold")["cache"] == "cold"
        # The restart is warm by the kernel's account (fincore); the exporter's label is kept in
        # the report, not held here: in 1 of 5 runs no residency pass landed within the warm
        # load's few seconds and its label was unknown (None), which is the forecast's and the
        # report's concern, not the probes' (the label's own tests are the loads' tests).
        prewarm(str(gguf_model))
        assert fincore_bytes(gguf_model) >= gguf_model.stat().st_size  # whole pages
        assert life.through_ready(procs, "warm")["cache"] in ("warm", "None")

        # 4. A cold load killed mid-weights: dead within a period.
        evict(str(gguf_model))
        server, prober, started = life.start(procs)
        wait_for(lambda: life.entry().get("phase") == "loading_weights", timeout=60, interval=0.05)
        killed_at = time.time()
        server.proc.kill()
        server.proc.wait(10)
        dead = prober.wait_for(False, killed_at, PERIOD + 10)
        time.sleep(PERIOD)
        prober.stop()
        life.loads.append({"label": "cold, SIGKILL mid-weights", "started": started,
                           "killed_after": killed_at - started,
                           "failed_probe_after_kill": dead.at - killed_at, "failed_line": dead.body,
                           "probes": summary(prober)})  # fmt: skip
        assert dead.at - killed_at <= PERIOD + LAG, dead.at - killed_at
        assert dead.body.startswith("load failed; process exited"), dead.body
        assert all(p.ok for p in prober.between(0, killed_at))

    # The advice beside the truth: the cold loads that finished ready.
    advice = life.entry()["startup_probe"]
    cold = [x for x in life.loads if x.get("cache") == "cold"]
    true_p99 = sorted(x["truth"] for x in cold)[math.ceil(0.99 * len(cold)) - 1]
    REPORTS.mkdir(parents=True, exist_ok=True)
    report = {
        "throttle_bytes_per_second": THROTTLE,
        "prober": {"period_seconds": PERIOD, "timeout_seconds": TIMEOUT,
                   "failure_threshold": FAILURES, "first_probe_after_start_seconds": FIRST_PROBE},
        "stall_after_seconds": STALL_AFTER,
        "sample_interval_seconds": INTERVAL,
        "advice": advice,
        "true_cold_p99_seconds": true_p99,
        "loads": life.loads,
    }  # fmt: skip
    (REPORTS / "probes-on-llamacpp.json").write_text(json.dumps(report, indent=2) + "\n")
    assert advice["cold_loads"] == len(cold) == 2
    assert abs(advice["cold_p99_seconds"] - true_p99) < 1.0, (advice, true_p99)
    periods = math.ceil(advice["cold_p99_seconds"] * MARGIN / PERIOD_SECONDS)
    assert advice["failure_threshold"] == periods
    assert advice["window_seconds"] >= true_p99 * MARGIN
