"""End to end with no config at all: the exporter finds a model server by its command line.

A stand-in SGLang (tests/helpers/standins.py: SGLang's real command line, the simulator
underneath) is started after the exporter, loads cold, and is restarted to load warm. Both loads
belong to one discovered target, with the right cache temperatures and durations.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.standins import install
from helpers.support import free_port, wait_for

from exporter.sim.shards import generate_shards
from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict, prewarm

pytestmark = pytest.mark.system

SHARDS, SHARD_SIZE = 4, 16 << 20


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[str]:
    """`model-load-exporter` with no config file: only where to listen (and, to keep the test
    hermetic, where to keep history and a sub-second interval to time readiness)."""
    yield from _exporter(tmp_path)


def _exporter(tmp_path: Path, *args: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
         f"--history.path={tmp_path / 'history.sqlite'}", "--sample.interval=250ms", *args],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return requests.get(f"{url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    wait_for(up, timeout=30)
    yield url
    proc.terminate()
    _, stderr = proc.communicate(timeout=15)
    assert "Traceback" not in stderr


class StandIn:
    """`python -m sglang.launch_server --model-path W --port N`, the simulator underneath."""

    def __init__(self, tmp: Path, weights: Path, port: int, rates: str) -> None:
        site, _ = install(tmp / "standins")
        self.report = tmp / f"report-{time.monotonic_ns()}.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
            "STANDIN_SIM_ARGS": f"{rates} --startup-seconds 0.5 --init-seconds 1 "
            f"--report {self.report}",
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", "--model-path", str(weights),
             "--port", str(port)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        started = process_start_time(self.proc.pid)
        assert started is not None
        self.started = started

    def truth(self) -> float:
        """Seconds from the server's process start until the simulator was ready."""
        report = json.loads(wait_for(lambda: self.report.exists() and self.report.read_text()))
        assert report["outcome"] == "ready"
        return float(report["ready_at"]) - self.started

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=15)


def loads(url: str, target: str) -> list[dict[str, Any]]:
    response = requests.get(f"{url}/api/v1/loads", params={"target": target}, timeout=5)
    return list(response.json()["loads"])


def test_a_server_started_after_the_exporter_is_found_and_its_restarts_are_one_target(
    tmp_path: Path, exporter: str
) -> None:
    weights = tmp_path / "Qwen2.5-0.5B-Instruct"
    weights.mkdir()
    generate_shards(weights, SHARDS, SHARD_SIZE)
    for shard in weights.glob("*.safetensors"):
        evict(str(shard))
    port = free_port()
    name = f"sglang-Qwen2.5-0.5B-Instruct-{port}"
    # Slow enough that the load outlasts discovery's first look (every 5 s by default).
    cold = StandIn(tmp_path, weights, port, "--read-rate 9MB/s")
    try:
        status = wait_for(
            lambda: next(
                (t for t in requests.get(f"{exporter}/api/v1/status", timeout=5).json()["targets"]
                 if t["target"] == name), None,
            ), timeout=15,
        )  # fmt: skip
        assert status["server"] == "sglang" and status["discovered"]["pid"] == cold.proc.pid
        why = {e["what"]: e["source"] for e in status["discovered"]["why"]}
        assert "--port" in why["port"] and "--model-path" in why["model"]
        [first] = wait_for(lambda: loads(exporter, name), timeout=40)
        cold_truth = cold.truth()
    finally:
        cold.stop()
    for shard in weights.glob("*.safetensors"):
        prewarm(str(shard))
    warm = StandIn(tmp_path, weights, port, "--cached-read-rate 48MB/s")
    try:
        second, _ = wait_for(lambda: len(found := loads(exporter, name)) == 2 and found, timeout=40)
        warm_truth = warm.truth()
    finally:
        warm.stop()
    print(f"\ncold: {first['duration_seconds']:.2f}s measured, {cold_truth:.2f}s true"
          f" (seen late: {first['seen_late']}); warm: {second['duration_seconds']:.2f}s measured,"
          f" {warm_truth:.2f}s true")  # fmt: skip
    assert (first["outcome"], first["cache"]) == ("ready", "cold")
    assert (second["outcome"], second["cache"]) == ("ready", "warm")
    assert abs(first["duration_seconds"] - cold_truth) < 0.5, (first, cold_truth)
    assert abs(second["duration_seconds"] - warm_truth) < 0.5, (second, warm_truth)
    assert not second["seen_late"]  # the restart is seen at once: discovery watches for it
    metrics = requests.get(f"{exporter}/metrics", timeout=5).text
    assert f'discovered="true",endpoint="http://127.0.0.1:{port}"' in metrics


def test_a_dropped_target_takes_its_history_series_with_it(tmp_path: Path) -> None:
    """Gone for `keep_for`, a discovered target is no longer watched: its expected and last
    durations leave /metrics with it (they stayed until another target's load finished)."""
    config = tmp_path / "discovery.yml"
    config.write_text("discovery:\n  interval: 500ms\n  keep_for: 1s\n")
    weights = tmp_path / "Qwen2.5-0.5B-Instruct"
    weights.mkdir()
    generate_shards(weights, 2, SHARD_SIZE)
    port = free_port()
    name = f"sglang-Qwen2.5-0.5B-Instruct-{port}"
    series = [f'model_load_last_duration_seconds{{target="{name}"}}',
              f'model_load_expected_duration_seconds{{cache="warm",target="{name}"}}']  # fmt: skip
    started = _exporter(tmp_path, f"--config.file={config}")
    exporter = next(started)
    try:
        server = StandIn(tmp_path, weights, port, "--cached-read-rate 48MB/s")
        try:
            wait_for(lambda: loads(exporter, name), timeout=40)
            metrics = wait_for(
                lambda: all(s in (text := requests.get(f"{exporter}/metrics", timeout=5).text)
                            for s in series) and text, timeout=10,
            )  # fmt: skip
            assert all(s in metrics for s in series)
        finally:
            server.stop()

        def dropped() -> bool:
            status = requests.get(f"{exporter}/api/v1/status", timeout=5).json()
            return all(t["target"] != name for t in status["targets"])

        wait_for(dropped, timeout=15)
        metrics = requests.get(f"{exporter}/metrics", timeout=5).text
        assert not [s for s in series if s in metrics]
        assert f'target="{name}"' not in metrics
    finally:
        next(started, None)
