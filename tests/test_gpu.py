"""NvmlSource against a fake NVML, and against the real pynvml on whatever host runs the tests."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any
from unittest.mock import ANY

import pynvml
import pytest
from helpers.fake_nvml import (
    FIELD_VALUES,
    GIB,
    H200_TOTAL_BYTES,
    MEMORY_V2,
    PROCESSES_V3,
    RESERVED_BYTES,
    FakeNvml,
    FakeProcess,
    NVMLError_DriverNotLoaded,
    NVMLError_LibraryNotFound,
    h200_node,
)
from helpers.real_nvml import RealNvml, real_nvml

from exporter.sources.gpu import (
    GpuDevice,
    GpuProcess,
    GpuSample,
    NvmlSource,
    NvmlUnavailable,
    PcieMark,
    mark_pcie,
    pcie_rx_since,
    process_gpu_memory,
)
from exporter.sources.nvml_pids import NvmlPidCheck, in_initial_pid_namespace

PROBE = Path(__file__).resolve().parent.parent / "scripts" / "nvml_probe.py"
SERVER_PIDS = (4242, 4243)  # a launcher and its tensor-parallel worker


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def host_source(nvml: FakeNvml, **kwargs: Any) -> NvmlSource:
    """A source in the host's PID namespace, where NVML's PIDs are ours (see test_nvml_pids)."""
    return NvmlSource(nvml, pid_check=NvmlPidCheck(host_namespace=True), **kwargs)


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
    sample = host_source(nvml).sample()

    assert sample.driver_version == "570.133.20"
    assert sample.errors == ()
    assert [d.index for d in sample.devices] == list(range(8))
    for device, gpu in zip(sample.devices, nvml.gpus, strict=True):
        assert (device.uuid, device.name) == (gpu.uuid, "NVIDIA H200")
        assert device.memory_total_bytes == H200_TOTAL_BYTES
        assert device.memory_used_bytes == gpu.used_bytes
        assert device.memory_reserved_bytes == RESERVED_BYTES
    # v2: used is what the processes allocated (nvidia-smi's figure), the driver's reserve apart.
    assert sample.devices[2].memory_used_bytes == 30 * GIB
    assert sample.devices[0].memory_used_bytes == 0
    assert set(sample.processes) == {
        GpuProcess(4242, 2, nvml.gpus[2].uuid, 30 * GIB),
        GpuProcess(4243, 5, nvml.gpus[5].uuid, 20 * GIB),
        GpuProcess(999, 7, nvml.gpus[7].uuid, 70 * GIB),
    }


def test_process_tree_attribution_and_gpu_restriction() -> None:
    nvml = loading_node()
    nvml.gpus[2].processes.append(FakeProcess(4243, 2 * GIB))  # the worker also touches GPU 2
    sample = host_source(nvml).sample()

    assert process_gpu_memory(sample, SERVER_PIDS) == {2: 32 * GIB, 5: 20 * GIB}
    assert process_gpu_memory(sample, SERVER_PIDS, gpus=(0,)) == {}
    assert process_gpu_memory(sample, SERVER_PIDS, gpus=(2,)) == {2: 32 * GIB}
    assert process_gpu_memory(sample, [999]) == {7: 70 * GIB}
    assert process_gpu_memory(sample, []) == {}


def test_memory_growth_between_samples_is_seen() -> None:
    nvml = loading_node()
    source = host_source(nvml)
    before = process_gpu_memory(source.sample(), SERVER_PIDS)
    nvml.gpus[2].processes[0].used_bytes = 60 * GIB
    nvml.gpus[2].used_bytes += 30 * GIB
    after = source.sample()

    assert before[2] == 30 * GIB
    assert process_gpu_memory(after, SERVER_PIDS)[2] == 60 * GIB
    assert after.devices[2].memory_used_bytes == 60 * GIB


def test_not_supported_degrades_only_that_field() -> None:
    nvml = loading_node()
    nvml.not_supported["nvmlDeviceGetMemoryInfo"] = {3}
    sample = host_source(nvml).sample()

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
    sample = host_source(nvml).sample()

    assert sample.devices[5].memory_used_bytes == 20 * GIB
    assert {p.gpu_index for p in sample.processes} == {2, 7}
    assert process_gpu_memory(sample, SERVER_PIDS) == {2: 30 * GIB}
    assert sample.errors == (sample.errors[0],) and "gpu 5: " in sample.errors[0]


def test_used_gpu_memory_none_is_unknown_not_zero() -> None:
    nvml = loading_node()
    nvml.gpus[5].processes = [FakeProcess(4243, None)]
    nvml.gpus[2].processes.append(FakeProcess(4243, None))
    sample = host_source(nvml).sample()

    assert GpuProcess(4243, 5, nvml.gpus[5].uuid, None) in sample.processes
    # GPU 2 holds a known and an unknown share of the tree: a partial sum would lie.
    assert process_gpu_memory(sample, SERVER_PIDS) == {}
    assert process_gpu_memory(sample, [4242]) == {2: 30 * GIB}


def test_gpu_lost_mid_run_degrades_only_that_gpu() -> None:
    nvml = loading_node()
    source = host_source(nvml)
    first = source.sample()
    # Each sample touches a GPU for memory, the PCIe counter and processes (handle, uuid and
    # name are cached): lost at the last of them.
    nvml.gpus[2].lost_at_call = nvml.gpus[2].calls + 3
    second = source.sample()
    third = source.sample()

    assert first.devices[2].memory_used_bytes == 30 * GIB
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
    source = host_source(nvml)
    source.sample()
    nvml.gpus[4].lost = True
    lost = source.sample()
    nvml.gpus[4].lost = False
    back = source.sample()

    assert lost.devices[4].memory_used_bytes is None
    assert back.devices[4].memory_used_bytes == 0
    assert back.devices[4].memory_total_bytes == H200_TOTAL_BYTES
    assert back.errors == ()
    # Only the lost GPU's handle was dropped and fetched again; the others stayed cached.
    assert nvml.calls["nvmlDeviceGetHandleByIndex"] == 8 + 1


def test_gpu_lost_before_first_read_has_no_identity() -> None:
    nvml = loading_node()
    nvml.gpus[6].lost = True
    sample = host_source(nvml).sample()

    assert sample.devices[6].uuid == ""
    assert sample.devices[6].memory_total_bytes is None
    assert sample.devices[0].uuid == nvml.gpus[0].uuid


def test_strings_as_bytes_are_decoded() -> None:
    nvml = loading_node()
    nvml.strings_as_bytes = True
    sample = host_source(nvml).sample()

    assert sample.driver_version == "570.133.20"
    assert sample.devices[0].name == "NVIDIA H200"
    assert sample.processes[0].gpu_uuid == nvml.gpus[2].uuid


def test_library_missing_is_unavailable_retried_slowly_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = loading_node()
    nvml.init_error = NVMLError_LibraryNotFound
    clock = Clock()
    source = host_source(nvml, clock=clock)
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
        host_source(nvml).sample()
    assert str(caught.value) == "NVIDIA driver not loaded"


def test_zero_gpus_is_unavailable_and_releases_nvml() -> None:
    nvml = FakeNvml([])
    with pytest.raises(NvmlUnavailable, match="no GPU"):
        host_source(nvml).sample()
    assert nvml.calls["nvmlShutdown"] == 1
    assert not nvml.initialized


@pytest.mark.parametrize(
    "function",
    ["nvmlDeviceGetMemoryInfo", "nvmlDeviceGetFieldValues", "nvmlDeviceGetComputeRunningProcesses"],
)
def test_driver_gone_mid_run_is_unavailable_then_reinitialised(
    function: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.sources.gpu")
    nvml = loading_node()
    clock = Clock()
    source = host_source(nvml, clock=clock)
    source.sample()
    nvml.failing[function] = NVMLError_DriverNotLoaded

    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        source.sample()
    with pytest.raises(NvmlUnavailable):
        source.sample()
    assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
    # A dead driver is not a driver without v2 memory info.
    assert not [r for r in caplog.records if "no v2 memory info" in r.getMessage()]

    del nvml.failing[function]
    clock.now += 60.0
    assert source.sample().errors == ()
    assert nvml.calls["nvmlInit"] == 2


def test_close_gives_nvml_back_once_and_for_good() -> None:
    nvml = loading_node()
    source = host_source(nvml)
    source.sample()
    source.close()
    source.close()
    assert nvml.calls["nvmlShutdown"] == 1 and nvml.refcount == 0
    # A straggling sampler thread must not take a reference that nobody would give back.
    with pytest.raises(NvmlUnavailable, match="closed"):
        source.sample()
    assert nvml.calls["nvmlInit"] == 1 and nvml.refcount == 0


def test_overlapping_sources_keep_their_own_reference() -> None:
    """A config reload starts the new runtime before the old one stops: one NVML, two holders."""
    nvml = loading_node()
    old, fresh = host_source(nvml), host_source(nvml)
    old.sample()
    fresh.sample()
    assert nvml.refcount == 2
    old.close()
    assert nvml.initialized
    assert fresh.sample().errors == ()
    fresh.close()
    assert nvml.refcount == 0


def test_source_never_gives_back_a_reference_it_lost() -> None:
    """Another holder in the process shuts NVML down once too often: ours is gone with it."""
    nvml = loading_node()
    clock = Clock()
    source = host_source(nvml, clock=clock)
    source.sample()
    nvml.nvmlShutdown()  # the other holder's extra shutdown
    with pytest.raises(NvmlUnavailable, match="Uninitialized"):
        source.sample()
    assert nvml.calls["nvmlShutdown"] == 1  # the source did not try to give back what is gone
    clock.now += 60.0
    assert len(source.sample().devices) == 8
    assert nvml.refcount == 1
    source.close()
    assert nvml.refcount == 0


def test_memory_v2_reserved_apart_and_v1_folds_it_into_used() -> None:
    nvml = loading_node()
    gpu = nvml.gpus[2]
    sample = host_source(nvml).sample()
    device = sample.devices[2]
    assert device.memory_used_bytes == 30 * GIB
    assert device.memory_reserved_bytes == RESERVED_BYTES
    handle = nvml.nvmlDeviceGetHandleByIndex(2)
    v1 = nvml.nvmlDeviceGetMemoryInfo(handle)
    v2 = nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)
    assert v2.total == v2.reserved + v2.used + v2.free == gpu.total_bytes
    assert v1.used == v2.used + v2.reserved and v1.free == v2.free
    with pytest.raises(pynvml.NVMLError_ArgumentVersionMismatch):
        nvml.nvmlDeviceGetMemoryInfo(handle, version=2)  # the struct version, not "2"


def test_driver_without_v2_memory_info_falls_back_to_v1_for_good() -> None:
    nvml = loading_node()
    nvml.missing_functions.add(MEMORY_V2)
    source = host_source(nvml)
    first = source.sample()
    second = source.sample()

    for sample in (first, second):
        assert sample.errors == ()
        # As that driver's nvidia-smi shows it: the reserve inside used, not reported apart.
        assert sample.devices[2].memory_used_bytes == 30 * GIB + RESERVED_BYTES
        assert sample.devices[2].memory_reserved_bytes is None
        assert sample.devices[2].memory_total_bytes == H200_TOTAL_BYTES
    # v2 tried once per GPU, not once per sample: 8 failed v2 calls, then v1 only.
    assert nvml.calls[MEMORY_V2] == 8
    assert nvml.calls["nvmlDeviceGetMemoryInfo"] == 2 * 8


@pytest.mark.parametrize("count", [1, 8])
def test_library_mismatch_in_process_listing_keeps_memory(count: int) -> None:
    """A binding newer than the driver: the unversioned listing raises NVMLLibraryMismatchError,
    which is no NVMLError. That one call fails on each GPU; the rest of the sample stands."""
    gpus = h200_node(count)
    gpus[0].used_bytes = 30 * GIB
    gpus[0].processes = [FakeProcess(4242, 30 * GIB)]
    nvml = FakeNvml(gpus, missing_functions={PROCESSES_V3})
    sample = host_source(nvml).sample()

    assert [d.memory_used_bytes for d in sample.devices] == [30 * GIB] + [0] * (count - 1)
    assert all(d.memory_total_bytes == H200_TOTAL_BYTES for d in sample.devices)
    assert sample.devices[0].uuid == gpus[0].uuid
    assert sample.processes == ()
    assert process_gpu_memory(sample, [4242]) == {}
    assert len(sample.errors) == count
    assert sample.errors[0].startswith("gpu 0: GetComputeRunningProcesses: ")
    assert "does not match the NVML lib version" in sample.errors[0]


def rx(sample: GpuSample) -> list[int | None]:
    return [d.pcie_rx_bytes for d in sample.devices]


@pytest.mark.parametrize(
    "value_type",
    [
        pynvml.NVML_VALUE_TYPE_UNSIGNED_INT,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
    ],
)
def test_pcie_rx_counter_starts_at_the_drivers_and_advances(value_type: int) -> None:
    """Read from the union member the field's value type names, whichever that is."""
    nvml = loading_node()
    for gpu in nvml.gpus:
        gpu.pcie_value_type = value_type
    nvml.gpus[2].pcie_rx_bytes = 3 * GIB  # the driver counted before the exporter started
    source = host_source(nvml)
    first = source.sample()
    nvml.gpus[2].pcie_rx_bytes += GIB // 2
    nvml.gpus[5].pcie_rx_bytes = 1234
    second = source.sample()

    assert rx(first) == [0, 0, 3 * GIB, 0, 0, 0, 0, 0]
    assert rx(second) == [0, 0, 3 * GIB + GIB // 2, 0, 0, 1234, 0, 0]
    assert first.errors == second.errors == ()


def test_pcie_rx_wrap_and_reset_never_go_back_or_jump() -> None:
    """A 32-bit driver counter wraps at 4 GiB; a GPU reset starts it at 0 again. Each such step
    back counts nothing (that interval's bytes are lost), every forward step counts."""
    nvml = FakeNvml(h200_node(1))
    gpu = nvml.gpus[0]
    gpu.pcie_value_type = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    gpu.pcie_rx_bytes = 4 * GIB - GIB // 2
    source = host_source(nvml)
    seen = [rx(source.sample())[0]]
    for step in (GIB // 4, GIB // 2, GIB // 4, None, GIB):  # None: the GPU was reset
        gpu.pcie_rx_bytes = 0 if step is None else gpu.pcie_rx_bytes + step
        seen.append(rx(source.sample())[0])

    base = 4 * GIB - GIB // 2
    quarter = GIB // 4
    # driver: 3.5, 3.75, (4.25 wraps to) 0.25, 0.5, 0 (reset), 1 GiB
    assert seen == [
        base,
        base + quarter,
        base + quarter,  # the wrap: nothing counted
        base + 2 * quarter,
        base + 2 * quarter,  # the reset: nothing counted
        base + 2 * quarter + GIB,
    ]


def test_pcie_rx_field_not_supported_is_absent_without_an_error_and_not_asked_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.sources.gpu")
    nvml = loading_node()
    nvml.gpus[3].pcie_rx_bytes = None  # this GPU's nvmlReturn for the field: NOT_SUPPORTED
    source = host_source(nvml)
    samples = [source.sample(), source.sample()]

    for sample in samples:
        assert rx(sample) == [0, 0, 0, None, 0, 0, 0, 0]
        assert sample.errors == ()
        assert sample.devices[3].memory_used_bytes == 0
    assert nvml.calls[FIELD_VALUES] == 8 + 7  # GPU 3 asked once
    notes = [r.getMessage() for r in caplog.records if "PCIe" in r.getMessage()]
    assert notes == ["gpu 3: no PCIe byte counter (Not Supported)"]
    assert all(r.levelno == logging.INFO for r in caplog.records)


@pytest.mark.parametrize("driver", ["function missing", "call not supported"])
def test_old_driver_without_the_counter_then_upgraded(driver: str) -> None:
    """No field values at all (FunctionNotFound), or NotSupported from the whole call: no GPU
    has the counter, none is asked again, until NVML is initialised again (a new driver)."""
    nvml = loading_node()
    if driver == "function missing":
        nvml.missing_functions.add(FIELD_VALUES)
    else:
        nvml.not_supported[FIELD_VALUES] = {None}
    clock = Clock()
    source = host_source(nvml, clock=clock)
    before = [source.sample(), source.sample()]

    for sample in before:
        assert rx(sample) == [None] * 8 and sample.errors == ()
        assert sample.devices[2].memory_used_bytes == 30 * GIB
    assert nvml.calls[FIELD_VALUES] == 8

    nvml.missing_functions.clear()
    nvml.not_supported.clear()
    assert rx(source.sample()) == [None] * 8  # decided for this init
    nvml.failing["nvmlDeviceGetMemoryInfo"] = NVMLError_DriverNotLoaded  # the driver reloaded
    with pytest.raises(NvmlUnavailable):
        source.sample()
    del nvml.failing["nvmlDeviceGetMemoryInfo"]
    clock.now += 60.0
    assert rx(source.sample()) == [0] * 8


def test_pcie_rx_other_errors_are_error_lines_and_read_again() -> None:
    nvml = loading_node()
    nvml.gpus[2].pcie_rx_bytes = 5 * GIB
    source = host_source(nvml)
    source.sample()
    nvml.failing[FIELD_VALUES] = pynvml.NVMLError_Unknown
    failed = source.sample()
    del nvml.failing[FIELD_VALUES]
    nvml.gpus[2].pcie_rx_bytes += GIB
    back = source.sample()

    assert rx(failed) == [None] * 8
    assert failed.errors[0] == "gpu 0: GetFieldValues: Unknown Error" and len(failed.errors) == 8
    assert failed.devices[2].memory_used_bytes == 30 * GIB
    assert rx(back)[2] == 6 * GIB and back.errors == ()


def test_gpu_lost_at_the_pcie_read_then_back_after_a_reset_keeps_its_counter() -> None:
    nvml = loading_node()
    gpu = nvml.gpus[2]
    gpu.pcie_rx_bytes = 7 * GIB
    source = host_source(nvml)
    source.sample()
    gpu.lost_at_call = gpu.calls + 2  # memory, then the PCIe counter
    lost = source.sample()
    gpu.lost, gpu.lost_at_call = False, None
    gpu.pcie_rx_bytes = GIB  # reset with the GPU: the driver counts from 0 again
    back = source.sample()
    gpu.pcie_rx_bytes += 2 * GIB
    later = source.sample()

    assert rx(lost) == [0, 0, None, 0, 0, 0, 0, 0]
    assert lost.devices[2].memory_used_bytes is None
    assert len(lost.errors) == 1 and lost.errors[0].startswith("gpu 2: GetFieldValues: ")
    assert "GPU is lost" in lost.errors[0]
    assert rx(back)[2] == 7 * GIB  # neither back to 1 GiB nor up by it
    assert rx(later)[2] == 9 * GIB


def test_pcie_rx_value_of_a_type_the_binding_cannot_read_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    nvml = loading_node()
    nvml.gpus[4].pcie_value_type = 42  # from a driver newer than the binding's value union
    source = host_source(nvml)
    samples = [source.sample(), source.sample()]

    assert [rx(s)[4] for s in samples] == [None, None]
    assert [s.errors for s in samples] == [(), ()]
    assert nvml.calls[FIELD_VALUES] == 8 + 7
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert warnings == ["gpu 4: PCIe RX counter unusable (value type 42, value None): not read"]


def test_pcie_marks_and_bytes_since_on_hand_made_samples() -> None:
    def sample(*counters: int | None) -> GpuSample:
        devices = tuple(
            GpuDevice(i, f"GPU-{i}", "H200", 0, 1, pcie_rx_bytes=c) for i, c in enumerate(counters)
        )
        return GpuSample("", devices, (), ())

    assert mark_pcie({}, sample(90, 30), read_at=9.0, started_at=9.5) == {}  # from before it
    first = mark_pcie({}, sample(100, None), read_at=10.0, started_at=9.5)
    assert first == {(0, "GPU-0"): PcieMark(100, 10.0)}
    assert mark_pcie(first, None, read_at=11.0, started_at=9.5) is first
    assert mark_pcie(first, sample(150, None), read_at=11.0, started_at=9.5) is first  # marked
    later = mark_pcie(first, sample(150, 40), read_at=12.0, started_at=9.5)  # GPU 1 read now
    assert later == {(0, "GPU-0"): PcieMark(100, 10.0), (1, "GPU-1"): PcieMark(40, 12.0)}

    now = sample(180, 90).devices
    marks = [later[(d.index, d.uuid)] for d in now]
    assert [pcie_rx_since(m, d, read_at=13.0) for m, d in zip(marks, now, strict=True)] == [80, 50]
    assert pcie_rx_since(marks[1], now[1], read_at=11.0) is None  # a sample older than the mark
    assert pcie_rx_since(None, now[0], read_at=13.0) is None
    assert pcie_rx_since(marks[0], sample(None).devices[0], read_at=13.0) is None


def test_process_gpu_memory_on_a_hand_made_sample() -> None:
    sample = GpuSample(
        driver_version="",
        devices=(),
        processes=(GpuProcess(1, 0, "a", 5), GpuProcess(1, 1, "b", 7), GpuProcess(2, 1, "b", 1)),
        errors=(),
    )
    assert process_gpu_memory(sample, {1, 2}) == {0: 5, 1: 8}
    assert process_gpu_memory(sample, {1, 2}, gpus=(1, 3)) == {1: 8}


# What the source says for each reason pynvml itself gives for not starting.
UNAVAILABLE_REASONS = {
    pynvml.NVMLError_LibraryNotFound: "libnvidia-ml.so.1 not found",
    pynvml.NVMLError_DriverNotLoaded: "NVIDIA driver not loaded",
}
PROBE_KEYS = {
    "schema", "nvml", "reason", "binding", "driver_version", "pid_namespace", "devices",
    "nvidia_smi", "source", "attribution", "samples", "pcie_end", "errors",
}  # fmt: skip


def _expected_unavailable(truth: RealNvml) -> str:
    if truth.error is None:
        return "NVML sees no GPU"
    return UNAVAILABLE_REASONS.get(type(truth.error), str(truth.error))


@pytest.mark.nvml
@pytest.mark.parametrize("injected", [True, False], ids=["injected", "lazy-import"])
def test_source_agrees_with_the_real_pynvml_here(
    injected: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """No GPU here: the same reason pynvml gives. A GPU here: the same GPUs pynvml lists."""
    truth = real_nvml()
    source = NvmlSource(pynvml if injected else None)
    try:
        if not truth.present:
            with pytest.raises(NvmlUnavailable, match=re.escape(_expected_unavailable(truth))):
                source.sample()
            with pytest.raises(NvmlUnavailable):
                source.sample()
            assert len([r for r in caplog.records if r.levelno >= logging.WARNING]) == 1
            return
        sample = source.sample()
    finally:
        source.close()
    assert sample.driver_version == truth.driver_version
    assert [(d.index, d.uuid, d.name, d.memory_total_bytes) for d in sample.devices] == [
        (g.index, g.uuid, g.name, g.total_bytes) for g in truth.gpus
    ]
    assert sample.errors == ()
    for device in sample.devices:
        assert device.memory_used_bytes is not None and device.memory_total_bytes is not None
        reserved = device.memory_reserved_bytes or 0
        assert 0 <= device.memory_used_bytes + reserved <= device.memory_total_bytes


def load_script(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, PROBE.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_probe(cwd: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(PROBE), *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    return done.stdout


@pytest.mark.system
@pytest.mark.nvml
def test_probe_script_agrees_with_the_real_pynvml_here(tmp_path: Path) -> None:
    truth = real_nvml()
    text = _run_probe(tmp_path, "--seconds", "0")
    report = json.loads(_run_probe(tmp_path, "--seconds", "1", "--interval", "0.5", "--json"))

    assert set(report) == PROBE_KEYS and report["schema"] == 1
    assert report["nvml"] is truth.present
    assert report["pid_namespace"]["host"] is in_initial_pid_namespace()
    if not truth.present:
        assert text == f"no NVML: {report['reason']}\n"
        assert _expected_unavailable(truth) in report["reason"]
        assert report["devices"] == [] and report["source"] is None
        return
    assert report["driver_version"] == truth.driver_version
    assert [d["uuid"] for d in report["devices"]] == [g.uuid for g in truth.gpus]
    assert [d["uuid"] for d in report["source"]["devices"]] == [g.uuid for g in truth.gpus]
    assert report["samples"] and all(s["unavailable"] is None for s in report["samples"])
    assert f"driver {truth.driver_version}" in text


def test_probe_report_shape_with_gpus(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The JSON a device check asserts on, here from a fake two-GPU host (this process on GPU 1)."""
    gpus = h200_node(2)
    gpus[1].used_bytes = 3 * GIB
    gpus[1].processes = [FakeProcess(os.getpid(), 3 * GIB)]
    gpus[0].pcie_rx_bytes = None  # no counter on GPU 0
    gpus[1].pcie_rx_bytes = 9 * GIB
    nvml = FakeNvml(gpus)
    report = fake_probe_report(monkeypatch, capsys, nvml, "--seconds", "0.2", "--interval", "0.1")

    assert set(report) == PROBE_KEYS
    assert (report["nvml"], report["reason"], report["driver_version"]) == (
        True,
        None,
        "570.133.20",
    )
    gpu = report["devices"][1]
    assert gpu["memory"] == {
        "total": H200_TOTAL_BYTES,
        "reserved": RESERVED_BYTES,
        "used": 3 * GIB,
        "free": H200_TOTAL_BYTES - RESERVED_BYTES - 3 * GIB,
        "version": 2,
    }
    assert gpu["memory_v1"]["used"] == 3 * GIB + RESERVED_BYTES
    not_supported = {"return": 3, "error": "Not Supported", "value_type": None, "value": None}
    assert gpu["pcie"] == {
        "rx": {"return": 0, "error": None, "value_type": 3, "value": 9 * GIB},
        "tx": not_supported,  # the fake has no TX counter
    }
    assert report["devices"][0]["pcie"] == {"rx": not_supported, "tx": not_supported}
    assert report["pcie_end"] == [report["devices"][0]["pcie"], gpu["pcie"]]
    assert all(s["pcie_rx_bytes"] == [None, 9 * GIB] for s in report["samples"])
    rates = [s["pcie_rx_bytes_per_second"] for s in report["samples"]]
    assert rates[0] == [None, None] and rates[1:] and all(r == [None, 0.0] for r in rates[1:])
    assert gpu["processes"] == [
        {"pid": os.getpid(), "used_bytes": 3 * GIB, "here": True, "cmdline": ANY}
    ]
    assert report["source"]["devices"][1]["memory_used_bytes"] == 3 * GIB
    assert report["source"]["devices"][1]["memory_reserved_bytes"] == RESERVED_BYTES
    # This process holds no NVIDIA device: outside the host's PID namespace that refuses it.
    trusted = in_initial_pid_namespace()
    assert report["attribution"]["trusted"] is trusted
    assert (report["source"]["attribution_problem"] is None) is trusted
    assert len(report["samples"]) >= 2 and report["samples"][0]["used_bytes"] == [0, 3 * GIB]
    assert report["errors"] == []
    assert nvml.refcount == 0  # the probe gave back every init it took


def fake_probe_report(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    nvml: FakeNvml,
    *args: str,
) -> dict[str, Any]:
    """The probe's JSON document on a fake GPU host."""
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert load_script("nvml_probe").main(["--json", *args]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def test_gpu_check_judges_a_probe_report(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """scripts/gpu_check.py runs once on a lent GPU host: its checks are proven here first."""
    gpus = h200_node(2)
    gpus[1].used_bytes = 3 * GIB
    args = ["--seconds", "0", "--allocate-gib", "0.25"]
    report = fake_probe_report(monkeypatch, capsys, FakeNvml(gpus), *args)
    check = load_script("gpu_check")

    verdicts = {name: (passed, detail) for name, passed, detail in check._judge(report)}
    # No libcuda here: the allocation fails and says why; on a GPU host that is a failure.
    assert {name for name, (passed, _) in verdicts.items() if passed is False} == {"allocation"}
    assert verdicts["allocation"][1].startswith("failed: error libcuda.so.1: ")
    assert verdicts["raw errors"] == (True, "none")
    assert verdicts["v2 memory"] == (True, "v2 adds up; reserved MiB per GPU: 512, 512")
    assert verdicts["agreement"][0] is True and verdicts["source errs"] == (True, "none")

    report["source"]["devices"][1]["memory_used_bytes"] += GIB  # a source that misreads
    report["devices"][0]["memory_v1"]["used"] -= GIB  # a v1 that does not hold the reserve
    wrong = {name: passed for name, passed, _ in check._judge(report)}
    assert wrong["agreement"] is False and wrong["v2 memory"] is False

    attribution = report["attribution"]
    attribution["allocator"].update(allocated_bytes=GIB // 4, error=None)
    for trusted, problem, attributed, verdict in [
        (True, None, GIB // 4, True),
        (True, None, 0, False),  # NVML's PIDs trusted, yet the child's memory not found
        (False, "NVML reports host process IDs ...", 0, True),  # refused, and said why
        (False, None, 0, False),  # refused without a reason
    ]:
        attribution.update(trusted=trusted, problem=problem, allocator_attributed_bytes=attributed)
        found = {name: passed for name, passed, _ in check._judge(report)}
        assert found["attribution"] is verdict, (trusted, problem, attributed)


def test_gpu_check_judges_the_pcie_counter(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """GPU 0 must have moved by what the allocator copied, read by the source, never back."""
    gpus = h200_node(2)
    gpus[0].pcie_rx_bytes = 2 * GIB
    args = ["--seconds", "0.2", "--interval", "0.1"]
    report = fake_probe_report(monkeypatch, capsys, FakeNvml(gpus), *args)
    check = load_script("gpu_check")

    def verdict() -> tuple[bool | None, str]:
        [(passed, detail)] = [(p, d) for name, p, d in check._judge(report) if name == "pcie rx"]
        return passed, detail

    assert verdict()[0] is True  # nothing copied: only the source against the driver
    report["attribution"]["allocator"] = {"allocated_bytes": GIB, "pid": 1, "error": None}
    assert verdict()[0] is False  # copied 1 GiB, the counter did not move
    report["pcie_end"][0]["rx"]["value"] += GIB
    assert verdict() == (
        True,
        "gpu 0: RX +1,024 MiB, TX +unknown for 1,024 MiB copied; value type 3;"
        " peak 0 MiB/s while sampling",
    )
    report["samples"][1]["pcie_rx_bytes"][0] -= 1  # the source's counter went back
    assert verdict()[0] is False
    report["samples"][1]["pcie_rx_bytes"][0] += 1
    report["source"]["devices"][1]["pcie_rx_bytes"] = None  # the source lost GPU 1's counter
    passed, detail = verdict()
    assert passed is False and detail.startswith("gpu 1: driver has counter, source none")

    # No counter on GPU 0 (nor in the source): information, not a failure.
    report["source"]["devices"][1]["pcie_rx_bytes"] = 0
    report["devices"][0]["pcie"]["rx"].update({"return": 3, "error": "Not Supported"})
    report["source"]["devices"][0]["pcie_rx_bytes"] = None
    assert verdict() == (None, "no counter on GPU 0 (Not Supported)")
