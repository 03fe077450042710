"""NvmlSource against a fake NVML (no GPU here) and against the real pynvml (no driver here)."""

from __future__ import annotations

import ctypes
import logging
import subprocess
import sys
from pathlib import Path

import pynvml
import pytest
from helpers.fake_nvml import (
    GIB,
    H200_TOTAL_BYTES,
    FakeNvml,
    FakeProcess,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    h200_node,
)

from exporter.sources.gpu import (
    GpuProcess,
    GpuSample,
    NvmlSource,
    NvmlUnavailable,
    process_gpu_memory,
)

PROBE = Path(__file__).resolve().parent.parent / "scripts" / "nvml_probe.py"
SERVER_PIDS = (4242, 4243)  # a launcher and its tensor-parallel worker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def loading_node() -> FakeNvml:
    """8 H200s; the server tree holds GPUs 2 and 5 (one worker each), another job holds GPU 7."""
    gpus = h200_node()
    gpus[2].processes = [FakeProcess(4242, 30 * GIB)]
    gpus[5].processes = [FakeProcess(4243, 20 * GIB)]
    gpus[7].processes = [FakeProcess(999, 70 * GIB)]
    for gpu in gpus:
        gpu.used_bytes += sum(p.used_bytes or 0 for p in gpu.processes)
    return FakeNvml(gpus)


def test_eight_h200_devices_and_processes() -> None:
    nvml = loading_node()
    sample = NvmlSource(nvml).sample()

    assert sample.driver_version == "570.133.20"
    assert sample.errors == ()
    assert [d.index for d in sample.devices] == list(range(8))
    for device, gpu in zip(sample.devices, nvml.gpus, strict=True):
        assert (device.uuid, device.name) == (gpu.uuid, "NVIDIA H200")
        assert device.memory_total_bytes == H200_TOTAL_BYTES
        assert device.memory_used_bytes == gpu.used_bytes
    assert sample.devices[2].memory_used_bytes == 30 * GIB + GIB // 2
    assert set(sample.processes) == {
        GpuProcess(4242, 2, nvml.gpus[2].uuid, 30 * GIB),
        GpuProcess(4243, 5, nvml.gpus[5].uuid, 20 * GIB),
        GpuProcess(999, 7, nvml.gpus[7].uuid, 70 * GIB),
    }


def test_process_tree_attribution_and_gpu_restriction() -> None:
    nvml = loading_node()
    nvml.gpus[2].processes.append(FakeProcess(4243, 2 * GIB))  # the worker also touches GPU 2
    sample = NvmlSource(nvml).sample()

    assert process_gpu_memory(sample, SERVER_PIDS) == {2: 32 * GIB, 5: 20 * GIB}
    assert process_gpu_memory(sample, SERVER_PIDS, gpus=(0,)) == {}
    assert process_gpu_memory(sample, SERVER_PIDS, gpus=(2,)) == {2: 32 * GIB}
    assert process_gpu_memory(sample, [999]) == {7: 70 * GIB}
    assert process_gpu_memory(sample, []) == {}


def test_memory_growth_between_samples_is_seen() -> None:
    nvml = loading_node()
    source = NvmlSource(nvml)
    before = process_gpu_memory(source.sample(), SERVER_PIDS)
    nvml.gpus[2].processes[0].used_bytes = 60 * GIB
    nvml.gpus[2].used_bytes += 30 * GIB
    after = source.sample()

    assert before[2] == 30 * GIB
    assert process_gpu_memory(after, SERVER_PIDS)[2] == 60 * GIB
    assert after.devices[2].memory_used_bytes == 60 * GIB + GIB // 2


def test_not_supported_degrades_only_that_field() -> None:
    nvml = loading_node()
    nvml.not_supported["nvmlDeviceGetMemoryInfo"] = {3}
    sample = NvmlSource(nvml).sample()

    assert sample.devices[3].memory_used_bytes is None
    assert sample.devices[3].memory_total_bytes is None
    assert sample.devices[3].uuid == nvml.gpus[3].uuid
    assert all(d.memory_total_bytes == H200_TOTAL_BYTES for d in sample.devices if d.index != 3)
    assert len(sample.processes) == 3
    assert len(sample.errors) == 1
    assert sample.errors[0].startswith("gpu 3: ")
    assert "Not Supported" in sample.errors[0]


