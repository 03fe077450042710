"""The exporter with no config at all, watching a real vLLM load its checkpoint, cold then warm.

vLLM spends its first tens of seconds importing torch (half a GB through read()) before it opens
a weight file; the phases, progress and ETA must follow what it does with its weight files and
what its own log says, found by the exporter itself. Every boundary is compared with the line
vLLM stamped for it (whole seconds of local time: the moment it names lies in [stamp, stamp+1)).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from helpers.filesystems import fincore_bytes
from helpers.hostile import ExporterProcess
from helpers.processes import evict_dir
from helpers.support import free_port, wait_for

from exporter.runtime.pacing import EVICTION_LOOK_SECONDS, QUIET_INTERVAL
from servers.vllm_server import SERVERS, START_TIMEOUT, VllmServer, stamp_of

REPORT = SERVERS / "reports" / "exporter-on-vllm.json"
POLL = 0.25


def vllm_target(exporter: ExporterProcess, pid: int) -> dict[str, Any] | None:
    targets = exporter.get("/api/v1/status").json()["targets"]
    return next((t for t in targets if (t.get("discovered") or {}).get("pid") == pid), None)


def follow_load(exporter: ExporterProcess, server: VllmServer) -> list[dict[str, Any]]:
    """Every status of vLLM's target, POLL apart, from when it is found until its load ended."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        target = vllm_target(exporter, server.proc.pid)
        if target is not None:
            seen.append(target)
            loading = any(s.get("in_progress") for s in seen)
            if loading and target.get("phase") in ("ready", "failed"):
                return seen
        time.sleep(POLL)
    raise AssertionError(f"vLLM's load did not finish in {START_TIMEOUT}s:\n{server.tail()}")


def test_phases_progress_and_eta_follow_a_real_vllm_cold_then_warm(
    start_vllm: Callable[..., VllmServer], tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "history_path": str(tmp_path / "history.sqlite"),
                "discovery": {"interval": "1s"},
            }
        )
    )
    exporter = ExporterProcess([f"--config.file={config}"])
    report: dict[str, Any] = {}
    try:
        exporter.wait_listening()
        port = free_port()  # one port: the restart is the same target, with the first in history
        for cache in ("cold", "warm"):
            server = start_vllm(cache, wait=False, port=port)
            states = follow_load(exporter, server)
            log = server.log.read_text(errors="replace")
            name = states[-1]["target"]
            loads = exporter.get(f"/api/v1/loads?target={name}").json()["loads"]
            record = loads[0]
            phases = record["phase_seconds"]
            began_log = stamp_of(log, "Starting to load model")
            ended_log = stamp_of(log, "Loading weights took")
            weights_began = record["started_at"] + phases["starting"]
            weights_ended = weights_began + phases["loading_weights"]
            starting = [s for s in states if s.get("phase") == "starting"]
            initializing = [s for s in states if s.get("phase") == "initializing"]
            report[cache] = {
                "phases": phases,
                "cache": record["cache"],
                "duration": record["duration_seconds"],
                "weights_began_minus_log": weights_began - began_log,
                "weights_ended_minus_log": weights_ended - ended_log,
                "log_weights_seconds": float(
                    re.search(r"Loading weights took ([\d.]+)", log).group(1)  # type: ignore[union-attr]
                ),
                "steps_seen_live": sorted({s["step"] for s in initializing if s.get("step")}),
                "etas_while_starting": sorted({s["eta_seconds"] for s in starting}, key=str)[:5],
                "log": states[-1].get("log"),
                # The exporter's view around the weights, in seconds since vLLM's own line.
                "around_the_weights": [
                    {
                        "since_begin_line": round(
                            s["started_at"] + s["elapsed_seconds"] - began_log, 2
                        ),
                        "phase": s["phase"],
                        "step": s.get("step"),
                        "progress": s.get("progress_ratio"),
                        "source": s.get("progress_source"),
                        "idle_since": (s.get("weight_files") or {}).get("idle_since"),
                    }
                    for s in states
                    if s.get("in_progress")
                    and -2
                    < s["started_at"] + s["elapsed_seconds"] - began_log
                    < ended_log - began_log + 4
                ],
            }

            assert record["outcome"] == "ready" and record["cache"] == cache, record
            # The stamps are whole seconds: the moment a line names lies in [stamp, stamp + 1).
            assert -1.0 < weights_began - began_log < 2.0, report[cache]
            assert -1.0 < weights_ended - ended_log < 2.0, report[cache]
            # Starting covers the imports: no weight file is touched before vLLM says so.
            assert phases["starting"] > 10.0, phases
            assert phases["initializing"] > 10.0, phases
            assert {"compile", "warmup", "kv_cache"} <= set(phases), phases
            assert "compile" in report[cache]["steps_seen_live"], report[cache]
            log_state = states[-1]["log"]
            assert str(server.log) in (log_state.get("found_by") or ""), log_state
            # No ETA from start-up reads. History's medians of the phases ahead would be one, but
            # the warm start has only a cold load before it: no basis for warm weights, so none.
            assert starting and all(s["weights_eta_seconds"] is None for s in starting)
            assert all(s["eta_seconds"] is None for s in starting)
            # Once the weights are in, the cold load's initializing median gives the ETA.
            if cache == "warm":
                assert initializing and all(s["eta_seconds"] is not None for s in initializing)
            assert server.stop() == []
    finally:
        exporter.stop()
        REPORT.parent.mkdir(parents=True, exist_ok=True)
        REPORT.write_text(json.dumps(report, indent=2) + "\n")


