"""The runtime's whole /metrics over a fixture host, pinned: the sources' parsing, not only names.

tests/test_exposition.py builds its snapshot from fixed readings, so a source that misread /proc
would not show there. Here the real `Runtime` reads tests/fixtures/e2e/ (a /proc, /sys and host
tree written by its make_tree.py; its README.md says what it holds) with the fake NVML, a fake
clock and stepped loops, probes two loopback stand-ins, and its /metrics, scraped over HTTP, is
compared with tests/fixtures/e2e-output.prom, as node_exporter compares its own with
e2e-output.txt. After an intended change: `UPDATE_GOLDEN=1 pytest tests/test_e2e_golden.py`,
then read the diff.

What this machine decides is masked in both: the stand-ins' ports, the Python and exporter
versions, and how long each sample and probe took (`MASKS`).
"""

from __future__ import annotations

import importlib.util
import os
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import requests
from helpers.fake_nvml import GIB, FakeGpu, FakeNvml, FakeProcess
from helpers.stepped import SteppedLoops
from helpers.support import ModelServer
from prometheus_client.parser import text_string_to_metric_families

from exporter.config.reader import parse_config
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.runtime.reactions import TRACKER_LOOP
from exporter.runtime.sampler import Sampler
from exporter.runtime.wiring import Runtime
from exporter.storage.cachectl import evict

FIXTURE = Path(__file__).with_name("fixtures") / "e2e"
GOLDEN = Path(__file__).with_name("fixtures") / "e2e-output.prom"
ROUNDS = 12  # sample intervals the run lasts: past the tracker's 10-s rate window
QWEN_READY_FROM = 3  # the round from which qwen's endpoint answers ready (503 before)
GPU_USED = (61 * GIB, 60 * GIB, 70 * GIB)  # what NVML says each GPU's one process holds


