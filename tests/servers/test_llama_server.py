"""The exporter with no config, watching llama.cpp's own llama-server load a GGUF: cold and warm,
a GGUF in three splits, and `--load-mode none` (read, not mapped).

llama-server opens its port at once and answers 503 `Loading model` until the model is in: that
is loading, never failed. It stamps each log line with the time since it started
(`0.00.007.654 I srv load_model: ...`), which the test reads itself: process start + stamp is
when the line was written. The server runs in a blkio cgroup that reads the disk at THROTTLE, so
a cold load takes seconds. Against its own answers and log: the load ends within 1 s of the first
200 of /health (polled by the test every 20 ms, counted from the process's start), and the weights
phase lies within 1 s of the `load_model: loading model` and `init: llama threadpool init`
lines. The figures land in .servers/reports/llama-server.json.
"""

from __future__ import annotations

import os
import re
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.filesystems import scratch
from helpers.hostile import ExporterProcess
from helpers.require import require_all
from test_disk import lsblk_whole_disk

from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict, prewarm
from servers import llama_server
from servers.llama_server import LlamaServer
from servers.watch import (
    follow,
    follow_load,
    last_load,
    live,
    target_of,
    write_report,
    zero_config_exporter,
)

THROTTLE = 100_000_000  # bytes per second from the disk: about 5.5 s for a cold load
TOLERANCE = 1.0  # seconds, the issue's bar for the duration and the weights' boundaries
# `M.SS.mmm.uuu L ` before each line: minutes, seconds, ms and µs since the server started.
_STAMP = re.compile(r"^(\d+)\.(\d\d)\.(\d{3})\.(\d{3}) [IWEDN] ")
# Its lines at its default verbosity around the weights: opening the GGUF, and the first once the
# model is in (mapped and populated, or read) and its context made.
BEGIN_LINE = "load_model: loading model '"
END_LINE = "llama threadpool init"
REPORT: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}


@pytest.fixture(scope="module")
def binary() -> Path:
    require_all("llama_server")
    found = llama_server.find_binary()
    assert found is not None
    return found


def since_start(log: str, marker: str) -> float:
    """Seconds after the server's start of its first log line holding `marker`, by its stamp."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and marker in line:
            minutes, seconds, ms, us = (int(g) for g in m.groups())
            return minutes * 60 + seconds + ms / 1e3 + us / 1e6
    raise AssertionError(f"no {marker!r} line in llama-server's log")


class Readiness:
    """/health polled every 20 ms from a thread of its own: when it first said 200, and what it
    answered before that."""

    def __init__(self, server: LlamaServer) -> None:
        self.result: tuple[float, list[tuple[int, str]]] | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server: LlamaServer) -> None:
        try:
            self.result = server.wait_ready()
        except BaseException as exc:  # reported by the test's thread
            self.error = exc

    def wait(self) -> tuple[float, list[tuple[int, str]]]:
        self._thread.join(llama_server.START_TIMEOUT)
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def one_load(
    exporter: ExporterProcess, binary: Path, model: Path, log: Path, procs: Path, *extra: str
) -> dict[str, Any]:
    """A load to ready, followed by the exporter, then stopped: its figures beside the server's."""
    server = LlamaServer(binary, model, log, procs, extra)
    try:
        readiness = Readiness(server)
        seen = follow_load(exporter, server.proc.pid, server.tail)
        ready_at, before = readiness.wait()
        started = process_start_time(server.proc.pid)
        assert started is not None
    finally:
        assert server.stop() in (0, -15), server.tail()
    text = log.read_text(errors="replace")
    record = last_load(exporter, seen[-1]["target"])
    phases = record["phase_seconds"]
    began = record["started_at"] + phases.get("starting", float("nan"))
    ended = began + phases.get("loading_weights", float("nan"))
    final = seen[-1]
    time.sleep(1.5)  # the exporter sees the exit before the next start
    truth = ready_at - started
    begin_line, end_line = since_start(text, BEGIN_LINE), since_start(text, END_LINE)
    return {
        "outcome": record["outcome"],
        "cache": record["cache"],
        "duration": record["duration_seconds"],
        "first_ready_since_start": round(truth, 3),
        "duration_minus_first_ready": round(record["duration_seconds"] - truth, 3),
        "phases": phases,
        "log_weights_seconds": round(end_line - begin_line, 3),
        "weights_began_minus_log": round(began - started - begin_line, 3),
        "weights_ended_minus_log": round(ended - started - end_line, 3),
        "answers_before_ready": [f"{code} {body[:80]}" for code, body in before],
        "phases_seen": sorted({s["phase"] for s in seen if "phase" in s}),  # none before a tick
        "weights_bytes": record["weights_bytes"],
        "discovered_weights": final["discovered"]["weights"],
        "log_found_by": (final.get("log") or {}).get("found_by"),
        "log_format": (final.get("log") or {}).get("format"),
        "live": live(seen),
    }