def test_an_eviction_while_vllm_serves_is_measured_within_a_minute(
    start_vllm: Callable[..., VllmServer], llama_checkpoint: Path, tmp_path: Path
) -> None:
    """vLLM copies its weights out of the safetensors and lets the files go, so an eviction
    while it serves really empties the page cache of them (fincore). The exporter, with no
    config and at its real quiet pace, must measure that within a minute (the eviction alert's
    bar; tests/test_serving_eviction.py takes it on to the shipped rule in a real Prometheus),
    and its restart forecast with it."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"history_path": str(tmp_path / "history.sqlite")}))
    exporter = ExporterProcess([f"--config.file={config}"])
    shards = sorted(llama_checkpoint.glob("*.safetensors"))
    size = sum(s.stat().st_size for s in shards)

    def target() -> dict[str, Any]:
        targets = exporter.get("/api/v1/status").json()["targets"]
        return dict(targets[0]) if targets else {}

    def share() -> float | None:
        return (target().get("restart_forecast") or {}).get("resident_share")

    try:
        exporter.wait_listening()
        start_vllm("warm", wait=True)
        wait_for(lambda: target().get("phase") == "ready", timeout=60)
        wait_for(lambda: (share() or 0) >= 0.9, timeout=30)
        # Into quiet mode (every loop at its quiet pace once the target settled, a tick later)
        # and past a memory look: the eviction lands at no convenient moment of ours.
        time.sleep(QUIET_INTERVAL + EVICTION_LOOK_SECONDS / 2)
        evict_dir(llama_checkpoint)
        began = time.monotonic()
        truth = sum(fincore_bytes(s) for s in shards) / size
        wait_for(lambda: abs((share() or 0) - truth) <= 0.05, timeout=60, interval=0.2)
        measured = time.monotonic() - began
    finally:
        exporter.stop()
    reports = SERVERS / "reports"
    reports.mkdir(parents=True, exist_ok=True)
    (reports / "eviction-on-vllm.json").write_text(
        json.dumps({"fincore_share_after": truth, "measured_after_seconds": measured}) + "\n"
    )
    assert truth < 0.1, truth  # the files were let go: the eviction took them
    assert measured < EVICTION_LOOK_SECONDS + 5 < 60, measured  # the next memory look did it
