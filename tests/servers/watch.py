"""A zero-config exporter watching a real server, and what it said of one load, for the
real-server tests of llama-server and Triton (tests/servers/test_llama_server.py,
test_triton.py).

The exporter runs as its own process with no targets (discovery finds the server) and its
default one-second sample interval, with history; the test follows `/api/v1/status` every POLL
seconds and keeps every state it saw, so a load's live progress is in the report beside its
record.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from helpers.hostile import ExporterProcess

from exporter.sources.process import process_start_time
from servers.vllm_server import SERVERS

REPORTS = SERVERS / "reports"
POLL = 0.1
TIMEOUT = 120.0


def zero_config_exporter(tmp_path: Path) -> ExporterProcess:
    """An exporter with no targets (discovery every second) and history, listening."""
    config = tmp_path / "exporter.yaml"
    config.write_text(
        yaml.safe_dump(
            {"history_path": str(tmp_path / "history.sqlite"), "discovery": {"interval": "1s"}}
        )
    )
    exporter = ExporterProcess([f"--config.file={config}"])
    exporter.wait_listening()
    return exporter


def target_of(exporter: ExporterProcess, pid: int) -> dict[str, Any] | None:
    """The discovered target whose server process is `pid`."""
    targets = exporter.get("/api/v1/status").json()["targets"]
    return next((t for t in targets if (t.get("discovered") or {}).get("pid") == pid), None)


def follow(
    exporter: ExporterProcess,
    pick: Callable[[], dict[str, Any] | None],
    done: Callable[[list[dict[str, Any]]], bool],
    tail: Callable[[], str],
    timeout: float = TIMEOUT,
) -> list[dict[str, Any]]:
    """Every state `pick` returns, POLL apart, until `done` says so of what was seen."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = pick()
        if state is not None:
            seen.append(state)
            if done(seen):
                return seen
        time.sleep(POLL)
    raise AssertionError(
        f"no end of the load in {timeout:.0f} s; last state {seen[-1:]}:\n{tail()}\n"
        f"exporter: {exporter.stderr()[-3000:]}"
    )


def follow_load(
    exporter: ExporterProcess, pid: int, tail: Callable[[], str]
) -> list[dict[str, Any]]:
    """The states of the target of server process `pid` until its load ended (its record is
    the target's last: a warm start may be over before the first state is polled)."""
    started = process_start_time(pid)
    assert started is not None

    def ended(seen: list[dict[str, Any]]) -> bool:
        last = seen[-1].get("last_record") or {}
        return (
            seen[-1].get("phase") in ("ready", "failed")
            and last.get("started_at", 0.0) >= started - 1.0
        )

    return follow(exporter, lambda: target_of(exporter, pid), ended, tail)


def last_load(exporter: ExporterProcess, target: str) -> dict[str, Any]:
    return dict(exporter.get(f"/api/v1/loads?target={target}").json()["loads"][0])


def live(seen: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the exporter showed while the load ran: phase, progress and where it came from."""
    shown = [
        {
            "at": round(s["started_at"] + s["elapsed_seconds"], 3),
            "phase": s["phase"],
            "in_server": s.get("in_server", False),
            "progress": s.get("progress_ratio"),
            "source": s.get("progress_source"),
            "weight_files": {
                k: (s.get("weight_files") or {}).get(k)
                for k in ("consumed_bytes", "files_seen", "files_done", "held")
            },
        }
        for s in seen
        if s.get("in_progress")
    ]
    return [s for i, s in enumerate(shown) if i == 0 or s != shown[i - 1]]


def write_report(name: str, document: dict[str, Any]) -> None:
    REPORTS.mkdir(parents=True, exist_ok=True)
    (REPORTS / name).write_text(json.dumps(document, indent=2) + "\n")
