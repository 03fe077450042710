"""GPU series in /metrics: a fake 8-GPU NVML at the module boundary, a real server process tree."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fake_nvml import (
    GIB,
    MEMORY_V2,
    PROCESSES_V3,
    RESERVED_BYTES,
    FakeNvml,
    FakeProcess,
    h200_node,
)
from helpers.support import RunningExporter, sample_value, wait_for

from exporter.config.reader import parse_config
from exporter.runtime.wiring import Runtime
from exporter.sources import NVML
from exporter.sources.nvml_pids import NvmlPidCheck

# A server whose tree is two processes, like a launcher and its TP worker.
TREE = (
    "import subprocess, sys, time\n"
    "worker = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(worker.pid, flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def spawn_tree() -> Iterator[Callable[[], tuple[int, int]]]:
    """Starts server trees (root, worker) on demand; kills what is left of them at the end."""
    started: list[tuple[subprocess.Popen[str], int]] = []

    def spawn() -> tuple[int, int]:
        proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        worker = int(proc.stdout.readline())
        started.append((proc, worker))
        return proc.pid, worker

    yield spawn
    for proc, worker in started:
        subprocess.run(["kill", "-9", str(worker)], check=False)
        proc.kill()
        proc.wait()


@pytest.fixture
def server_tree(spawn_tree: Callable[[], tuple[int, int]]) -> tuple[int, int]:
    return spawn_tree()


@pytest.mark.system
def test_eight_gpus_with_per_process_attribution(
    start_exporter: Any, model_server: Any, server_tree: tuple[int, int], tmp_path: Path
) -> None:
    root, worker = server_tree
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(str(root))
    nvml = FakeNvml(h200_node(8))
    nvml.gpus[2].processes = [FakeProcess(root, 20 * GIB), FakeProcess(4_000_000, 5 * GIB)]
    nvml.gpus[5].processes = [FakeProcess(worker, 30 * GIB)]
    for gpu in nvml.gpus:
        gpu.used_bytes += sum(p.used_bytes or 0 for p in gpu.processes)
    running: RunningExporter = start_exporter(
        {
            "targets": [
                {
                    "name": "kimi",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                },
                {
                    "name": "pinned",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                    "gpus": [5],
                },
            ]
        },
        nvml=nvml,
    )

    def attributed() -> str | None:
        text = running.metrics()
        both = all(
            sample_value(text, "model_load_process_gpu_memory_bytes", target=t, gpu="5")
            for t in ("kimi", "pinned")
        )
        return text if both else None

    text = wait_for(attributed)
    assert sample_value(text, "model_load_source_up", source="nvml", target="") == 1
    info = [line for line in text.splitlines() if line.startswith("model_load_gpu_info{")]
    assert len(info) == 8 and all('driver_version="570.133.20"' in line for line in info)
    for index in range(8):
        total = sample_value(text, "model_load_gpu_memory_total_bytes", gpu=str(index))
        assert total == nvml.gpus[index].total_bytes
    assert sample_value(text, "model_load_gpu_memory_used_bytes", gpu="2") == 25 * GIB
    # The tree's share only: the other tenant's 5 GiB on GPU 2 is not the target's.
    assert sample_value(text, "model_load_process_gpu_memory_bytes", target="kimi", gpu="2") == (
        20 * GIB
    )
    assert sample_value(text, "model_load_process_gpu_memory_bytes", target="kimi", gpu="5") == (
        30 * GIB
    )
    assert sample_value(text, "model_load_process_gpu_memory_bytes", target="kimi", gpu="0") is None
    assert (
        sample_value(text, "model_load_process_gpu_memory_bytes", target="pinned", gpu="2") is None
    )
    assert sample_value(text, "model_load_process_gpu_memory_bytes", target="pinned", gpu="5") == (
        30 * GIB
    )

    # Weights keep arriving on GPU 5: the next samples show it.
    nvml.gpus[5].processes[0].used_bytes = 60 * GIB
    wait_for(
        lambda: (
            sample_value(
                running.metrics(), "model_load_process_gpu_memory_bytes", target="kimi", gpu="5"
            )
            == 60 * GIB
        )
    )
    check = subprocess.run(
        ["promtool", "check", "metrics"],
        input=running.metrics(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_gpu_lost_mid_run_degrades_that_gpu_only(start_exporter: Any, model_server: Any) -> None:
    nvml = FakeNvml(h200_node(8))
    running: RunningExporter = start_exporter(
        {"targets": [{"name": "m", "endpoint": {"url": model_server.url}}]},
        nvml=nvml,
    )
    wait_for(
        lambda: (
            sample_value(running.metrics(), "model_load_gpu_memory_used_bytes", gpu="3") is not None
        )
    )
    nvml.gpus[3].lost = True
    text = wait_for(
        lambda: (
            (t := running.metrics())
            and sample_value(t, "model_load_gpu_memory_used_bytes", gpu="3") is None
            and t
        )
    )
    assert sample_value(text, "model_load_source_up", source="nvml", target="") == 1
    assert sample_value(text, "model_load_gpu_memory_used_bytes", gpu="4") == 0


def test_config_reload_overlap_keeps_nvml_for_the_new_runtime(model_server: Any) -> None:
    """serve.reload starts the new runtime before it stops the old: one NVML, two holders."""
    nvml = FakeNvml(h200_node(2))
    config = parse_config(
        {
            "history_path": "",
            "sample_interval": "100ms",
            "targets": [{"name": "m", "endpoint": {"url": model_server.url}}],
        }
    )
    runtimes = [
        Runtime(
            config,
            nvml=nvml,
            gpu_pid_check=NvmlPidCheck(host_namespace=True),
            quiet_interval=0.1,  # the target is ready: NVML would be sampled every 30 s
        )
        for _ in range(2)
    ]
    for runtime in runtimes:
        runtime.start()
    old, fresh = runtimes
    try:
        wait_for(lambda: all(r.sampler.value(NVML) is not None for r in runtimes))
        old.stop()
        assert nvml.refcount == 1
        stopped = time.time()

        def sampled_since() -> bool:
            reading = fresh.sampler.latest(NVML)
            return reading is not None and reading.finished_at > stopped + 0.2 and reading.ok

        wait_for(sampled_since)
    finally:
        fresh.stop()
    assert nvml.refcount == 0 and nvml.calls["nvmlShutdown"] == 2


@pytest.mark.system
def test_driver_older_than_the_binding_keeps_gpu_memory_in_metrics(
    start_exporter: Any, model_server: Any, server_tree: tuple[int, int], tmp_path: Path
) -> None:
    """No v2 memory info and no v3 process listing (NVMLLibraryMismatchError): the GPU series
    stay, v1's used (with the driver's reserve in it), and no per-process figure is invented."""
    root, _ = server_tree
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(str(root))
    gpus = h200_node(1)
    gpus[0].processes = [FakeProcess(root, 10 * GIB)]
    gpus[0].used_bytes = 10 * GIB
    nvml = FakeNvml(gpus, missing_functions={MEMORY_V2, PROCESSES_V3})
    running: RunningExporter = start_exporter(
        {
            "targets": [
                {
                    "name": "m",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                }
            ]
        },
        nvml=nvml,
    )
    text = wait_for(
        lambda: (
            (t := running.metrics())
            and sample_value(t, "model_load_process_up", target="m") == 1
            and sample_value(t, "model_load_gpu_memory_used_bytes", gpu="0") is not None
            and t
        )
    )
    assert sample_value(text, "model_load_source_up", source="nvml", target="") == 1
    assert sample_value(text, "model_load_gpu_memory_used_bytes", gpu="0") == (
        10 * GIB + RESERVED_BYTES
    )
    assert sample_value(text, "model_load_process_gpu_memory_bytes", target="m", gpu="0") is None


def hold(nvml: FakeNvml, root: int, worker: int) -> None:
    """The tree holds GPU 2 (its root) and GPU 5 (its worker), as a TP=2 server would."""
    nvml.gpus[2].processes = [FakeProcess(root, 20 * GIB)]
    nvml.gpus[5].processes = [FakeProcess(worker, 30 * GIB)]


@pytest.mark.system
def test_pcie_bytes_per_gpu_in_metrics_and_per_load_in_status(
    start_exporter: Any,
    model_server: Any,
    spawn_tree: Callable[[], tuple[int, int]],
    tmp_path: Path,
) -> None:
    """A real runtime, server tree and HTTP server; the fake NVML's counters advance as weights
    would arrive. The status counts each GPU from the load's start, afresh for the next load."""
    root, worker = spawn_tree()
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(str(root))
    nvml = FakeNvml(h200_node(8))
    hold(nvml, root, worker)
    nvml.gpus[2].pcie_rx_bytes = 4 * GIB  # what the driver counted before this load
    nvml.gpus[5].pcie_rx_bytes = 10 * GIB
    nvml.gpus[3].pcie_rx_bytes = None  # no such counter on this GPU
    model_server.mode = "503"  # loading
    running: RunningExporter = start_exporter(
        {
            "targets": [
                {
                    "name": "kimi",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                },
                {  # its GPUs configured: shown whether the tree holds memory there or not
                    "name": "pinned",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                    "gpus": [0],
                },
            ]
        },
        nvml=nvml,
    )

    def target(name: str) -> dict[str, Any]:
        [entry] = [t for t in running.status()["targets"] if t["target"] == name]
        return entry

    def pcie_when(check: Callable[[dict[int, dict[str, Any]]], bool]) -> dict[str, Any]:
        """kimi's status entry once it lists GPUs 2 and 5 and `check` holds; else a failure that
        shows the last entry's load and PCIe counts."""
        last: dict[str, Any] = {}

        def entry() -> dict[str, Any] | None:
            kimi = target("kimi")
            last.update({key: kimi[key] for key in ("phase", "started_at", "gpu_pcie")})
            by_gpu = {g["gpu"]: g for g in kimi["gpu_pcie"]}
            return kimi if set(by_gpu) == {2, 5} and check(by_gpu) else None

        try:
            result: dict[str, Any] = wait_for(entry)
        except AssertionError as e:
            raise AssertionError(f"{e}; kimi's last entry: {last}") from None
        return result

    def since(target: dict[str, Any]) -> dict[int, int | None]:
        return {g["gpu"]: g["pcie_rx_bytes_since_load_start"] for g in target["gpu_pcie"]}

    first = pcie_when(lambda g: g[5]["pcie_rx_bytes_since_load_start"] is not None)
    assert first["in_progress"] and since(first) == {2: 0, 5: 0}
    assert {g["gpu"]: g["uuid"] for g in first["gpu_pcie"]} == {
        2: nvml.gpus[2].uuid,
        5: nvml.gpus[5].uuid,
    }
    assert all(g["pcie_rx_counted_since"] <= time.time() for g in first["gpu_pcie"])
    wait_for(
        lambda: [g["pcie_rx_bytes_since_load_start"] for g in target("pinned")["gpu_pcie"]] == [0]
    )

    nvml.gpus[2].pcie_rx_bytes += GIB
    nvml.gpus[5].pcie_rx_bytes += 3 * GIB
    nvml.gpus[0].pcie_rx_bytes += 7 * GIB  # another job's GPU: not the target's
    loading = pcie_when(lambda g: g[5]["pcie_rx_bytes_since_load_start"] == 3 * GIB)
    assert since(loading) == {2: GIB, 5: 3 * GIB}
    assert {g["gpu"]: g["pcie_rx_bytes"] for g in loading["gpu_pcie"]} == {2: 5 * GIB, 5: 13 * GIB}
    text = running.metrics()
    assert sample_value(text, "model_load_gpu_pcie_rx_bytes_total", gpu="5") == 13 * GIB
    assert sample_value(text, "model_load_gpu_pcie_rx_bytes_total", gpu="0") == 7 * GIB
    assert sample_value(text, "model_load_gpu_pcie_rx_bytes_total", gpu="3") is None
    assert sample_value(text, "model_load_gpu_memory_total_bytes", gpu="3") is not None
    [pinned] = target("pinned")["gpu_pcie"]
    assert (pinned["gpu"], pinned["pcie_rx_bytes_since_load_start"]) == (0, 7 * GIB)

    # Ready: the last load's count goes on from the same start.
    model_server.mode = "ready"
    wait_for(lambda: target("kimi")["phase"] == "ready")
    nvml.gpus[5].pcie_rx_bytes += GIB
    ready = pcie_when(lambda g: g[5]["pcie_rx_bytes_since_load_start"] == 4 * GIB)
    assert ready["started_at"] == loading["started_at"]
    [first_counted] = {g["pcie_rx_counted_since"] for g in ready["gpu_pcie"]}  # one NVML sample

    # A restart: a new process is a new load, counted afresh from a sample at or after its start.
    # (Not "after the test's restart": a start is stamped in whole clock ticks, up to 10 ms
    # before the fork, and a sample inside that tick is the load's first.)
    model_server.mode = "503"
    new_root, new_worker = spawn_tree()
    hold(nvml, new_root, new_worker)
    pidfile.write_text(str(new_root))
    subprocess.run(["kill", "-9", str(worker), str(root)], check=True)
    second = pcie_when(lambda g: g[5]["pcie_rx_counted_since"] > first_counted)
    assert second["in_progress"] and second["started_at"] > loading["started_at"]
    assert all(g["pcie_rx_counted_since"] >= second["started_at"] for g in second["gpu_pcie"])
    assert since(second) == {2: 0, 5: 0}
    nvml.gpus[5].pcie_rx_bytes += 2 * GIB
    more = pcie_when(lambda g: g[5]["pcie_rx_bytes_since_load_start"] == 2 * GIB)
    assert {g["gpu"]: g["pcie_rx_bytes"] for g in more["gpu_pcie"]} == {2: 5 * GIB, 5: 16 * GIB}
    assert since(more) == {2: 0, 5: 2 * GIB}