def check(r: dict[str, Any], cache: str) -> None:
    assert r["outcome"] == "ready" and r["cache"] == cache, r
    assert abs(r["duration_minus_first_ready"]) <= TOLERANCE, r
    assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
    assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
    assert "failed" not in r["phases_seen"], r
    assert r["log_found_by"] and r["log_format"] == "llamacpp", r


def test_a_zero_config_exporter_follows_real_llama_server_cold_then_warm(
    binary: Path, tmp_path: Path
) -> None:
    model = llama_server.ensure_model(binary)
    exporter = zero_config_exporter(tmp_path)
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(model), THROTTLE)
            for cache in ("cold", "warm"):
                (evict if cache == "cold" else prewarm)(str(model))
                log = tmp_path / f"llama-server-{cache}.log"
                REPORT[cache] = one_load(exporter, binary, model, log, procs)
    finally:
        exporter.stop()
        write_report("llama-server.json", REPORT)
    for cache in ("cold", "warm"):
        check(REPORT[cache], cache)
    # It answered 503 `Loading model` while it loaded (the exporter: loading, never failed).
    cold = REPORT["cold"]
    assert any(a.startswith("503") and "Loading model" in a for a in cold["answers_before_ready"])
    assert any(
        s["phase"] == "loading_weights" and 0.0 < (s["progress"] or 0) < 1.0 for s in cold["live"]
    ), cold["live"]


def test_a_gguf_in_splits_and_a_load_without_mmap(binary: Path, tmp_path: Path) -> None:
    """Three split files load as one model (the weights are all three); `--load-mode none`
    reads the file instead of mapping it, and the file view follows its offset."""
    split = llama_server.ensure_model(binary, splits=3)
    whole = llama_server.ensure_model(binary)
    exporter = zero_config_exporter(tmp_path)
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(whole), THROTTLE)
            for part in llama_server.parts(split):
                evict(str(part))
            REPORT["split"] = one_load(exporter, binary, split, tmp_path / "split.log", procs)
            evict(str(whole))
            REPORT["no_mmap"] = one_load(
                exporter, binary, whole, tmp_path / "none.log", procs, "--load-mode", "none"
            )
    finally:
        exporter.stop()
        write_report("llama-server.json", REPORT)
    parts = llama_server.parts(split)
    r = REPORT["split"]
    check(r, "cold")
    # Discovery resolves the path the server was given (a checkpoints folder reached through a
    # link is named by where it is).
    resolved = sorted(str(p.resolve()) for p in parts)
    assert len(parts) == 3 and sorted(r["discovered_weights"]) == resolved, r
    assert r["weights_bytes"] == sum(p.stat().st_size for p in parts), r
    check(REPORT["no_mmap"], "cold")
    # Progress seen while it reads: from the file view, or from the page cache or the tree's
    # reads where one of those led at that look (which leads depends on when the looks land).
    assert any(
        0.0 < (s["progress"] or 0) < 1.0
        and s["source"] in ("weight_files", "page_cache", "process_reads")
        for s in REPORT["no_mmap"]["live"]
    ), REPORT["no_mmap"]["live"]


