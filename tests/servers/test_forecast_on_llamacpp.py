"""The restart forecast against the truth on the real llama.cpp server (llama-cpp-python's).

Its GGUF (1.08 GB) comes off this machine's virtio disk at about 3 GB/s, so a cold load would be
as quick as a warm one and the read rates would mean nothing: the server runs in a blkio cgroup
that reads the disk at THROTTLE, like the storage tests do. The exporter watches it through a
pidfile, with history. After one cold and one warm load are in history, the forecast read just
before a warm, a cold and a half-evicted (mixed: the second half of the file dropped) restart
must each be within 20 % of how long that restart then took: from the process's start to the
first answer of /v1/models, polled by the test itself. The table lands in
.servers/reports/forecast-on-llamacpp.json.

The same server then explains a slow load: two cold loads at THROTTLE, a third with the disk read
at a third of it; the third's report says its weights took about 3x their cold median and that
storage delivered about a third of the rate before (.servers/reports/slow-load-on-llamacpp.json).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.filesystems import fincore_bytes, scratch
from helpers.forecasts import Restart, forecast_at, table
from helpers.support import RunningExporter, free_port, wait_for
from test_disk import lsblk_whole_disk

from exporter.runtime.pacing import EVICTION_LOOK_SECONDS, QUIET_INTERVAL
from exporter.sources import MEMORY
from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict, prewarm
from servers.llamacpp_server import LlamaCppServer
from servers.vllm_server import SERVERS

THROTTLE = 100_000_000  # bytes per second from the disk: about 11 s for a cold load
# A warm load is about a second (Python's start-up, then the GGUF mapped from the cache), and
# llama.cpp's log has no stamps: a phase boundary it marks is known to the log's read interval.
# At 200 ms those steps alone moved a warm forecast by 20 %; at 100 ms by half that.
SAMPLE_INTERVAL = "100ms"
# A warm restart is a second and a half of Python imports, and two identical ones vary by more
# than a fifth: 1.35 and 1.74 s in one run here (environment cached, nothing read from storage),
# 1.56 and 1.97 s in another. A warm forecast within this of its restart is as close as the
# restart itself allows; the cold and mixed ones (6-12 s) are held to the 20 % alone.
WARM_JITTER_SECONDS = 0.5
REPORTS = SERVERS / "reports"
SLOW_REASON = re.compile(
    r"weights took (\d+\.\d)x their cold median: storage delivered (\S+) MB/s against (\S+) MB/s"
)


def evict_second_half(path: Path) -> None:
    """Drop the second half of the file from the page cache: a mixed load's residency."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        os.posix_fadvise(fd, size // 2, size - size // 2, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Llama:
    """A real llama.cpp server watched by an exporter with history (through a pidfile), loaded
    to ready and stopped, one load at a time."""

    def __init__(
        self, start_exporter: Any, python: str, model: Path, tmp_path: Path, **kwargs: Any
    ) -> None:
        self.python, self.model, self.tmp = python, model, tmp_path
        self.port, self.pidfile = free_port(), tmp_path / "server.pid"
        self.exporter: RunningExporter = start_exporter(
            {
                "sample_interval": SAMPLE_INTERVAL,
                "history_path": str(tmp_path / "history.sqlite"),
                "targets": [
                    {
                        "name": "llama",
                        "endpoint": {"url": f"http://127.0.0.1:{self.port}", "probe": "models"},
                        "weights": {"paths": [str(model)]},
                        "process": {"pidfile": str(self.pidfile)},
                    }
                ],
            },
            **kwargs,
        )
        self.loads: list[dict[str, Any]] = []  # each load's label, truth and phases, in order

    def entry(self) -> dict[str, Any]:
        return dict(self.exporter.status()["targets"][0])

    def load(self, procs: Path) -> tuple[str, float]:
        """One load to ready in the blkio cgroup of `procs`, then stopped: the exporter's cache
        label and how long it took, from the process's start to the first /v1/models answer."""
        server = LlamaCppServer(
            self.python, self.model, self.port, self.tmp / "llama.log", self.pidfile, procs
        )
        try:
            ready_at = server.wait_ready()
            started = process_start_time(server.proc.pid)
            assert started is not None
            wait_for(lambda: self.entry().get("phase") == "ready", timeout=10)
        finally:
            assert server.stop() in (0, -15), server.tail()
        wait_for(lambda: self.entry().get("phase") in ("down", "failed"), timeout=10)
        last = self.exporter.runtime.loads("llama", 1)[0]
        phases = {str(p): round(t, 3) for p, t in last.phase_seconds.items()}
        self.loads.append({
            "cache": str(last.cache), "truth": ready_at - started, "phases": phases,
            # what start-up read from storage and how much of the environment was cached: a
            # warm start of a second and a half is mostly imports, paced by them
            "startup_read_bytes": last.startup_read_bytes,
            "environment_bytes": last.environment_bytes,
            "environment_resident_bytes": last.environment_resident_bytes,
        })  # fmt: skip
        return str(last.cache), ready_at - started

    def cold_load(self, procs: Path) -> tuple[str, float]:
        """A load with the GGUF evicted, begun once the exporter has measured that."""
        evict(str(self.model))
        forecast_at(self.entry, 0.0, made=False)
        return self.load(procs)


