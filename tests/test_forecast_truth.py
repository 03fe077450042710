"""The restart forecast against the truth: the simulator loads real shards at a cold-disk and a
page-cache rate (decided per chunk by asking the kernel), the exporter watches it through its
pidfile, and after one cold and one warm load are in history, the forecast read just before a
warm, a cold and a half-evicted (mixed) restart must each be within 20 % of how long that
restart then took, by the simulator's own clock (its report: process start to ready).

tests/servers/test_forecast_on_llamacpp.py does the same on the real llama.cpp server.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.forecasts import Restart, forecast_at, table
from helpers.processes import Simulator, evict_dir
from helpers.support import RunningExporter, free_port, sim_target, wait_for

from exporter.sim.shards import generate_shards
from exporter.storage.cachectl import evict, prewarm

pytestmark = pytest.mark.system

SHARDS, SHARD_SIZE = 4, 8 << 20
# Cold weights about 2.8 s, warm about 0.3 s, and 1.5 s each before and after them: a warm
# restart is half a cold one, as in the field (start-up and compile do not read the cache).
# vLLM's log: its port opens at ready, so the report's ready_at is when it first answers (an
# SGLang stand-in answers completions through its warm-up already, 0.2 s before ready_at).
PACE = ("--read-rate", "12MB/s", "--cached-read-rate", "120MB/s", "--startup-seconds", "1.5",
        "--init-seconds", "1.5", "--log-format", "vllm")  # fmt: skip


@pytest.fixture
def watched(
    tmp_path: Path, start_exporter: Any
) -> tuple[RunningExporter, Path, Callable[[], dict[str, Any]]]:
    """An exporter with history watching the simulator's shards; `load()` runs one load of the
    simulator to ready, stops it, and returns its report once the exporter has seen it go."""
    weights = tmp_path / "model"
    generate_shards(weights, SHARDS, SHARD_SIZE)
    port = free_port()
    running: RunningExporter = start_exporter(
        {
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [sim_target(port, weights, tmp_path / "server.pid")],
        }
    )

    def load() -> dict[str, Any]:
        sim = Simulator(tmp_path, weights, port, pace=PACE)
        try:
            report = sim.result(timeout=60)
            assert report["outcome"] == "ready", report
            wait_for(lambda: phase(running) == "ready", timeout=10)
        finally:
            sim.stop()
        wait_for(lambda: phase(running) == "down", timeout=10)
        return report

    return running, weights, load


def phase(running: RunningExporter) -> str:
    return str(running.status()["targets"][0].get("phase"))


def test_forecasts_before_warm_cold_and_mixed_restarts_are_within_20_percent_of_the_truth(
    watched: tuple[RunningExporter, Path, Callable[[], dict[str, Any]]],
) -> None:
    running, weights, load = watched
    shards = sorted(weights.glob("*.safetensors"))
    evict_dir(weights)
    assert load()["cache"] == "cold"
    assert load()["cache"] == "warm"  # the first load left the shards cached
    restarts = []
    for cache, share, prepare in (
        ("warm", 1.0, lambda: [prewarm(str(s)) for s in shards]),
        ("cold", 0.0, lambda: evict_dir(weights)),
        ("mixed", 0.5, lambda: [evict(str(s)) for s in shards[: SHARDS // 2]]),
    ):
        prepare()
        known = forecast_at(lambda: running.status()["targets"][0], share)
        report = load()
        assert report["cache"] == cache, report
        restarts.append(
            Restart(cache, known["seconds"], known["resident_share"], report["load_seconds"])
        )
    print("\n" + table(restarts))
    assert all(r.within() for r in restarts), table(restarts)
