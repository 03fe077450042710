"""A stand-in for the `pynvml` module (nvidia-ml-py), for tests on machines without a GPU.

It behaves like the real binding where the exporter depends on it, and is built from the real
module's own parts so it cannot quietly drift (tests/test_nvml_contract.py compares the two):
- the error classes are the real ones, so code under test catches what it would catch on a GPU
  host and messages read as they do there ("GPU is lost", "Not Supported");
- memory info comes back as the real ctypes structs: `c_nvmlMemory_t` (total, free, used; used
  includes the memory the driver reserves) or, with `version=nvmlMemory_v2`, `c_nvmlMemory_v2_t`
  (version, total, reserved, free, used; used is what nvidia-smi shows, reserved apart);
- processes come back as the real binding builds them (`nvmlStructToFriendlyObject` over
  `c_nvmlProcessInfo_t`, usedGpuMemory None where the driver says "not available");
- field values come back as the real binding returns them: a ctypes array of
  `c_nvmlFieldValue_t` (fieldId, scopeId, timestamp, latencyUsec, valueType, nvmlReturn, value),
  the value in the `c_nvmlValue_t` member its valueType names; the one field modelled is the
  PCIe RX byte counter, a per-GPU count a test advances, reported modulo the width of the GPU's
  value type (a 32-bit one wraps at 4 GiB), or NOT_SUPPORTED in `nvmlReturn` on a GPU without
  it (as every other field is);
- `nvmlInit`/`nvmlShutdown` keep a reference count like libnvidia-ml: NVML stays up until every
  init has had its shutdown, and a shutdown without an init raises `NVMLError_Uninitialized`;
- a driver older than the binding is modelled by the C functions it lacks: a missing
  `nvmlDeviceGetMemoryInfo_v2` raises `NVMLError_FunctionNotFound` from the v2 call, a missing
  `nvmlDeviceGetComputeRunningProcesses_v3` makes the unversioned listing raise
  `NVMLLibraryMismatchError` through the real `throwOnVersionMismatch` wrapper, and a missing
  `nvmlDeviceGetFieldValues` raises `NVMLError_FunctionNotFound`.
Everything is mutable, so a test can make memory grow, processes come and go, or a GPU fall off
the bus between samples.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pynvml
from pynvml import (
    NVMLError,
    NVMLError_ArgumentVersionMismatch,
    NVMLError_DriverNotLoaded,
    NVMLError_FunctionNotFound,
    NVMLError_GpuIsLost,
    NVMLError_InvalidArgument,
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
MIB = 1024**2
# Memory the driver and firmware keep for themselves on an idle GPU (v2 `reserved`; inside v1
# `used`). The real figure varies by GPU and driver; a round one keeps test arithmetic readable.
RESERVED_BYTES = 512 * MIB
NOT_AVAILABLE = pynvml.NVML_VALUE_NOT_AVAILABLE_ulonglong.value
NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId / computeInstanceId without MIG

# C functions a driver older than the binding lacks, and what the binding raises for each.
MEMORY_V2 = "nvmlDeviceGetMemoryInfo_v2"
PROCESSES_V3 = "nvmlDeviceGetComputeRunningProcesses_v3"
FIELD_VALUES = "nvmlDeviceGetFieldValues"

PCIE_RX_FIELD = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
# nvmlValueType_t -> (the c_nvmlValue_t member that holds it, the width a counter wraps at)
VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: ("uiVal", 2**32),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: ("ulVal", 2**64),
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: ("ullVal", 2**64),
}


@dataclass
class FakeProcess:
    pid: int
    used_bytes: int | None  # None: the driver cannot say (usedGpuMemory None)


@dataclass
class FakeGpu:
    uuid: str
    name: str = "NVIDIA H200"
    total_bytes: int = H200_TOTAL_BYTES
    used_bytes: int = 0  # allocated by processes: v2 `used`, what nvidia-smi shows
    reserved_bytes: int = RESERVED_BYTES
    processes: list[FakeProcess] = field(default_factory=list)
    # Bytes received over PCIe since the driver started counting; None: no such field here.
    pcie_rx_bytes: int | None = 0
    pcie_value_type: int = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    lost: bool = False
    lost_at_call: int | None = None  # becomes lost at this (1-based) device call, then stays lost
    calls: int = 0  # device calls (handle, uuid, name, memory, fields, processes) seen so far

    def touch(self) -> None:
        self.calls += 1
        if self.lost_at_call is not None and self.calls >= self.lost_at_call:
            self.lost = True
        if self.lost:
            raise NVMLError_GpuIsLost()

    @property
    def free_bytes(self) -> int:
        return self.total_bytes - self.reserved_bytes - self.used_bytes


@dataclass(frozen=True)
class _Handle:
    index: int


class FakeNvml(ModuleType):
    """A module object: `NvmlSource(FakeNvml(...))` uses it where it would use `pynvml`."""

    NVMLError = NVMLError
    NVMLError_ArgumentVersionMismatch = NVMLError_ArgumentVersionMismatch
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_LibRmVersionMismatch = NVMLError_LibRmVersionMismatch
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = pynvml.nvmlMemory_v2
    NVML_SUCCESS = pynvml.NVML_SUCCESS
    NVML_FI_DEV_PCIE_COUNT_RX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    NVML_FI_DEV_PCIE_COUNT_TX_BYTES = pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES

    def __init__(
        self,
        gpus: list[FakeGpu],
        *,
        driver_version: str = "570.133.20",
        init_error: type[Exception] | None = None,
        strings_as_bytes: bool = False,
        missing_functions: set[str] | None = None,
    ) -> None:
        super().__init__("pynvml", "A fake pynvml for tests.")
        self.gpus = gpus
        self.driver_version = driver_version
        self.init_error = init_error  # raised by every nvmlInit while set
        self.strings_as_bytes = strings_as_bytes  # as old bindings return them
        # C functions this "driver" lacks (MEMORY_V2, PROCESSES_V3, FIELD_VALUES): an older one.
        self.missing_functions: set[str] = set(missing_functions or ())
        # Function name (e.g. "nvmlDeviceGetMemoryInfo") -> GPU indexes where it raises
        # NotSupported; None in the set means every GPU.
        self.not_supported: dict[str, set[int | None]] = {}
        # Function name -> error raised on every call from now on (e.g. the driver unloaded).
        self.failing: dict[str, type[Exception]] = {}
        self.calls: Counter[str] = Counter()
        self.refcount = 0  # libnvidia-ml's count of inits not yet shut down

    @property
    def initialized(self) -> bool:
        return self.refcount > 0

    def nvmlInit(self) -> None:
        self._count("nvmlInit")
        if self.init_error is not None:
            raise self.init_error()
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._count("nvmlShutdown")
        self._check_initialized()
        self.refcount -= 1

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

    def nvmlDeviceGetMemoryInfo(self, handle: _Handle, version: int | None = None) -> Any:
        """v1 without a version (as the binding decides: `if not version`), v2 with one."""
        if not version:
            gpu = self._device_call("nvmlDeviceGetMemoryInfo", handle.index)
            used = gpu.used_bytes + gpu.reserved_bytes
            return pynvml.c_nvmlMemory_t(total=gpu.total_bytes, free=gpu.free_bytes, used=used)
        self._symbol(MEMORY_V2)
        gpu = self._device_call("nvmlDeviceGetMemoryInfo", handle.index)
        if version != pynvml.nvmlMemory_v2:
            raise NVMLError_ArgumentVersionMismatch()
        return pynvml.c_nvmlMemory_v2_t(
            version=version,
            total=gpu.total_bytes,
            reserved=gpu.reserved_bytes,
            free=gpu.free_bytes,
            used=gpu.used_bytes,
        )

    @pynvml.throwOnVersionMismatch
    def nvmlDeviceGetComputeRunningProcesses(self, handle: _Handle) -> list[Any]:
        """The binding's unversioned listing calls the v3 C function; an old driver lacks it."""
        self._symbol(PROCESSES_V3)
        gpu = self._device_call("nvmlDeviceGetComputeRunningProcesses", handle.index)
        listed = []
        for p in gpu.processes:
            struct = pynvml.c_nvmlProcessInfo_t(
                pid=p.pid,
                usedGpuMemory=NOT_AVAILABLE if p.used_bytes is None else p.used_bytes,
                gpuInstanceId=NO_INSTANCE,
                computeInstanceId=NO_INSTANCE,
            )
            obj = pynvml.nvmlStructToFriendlyObject(struct)
            if obj.usedGpuMemory == NOT_AVAILABLE:  # what the binding does with the sentinel
                obj.usedGpuMemory = None
            listed.append(obj)
        return listed

    def nvmlDeviceGetFieldValues(self, handle: _Handle, fieldIds: list[Any]) -> Any:
        """As the binding does it: the ids (or (id, scope) pairs) go in, each field's own
        nvmlReturn comes back beside the others'; only a failure of the call itself raises."""
        self._count(FIELD_VALUES)
        self._resolve(FIELD_VALUES)
        gpu = self._device(handle.index, FIELD_VALUES)
        values = (pynvml.c_nvmlFieldValue_t * len(fieldIds))()
        for value, field_id in zip(values, fieldIds, strict=True):
            pair = field_id if isinstance(field_id, tuple) else (field_id, 0)
            value.fieldId, value.scopeId = pair
            value.timestamp = int(time.time() * 1e6)
            if value.fieldId != PCIE_RX_FIELD or gpu.pcie_rx_bytes is None:
                value.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
                continue
            value.valueType = gpu.pcie_value_type
            value.nvmlReturn = pynvml.NVML_SUCCESS
            if gpu.pcie_value_type in VALUE_MEMBERS:  # else a type this binding has no member for
                member, width = VALUE_MEMBERS[gpu.pcie_value_type]
                setattr(value.value, member, gpu.pcie_rx_bytes % width)
        return values

    def _symbol(self, name: str) -> None:
        self.calls[name] += 1
        self._resolve(name)

    def _resolve(self, name: str) -> None:
        """What `_nvmlGetFunctionPointer` raises for a C function the driver does not export."""
        if name in self.missing_functions:
            raise NVMLError_FunctionNotFound()

    def _count(self, name: str) -> None:
        self.calls[name] += 1
        if name in self.failing:
            raise self.failing[name]()

    def _check_initialized(self) -> None:
        if not self.initialized:
            raise NVMLError_Uninitialized()

    def _device_call(self, name: str, index: int) -> FakeGpu:
        self._count(name)
        return self._device(index, name)

    def _device(self, index: int, name: str) -> FakeGpu:
        """The GPU a call on `index` reaches, or the error the driver gives instead."""
        self._check_initialized()
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        gpu = self.gpus[index]
        gpu.touch()
        where = self.not_supported.get(name, set())
        if index in where or None in where:
            raise NVMLError_NotSupported()
        return gpu

    def _string(self, value: str) -> str | bytes:
        return value.encode() if self.strings_as_bytes else value


def h200_node(count: int = 8) -> list[FakeGpu]:
    """An idle 8x H200 box: nothing allocated, the driver's reserve held back on each GPU."""
    return [FakeGpu(uuid=f"GPU-{index:08x}-7c1d-4f0e-9a1b-2b3c4d5e6f70") for index in range(count)]