def test_not_supported_process_listing_keeps_memory() -> None:
    nvml = loading_node()
    nvml.not_supported["nvmlDeviceGetComputeRunningProcesses"] = {5}
    sample = NvmlSource(nvml).sample()

    assert sample.devices[5].memory_used_bytes == 20 * GIB + GIB // 2
    assert {p.gpu_index for p in sample.processes} == {2, 7}
    assert process_gpu_memory(sample, SERVER_PIDS) == {2: 30 * GIB}
    assert sample.errors == (sample.errors[0],) and "gpu 5: " in sample.errors[0]


def test_used_gpu_memory_none_is_unknown_not_zero() -> None:
    nvml = loading_node()
    nvml.gpus[5].processes = [FakeProcess(4243, None)]
    nvml.gpus[2].processes.append(FakeProcess(4243, None))
    sample = NvmlSource(nvml).sample()

    assert GpuProcess(4243, 5, nvml.gpus[5].uuid, None) in sample.processes
    # GPU 2 holds a known and an unknown share of the tree: a partial sum would lie.
    assert process_gpu_memory(sample, SERVER_PIDS) == {}
    assert process_gpu_memory(sample, [4242]) == {2: 30 * GIB}


def test_gpu_lost_mid_run_degrades_only_that_gpu() -> None:
    nvml = loading_node()
    source = NvmlSource(nvml)
    first = source.sample()
    # Each sample touches a GPU for memory and processes (handle, uuid, name are cached).
    nvml.gpus[2].lost_at_call = nvml.gpus[2].calls + 2
    second = source.sample()
    third = source.sample()

    assert first.devices[2].memory_used_bytes == 30 * GIB + GIB // 2
    for lost in (second, third):
        device = lost.devices[2]
        assert (device.index, device.uuid, device.name) == (2, nvml.gpus[2].uuid, "NVIDIA H200")
        assert device.memory_used_bytes is None
        assert all(p.gpu_index != 2 for p in lost.processes)
        assert process_gpu_memory(lost, SERVER_PIDS) == {5: 20 * GIB}
        assert len(lost.errors) == 1 and lost.errors[0].startswith("gpu 2: ")
        assert "GPU is lost" in lost.errors[0]
        others = [d for d in lost.devices if d.index != 2]
        assert [d.memory_used_bytes for d in others] == [
            d.memory_used_bytes for d in first.devices if d.index != 2
        ]


def test_gpu_lost_is_read_again_after_it_comes_back() -> None:
    nvml = loading_node()
    source = NvmlSource(nvml)
    source.sample()
    nvml.gpus[4].lost = True
    lost = source.sample()
    nvml.gpus[4].lost = False
    back = source.sample()

    assert lost.devices[4].memory_used_bytes is None
    assert back.devices[4].memory_used_bytes == GIB // 2
    assert back.errors == ()
    # Only the lost GPU's handle was dropped and fetched again; the others stayed cached.
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == 8 + 1


def test_gpu_lost_before_first_read_has_no_identity() -> None:
    nvml = loading_node()
    nvml.gpus[6].lost = True
    sample = NvmlSource(nvml).sample()

    assert sample.devices[6].uuid == ""
    assert sample.devices[6].memory_total_bytes is None
    assert sample.devices[0].uuid == nvml.gpus[0].uuid


def test_strings_as_bytes_are_decoded() -> None:
    nvml = loading_node()
    nvml.strings_as_bytes = True
    sample = NvmlSource(nvml).sample()

    assert sample.driver_version == "570.133.20"
    assert sample.devices[0].name == "NVIDIA H200"
    assert sample.processes[0].gpu_uuid == nvml.gpus[2].uuid


