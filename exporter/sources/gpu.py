"""GPU memory per device and per compute process, from NVML.

NVML is optional: hosts without a driver (or a CI runner) must still run the exporter, so the
library is imported and initialised lazily, a failed init is retried at most every
`INIT_RETRY_SECONDS` and logged once, and errors of one call on one GPU degrade only that field
or device instead of the whole sample.

Memory is read with `nvmlDeviceGetMemoryInfo_v2` where the driver has it (R510 and later):
its `used` is what processes allocated, the figure nvidia-smi shows, and `reserved` is what the
driver and firmware keep for themselves (hundreds of MiB, fixed per GPU), so total = reserved +
used + free. The v1 call folds `reserved` into `used`, so an idle GPU reads as half a GiB used;
it is the fallback for older drivers (as their nvidia-smi showed it), remembered per GPU.

Bytes each GPU received over PCIe come from the driver's cumulative counter, the field value
`NVML_FI_DEV_PCIE_COUNT_RX_BYTES` ("Value can be wrapped"), kept monotonic here (`_ForwardCounter`).
Not every GPU or driver has it: the field or the whole call is NOT_SUPPORTED, or an old driver
lacks the function; that is decided once per GPU until NVML is initialised again, as the memory
fallback is, and such a GPU costs no further call.

libnvidia-ml counts `nvmlInit` calls and shuts down at the last `nvmlShutdown`; a source gives
back exactly the inits it took, so two runtimes overlapping in a config reload (or a host
application that uses NVML too) keep their own reference.

Per-process figures are only as good as NVML's PIDs: see `nvml_pids` for when they name
processes in this PID namespace, and `GpuSample.attribution_problem` for when they do not.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Literal

from exporter.sources.nvml_pids import NvmlPidCheck
from exporter.sources.sample import Health, Sample

log = logging.getLogger(__name__)

INIT_RETRY_SECONDS = 60.0

# nvml.h's NVML_FI_DEV_PCIE_COUNT_RX_BYTES. The driver decides whether it knows the field; the
# binding only passes the number (nvidia-ml-py 12.535, the oldest we take, has no name for it).
PCIE_RX_BYTES_FIELD = 198
# The member of a field value's union that holds each value type, by nvmlValueType_t (nvml.h:
# double, unsigned int, unsigned long, unsigned long long, signed long long, signed int,
# unsigned short). Older bindings lack the last member: such a value is unusable with them.
VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")

CLOSE_TIMEOUT_SECONDS = 5.0

# Errors after which nothing on any GPU can work until NVML is initialised again.
_FATAL_ERRORS = (
    "NVMLError_Uninitialized",
    "NVMLError_DriverNotLoaded",
    "NVMLError_LibraryNotFound",
    "NVMLError_LibRmVersionMismatch",
)


@dataclass(frozen=True)
class GpuDevice:
    index: int
    uuid: str  # "" when NVML never told us (the GPU was lost before its first read)
    name: str
    memory_used_bytes: int | None  # None when this call failed for this GPU
    memory_total_bytes: int | None
    # Held back by the driver and firmware (v2 only); None from the v1 call, whose used holds it.
    memory_reserved_bytes: int | None = None
    # Bytes received over PCIe, monotonic (see `_ForwardCounter`); None where the GPU or driver
    # has no such counter, or this sample could not read it.
    pcie_rx_bytes: int | None = None


@dataclass(frozen=True)
class GpuProcess:
    pid: int  # as NVML sees it: the host's PID namespace
    gpu_index: int
    gpu_uuid: str
    used_bytes: int | None  # None when the driver cannot say


@dataclass(frozen=True)
class GpuSample(Sample):
    driver_version: str
    devices: tuple[GpuDevice, ...]
    processes: tuple[GpuProcess, ...]  # compute processes on every GPU, PIDs as NVML gave them
    errors: tuple[str, ...]  # per-call errors of this sample, e.g. "gpu 3: GetMemoryInfo: ..."
    # Why the processes' PIDs cannot be matched to servers here (another PID namespace, or not
    # checkable); None when they can. `process_gpu_memory` attributes nothing while it is set.
    attribution_problem: str | None = None

    def health(self) -> Health:
        return Health(self.up, self.reason, self.note)

    @property
    def note(self) -> str | None:
        """What a status reader should know although the sample succeeded."""
        if self.attribution_problem is None:
            return None
        return f"per-process GPU memory not attributed: {self.attribution_problem}"

    @property
    def up(self) -> bool:
        """False when NVML answered init but no GPU's memory could be read: no reading at all."""
        return not self.devices or any(
            d.memory_used_bytes is not None or d.memory_total_bytes is not None
            for d in self.devices
        )

    @property
    def reason(self) -> str | None:
        if self.up:
            return None
        return f"no GPU could be read: {self.errors[0] if self.errors else 'no memory info'}"