def test_forecasts_before_warm_cold_and_mixed_llamacpp_restarts_are_within_20_percent(
    llamacpp_python: str, gguf_model: Path, tmp_path: Path, start_exporter: Any
) -> None:
    llama = Llama(start_exporter, llamacpp_python, gguf_model, tmp_path)
    with scratch(tmp_path / "scratch") as s:
        procs = s.throttle(lsblk_whole_disk(gguf_model), THROTTLE)
        # The loads for history begin as the restarts do, once the exporter has measured the page
        # cache the test prepared: not while it still files the load before (a warm start is
        # under a second of Python, and two cores shared with that work slowed it by 25 %).
        assert llama.cold_load(procs)[0] == "cold"
        forecast_at(llama.entry, 1.0, made=False)
        assert llama.load(procs)[0] == "warm"
        restarts = []
        for cache, share, prepare in (
            ("warm", 1.0, lambda: prewarm(str(gguf_model))),
            ("cold", 0.0, lambda: evict(str(gguf_model))),
            ("mixed", 0.5, lambda: evict_second_half(gguf_model)),
        ):
            prepare()
            known = forecast_at(llama.entry, share)
            label, seconds = llama.load(procs)
            assert label == cache, (label, cache)
            restarts.append(Restart(cache, known["seconds"], known["resident_share"], seconds))
    print("\n" + table(restarts))
    write_report(
        "forecast-on-llamacpp.json",
        table=table(restarts).splitlines(),
        loads=llama.loads,  # the two in history first, then the three restarts
    )
    assert all(r.within(WARM_JITTER_SECONDS if r.cache == "warm" else 0.0) for r in restarts), (
        table(restarts)
    )


def test_a_load_from_storage_throttled_to_a_third_is_explained_by_its_report(
    llamacpp_python: str, gguf_model: Path, tmp_path: Path, start_exporter: Any
) -> None:
    llama = Llama(start_exporter, llamacpp_python, gguf_model, tmp_path)
    with scratch(tmp_path / "scratch") as s:
        disk = lsblk_whole_disk(gguf_model)
        usual, third = s.throttle(disk, THROTTLE), s.throttle(disk, THROTTLE // 3)
        for procs in (usual, usual, third):
            assert llama.cold_load(procs)[0] == "cold"
    url = f"{llama.exporter.url}/api/v1/loads"
    slow, *earlier = requests.get(url, timeout=5).json()["loads"]
    report = slow["report"]
    write_report("slow-load-on-llamacpp.json", reason=report["reason"], loads=llama.loads)
    assert all(x["report"]["reason"] is None for x in earlier), earlier
    match = SLOW_REASON.fullmatch(report["reason"] or "")
    assert match, report
    assert 2.4 <= float(match[1]) <= 3.6, report["reason"]  # the weights, read at a third
    rate, best = float(match[2]), float(match[3])
    assert 0.25 < rate / best < 0.45 and 0.6 * THROTTLE / 1e6 < best < 1.1 * THROTTLE / 1e6, report


def test_an_evict_while_llamacpp_serves_leaves_its_mapped_weights_resident_as_measured(
    llamacpp_python: str, gguf_model: Path, tmp_path: Path, start_exporter: Any
) -> None:
    """What the real server shows of eviction while serving: llama.cpp serves from its mapping
    of the GGUF, and mapped pages are not dropped by an fadvise eviction (`prewarm --evict`), so
    the weights stay resident (fincore) and the exporter, at its real quiet pace, goes on saying
    so at its next memory look: no false eviction, the forecast still a warm restart. (Reclaim
    under memory pressure does take mapped pages; tests/test_serving_eviction.py shows a real
    eviction reaching the shipped alert within a minute, with a real Prometheus.)"""
    llama = Llama(
        start_exporter, llamacpp_python, gguf_model, tmp_path, quiet_interval=QUIET_INTERVAL
    )
    runtime = llama.exporter.runtime
    with scratch(tmp_path / "scratch") as s:
        procs = s.throttle(lsblk_whole_disk(gguf_model), THROTTLE)
        assert llama.cold_load(procs)[0] == "cold"
        forecast_at(llama.entry, 1.0, made=False)
        assert llama.load(procs)[0] == "warm"  # history: both rates
        server = LlamaCppServer(
            llama.python, gguf_model, llama.port, tmp_path / "llama.log", llama.pidfile, procs
        )
        try:
            server.wait_ready()
            wait_for(lambda: runtime.quiet, timeout=30)
            warm = forecast_at(llama.entry, 1.0)

            def memory_look() -> float | None:
                reading = runtime.sampler.latest(MEMORY)
                return reading.finished_at if reading is not None else None

            looked = memory_look()
            wait_for(
                lambda: memory_look() != looked, timeout=EVICTION_LOOK_SECONDS + 5, interval=0.05
            )
            evict(str(gguf_model))
            looked = memory_look()
            wait_for(
                lambda: memory_look() != looked, timeout=EVICTION_LOOK_SECONDS + 5, interval=0.05
            )
            truth = fincore_bytes(gguf_model)
            after = dict(llama.entry()["restart_forecast"])
            quiet = runtime.quiet
            assert server.ready()
        finally:
            assert server.stop() in (0, -15), server.tail()
    size = gguf_model.stat().st_size
    write_report(
        "evict-while-serving-on-llamacpp.json",
        fincore_share_after=round(truth / size, 4),
        forecast_before=warm,
        forecast_after=after,
    )
    assert truth >= 0.99 * size  # the mapping kept them
    assert after["resident_share"] == pytest.approx(truth / size, abs=0.01), (after, truth)
    assert after["seconds"] == pytest.approx(warm["seconds"], rel=0.2)  # still a warm restart
    assert quiet


def write_report(name: str, **parts: Any) -> None:
    """A report in .servers/reports/ for the closing note, with the throttle it ran under."""
    REPORTS.mkdir(parents=True, exist_ok=True)
    document = {"throttle_bytes_per_second": THROTTLE, **parts}
    (REPORTS / name).write_text(json.dumps(document, indent=2) + "\n")