def _fixture_module() -> ModuleType:
    """make_tree.py's numbers, to check the golden's against (it is no package)."""
    spec = importlib.util.spec_from_file_location("make_tree", FIXTURE / "make_tree.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TREE = _fixture_module()
_BUILD = re.compile(r'python_version="[^"]*",version="[^"]*"')
_DURATION = re.compile(
    r"^(model_load_(?:source|endpoint_probe)_duration_seconds\{[^}]*\}) .*$", re.M
)
MASKS = (
    (_BUILD, 'python_version="PYTHON",version="VERSION"'),
    (_DURATION, r"\1 DURATION"),
    (re.compile(r"127\.0\.0\.1:\d+"), "127.0.0.1:PORT"),
)


class Clock:
    """The runtime's only time: set by the test, one sample interval per round."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """SGLang stamps its lines in local time: the fixture's are UTC, so the test runs in UTC."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


@pytest.fixture
def refused_port() -> Iterator[int]:
    """A loopback port bound but not listening: every connection is refused (SGLang loading)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield int(sock.getsockname()[1])


def fake_gpus() -> FakeNvml:
    """Three GPUs: kimi-k2's two ranks on 0 and 1, qwen on 2, whose driver has no PCIe counter."""
    gpus = [FakeGpu(uuid=f"GPU-{i}e2e0000-7c1d-4f0e-9a1b-2b3c4d5e6f70") for i in range(3)]
    for gpu, pid, used in zip(gpus, (*TREE.KIMI_RANKS, TREE.QWEN_PID), GPU_USED, strict=True):
        gpu.used_bytes = used
        gpu.processes = [FakeProcess(pid, used)]
    gpus[0].pcie_rx_bytes, gpus[1].pcie_rx_bytes = 38 * GIB, 37 * GIB
    gpus[2].pcie_rx_bytes = None
    return FakeNvml(gpus)


def exposition(refused_port: int, model_server: ModelServer, history: Path) -> str:
    """Run the runtime over the fixture for ROUNDS intervals; its /metrics, masked."""
    for shard in sorted((FIXTURE / "models").rglob("*.safetensors")):
        evict(str(shard))  # cold: the checkout may have left them in the page cache
    model_server.mode = "503"
    config = parse_config(
        {
            "sample_interval": "1s",
            "history_path": str(history),
            "targets": [
                {
                    "name": "kimi-k2",
                    "endpoint": {"url": f"http://127.0.0.1:{refused_port}", "model": "kimi-k2"},
                    "weights": {"paths": [str(FIXTURE / TREE.KIMI)], "per_file": True},
                    "process": {"cmdline": r"sglang\.launch_server .*--port 30000"},
                },
                {
                    "name": "qwen",
                    "endpoint": {"url": model_server.url},
                    "weights": {"paths": [str(FIXTURE / TREE.QWEN)]},
                    "process": {"pidfile": str(FIXTURE / "host" / "run" / "vllm-qwen.pid")},
                },
            ],
        },
        source="test",
    )
    clock = Clock(TREE.NOW)
    loops = SteppedLoops(last=(TRACKER_LOOP,))
    runtime = Runtime(
        config,
        nvml=fake_gpus(),
        proc_root=str(FIXTURE / "proc"),
        sys_root=str(FIXTURE / "sys"),
        host_root=str(FIXTURE / "host"),
        clock=clock,
        sampler=Sampler(config.sample_interval, clock, periodic=loops),
    )
    http = HttpServer(WebApp(runtime), "127.0.0.1:0")
    http.start()
    try:
        for number in range(ROUNDS):
            clock.now = TREE.NOW + number * config.sample_interval
            if number == QWEN_READY_FROM:
                model_server.mode = "ready"
            loops.round()
        response = requests.get(f"http://127.0.0.1:{http.port}/metrics", timeout=10)
        response.raise_for_status()
    finally:
        http.stop()
        runtime.stop()
    text = response.text
    for pattern, mask in MASKS:
        text = pattern.sub(mask, text)
    return text


@pytest.mark.usefixtures("utc")
def test_metrics_over_the_fixture_host_match_the_golden_file(
    refused_port: int, model_server: ModelServer, tmp_path: Path
) -> None:
    text = exposition(refused_port, model_server, tmp_path / "history.sqlite")
    if os.environ.get("UPDATE_GOLDEN"):
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text(), "exposition changed: see the diff, then UPDATE_GOLDEN=1"


def golden_value(name: str, **labels: str) -> float:
    """One sample of the committed golden file (masked durations left out)."""
    text = "".join(line for line in GOLDEN.read_text().splitlines(True) if "DURATION" not in line)
    values = [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(values) == 1, f"{name}{labels}: {values}"
    return float(values[0])


def test_the_golden_numbers_are_the_fixtures_own() -> None:
    """The golden is right, not merely unchanged: its numbers follow from make_tree.py's, each
    through the parsing of one source (a regenerated golden that misread one fails here)."""
    kib = 1024
    assert golden_value("model_load_host_memory_total_bytes") == TREE.MEMINFO["MemTotal"] * kib
    assert golden_value("model_load_host_memory_available_bytes") == (
        TREE.MEMINFO["MemAvailable"] * kib
    )
    assert golden_value("model_load_host_memory_page_cache_bytes") == TREE.MEMINFO["Cached"] * kib
    # The weights are on nvme0n1p1: the whole disk's reads count, in 512-byte sectors.
    sectors = {name: count for _, _, name, _, count in TREE.DISKS}
    assert golden_value("model_load_disk_read_bytes_total", device="nvme0n1") == (
        sectors["nvme0n1"] * 512
    )
    for target, started in (("kimi-k2", TREE.KIMI_STARTED), ("qwen", TREE.QWEN_STARTED)):
        assert golden_value("model_load_process_start_time_seconds", target=target) == started
        assert golden_value("model_load_started_timestamp_seconds", target=target) == started
    # The tree is the launcher and its children, not the container's shim above it.
    assert golden_value("model_load_process_read_bytes_total", target="kimi-k2") == sum(
        read_bytes for _, read_bytes in TREE.KIMI_IO.values()
    )
    assert golden_value("model_load_process_read_bytes_total", target="qwen") == TREE.QWEN_IO[1]
    for target, shards in (("kimi-k2", TREE.KIMI_SHARDS), ("qwen", TREE.QWEN_SHARDS)):
        assert golden_value("model_load_weights_bytes", target=target) == sum(shards.values())
        assert golden_value("model_load_weights_files", target=target) == len(shards)
    # Both ranks read the shard they hold; the furthest offset is how much of it is consumed.
    assert golden_value("model_load_weights_progress_ratio", target="kimi-k2") == max(
        TREE.KIMI_OFFSETS
    ) / sum(TREE.KIMI_SHARDS.values())
    owners = ("kimi-k2", "kimi-k2", "qwen")
    for gpu, (target, used) in enumerate(zip(owners, GPU_USED, strict=True)):
        assert golden_value("model_load_process_gpu_memory_bytes", target=target, gpu=str(gpu)) == (
            used
        )
    last = TREE.NOW + ROUNDS - 1
    assert golden_value("model_load_elapsed_seconds", target="kimi-k2") == last - TREE.KIMI_STARTED
    probes = "model_load_endpoint_probes_total"
    assert golden_value(probes, target="kimi-k2", result="refused") == ROUNDS
    assert golden_value(probes, target="qwen", result="http_error") == QWEN_READY_FROM
    assert golden_value(probes, target="qwen", result="ready") == ROUNDS - QWEN_READY_FROM
    # qwen's load, seen late, lasted from its process's start to its first ready answer.
    ready_at = TREE.NOW + QWEN_READY_FROM
    assert golden_value("model_load_last_duration_seconds", target="qwen") == (
        ready_at - TREE.QWEN_STARTED
    )
