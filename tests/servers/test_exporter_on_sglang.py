"""The exporter with no config at all, watching a real SGLang load its checkpoint, cold then warm.

SGLang spends its first minute importing (its launcher, then a scheduler child that loads the
weights, and a detokenizer) before the scheduler opens a weight file. It reads the shards from a
disk throttled in a blkio cgroup (THROTTLE), so a cold load's weights take seconds enough for
rates and an ETA to mean something. The test itself asks for a completion every 100 ms from the
process's start: SGLang's first answer is the truth the load's end is held to. Every boundary is
compared with the line SGLang stamped for it (whole seconds of local time: the moment it names
lies in [stamp, stamp + 1)), and SGLang's own `Engine startup timings` land beside the
exporter's figures in .servers/reports/exporter-on-sglang.json.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from helpers.filesystems import scratch
from helpers.forecasts import TOLERANCE
from helpers.hostile import ExporterProcess
from helpers.support import free_port, wait_for
from test_disk import lsblk_whole_disk

from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict
from servers.sglang_server import LIBCUDA_ENV, START_TIMEOUT, SglangServer, describe
from servers.vllm_server import SERVERS, set_cache

REPORT = SERVERS / "reports" / "exporter-on-sglang.json"
THROTTLE = 100_000_000  # bytes per second from the disk: a cold load's weights in ~14 s
POLL = 0.25
STAMP = 1.0  # SGLang's stamps are whole seconds


def sglang_target(exporter: ExporterProcess, pid: int) -> dict[str, Any] | None:
    targets = exporter.get("/api/v1/status").json()["targets"]
    return next((t for t in targets if (t.get("discovered") or {}).get("pid") == pid), None)


class Follower(threading.Thread):
    """Every status of SGLang's target, POLL apart, each with when it was read, until its load
    ended (or the timeout)."""

    def __init__(self, exporter: ExporterProcess, server: SglangServer) -> None:
        super().__init__(daemon=True)
        self.exporter, self.server = exporter, server
        self.seen: list[dict[str, Any]] = []

    def run(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            target = sglang_target(self.exporter, self.server.pid)
            if target is not None:
                self.seen.append({**target, "read_at": time.time()})
                loading = any(s.get("in_progress") for s in self.seen)
                if loading and target.get("phase") in ("ready", "failed"):
                    return
            time.sleep(POLL)


def weights_end_window(words: dict[str, Any]) -> tuple[float, float]:
    """When SGLang's weights ended, from both its lines and the `elapsed=` it states: the end
    line's second, and the begin line's second moved by the elapsed time."""
    begin, end, elapsed = words["weights_begin"], words["weights_end"], words["weights_elapsed"]
    low, high = max(end, begin + elapsed), min(end + STAMP, begin + STAMP + elapsed)
    return low, max(low, high)


def eta_errors(states: list[dict[str, Any]], began: float, ended: float) -> list[float]:
    """The weights ETA's relative error at each look in the second half of the weights."""
    errors = []
    for s in states:
        at, eta = s["read_at"], s.get("weights_eta_seconds")
        if s.get("phase") != "loading_weights" or eta is None or at < (began + ended) / 2:
            continue
        remaining = ended - at
        if remaining > 0.5:  # the last half second is all noise of the looks' timing
            errors.append(abs(eta - remaining) / remaining)
    return errors


def around_the_weights(load: dict[str, Any]) -> list[dict[str, Any]]:
    """The exporter's view from just before SGLang's weights line to just after its end line,
    in seconds since the begin line's stamp."""
    words = load["words"]
    begin, end = words["weights_begin"], words["weights_end"]
    return [
        {
            "since_begin_line": round(s["read_at"] - begin, 2),
            "phase": s.get("phase"),  # none before the target's first tick
            "step": s.get("step"),
            "progress": s.get("progress_ratio"),
            "source": s.get("progress_source"),
            "weights_eta": s.get("weights_eta_seconds"),
        }
        for s in load["states"]
        if s.get("in_progress") and begin - 2 < s["read_at"] < end + 3
    ]


