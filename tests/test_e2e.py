"""End to end: the real exporter watching the real `simulate` server load real files on loopback."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.processes import Simulator, evict_dir
from helpers.support import (
    RunningExporter,
    free_port,
    metrics_when,
    sample_value,
    sim_target,
    wait_for,
)

from exporter.sim.shards import generate_shards
from exporter.storage.cachectl import prewarm

pytestmark = pytest.mark.system  # child processes, servers

SHARDS, SHARD_SIZE = 4, 16 << 20
INTERVAL = 0.25
# Cold at 40 MB/s, cached pages unthrottled, a second of start-up and 1.5 s of init.
PACE = ("--read-rate", "40MB/s", "--init-seconds", "1.5", "--startup-seconds", "1")


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    directory.mkdir()
    generate_shards(directory, SHARDS, SHARD_SIZE)
    return directory


@pytest.fixture
def scenario(tmp_path: Path, weights: Path, start_exporter: Any) -> Iterator[Any]:
    port = free_port()
    sims: list[Simulator] = []

    def exporter(**target: Any) -> RunningExporter:
        running: RunningExporter = start_exporter(
            {
                "sample_interval": f"{int(INTERVAL * 1000)}ms",
                "history_path": str(tmp_path / "history.sqlite"),
                "targets": [
                    sim_target(
                        port,
                        weights,
                        tmp_path / "server.pid",
                        endpoint={
                            "url": f"http://127.0.0.1:{port}",
                            "probe": "completion",
                            "timeout": "1s",
                        },
                        **target,
                    )
                ],
            }
        )
        return running

    def simulate(*extra: str) -> Simulator:
        sim = Simulator(tmp_path, weights, port, *extra, pace=PACE)
        sims.append(sim)
        return sim

    yield exporter, simulate
    for sim in sims:
        sim.stop()


def watch(running: RunningExporter, until: str, timeout: float = 60) -> list[dict[str, Any]]:
    """Poll /api/v1/status until the target reaches `until`; return every state seen."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = running.status()
        state = {**status["targets"][0], "time": status["time"]}
        seen.append(state)
        if state.get("phase") == until:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"never reached {until}: {[s.get('phase') for s in seen][-20:]}")


def finished(running: RunningExporter, **labels: str) -> tuple[str, float]:
    """Scrape until a load with these labels is in the duration histogram; the text and sum."""
    count = "model_load_duration_seconds_count"
    text = metrics_when(running.url, lambda t: bool(sample_value(t, count, target="sim", **labels)))
    total = sample_value(text, "model_load_duration_seconds_sum", target="sim", **labels)
    assert total is not None
    return text, total


def distinct(values: list[Any]) -> list[Any]:
    return [v for i, v in enumerate(values) if i == 0 or values[i - 1] != v]


def test_cold_then_warm_load(scenario: Any, weights: Path) -> None:
    exporter, simulate = scenario
    evict_dir(weights)
    running = exporter(stall_after="30s")
    watch(running, "down")
    cold = simulate()
    seen = watch(running, "ready")
    phases = distinct([s["phase"] for s in seen])
    assert phases[-4:] == ["starting", "loading_weights", "initializing", "ready"], [
        (s["phase"], s["started_at"], s["elapsed_seconds"], s["signals"]) for s in seen
    ]
    progress = [s["progress_ratio"] for s in seen if s.get("progress_ratio") is not None]
    assert progress == sorted(progress) and progress[-1] >= 0.99
    report = cold.result()
    assert report["cache"] == "cold"

    text, measured = finished(running, cache="cold", outcome="ready")
    assert measured is not None and abs(measured - report["load_seconds"]) < 2.0
    assert sample_value(
        text, "model_load_phase_duration_seconds_count", target="sim", phase="loading_weights"
    )
    assert sample_value(text, "model_load_last_duration_seconds", target="sim") == measured
    cold.stop()
    watch(running, "down")

    # The cold run left the shards cached; read them again in case this VM reclaimed some since.
    for shard in weights.glob("*.safetensors"):
        prewarm(str(shard))
    warm = simulate()
    watch(running, "ready")
    assert warm.result()["outcome"] == "ready"
    text, warm_seconds = finished(running, cache="warm", outcome="ready")
    assert warm_seconds is not None and warm_seconds < measured
    assert sample_value(text, "model_load_expected_duration_seconds", target="sim", cache="warm")


def test_stall_raises_and_clears(scenario: Any, weights: Path) -> None:
    exporter, simulate = scenario
    evict_dir(weights)
    stall_after = 1.5
    running = exporter(stall_after=f"{int(stall_after * 1000)}ms")
    simulate("--stall-at", "0.5", "--stall-for", "5s")
    seen = watch(running, "loading_weights")
    first_stalled = None
    while first_stalled is None:
        state = running.status()["targets"][0]
        seen.append(state)
        assert state["phase"] in ("loading_weights", "starting"), state["phase"]
        if state["stalled"]:
            first_stalled = state
        time.sleep(0.05)
    # Raised within stall_after + one sampling interval (+ the status poll's own granularity).
    assert stall_after <= first_stalled["seconds_since_progress"] <= stall_after + INTERVAL + 0.3
    text = running.metrics()
    assert sample_value(text, "model_load_stalled", target="sim") == 1
    # Loading resumes after the 5 s stall: the flag clears and the load completes.
    cleared = wait_for(
        lambda: not (s := running.status()["targets"][0])["stalled"] and s, timeout=20
    )
    assert cleared["phase"] in ("loading_weights", "initializing", "ready")
    watch(running, "ready")