class RouterClock:
    """The router's word on a model (`GET /models`), polled every 20 ms from a thread of its
    own: when it first said `loaded`, and the port of the model's server (its arguments)."""

    def __init__(self, server: LlamaServer, name: str) -> None:
        self.loaded_at: float | None = None
        self.port: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server, name), daemon=True)
        self._thread.start()

    def _run(self, server: LlamaServer, name: str) -> None:
        while not self._stop.is_set() and self.loaded_at is None:
            said = server.router_status(name)
            if said is not None and said[0] in ("loading", "loaded") and "--port" in said[1]:
                self.port = int(said[1][said[1].index("--port") + 1])
            if said is not None and said[0] == "loaded":
                self.loaded_at = time.time()
            time.sleep(0.02)

    def wait(self) -> tuple[float, int]:
        self._thread.join(llama_server.START_TIMEOUT)
        self._stop.set()
        assert self.loaded_at is not None and self.port is not None
        return self.loaded_at, self.port


def child_lines(log: str, port: int) -> str:
    """The lines the router forwarded from the model's server on `port`, without `[port] `."""
    mark = f"[{port}] "
    return "\n".join(line[len(mark) :] for line in log.splitlines() if line.startswith(mark))


def routed_load(
    exporter: ExporterProcess, router: LlamaServer, name: str, target: str
) -> dict[str, Any]:
    """`POST /models/load` of `name`, followed by the exporter until its target's load ended;
    its figures beside the router's word and the model server's own log lines."""
    loads = lambda: exporter.get(f"/api/v1/loads?target={target}").json()["loads"]  # noqa: E731
    before = len(loads()) if target_listed(exporter, target) else 0
    clock = RouterClock(router, name)
    requested = router.router("load", name)
    seen = follow(
        exporter,
        lambda: target_state(exporter, target),
        lambda states: states[-1].get("phase") in ("ready", "failed") and len(loads()) > before,
        router.tail,
    )
    loaded_at, port = clock.wait()
    child = next(p for p in psutil.Process(router.proc.pid).children() if f"{port}" in p.cmdline())
    started = process_start_time(child.pid)
    assert started is not None
    record = last_load(exporter, target)
    text = child_lines(router.log.read_text(errors="replace"), port)
    phases = record["phase_seconds"]
    began = record["started_at"] + phases.get("starting", float("nan"))
    ended = began + phases.get("loading_weights", float("nan"))
    begin_line, end_line = since_start(text, BEGIN_LINE), since_start(text, END_LINE)
    truth = loaded_at - started
    return {
        "requested": requested,
        "model_server_started_after_request": round(started - requested, 3),
        "model_server_pid": child.pid,
        "model_server_port": port,
        "outcome": record["outcome"],
        "cache": record["cache"],
        "partial": record["partial"],
        "duration": record["duration_seconds"],
        "router_loaded_since_start": round(truth, 3),
        "duration_minus_router_loaded": round(record["duration_seconds"] - truth, 3),
        "log_model_loaded_since_start": since_start(text, "llama_server: model loaded"),
        "phases": phases,
        "log_weights_seconds": round(end_line - begin_line, 3),
        "weights_began_minus_log": round(began - started - begin_line, 3),
        "weights_ended_minus_log": round(ended - started - end_line, 3),
        "phases_seen": sorted({s["phase"] for s in seen if "phase" in s}),  # none before a tick
        "endpoint": seen[-1]["endpoint"],
        "router_evidence": next(
            (e["value"] for e in seen[-1]["discovered"]["why"] if e["what"] == "router"), None
        ),
        "log_found_by": (seen[-1].get("log") or {}).get("found_by"),
        "live": live(seen),
    }


def target_listed(exporter: ExporterProcess, name: str) -> bool:
    return target_state(exporter, name) is not None


def target_state(exporter: ExporterProcess, name: str) -> dict[str, Any] | None:
    targets = exporter.get("/api/v1/status").json()["targets"]
    return next((t for t in targets if t["target"] == name), None)