def one_load(exporter: ExporterProcess, server: SglangServer) -> dict[str, Any]:
    """Follow one load to its end; what the exporter said, beside SGLang's own account."""
    follower = Follower(exporter, server)
    follower.start()
    answered = server.wait_first_completion()
    follower.join(60)
    started = process_start_time(server.pid)
    assert started is not None
    server.wait_fired_up()
    states = follower.seen
    name = states[-1]["target"]
    record = exporter.get(f"/api/v1/loads?target={name}").json()["loads"][0]
    words = describe(server)
    phases = record["phase_seconds"]
    weights_began = record["started_at"] + phases["starting"]
    weights_ended = weights_began + phases["loading_weights"]
    low, high = weights_end_window(words)
    ended_truth = (low + high) / 2
    loading = [s for s in states if s.get("in_progress")]
    errors = eta_errors(loading, words["weights_begin"] + STAMP / 2, ended_truth)
    live_weights = next(s["read_at"] for s in loading if s["phase"] != "starting")
    return {
        "record": record,
        "states": states,
        "words": words,
        "truth": {
            "process_start": started,
            "first_completion_after_start": answered - started,
            "weights_seconds": words["weights_elapsed"],
            "initializing_seconds": answered - ended_truth,
        },
        "exporter": {
            "duration": record["duration_seconds"],
            "phases": phases,
            "cache": record["cache"],
            "weights_began_minus_log": weights_began - words["weights_begin"],
            "weights_ended_minus_log": weights_ended - words["weights_end"],
            "steps_seen_live": sorted(
                {s["step"] for s in loading if s.get("step") not in (None, "none")}
            ),
            # Its imports (launcher, then the scheduler's) run until the scheduler's parallel
            # set-up; the weights phase may begin a moment before SGLang's line says so, when
            # its scheduler first opens a shard.
            "phases_seen_during_imports": sorted(
                {s["phase"] for s in loading if s["read_at"] < words["init_parallel"]}
            ),
            "imports_seconds": words["init_parallel"] - started,
            "live_weights_began_minus_log": live_weights - words["weights_begin"],
            "progress_sources": sorted({str(s.get("progress_source")) for s in loading}),
            "startup_read_bytes": record.get("startup_read_bytes"),
            "weights_eta_errors_second_half": [round(e, 3) for e in errors],
            "log_found_by": (states[-1].get("log") or {}).get("found_by"),
        },
    }


def test_phases_steps_and_eta_follow_a_real_sglang_cold_then_warm(
    sglang_python: str, sglang_checkpoint: Path, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    history = {"history_path": str(tmp_path / "history.sqlite"), "discovery": {"interval": "1s"}}
    config.write_text(yaml.safe_dump(history))
    exporter = ExporterProcess([f"--config.file={config}"])
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        exporter.wait_listening()
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(sglang_checkpoint), THROTTLE)
            port = free_port()  # one port: the restart is the same target
            for cache in ("cold", "warm"):
                set_cache(sglang_checkpoint, cache)
                time.sleep(1.5)  # the exporter's residency look sees what the test prepared
                log = tmp_path / f"sglang-{cache}.log"
                server = SglangServer(sglang_python, sglang_checkpoint, port, log, procs)
                try:
                    load = one_load(exporter, server)
                finally:
                    assert server.stop() == []
                report[cache] = {k: load[k] for k in ("truth", "exporter", "words")}
                report[cache]["around_the_weights"] = around_the_weights(load)
                shutil.copy(log, REPORT.parent / f"sglang-{cache}.log")  # a fixture's source
                check(load, cache)
    finally:
        exporter.stop()
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps(report, indent=2) + "\n")


