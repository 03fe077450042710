"""Phases, progress and the weights ETA against the truth, for every way a server reads weights.

The simulator imports first (64 MiB through read(), as an interpreter importing torch does),
then loads its shards through safetensors' mmap, plain read(), pread from threads, or as four
tensor-parallel ranks each mapping its slice of every shard, and writes down every chunk it
consumed (`--trace`). The exporter must begin the weights at the first weight file, follow the
bytes consumed within 5 % at every tick, and give a weights ETA within 25 % of the truth in the
second half of the weights.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import Simulator, cold_checkpoint
from helpers.support import RunningExporter, free_port, sim_target

pytestmark = pytest.mark.system

SHARDS, SHARD_SIZE = 8, 32 << 20
RATE = 32e6  # bytes/s: 8 s of weights, 32 ticks of 0.25 s, a 4-MiB chunk every 0.13 s
INTERVAL = 0.25
LOOK = INTERVAL / 4  # the file view looks this often while the weights load


class Truth:
    """The bytes of the weight files the simulator's ranks had consumed, at any moment."""

    def __init__(self, trace: Path) -> None:
        self.opened = float("inf")
        self.last_chunk = 0.0  # when the last weight byte was consumed
        last: dict[int, int] = {}
        self.times: list[float] = []
        self.totals: list[int] = []
        for line in trace.read_text().splitlines():
            event = json.loads(line)
            if event["event"] == "open":
                self.opened = min(self.opened, event["time"])
            elif event["event"] == "chunk":
                self.last_chunk = max(self.last_chunk, event["time"])
            last[event["rank"]] = event["consumed"]
            self.times.append(event["time"])
            self.totals.append(sum(last.values()))

    def at(self, t: float) -> int:
        i = bisect.bisect_right(self.times, t)
        return self.totals[i - 1] if i else 0


def follow(running: RunningExporter, done: Callable[[], bool]) -> list[dict[str, Any]]:
    """The target's state, 0.1 s apart, until `done`; each with the tick time it was made at."""
    states: list[dict[str, Any]] = []
    deadline = time.monotonic() + 90
    while not done() and time.monotonic() < deadline:
        state = running.status()["targets"][0]
        if state.get("in_progress"):
            state["tick"] = state["started_at"] + state["elapsed_seconds"]
            states.append(state)
        time.sleep(0.1)
    return states


@pytest.mark.parametrize(
    "loader",
    [["--loader", "mmap"], ["--loader", "read"], ["--loader", "pread"],
     ["--loader", "mmap", "--tensor-parallel", "4"]],
    ids=["mmap", "read", "pread", "mmap-tp4"],
)  # fmt: skip
def test_progress_follows_the_bytes_consumed_whatever_the_loader(
    loader: list[str], tmp_path: Path, start_exporter: Any
) -> None:
    weights = cold_checkpoint(tmp_path / "model", SHARDS, SHARD_SIZE)
    port, trace = free_port(), tmp_path / "trace.jsonl"
    target = sim_target(port, weights, tmp_path / "server.pid")
    running = start_exporter({"sample_interval": f"{int(INTERVAL * 1000)}ms", "targets": [target]})
    sim = Simulator(
        tmp_path, weights, port, "--read-rate", f"{RATE / 1e6:g}MB/s", "--startup-seconds", "2",
        "--init-seconds", "1.5", "--import-bytes", "64MiB", "--trace", str(trace), *loader,
    )  # fmt: skip
    try:
        states = follow(running, lambda: sim.report.exists())
        report = sim.result()
    finally:
        sim.stop()
    truth, total = Truth(trace), SHARDS * SHARD_SIZE
    assert truth.totals[-1] == total

    # The weights begin at the first weight file opened: the imports before it are starting.
    starting = [s for s in states if s["phase"] == "starting"]
    loading = [s for s in states if s["phase"] == "loading_weights"]
    assert starting and loading
    assert all(not s["progress_ratio"] and s["weights_eta_seconds"] is None for s in starting)
    assert all(s["tick"] < truth.opened + INTERVAL for s in starting)
    began = min(s["tick"] for s in loading)
    assert truth.opened <= began < truth.opened + 2 * INTERVAL

    # Progress follows the bytes consumed: never falling, within 5 % at every tick (the look
    # behind the tick is at most one look interval older).
    progress = [s["progress_ratio"] for s in loading]
    assert progress == sorted(progress)
    for state in loading:
        consumed = state["progress_ratio"] * total
        low, high = truth.at(state["tick"] - LOOK - 0.05), truth.at(state["tick"])
        assert low - 0.05 * total <= consumed <= high + 0.05 * total, (state["tick"], consumed)

    # The weights ETA in their second half, against when the last weight byte really came in.
    done = truth.last_chunk
    assert done <= report["weights_done_at"]
    checked = 0
    for state in loading:
        eta, share = state["weights_eta_seconds"], state["progress_ratio"]
        remaining = done - state["tick"]
        if 0.5 <= share < 0.9 and remaining > 1.0:
            assert eta is not None and abs(eta - remaining) <= 0.25 * remaining, (share, eta)
            checked += 1
    assert checked >= 4