def test_library_missing_is_unavailable_retried_slowly_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = loading_node()
    nvml.init_error = NVMLError_LibraryNotFound
    clock = Clock()
    source = NvmlSource(nvml, clock=clock)
    caplog.set_level(logging.DEBUG, logger="exporter.sources.gpu")

    for step in (0.0, 1.0, 30.0, 59.0):
        clock.now = 1000.0 + step
        with pytest.raises(NvmlUnavailable, match="not found"):
            source.sample()
    assert nvml.calls["nvmlInit"] == 1

    clock.now = 1060.0
    with pytest.raises(NvmlUnavailable):
        source.sample()
    clock.now = 1061.0
    with pytest.raises(NvmlUnavailable):
        source.sample()
    assert nvml.calls["nvmlInit"] == 2

    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "not found" in warnings[0].getMessage()

    nvml.init_error = None
    clock.now = 1120.0
    assert len(source.sample().devices) == 8
    assert nvml.calls["nvmlInit"] == 3


def test_unavailable_reason_is_one_line() -> None:
    nvml = loading_node()
    nvml.init_error = NVMLError_DriverNotLoaded
    with pytest.raises(NvmlUnavailable) as caught:
        NvmlSource(nvml).sample()
    assert str(caught.value) == "NVIDIA driver not loaded"


def test_zero_gpus_is_unavailable_and_releases_nvml() -> None:
    nvml = FakeNvml([])
    with pytest.raises(NvmlUnavailable, match="no GPU"):
        NvmlSource(nvml).sample()
    assert nvml.calls["nvmlShutdown"] == 1
    assert not nvml.initialized


def test_driver_gone_mid_run_is_unavailable_then_reinitialised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = loading_node()
    clock = Clock()
    source = NvmlSource(nvml, clock=clock)
    source.sample()
    nvml.failing["nvmlDeviceGetMemoryInfo"] = NVMLError_DriverNotLoaded

    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        source.sample()
    with pytest.raises(NvmlUnavailable):
        source.sample()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1

    del nvml.failing["nvmlDeviceGetMemoryInfo"]
    clock.now += 60.0
    assert source.sample().errors == ()
    assert nvml.calls["nvmlInit"] == 2


def test_close_shuts_nvml_down() -> None:
    nvml = loading_node()
    source = NvmlSource(nvml)
    source.sample()
    source.close()
    assert not nvml.initialized
    assert len(source.sample().devices) == 8


def test_process_gpu_memory_on_a_hand_made_sample() -> None:
    sample = GpuSample(
        driver_version="",
        devices=(),
        processes=(GpuProcess(1, 0, "a", 5), GpuProcess(1, 1, "b", 7), GpuProcess(2, 1, "b", 1)),
        errors=(),
    )
    assert process_gpu_memory(sample, {1, 2}) == {0: 5, 1: 8}
    assert process_gpu_memory(sample, {1, 2}, gpus=(1, 3)) == {1: 8}


def _nvml_library_loadable() -> bool:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False
    return True


@pytest.mark.skipif(_nvml_library_loadable(), reason="NVML present: see scripts/nvml_probe.py")
@pytest.mark.parametrize("injected", [True, False], ids=["injected", "lazy-import"])
def test_real_pynvml_without_driver_is_unavailable(
    injected: bool, caplog: pytest.LogCaptureFixture
) -> None:
    source = NvmlSource(pynvml if injected else None)
    with pytest.raises(NvmlUnavailable, match="libnvidia-ml"):
        source.sample()
    with pytest.raises(NvmlUnavailable):
        source.sample()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1


@pytest.mark.system
@pytest.mark.skipif(_nvml_library_loadable(), reason="NVML present: run the probe by hand")
def test_probe_script_runs_standalone_and_says_no_nvml(tmp_path: Path) -> None:
    for extra in ([], ["--json"]):
        done = subprocess.run(
            [sys.executable, str(PROBE), "--seconds", "1", *extra],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert done.returncode == 0, done.stderr
        assert done.stderr == ""
        assert ("no NVML: " in done.stdout) != bool(extra)
        assert ('"nvml": false' in done.stdout) == bool(extra)