def check(load: dict[str, Any], cache: str) -> None:
    record, truth, said = load["record"], load["truth"], load["exporter"]
    phases = record["phase_seconds"]
    assert record["outcome"] == "ready" and record["cache"] == cache, record
    # Ready when SGLang first answered a client, within a second.
    assert abs(said["duration"] - truth["first_completion_after_start"]) <= 1.0, (said, truth)
    # The weights by SGLang's own lines (whole-second stamps: [stamp, stamp + 1)).
    assert -1.0 < said["weights_began_minus_log"] < 1.0 + STAMP, said
    assert -1.0 < said["weights_ended_minus_log"] < 1.0 + STAMP, said
    assert abs(phases["initializing"] - truth["initializing_seconds"]) <= 1.5, (phases, truth)
    # Its imports are starting, whatever they read: no weight file is opened before its line.
    assert said["phases_seen_during_imports"] == ["starting"], said
    assert said["imports_seconds"] > 10.0, said  # 20 to 125 s here, with the machine's load
    # Its fine steps: the weights of a cold load live, with the shards its bars count (a warm
    # load's take a second: begin and end lines may come in one read of the log); on CPU no
    # graphs are captured, and the KV cache and uvicorn's start can share one stamped second
    # (both then pass between two looks), so those two are held to the finished load.
    assert {"kv_cache", "warmup"} <= set(phases), phases
    assert str(load["states"][-1]["target"]).startswith("sglang-")
    assert "stdout of pid" in (said["log_found_by"] or ""), said
    if cache == "cold":
        assert "weights" in said["steps_seen_live"], said
        errors = said["weights_eta_errors_second_half"]
        assert errors and statistics.median(errors) <= 0.5, said


FORECAST_REPORT = SERVERS / "reports" / "forecast-on-sglang.json"
# Shares of the environment the exporter must have measured before a restart is begun: a run
# leaves it (near) whole in the page cache; an eviction leaves the interpreter's own shared
# libraries and what other processes map.
ENV_WARM, ENV_COLD = 0.9, 0.2


class HostCpu:
    """What else used this shared machine's CPU while a load ran: the host's busy CPU seconds
    (/proc/stat) less the server tree's own, and the share of time some task waited for a CPU
    (/proc/pressure/cpu), beside the pressure the kernel averaged just before it began."""

    def __init__(self) -> None:
        self.before = _pressure()
        self.busy, self.waited, self.at = _busy_seconds(), _waited_seconds(), time.monotonic()

    def during(self, server: SglangServer) -> dict[str, Any]:
        wall = time.monotonic() - self.at
        own = 0.0
        for process in server.tree():
            with contextlib.suppress(psutil.Error):
                t = process.cpu_times()
                own += t.user + t.system + t.children_user + t.children_system
        return {
            "cpu_pressure_avg10_avg60_before": self.before,
            "server_cpu_cores": round(own / wall, 2),
            "others_cpu_cores": round((_busy_seconds() - self.busy - own) / wall, 2),
            "cpu_waited_share": round((_waited_seconds() - self.waited) / wall, 3),
        }


def _busy_seconds() -> float:
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def _pressure_line() -> list[str]:
    return Path("/proc/pressure/cpu").read_text().split("\n", 1)[0].split()


def _pressure() -> list[float]:
    return [float(f.split("=")[1]) for f in _pressure_line()[1:3]]


def _waited_seconds() -> float:
    return int(_pressure_line()[4].split("=")[1]) / 1e6


def evict_environment(python: str) -> int:
    """Drop SGLang's venv and its libcuda folder from the page cache (the project's own eviction
    helper, posix_fadvise DONTNEED per file); the bytes of the files it went over."""
    total = 0
    for root in (Path(python).parent.parent, Path(os.environ[LIBCUDA_ENV]).resolve()):
        for directory, _, names in os.walk(root):
            for name in names:
                path = os.path.join(directory, name)
                if os.path.isfile(path) and not os.path.islink(path):
                    total += evict(path)
    return total


def status_of(exporter: ExporterProcess, name: str) -> dict[str, Any]:
    targets = exporter.get("/api/v1/status").json()["targets"]
    return dict(next(t for t in targets if t["target"] == name))


def forecast_from(exporter: ExporterProcess, name: str, weights: float, env: str) -> dict[str, Any]:
    """The restart forecast once it is made from what the test just prepared: the weights'
    share cached (within 5 %) and the environment warm or cold by a pass after it."""
    seen: list[dict[str, Any]] = []

    def made() -> bool:
        seen.append(status_of(exporter, name).get("restart_forecast") or {})
        share, env_share = (
            seen[-1].get("resident_share"),
            seen[-1].get("environment_resident_share"),
        )
        if share is None or env_share is None or abs(share - weights) > 0.05:
            return False
        return env_share >= ENV_WARM if env == "warm" else env_share <= ENV_COLD

    try:
        wait_for(made, timeout=30, interval=0.25)
    except AssertionError:
        raise AssertionError(
            f"no forecast from {weights:.0%} cached, {env} env: {seen[-1]}"
        ) from None
    return seen[-1]