class _ForwardCounter:
    """A byte counter kept from the driver's, which may wrap or be reset: only forward steps count.

    It starts at the driver's first reading. A step back, whether the driver's value wrapped at
    its width or restarted from 0 (a GPU reset, a driver reload), adds nothing, so the counter
    never goes back and never jumps; the bytes of that one interval are lost, an undercount of
    at most one interval's traffic. A driver value that wraps more than once between two samples
    (a 32-bit one at over 4 GiB per sample interval) cannot be followed: it undercounts.
    """

    def __init__(self, raw: int) -> None:
        self.total = raw
        self._last = raw

    def advance(self, raw: int) -> int:
        if raw > self._last:
            self.total += raw - self._last
        self._last = raw
        return self.total


class NvmlUnavailable(RuntimeError):
    """No NVML library, no driver or no GPU: the whole source is down, with a one-line reason."""


class _GpuLost(Exception):
    """Stops reading one GPU for the rest of a sample."""


class NvmlSource:
    """Samples every GPU through an NVML module (the real `pynvml` unless one is injected).

    One sampler thread calls `sample`; `close` may come from another (exporter shutdown), so the
    two are serialised: a shutdown in the middle of a sample would give back the same NVML
    reference twice, taking another holder's.
    """

    def __init__(
        self,
        nvml: ModuleType | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        retry_interval: float = INIT_RETRY_SECONDS,
        pid_check: NvmlPidCheck | None = None,
    ) -> None:
        self._nvml: Any = nvml
        self._clock = clock
        self._retry_interval = retry_interval
        self._pids = pid_check if pid_check is not None else NvmlPidCheck()
        self._lock = threading.Lock()
        self._closed = False
        self._initialized = False
        self._count = 0
        self._driver_version: str | None = None
        self._failed_at: float | None = None
        self._failure = ""
        self._logged_failure: str | None = None
        self._handles: dict[int, Any] = {}
        self._identity: dict[int, tuple[str, str]] = {}
        self._memory_v1: set[int] = set()  # GPUs whose driver has no v2 memory info
        self._no_pcie: set[int] = set()  # GPUs without a PCIe RX counter
        # By (index, UUID), the series it is: kept across re-inits, so a series never goes back.
        self._pcie: dict[tuple[int, str], _ForwardCounter] = {}
        self._fatal: tuple[type[BaseException], ...] = ()
        self._per_call: tuple[type[BaseException], ...] = ()

    def sample(self) -> GpuSample:
        """One reading of every GPU; raises `NvmlUnavailable` while NVML cannot be used."""
        with self._lock:
            if self._closed:
                raise NvmlUnavailable("NVML source closed")
            return self._sample()

    def close(self) -> None:
        """Gives NVML back for good (exporter shutdown or the old runtime of a reload).

        Waits for a sample in flight; one stuck in the driver keeps its reference rather than
        stall the shutdown.
        """
        if not self._lock.acquire(timeout=CLOSE_TIMEOUT_SECONDS):
            log.warning("NVML busy for %gs at close: not shut down", CLOSE_TIMEOUT_SECONDS)
            return
        try:
            self._closed = True
            if self._initialized:
                self._initialized = False
                self._shutdown()
        finally:
            self._lock.release()

    def _sample(self) -> GpuSample:
        self._ensure_initialized()
        errors: list[str] = []
        devices: list[GpuDevice] = []
        processes: list[GpuProcess] = []
        try:
            driver_version = self._read_driver_version(errors)
            for index in range(self._count):
                device, procs = self._read_device(index, errors)
                devices.append(device)
                processes.extend(procs)
        except self._fatal as err:
            if isinstance(err, self._nvml.NVMLError_Uninitialized):
                # NVML's count already reached zero (a holder gave back one too many): our
                # reference is gone, and giving it back again could take someone else's.
                self._initialized = False
            self._fail(f"NVML stopped working: {_text(err)}")
            raise NvmlUnavailable(self._failure) from err
        problem = self._pids.problem({p.pid for p in processes})
        return GpuSample(driver_version, tuple(devices), tuple(processes), tuple(errors), problem)

    def _ensure_initialized(self) -> None:
        if self._initialized:
            return
        if self._failed_at is not None and self._clock() - self._failed_at < self._retry_interval:
            raise NvmlUnavailable(self._failure)
        try:
            self._init(self._module())
        except NvmlUnavailable as err:
            self._fail(str(err))
            raise
        self._initialized = True
        self._failed_at = None
        if self._logged_failure is not None:
            log.info("NVML available again: %d GPU(s)", self._count)
            self._logged_failure = None

    def _module(self) -> Any:
        if self._nvml is None:
            try:
                self._nvml = importlib.import_module("pynvml")
            except ImportError as err:
                raise NvmlUnavailable(f"pynvml not installed ({err})") from err
        nvml = self._nvml
        self._fatal = tuple(getattr(nvml, name) for name in _FATAL_ERRORS if hasattr(nvml, name))
        # Newer bindings raise NVMLLibraryMismatchError, not an NVMLError, when the driver lacks
        # the function version they call: one missing function must not take the GPU down.
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
        self._per_call = (nvml.NVMLError,) + ((mismatch,) if mismatch is not None else ())
        return nvml

    def _init(self, nvml: Any) -> None:
        try:
            nvml.nvmlInit()
        except nvml.NVMLError_LibraryNotFound as err:
            raise NvmlUnavailable(
                "NVML library libnvidia-ml.so.1 not found"
                " (no NVIDIA driver, or not mounted into this container)"
            ) from err
        except nvml.NVMLError_DriverNotLoaded as err:
            raise NvmlUnavailable("NVIDIA driver not loaded") from err
        except nvml.NVMLError as err:
            raise NvmlUnavailable(f"nvmlInit failed: {_text(err)}") from err
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            self._shutdown()
            raise NvmlUnavailable(f"nvmlDeviceGetCount failed: {_text(err)}") from err
        if count == 0:
            self._shutdown()
            raise NvmlUnavailable("NVML sees no GPU")
        self._count = count
        self._handles.clear()
        self._identity.clear()
        self._memory_v1.clear()  # the driver may have been upgraded while NVML was down
        self._no_pcie.clear()
        self._driver_version = None

    def _fail(self, reason: str) -> None:
        """Remembers why NVML is down; warns once per distinct reason, not once per sample."""
        if self._initialized:
            self._initialized = False
            self._shutdown()
        self._failed_at = self._clock()
        self._failure = reason
        if reason != self._logged_failure:
            log.warning(
                "GPU metrics unavailable: %s (retrying every %gs)", reason, self._retry_interval
            )
            self._logged_failure = reason

    def _shutdown(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            log.debug("nvmlShutdown: %s", _text(err))

    def _read_driver_version(self, errors: list[str]) -> str:
        if self._driver_version is None:
            try:
                self._driver_version = _text(self._nvml.nvmlSystemGetDriverVersion())
            except self._fatal:
                raise
            except self._per_call as err:
                errors.append(f"SystemGetDriverVersion: {_text(err)}")
                return ""
        return self._driver_version

    def _read_device(self, index: int, errors: list[str]) -> tuple[GpuDevice, list[GpuProcess]]:
        """Reads one GPU; a lost GPU comes back with what was known of it and no memory."""
        nvml = self._nvml
        uuid, name = self._identity.get(index, ("", ""))
        try:
            handle = self._call(index, errors, "GetHandleByIndex", lambda: self._handle(index))
            if handle is None:
                return GpuDevice(index, uuid, name, None, None), []
            uuid, name = self._read_identity(index, handle, errors)
            memory = self._read_memory(index, handle, errors)
            pcie_rx = self._read_pcie_rx(index, uuid, handle, errors)
            listed = self._call(
                index,
                errors,
                "GetComputeRunningProcesses",
                lambda: nvml.nvmlDeviceGetComputeRunningProcesses(handle),
            )
        except _GpuLost:
            return GpuDevice(index, uuid, name, None, None), []
        used = None if memory is None else int(memory.used)
        total = None if memory is None else int(memory.total)
        reserved = None if memory is None else _optional_int(getattr(memory, "reserved", None))
        processes = [
            GpuProcess(int(p.pid), index, uuid, _optional_int(p.usedGpuMemory))
            for p in listed or ()
        ]
        return GpuDevice(index, uuid, name, used, total, reserved, pcie_rx), processes

    def _read_memory(self, index: int, handle: Any, errors: list[str]) -> Any:
        """v2 memory info, or v1 where the driver lacks v2 (then for good, until re-init)."""
        nvml = self._nvml
        version = getattr(nvml, "nvmlMemory_v2", None)
        if version is not None and index not in self._memory_v1:
            try:
                return self._guarded(
                    index,
                    errors,
                    "GetMemoryInfo",
                    lambda: nvml.nvmlDeviceGetMemoryInfo(handle, version=version),
                )
            except self._fatal:
                raise
            except self._per_call as err:
                # FunctionNotFound before R510; NotSupported or Unknown on some virtual GPUs.
                log.info("gpu %d: no v2 memory info (%s): used includes reserved", index, err)
                self._memory_v1.add(index)
        return self._call(
            index, errors, "GetMemoryInfo", lambda: nvml.nvmlDeviceGetMemoryInfo(handle)
        )

    def _read_pcie_rx(self, index: int, uuid: str, handle: Any, errors: list[str]) -> int | None:
        """The GPU's PCIe RX counter, monotonic; None where it has none (then for good, until
        re-init) or this read failed."""
        if index in self._no_pcie:
            return None
        raw = self._call(index, errors, "GetFieldValues", lambda: self._pcie_rx_raw(index, handle))
        if raw is None:
            return None
        counter = self._pcie.get((index, uuid))
        if counter is None:
            counter = self._pcie[(index, uuid)] = _ForwardCounter(raw)
        return counter.advance(raw)

    def _pcie_rx_raw(self, index: int, handle: Any) -> int | None:
        """The driver's RX counter, from the union member its value type names.

        A field's own error is raised as the calls raise theirs, so a lost GPU or a dead driver
        reads the same whichever way NVML reports it; only an absence is settled here.
        """
        nvml = self._nvml
        try:
            [field] = nvml.nvmlDeviceGetFieldValues(handle, [PCIE_RX_BYTES_FIELD])
            if field.nvmlReturn != nvml.NVML_SUCCESS:
                raise nvml.NVMLError(field.nvmlReturn)
        except (nvml.NVMLError_NotSupported, nvml.NVMLError_FunctionNotFound) as err:
            # NotSupported: this GPU or driver has no such field; FunctionNotFound: a driver
            # older than field values.
            log.info("gpu %d: no PCIe byte counter (%s)", index, _text(err))
            self._no_pcie.add(index)
            return None
        value = field_value(field)
        if value is None or not math.isfinite(value) or value < 0:
            log.warning("gpu %d: PCIe RX counter unusable (value type %s, value %s): not read",
                        index, field.valueType, value)  # fmt: skip
            self._no_pcie.add(index)
            return None
        return int(value)

    def _handle(self, index: int) -> Any:
        if index not in self._handles:
            self._handles[index] = self._nvml.nvmlDeviceGetHandleByIndex(index)
        return self._handles[index]

    def _read_identity(self, index: int, handle: Any, errors: list[str]) -> tuple[str, str]:
        """UUID and name never change while NVML is up, so they are read once per GPU."""
        if index not in self._identity:
            nvml = self._nvml
            uuid = self._call(index, errors, "GetUUID", lambda: nvml.nvmlDeviceGetUUID(handle))
            name = self._call(index, errors, "GetName", lambda: nvml.nvmlDeviceGetName(handle))
            if uuid is None or name is None:
                return _text(uuid or ""), _text(name or "")
            self._identity[index] = (_text(uuid), _text(name))
        return self._identity[index]

    def _call(self, index: int, errors: list[str], what: str, call: Callable[[], Any]) -> Any:
        """One NVML call on one GPU: None on a per-call error, `_GpuLost` when the GPU is gone."""
        try:
            return self._guarded(index, errors, what, call)
        except self._fatal:
            raise
        except self._per_call as err:
            errors.append(f"gpu {index}: {what}: {_text(err)}")
            return None

    def _guarded(self, index: int, errors: list[str], what: str, call: Callable[[], Any]) -> Any:
        """Runs a call: a lost GPU becomes `_GpuLost`; every other error is the caller's."""
        try:
            return call()
        except self._fatal:
            raise
        except self._nvml.NVMLError_GpuIsLost as err:
            # Forget only this GPU's handle, so a GPU that comes back after a reset is read again.
            self._handles.pop(index, None)
            errors.append(f"gpu {index}: {what}: {_text(err)}")
            raise _GpuLost from err


def field_value(field: Any) -> float | None:
    """A `c_nvmlFieldValue_t`'s number, from the union member its valueType names; None for a
    type this binding's union has no member for."""
    if not 0 <= field.valueType < len(VALUE_MEMBERS):
        return None
    value: float | None = getattr(field.value, VALUE_MEMBERS[field.valueType], None)
    return value


def process_gpu_memory(
    sample: GpuSample,
    pids: Collection[int],
    gpus: Literal["auto"] | tuple[int, ...] = "auto",
) -> dict[int, int]:
    """Bytes that the given process tree holds on each GPU index it uses.

    A GPU where any of the tree's processes has unknown usage is left out: a partial sum would
    read as a truthful number. Nothing at all while the sample's PIDs cannot be trusted to be
    this namespace's: another process's memory would read as the server's.
    """
    if sample.attribution_problem is not None:
        return {}
    wanted = set(pids)
    totals: dict[int, int] = {}
    unknown: set[int] = set()
    for proc in sample.processes:
        if proc.pid not in wanted or (gpus != "auto" and proc.gpu_index not in gpus):
            continue
        if proc.used_bytes is None:
            unknown.add(proc.gpu_index)
        else:
            totals[proc.gpu_index] = totals.get(proc.gpu_index, 0) + proc.used_bytes
    return {index: used for index, used in sorted(totals.items()) if index not in unknown}


@dataclass(frozen=True)
class PcieMark:
    """A GPU's PCIe RX counter when a load began (or when first read during it): its baseline."""

    rx_bytes: int
    read_at: float  # unix time of the NVML sample it comes from


# By (GPU index, UUID): the counter series a mark belongs to.
PcieMarks = Mapping[tuple[int, str], PcieMark]


def mark_pcie(
    marks: PcieMarks, sample: GpuSample | None, read_at: float, started_at: float | None
) -> PcieMarks:
    """`marks` with a mark for each GPU the sample has a counter for and `marks` has none.

    Only a sample taken at or after the load's start marks: an older one may be a quiet
    interval (30 s) old and hold traffic from before the load. So each GPU counts from its first
    sample in the load, within an interval of its start (the start-up before any weights move),
    or later when NVML's first sample came late (an exporter started mid-load) or the GPU was
    lost: its mark's `read_at` says from when.
    """
    if sample is None or started_at is None or read_at < started_at:
        return marks
    new = {
        (d.index, d.uuid): PcieMark(d.pcie_rx_bytes, read_at)
        for d in sample.devices
        if d.pcie_rx_bytes is not None and (d.index, d.uuid) not in marks
    }
    return {**marks, **new} if new else marks


def pcie_rx_since(mark: PcieMark | None, device: GpuDevice, read_at: float) -> int | None:
    """Bytes the GPU received since its mark, by a sample read at `read_at`; None without a
    mark or a counter, or from a sample older than the mark (nothing measured since)."""
    if mark is None or device.pcie_rx_bytes is None or read_at < mark.read_at:
        return None
    return device.pcie_rx_bytes - mark.rx_bytes


def _text(value: object) -> str:
    """NVML strings come back as bytes from older bindings."""
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return str(value)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)