def test_a_model_the_router_loads_is_a_load_of_its_own_target(binary: Path, tmp_path: Path) -> None:
    """llama-server's router mode (`--models-dir DIR`, no model): `POST /models/load` starts a
    `llama-server --model FILE --alias tiny` of its own, which maps the GGUF (cold, from the
    throttled disk) and answers 503 `Loading model` until it is in. The exporter, with no
    config, finds that child as the model's own target, `<router's target>/tiny`, follows the
    lines the router forwards from it, and records its load: the duration within 1 s of the
    router first listing the model `loaded` (counted from the child's start), the weights
    within 1 s of the child's own log lines, progress from the pages of the GGUF the child
    maps. Unloaded, the model is counted and logged on the router's target; loaded again (warm
    now), it is a second load of the same target, on another port."""
    model = llama_server.ensure_model(binary)
    models = tmp_path / "models"
    models.mkdir()
    os.link(model, models / "tiny.gguf")  # the same bytes and pages, named as the router lists it
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(model), THROTTLE)
            log = tmp_path / "llama-router.log"
            router = LlamaServer(binary, None, log, procs, ("--models-dir", str(models)))
            try:
                router.wait_ready()
                up = follow(  # the router: ready at once, no model loaded
                    exporter,
                    lambda: target_of(exporter, router.proc.pid),
                    lambda states: states[-1].get("phase") == "ready",
                    router.tail,
                )
                name = up[-1]["target"]
                target = f"{name}/tiny"
                evict(str(model))
                time.sleep(1.5)
                report["cold"] = routed_load(exporter, router, "tiny", target)
                router.router("unload", "tiny")
                down = follow(
                    exporter,
                    lambda: target_state(exporter, target),
                    lambda states: states[-1].get("phase") == "down",
                    router.tail,
                    timeout=15,
                )[-1]
                unloaded = follow(
                    exporter,
                    lambda: target_of(exporter, router.proc.pid),
                    lambda states: states[-1].get("unloaded") is not None,
                    router.tail,
                    timeout=15,
                )[-1]
                metrics = exporter.get("/metrics").text
                report["unload"] = {
                    "model_target_phase": down["phase"],
                    "router_unloaded": unloaded.get("unloaded"),
                    "router_unloads_total": unloads_total(metrics, name),
                    "exporter_said": [
                        line for line in exporter.stderr().splitlines() if "unloaded model" in line
                    ],
                }
                time.sleep(1.5)
                report["warm"] = routed_load(exporter, router, "tiny", target)
                metrics = exporter.get("/metrics").text
                report["histogram_observations"] = histogram_count(metrics, target)
            finally:
                assert router.stop() in (0, -15), router.tail()
    finally:
        exporter.stop()
        write_report("llama-server-router.json", report)
    for cache in ("cold", "warm"):
        # A warm model server is in (0.1 s) before discovery's next pass finds its process:
        # its lines in the router's log date its phases and its ready line its end.
        r = report[cache]
        assert r["outcome"] == "ready" and r["cache"] == cache and not r["partial"], r
        assert abs(r["duration_minus_router_loaded"]) <= TOLERANCE, r
        assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
        assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
        assert "failed" not in r["phases_seen"], r
        assert r["endpoint"] == f"http://127.0.0.1:{r['model_server_port']}", r
        assert r["router_evidence"] == name, r
        assert "its router" in (r["log_found_by"] or ""), r
    assert report["cold"]["model_server_port"] != report["warm"]["model_server_port"], report
    assert any(
        s["phase"] == "loading_weights"
        and 0.0 < (s["progress"] or 0) < 1.0
        and s["source"] == "weight_files"
        for s in report["cold"]["live"]
    ), report["cold"]["live"]
    u = report["unload"]
    assert u["model_target_phase"] == "down" and u["router_unloaded"] == "tiny", u
    assert u["router_unloads_total"] == 1 and len(u["exporter_said"]) == 1, u
    assert report["histogram_observations"] == 2, report


def unloads_total(metrics: str, target: str) -> float | None:
    m = re.search(
        rf'^model_load_unloads_total{{target="{re.escape(target)}"}} (\S+)', metrics, re.MULTILINE
    )
    return float(m.group(1)) if m else None


def histogram_count(metrics: str, target: str) -> float:
    pattern = (
        rf'^model_load_duration_seconds_count{{[^}}]*target="{re.escape(target)}"[^}}]*}} (\S+)'
    )
    return sum(float(m.group(1)) for m in re.finditer(pattern, metrics, re.MULTILINE))