@pytest.mark.timeout(2400)
def test_forecast_before_a_warm_and_a_cold_sglang_restart_within_20_percent(
    sglang_python: str, sglang_checkpoint: Path, tmp_path: Path
) -> None:
    """Three loads for history (the first teaches the exporter SGLang's files; one with the
    environment warm, one with it evicted), then the restarts: weights and environment warm,
    then both evicted. Each forecast is read once the exporter has measured what the test
    prepared, and held to SGLang's first completion, counted from its process's start."""
    config = tmp_path / "config.yaml"
    history = {"history_path": str(tmp_path / "history.sqlite"), "discovery": {"interval": "1s"}}
    config.write_text(yaml.safe_dump(history))
    exporter = ExporterProcess([f"--config.file={config}"])
    plan = [  # (what it is, weights, environment): history first, then the restarts
        ("history", "cold", "as found"), ("history", "warm", "warm"), ("history", "cold", "cold"),
        ("restart", "warm", "warm"), ("restart", "cold", "cold"),
    ]  # fmt: skip
    loads: list[dict[str, Any]] = []
    name: str | None = None
    FORECAST_REPORT.parent.mkdir(parents=True, exist_ok=True)
    try:
        exporter.wait_listening()
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(sglang_checkpoint), THROTTLE)
            port = free_port()
            for n, (kind, weights, env) in enumerate(plan):
                set_cache(sglang_checkpoint, weights)
                evicted = evict_environment(sglang_python) if env == "cold" else None
                said = None
                if name is not None:
                    share = 1.0 if weights == "warm" else 0.0
                    said = forecast_from(exporter, name, share, env)
                    assert kind == "history" or said.get("seconds"), said
                elif env == "as found":
                    time.sleep(1.5)
                log = tmp_path / f"sglang-forecast-{n}.log"
                loadavg = os.getloadavg()
                cpu = HostCpu()
                server = SglangServer(sglang_python, sglang_checkpoint, port, log, procs)
                try:
                    load = one_load(exporter, server)
                    contention = cpu.during(server)
                finally:
                    assert server.stop() == []
                record = load["record"]
                name = str(record["target"])
                truth = load["truth"]["first_completion_after_start"]
                loads.append({
                    "kind": kind, "weights": weights, "environment": env,
                    "evicted_environment_files_bytes": evicted,
                    "loadavg_before": [round(x, 2) for x in loadavg],
                    **contention,
                    "forecast": said,
                    "truth_seconds": round(truth, 2),
                    "error": (
                        round((said["seconds"] - truth) / truth, 4)
                        if said and said.get("seconds") else None
                    ),
                    "exporter_duration": round(record["duration_seconds"], 2),
                    "cache": record["cache"],
                    "phases": {k: round(v, 2) for k, v in record["phase_seconds"].items()},
                    "environment_bytes": record.get("environment_bytes"),
                    "environment_resident_bytes": record.get("environment_resident_bytes"),
                    "environment_unknown": (record.get("report") or {}).get("environment_unknown"),
                    "startup_read_bytes": record.get("startup_read_bytes"),
                    "sglang_startup_timings": load["words"]["startup_timings"],
                })  # fmt: skip
                shutil.copy(log, REPORT.parent / f"sglang-forecast-{n}.log")
    finally:
        exporter.stop()
        FORECAST_REPORT.write_text(
            json.dumps({"throttle_bytes_per_second": THROTTLE, "loads": loads}, indent=2) + "\n"
        )
    history_loads, restarts = loads[:3], loads[3:]
    # The first load teaches the exporter SGLang's files; the next two began with them measured.
    assert history_loads[0]["environment_unknown"], history_loads[0]
    for warm_or_cold in history_loads[1:] + restarts:
        env_bytes, resident = (
            warm_or_cold["environment_bytes"],
            warm_or_cold["environment_resident_bytes"],
        )
        assert env_bytes and env_bytes > 100 << 20, warm_or_cold  # gigabytes of libraries
        share = resident / env_bytes
        assert share >= ENV_WARM if warm_or_cold["environment"] == "warm" else share <= ENV_COLD
    assert len(restarts) == 2 and all(r["cache"] == r["weights"] for r in restarts), restarts
    assert all(abs(r["error"]) <= TOLERANCE for r in restarts), restarts
