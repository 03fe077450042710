"""The restart forecast against the truth on the real llama.cpp server (llama-cpp-python's).

Its GGUF (1.08 GB) comes off this machine's virtio disk at about 3 GB/s, so a cold load would be
as quick as a warm one and the read rates would mean nothing: the server runs in a blkio cgroup
that reads the disk at THROTTLE, like the storage tests do. The exporter watches it through a
pidfile, with history. After one cold and one warm load are in history, the forecast read just
before a warm, a cold and a half-evicted (mixed: the second half of the file dropped) restart
must each be within 20 % of how long that restart then took: from the process's start to the
first answer of /v1/models, polled by the test itself. The table lands in
.servers/reports/forecast-on-llamacpp.json.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from helpers.filesystems import scratch
from helpers.forecasts import TOLERANCE, Restart, forecast_at, table
from helpers.support import RunningExporter, free_port, wait_for
from test_disk import lsblk_whole_disk

from exporter.cachectl import evict, prewarm
from exporter.sources.process import process_start_time
from servers.llamacpp_server import LlamaCppServer
from servers.vllm_server import SERVERS

THROTTLE = 100_000_000  # bytes per second from the disk: about 11 s for a cold load
# A warm load is about a second (Python's start-up, then the GGUF mapped from the cache), and
# llama.cpp's log has no stamps: a phase boundary it marks is known to the log's read interval.
# At 200 ms those steps alone moved a warm forecast by 20 %; at 100 ms by half that.
SAMPLE_INTERVAL = "100ms"
REPORT = SERVERS / "reports" / "forecast-on-llamacpp.json"


def evict_second_half(path: Path) -> None:
    """Drop the second half of the file from the page cache: a mixed load's residency."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, size // 2, size - size // 2, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_forecasts_before_warm_cold_and_mixed_llamacpp_restarts_are_within_20_percent(
    llamacpp_python: str, gguf_model: Path, tmp_path: Path, start_exporter: Any
) -> None:
    port, pidfile = free_port(), tmp_path / "server.pid"
    running: RunningExporter = start_exporter(
        {
            "sample_interval": SAMPLE_INTERVAL,
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [
                {
                    "name": "llama",
                    "endpoint": {"url": f"http://127.0.0.1:{port}", "probe": "models"},
                    "weights": {"paths": [str(gguf_model)]},
                    "process": {"pidfile": str(pidfile)},
                }
            ],
        }
    )

    def entry() -> dict[str, Any]:
        return dict(running.status()["targets"][0])

    with scratch(tmp_path / "scratch") as s:
        procs = s.throttle(lsblk_whole_disk(gguf_model), THROTTLE)

        def load() -> tuple[str, float]:
            """One load to ready, then stopped: the exporter's cache label and its duration (its
            phases as the exporter timed them go to the report)."""
            server = LlamaCppServer(
                llamacpp_python, gguf_model, port, tmp_path / "llama.log", pidfile, procs
            )
            try:
                ready_at = server.wait_ready()
                started = process_start_time(server.proc.pid)
                assert started is not None
                wait_for(lambda: entry().get("phase") == "ready", timeout=10)
            finally:
                assert server.stop() in (0, -15), server.tail()
            wait_for(lambda: entry().get("phase") in ("down", "failed"), timeout=10)
            last = running.runtime.loads("llama", 1)[0]
            phases = {str(p): round(t, 3) for p, t in last.phase_seconds.items()}
            loads.append({"cache": str(last.cache), "truth": ready_at - started, "phases": phases})
            return str(last.cache), ready_at - started

        loads: list[dict[str, Any]] = []

        # The loads for history begin as the restarts do, once the exporter has measured the page
        # cache the test prepared: not while it still files the load before (a warm start is
        # under a second of Python, and two cores shared with that work slowed it by 25 %).
        evict(str(gguf_model))
        forecast_at(entry, 0.0, made=False)
        assert load()[0] == "cold"
        forecast_at(entry, 1.0, made=False)
        assert load()[0] == "warm"
        restarts = []
        for cache, share, prepare in (
            ("warm", 1.0, lambda: prewarm(str(gguf_model))),
            ("cold", 0.0, lambda: evict(str(gguf_model))),
            ("mixed", 0.5, lambda: evict_second_half(gguf_model)),
        ):
            prepare()
            known = forecast_at(entry, share)
            label, seconds = load()
            assert label == cache, (label, cache)
            restarts.append(Restart(cache, known["seconds"], known["resident_share"], seconds))
    print("\n" + table(restarts))
    REPORT.parent.mkdir(parents=True, exist_ok=True)
    document = {
        "throttle_bytes_per_second": THROTTLE,
        "table": table(restarts).splitlines(),
        "loads": loads,  # the two in history first, then the three restarts
    }
    REPORT.write_text(json.dumps(document, indent=2) + "\n")
    assert all(abs(r.error) <= TOLERANCE for r in restarts), table(restarts)
