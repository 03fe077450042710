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

import json
import shutil
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import yaml
from helpers.filesystems import scratch
from helpers.hostile import ExporterProcess
from helpers.support import free_port
from test_disk import lsblk_whole_disk

from exporter.sources.process import process_start_time
from servers.sglang_server import START_TIMEOUT, SglangServer, describe
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
            "phase": s["phase"],
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
