"""A stand-in for the `pynvml` module, for tests on machines without a GPU.

It exposes the functions the exporter calls under their real names and re-exports the real
`pynvml` error classes, so code under test catches exactly what it would catch on a GPU host and
error messages read as they do there ("GPU is lost", "Not Supported"). Everything is mutable so a
test can make memory grow, processes come and go, or a GPU fall off the bus between samples.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any

import pynvml
from pynvml import (
    NVMLError,
    NVMLError_DriverNotLoaded,
    NVMLError_GpuIsLost,
    NVMLError_LibraryNotFound,
    NVMLError_LibRmVersionMismatch,
    NVMLError_NoPermission,
    NVMLError_NotSupported,
    NVMLError_Uninitialized,
    NVMLLibraryMismatchError,
)

# What NVML reports as total memory of one H200 (143771 MiB, "141 GB").
H200_TOTAL_BYTES = 143_771 * 1024 * 1024
GIB = 1024**3


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None  # None: the driver cannot say (usedGpuMemory None)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total_bytes: int = H200_TOTAL_BYTES
    used_bytes: int = 0
    processes: list[FakeProcess] = field(default_factory=list)
    lost: bool = False
    lost_at_call: int | None = None  # becomes lost at this (1-based) device call, then stays lost
    calls: int = 0  # device calls (handle, uuid, name, memory, processes) seen so far

    def touch(self) -> None:
        self.calls += 1
        if self.lost_at_call is not None and self.calls >= self.lost_at_call:
            self.lost = True
        if self.lost:
            raise NVMLError_GpuIsLost()


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNvml(ModuleType):
    """A module object: `NvmlSource(FakeNvml(...))` uses it where it would use `pynvml`."""

    NVMLError = NVMLError
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_LibRmVersionMismatch = NVMLError_LibRmVersionMismatch
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLLibraryMismatchError = NVMLLibraryMismatchError

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver_version: str = "570.133.20",
        init_error: type[Exception] | None = None,
        strings_as_bytes: bool = False,
    ) -> None:
        super().__init__("pynvml", "A fake pynvml for tests.")
        self.gpus = gpus
        self.driver_version = driver_version
        self.init_error = init_error  # raised by every nvmlInit while set
        self.strings_as_bytes = strings_as_bytes  # as old bindings return them
        # Function name (e.g. "nvmlDeviceGetMemoryInfo") -> GPU indexes where it raises
        # NotSupported; None in the set means every GPU.
        self.not_supported: dict[str, set[int | None]] = {}
        # Function name -> error raised on every call from now on (e.g. the driver unloaded).
        self.failing: dict[str, type[Exception]] = {}
        self.calls: Counter[str] = Counter()
        self.initialized = False

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error is not None:
            raise self.init_error()
        self.initialized = True

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        self._check_initialized()
        self.initialized = False

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._count("nvmlSystemGetDriverVersion")
        self._check_initialized()
        return self._string(self.driver_version)

    def nvmlDeviceGetCount(self) -> int:
        self._count("nvmlDeviceGetCount")
        self._check_initialized()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._device_call("nvmlDeviceGetHandleByIndex", index)
        return _Handle(index)

    def nvmlDeviceGetUUID(self, handle: _Handle) -> str | bytes:
        gpu = self._device_call("nvmlDeviceGetUUID", handle.index)
        return self._string(gpu.uuid)

    def nvmlDeviceGetName(self, handle: _Handle) -> str | bytes:
        gpu = self._device_call("nvmlDeviceGetName", handle.index)
        return self._string(gpu.name)

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle) -> Any:
        gpu = self._device_call("nvmlDeviceGetMemoryInfo", handle.index)
        free = gpu.total_bytes - gpu.used_bytes
        return SimpleNamespace(total=gpu.total_bytes, free=free, used=gpu.used_bytes)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        gpu = self._device_call("nvmlDeviceGetComputeRunningProcesses", handle.index)
        return [
            SimpleNamespace(
                pid=p.pid,
                usedGpuMemory=p.used_bytes,
                gpuInstanceId=0xFFFFFFFF,
                computeInstanceId=0xFFFFFFFF,
            )
            for p in gpu.processes
        ]

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.failing:
            raise self.failing[name]()

    def _check_initialized(self) -> None:
        if not self.initialized:
            raise NVMLError_Uninitialized()

    def _device_call(self, name: str, index: int) -> FakeGpu:
        self._count(name)
        self._check_initialized()
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        gpu = self.gpus[index]
        gpu.touch()
        where = self.not_supported.get(name, set())
        if index in where or None in where:
            raise NVMLError_NotSupported()
        return gpu

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.strings_as_bytes else value


def h200_node(count: int = 8) -> list[FakeGpu]:
    """An idle 8x H200 box, with the reserved memory NVML reports on an idle GPU."""
    return [
        FakeGpu(uuid=f"GPU-{index:08x}-7c1d-4f0e-9a1b-2b3c4d5e6f70", used_bytes=GIB // 2)
        for index in range(count)
    ]