def test_crash_ends_the_load_failed(scenario: Any, weights: Path) -> None:
    exporter, simulate = scenario
    evict_dir(weights)
    running = exporter(stall_after="30s")
    sim = simulate("--crash-at", "0.5")
    watch(running, "failed")
    assert sim.proc.wait(timeout=10) == 1
    text, _ = finished(running, cache="cold", outcome="failed")
    assert sample_value(text, "model_load_in_progress", target="sim") == 0
    loads = requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"]
    assert [load["outcome"] for load in loads] == ["failed"]


def test_history_survives_exporter_restart(scenario: Any, weights: Path) -> None:
    exporter, simulate = scenario
    first = exporter(stall_after="30s")
    simulate()
    watch(first, "ready")
    wait_for(lambda: requests.get(f"{first.url}/api/v1/loads", timeout=5).json()["loads"])
    before = requests.get(f"{first.url}/api/v1/loads", timeout=5).json()["loads"]
    first.stop()
    second = exporter(stall_after="30s")
    after = requests.get(f"{second.url}/api/v1/loads", timeout=5).json()["loads"]
    assert after == before and after[0]["outcome"] == "ready"
    text = second.metrics()
    assert sample_value(text, "model_load_last_duration_seconds", target="sim") == pytest.approx(
        before[0]["duration_seconds"]
    )


@pytest.mark.parametrize("cache", ["cold", "warm"])
def test_exporter_started_mid_load_measures_the_whole_load(
    scenario: Any, weights: Path, cache: str
) -> None:
    """The server starts first and reads its weights at a throttled pace; the exporter arrives
    half-way, yet records the load once, from the process's own start."""
    exporter, simulate = scenario
    if cache == "cold":
        evict_dir(weights)
        pace = ("--read-rate", "16MB/s")
    else:
        for shard in weights.glob("*.safetensors"):
            prewarm(str(shard))
        pace = ("--cached-read-rate", "16MB/s")
    sim = simulate(*pace)
    time.sleep(3.0)  # 1 s of startup, then about a third of the 67 MB of weights
    assert sim.proc.poll() is None
    running = exporter(stall_after="30s")
    arrived = wait_for(lambda: (s := running.status()["targets"][0]).get("in_progress") and s)
    assert arrived["seen_late"] and not arrived["partial"]
    watch(running, "ready")
    report = sim.result()
    assert report["cache"] == cache
    text, measured = finished(running, outcome="ready")
    assert abs(measured - report["load_seconds"]) < 0.5, (measured, report["load_seconds"])
    counts = {
        label: sample_value(text, "model_load_duration_seconds_count", target="sim", cache=label)
        for label in ("cold", "warm", "mixed", "unknown")
    }
    observed = {label: count for label, count in counts.items() if count}
    assert observed in ({cache: 1}, {"unknown": 1}), observed


def test_second_load_of_another_temperature_has_a_ready_eta(scenario: Any, weights: Path) -> None:
    exporter, simulate = scenario
    evict_dir(weights)
    running = exporter(stall_after="30s")
    cold = simulate()
    watch(running, "ready")
    assert cold.result()["cache"] == "cold"
    finished(running, cache="cold", outcome="ready")
    cold.stop()
    watch(running, "down")
    for shard in weights.glob("*.safetensors"):
        prewarm(str(shard))
    warm = simulate("--cached-read-rate", "24MB/s")  # mmap: followed by the pages it maps
    seen = watch(running, "ready")
    report = warm.result()
    assert report["cache"] == "warm"
    loading = [s for s in seen if s["phase"] == "loading_weights" and s["cache"] == "warm"]
    assert any(s["eta_seconds"] is not None for s in loading)
    rows = []
    for share in (0.25, 0.5, 0.75):
        state = next(
            s for s in loading if s["progress_ratio"] >= share and s["eta_seconds"] is not None
        )
        remaining = report["ready_at"] - state["time"]
        rows.append((share, state["eta_seconds"], remaining))
    print("\nready ETA of a warm load after one cold load (seconds)")
    print("weights progress  ETA    real remaining  error")
    for share, eta, remaining in rows:
        print(f"{share:>15.0%}  {eta:5.2f}  {remaining:14.2f}  {eta - remaining:+5.2f}")
    for _, eta, remaining in rows:  # early in the weights the rate has few samples: loose
        assert abs(eta - remaining) < max(3.0, remaining)
