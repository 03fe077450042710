#!/usr/bin/env python3
"""Check what NVML reports on a real GPU host, and what the exporter's GPU source makes of it.

Reads the driver, each GPU's memory (v2 and v1), PCIe byte counters (field values RX and TX)
and compute processes straight from `pynvml`, then one `NvmlSource.sample()`, nvidia-smi's own
figures when it is installed, and samples for a while, printing each GPU's PCIe RX counter and
its rate. With `--allocate-gib N` a child process allocates N GiB on GPU 0 through the CUDA
driver (libcuda, no framework needed) and keeps copying host memory into it while the probe
samples, so the RX counter must move by at least N GiB; the probe reports whether NVML lists the
allocation and whether the source attributes it: it cannot when NVML's PIDs are not this PID
namespace's (a container without the host's PID namespace and an older driver), and then the
source says so. The raw counters are read again at the end (`pcie_end`).

    python scripts/nvml_probe.py [--seconds 10] [--interval 1] [--allocate-gib 1] [--json]

`--json` prints one document whose keys are always present (schema 1; see `_empty_report`), for
scripts/gpu_check.py and other checks to assert on. Exits 0 with "no NVML: <reason>" (or
`"nvml": false`) on a host without a GPU or driver; 1 only when the probe itself breaks.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import logging
import os
import select
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from exporter.sources.gpu import (
    PCIE_RX_BYTES_FIELD,
    GpuSample,
    NvmlSource,
    NvmlUnavailable,
    field_value,
    process_gpu_memory,
)
from exporter.sources.nvml_pids import in_initial_pid_namespace

SCHEMA = 1
MIB = 1024 * 1024
GIB = 1024 * MIB
CHUNK_BYTES = 256 * MIB
ALLOCATED_TIMEOUT_SECONDS = 60.0
PCIE_TX_BYTES_FIELD = 197  # nvml.h NVML_FI_DEV_PCIE_COUNT_TX_BYTES
PCIE_FIELDS = {"rx": PCIE_RX_BYTES_FIELD, "tx": PCIE_TX_BYTES_FIELD}

# Runs in the child: allocate through the CUDA driver API, copy host memory into every chunk
# (over PCIe), say so, go on copying for `seconds` so the counters move while the probe
# samples, then hold until killed.
ALLOCATOR = """
import ctypes, sys, time
total, chunk, seconds = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
try:
    cuda = ctypes.CDLL("libcuda.so.1")
except OSError as err:
    print(f"error libcuda.so.1: {err}", flush=True)
    sys.exit(1)
cuda.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
cuda.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
def check(result, what):
    if result != 0:
        name = ctypes.c_char_p()
        cuda.cuGetErrorName(result, ctypes.byref(name))
        print(f"error {what}: {(name.value or b'?').decode()} ({result})", flush=True)
        sys.exit(1)
check(cuda.cuInit(0), "cuInit")
device = ctypes.c_int()
check(cuda.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
context = ctypes.c_void_p()
check(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
check(cuda.cuCtxSetCurrent(context), "cuCtxSetCurrent")
held = []
while len(held) * chunk < total:
    pointer = ctypes.c_uint64()
    check(cuda.cuMemAlloc_v2(ctypes.byref(pointer), chunk), "cuMemAlloc")
    held.append(pointer)
host = ctypes.create_string_buffer(chunk)
def copy():
    for pointer in held:
        check(cuda.cuMemcpyHtoD_v2(pointer.value, host, chunk), "cuMemcpyHtoD")
copy()
print(f"allocated {len(held) * chunk}", flush=True)
until = time.monotonic() + seconds
while time.monotonic() < until:
    copy()
time.sleep(86400)
"""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # The probe prints the source's reasons itself; its once-only warnings would repeat them.
    logging.getLogger("exporter.sources.gpu").setLevel(logging.ERROR)
    report = _empty_report()
    try:
        import pynvml
    except ImportError as err:
        return _no_nvml(report, f"pynvml not installed ({err})", args.json)
    report["binding"] = _binding_version()
    source = NvmlSource(pynvml)
    try:
        first = source.sample()
    except NvmlUnavailable as err:
        return _no_nvml(report, str(err), args.json)
    report["nvml"] = True
    report.update(_raw(pynvml, report["errors"]))
    report["nvidia_smi"] = _nvidia_smi(report["errors"])
    report["source"] = _sample_json(first)
    if not args.json:
        _print_raw(report)
    child, allocator = _start_allocator(args.allocate_gib, args.seconds)
    report["attribution"]["allocator"] = allocator
    try:
        last, report["samples"] = _watch(source, args.seconds, args.interval, child, args.json)
        last = last or first
        report["source"] = _sample_json(last)
        report["attribution"].update(_attribution(last, child))
        report["pcie_end"] = _raw_pcie_end(pynvml, report["errors"])
    finally:
        if child is not None:
            child.kill()
            child.wait()
        source.close()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    else:
        _print_attribution(report["attribution"])
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument(
        "--allocate-gib",
        type=float,
        default=0.0,
        help="allocate this much on GPU 0 in a child process while sampling (needs libcuda)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return parser.parse_args(argv)


def _empty_report() -> dict[str, Any]:
    """Every key of the JSON document, so a check never meets a missing one."""
    return {
        "schema": SCHEMA,
        "nvml": False,
        "reason": None,  # why NVML cannot be used, when "nvml" is false
        "binding": None,  # nvidia-ml-py version
        "driver_version": None,
        "pid_namespace": {
            "inode": _pid_namespace_inode(),
            "host": in_initial_pid_namespace(),
        },
        # Straight from pynvml: index, uuid, name, memory (v2 where the driver has it, else v1,
        # with "version"), memory_v1, pcie ({rx, tx}: see `_pcie_fields`), processes (pid,
        # used_bytes, here, cmdline), errors.
        "devices": [],
        "nvidia_smi": None,  # [{index, memory_used_mib, memory_total_mib, memory_reserved_mib}]
        "source": None,  # NvmlSource's last sample: devices, processes, errors, attribution
        "attribution": {
            "trusted": None,  # whether the source attributes per-process memory by these PIDs
            "problem": None,
            "allocator": None,  # {pid, requested_bytes, allocated_bytes, error}
            "allocator_listed_bytes": None,  # what NVML lists under the allocator's PID
            "allocator_attributed_bytes": None,  # what process_gpu_memory gives that PID
        },
        # {t, unavailable, used_bytes: [per GPU], pcie_rx_bytes: [per GPU, the source's counter],
        # pcie_rx_bytes_per_second: [per GPU, since the previous sample], attributed_bytes
        # (allocator), problem, errors}
        "samples": [],
        "pcie_end": [],  # per GPU, the raw {rx, tx} fields once more after the samples
        "errors": [],  # what failed in the probe's own NVML and nvidia-smi calls
    }


def _no_nvml(report: dict[str, Any], reason: str, as_json: bool) -> int:
    report["reason"] = reason
    if as_json:
        print(json.dumps(report))
    else:
        print(f"no NVML: {reason}")
    return 0


def _binding_version() -> str | None:
    try:
        return importlib.metadata.version("nvidia-ml-py")
    except importlib.metadata.PackageNotFoundError:
        return None


def _pid_namespace_inode() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _raw(nvml: Any, errors: list[str]) -> dict[str, Any]:
    """What the driver says directly, without the exporter's source in between."""
    nvml.nvmlInit()
    try:
        devices = [_raw_device(nvml, index) for index in range(nvml.nvmlDeviceGetCount())]
        driver = _text(nvml.nvmlSystemGetDriverVersion())
    finally:
        nvml.nvmlShutdown()
    errors.extend(f"gpu {d['index']}: {e}" for d in devices for e in d["errors"])
    return {"driver_version": driver, "devices": devices}


def _raw_pcie_end(nvml: Any, errors: list[str]) -> list[dict[str, Any]]:
    """The raw counters once more, to set against the start's (`devices[i]["pcie"]`)."""
    nvml.nvmlInit()
    try:
        ends = []
        for index in range(nvml.nvmlDeviceGetCount()):
            try:
                ends.append(_pcie_fields(nvml, nvml.nvmlDeviceGetHandleByIndex(index)))
            except _failures(nvml) as err:
                errors.append(f"gpu {index}: pcie at the end: {_text(err)}")
                ends.append({})
        return ends
    finally:
        nvml.nvmlShutdown()


def _failures(nvml: Any) -> tuple[type[Exception], ...]:
    return (nvml.NVMLError, nvml.NVMLLibraryMismatchError)


def _pcie_fields(nvml: Any, handle: Any) -> dict[str, Any]:
    """RX and TX as the driver reports them: {return, error, value_type, value} each."""
    values = nvml.nvmlDeviceGetFieldValues(handle, list(PCIE_FIELDS.values()))
    fields = {}
    for key, field in zip(PCIE_FIELDS, values, strict=True):
        ok = field.nvmlReturn == nvml.NVML_SUCCESS
        fields[key] = {
            "return": int(field.nvmlReturn),
            "error": None if ok else _text(nvml.NVMLError(field.nvmlReturn)),
            "value_type": int(field.valueType) if ok else None,
            "value": field_value(field) if ok else None,
        }
    return fields


def _raw_device(nvml: Any, index: int) -> dict[str, Any]:
    failures = _failures(nvml)
    gpu: dict[str, Any] = {
        "index": index,
        "uuid": None,
        "name": None,
        "memory": None,
        "memory_v1": None,
        "pcie": None,
        "processes": [],
        "errors": [],
    }
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        gpu["uuid"] = _text(nvml.nvmlDeviceGetUUID(handle))
        gpu["name"] = _text(nvml.nvmlDeviceGetName(handle))
    except failures as err:
        gpu["errors"].append(f"identity: {_text(err)}")
        return gpu
    reads = {
        "memory": lambda: _memory(nvml.nvmlDeviceGetMemoryInfo(handle, version=nvml.nvmlMemory_v2)),
        "memory_v1": lambda: _memory(nvml.nvmlDeviceGetMemoryInfo(handle)),
        "pcie": lambda: _pcie_fields(nvml, handle),
        "processes": lambda: [
            _process(p.pid, p.usedGpuMemory)
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
        ],
    }
    for key, read in reads.items():
        try:
            gpu[key] = read()
        except failures as err:
            gpu["errors"].append(f"{key}: {_text(err)}")
    if gpu["memory"] is None:
        gpu["memory"] = gpu["memory_v1"]
    return gpu


def _memory(struct: Any) -> dict[str, Any]:
    reserved = getattr(struct, "reserved", None)
    return {
        "total": int(struct.total),
        "reserved": None if reserved is None else int(reserved),
        "used": int(struct.used),
        "free": int(struct.free),
        "version": 1 if reserved is None else 2,
    }


def _process(pid: int, used: int | None) -> dict[str, Any]:
    cmdline = _cmdline(pid)
    return {"pid": int(pid), "used_bytes": used, "here": cmdline is not None, "cmdline": cmdline}


def _nvidia_smi(errors: list[str]) -> list[dict[str, Any]] | None:
    """nvidia-smi's own memory figures, the ones users compare with (None when not installed)."""
    if shutil.which("nvidia-smi") is None:
        return None
    fields = ["index", "memory.used", "memory.total", "memory.reserved"]
    for query in (fields, fields[:3]):  # memory.reserved is unknown to older nvidia-smi
        try:
            done = subprocess.run(
                ["nvidia-smi", f"--query-gpu={','.join(query)}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.TimeoutExpired) as err:
            errors.append(f"nvidia-smi: {err}")
            return None
        if done.returncode == 0:
            return [_smi_row(line, len(query)) for line in done.stdout.splitlines() if line]
    errors.append(f"nvidia-smi: {done.stdout.strip() or done.stderr.strip()}")
    return None


def _smi_row(line: str, width: int) -> dict[str, Any]:
    values = [value.strip() for value in line.split(",")] + ["[N/A]"]
    numbers = [int(v) if v.isdigit() else None for v in values]
    return {
        "index": numbers[0],
        "memory_used_mib": numbers[1],
        "memory_total_mib": numbers[2],
        "memory_reserved_mib": numbers[3] if width > 3 else None,
    }


def _sample_json(sample: GpuSample) -> dict[str, Any]:
    data = dataclasses.asdict(sample)
    data["note"] = sample.note
    return data


def _print_raw(report: dict[str, Any]) -> None:
    namespace = report["pid_namespace"]
    print(
        f"driver {report['driver_version']}, nvidia-ml-py {report['binding']},"
        f" {len(report['devices'])} GPU(s); PID namespace {namespace['inode']}"
        f" ({'host' if namespace['host'] else 'not the host'})"
    )
    for gpu in report["devices"]:
        line = f"gpu {gpu['index']}: {gpu['name']} {gpu['uuid']}"
        memory = gpu["memory"]
        if memory is not None:
            line += f"  used {_mib(memory['used'])} / {_mib(memory['total'])}"
            line += f" (v{memory['version']}, reserved {_mib(memory['reserved'])})"
        if gpu["memory_v1"] is not None:
            line += f"; v1 used {_mib(gpu['memory_v1']['used'])}"
        print(line)
        for key, field in (gpu["pcie"] or {}).items():
            shown = field["error"] or f"{field['value']} (value type {field['value_type']})"
            print(f"    pcie {key}: {shown}")
        for error in gpu["errors"]:
            print(f"    error: {error}")
        for proc in gpu["processes"]:
            print(f"    pid {proc['pid']:>8}  {_mib(proc['used_bytes']):>12}  {proc['cmdline']}")
    for row in report["nvidia_smi"] or ():
        print(
            f"nvidia-smi gpu {row['index']}: used {row['memory_used_mib']} MiB"
            f" / {row['memory_total_mib']} MiB, reserved {row['memory_reserved_mib']} MiB"
        )
    print(f"\nNvmlSource.sample():\n  {report['source']}")


def _start_allocator(
    gib: float, seconds: float
) -> tuple[subprocess.Popen[str] | None, dict[str, Any] | None]:
    """Starts the allocating child and waits until it holds the memory, copied into once (or
    fails); it goes on copying for `seconds`."""
    if gib <= 0:
        return None, None
    requested = int(gib * GIB)
    info: dict[str, Any] = {
        "pid": None,
        "requested_bytes": requested,
        "allocated_bytes": None,
        "error": None,
    }
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ALLOCATOR,
            str(requested),
            str(min(CHUNK_BYTES, requested)),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    info["pid"] = child.pid
    line = _read_line(child, ALLOCATED_TIMEOUT_SECONDS)
    if line.startswith("allocated "):
        info["allocated_bytes"] = int(line.split()[1])
    else:
        info["error"] = line or "no answer from the allocator"
    return child, info


def _read_line(child: subprocess.Popen[str], timeout: float) -> str:
    assert child.stdout is not None
    ready, _, _ = select.select([child.stdout], [], [], timeout)
    if not ready:
        return f"nothing within {timeout:g}s"
    return child.stdout.readline().strip()


def _watch(
    source: NvmlSource,
    seconds: float,
    interval: float,
    child: subprocess.Popen[str] | None,
    as_json: bool,
) -> tuple[GpuSample | None, list[dict[str, Any]]]:
    """Samples until `seconds` pass; the last sample and one entry per sample."""
    start = time.monotonic()
    last, samples = None, []
    before: tuple[float, list[int | None]] | None = None  # the previous sample's RX counters
    while (elapsed := time.monotonic() - start) <= seconds:
        entry: dict[str, Any] = {"t": round(elapsed, 2), "unavailable": None}
        try:
            last = source.sample()
        except NvmlUnavailable as err:
            entry.update(used_bytes=[], attributed_bytes=None, problem=None, errors=[])
            entry.update(pcie_rx_bytes=[], pcie_rx_bytes_per_second=[])
            entry["unavailable"] = str(err)
        else:
            attributed = process_gpu_memory(last, [child.pid]) if child else {}
            rx = [d.pcie_rx_bytes for d in last.devices]
            entry.update(
                used_bytes=[d.memory_used_bytes for d in last.devices],
                pcie_rx_bytes=rx,
                pcie_rx_bytes_per_second=_rates(before, elapsed, rx),
                attributed_bytes=sum(attributed.values()) if child else None,
                problem=last.attribution_problem,
                errors=list(last.errors),
            )
            before = (elapsed, rx)
        samples.append(entry)
        if not as_json:
            print(_line(entry))
        time.sleep(interval)
    return last, samples


def _rates(
    before: tuple[float, list[int | None]] | None, now: float, rx: list[int | None]
) -> list[float | None]:
    """Bytes per second each GPU's counter moved since the previous sample (None: no basis)."""
    if before is None or now <= before[0] or len(before[1]) != len(rx):
        return [None] * len(rx)
    then, old = before
    return [
        None if a is None or b is None else (b - a) / (now - then)
        for a, b in zip(old, rx, strict=True)
    ]


def _attribution(sample: GpuSample, child: subprocess.Popen[str] | None) -> dict[str, Any]:
    result: dict[str, Any] = {
        "trusted": sample.attribution_problem is None,
        "problem": sample.attribution_problem,
    }
    if child is not None:
        listed = [p.used_bytes or 0 for p in sample.processes if p.pid == child.pid]
        result["allocator_listed_bytes"] = sum(listed) if listed else None
        result["allocator_attributed_bytes"] = sum(process_gpu_memory(sample, [child.pid]).values())
    return result


def _print_attribution(attribution: dict[str, Any]) -> None:
    if attribution["trusted"]:
        print("attribution: trusted (NVML's PIDs are this namespace's)")
    else:
        print(f"attribution: refused: {attribution['problem']}")
    allocator = attribution["allocator"]
    if allocator is not None:
        print(
            f"allocator pid {allocator['pid']}: allocated {_mib(allocator['allocated_bytes'])}"
            f" ({allocator['error'] or 'ok'}); NVML lists"
            f" {_mib(attribution['allocator_listed_bytes'])} under that PID, the source"
            f" attributes {_mib(attribution['allocator_attributed_bytes'])}"
        )


def _line(entry: dict[str, Any]) -> str:
    if entry["unavailable"]:
        return f"t={entry['t']:5.1f}s unavailable: {entry['unavailable']}"
    used = " ".join(f"{i}:{_mib(b)}" for i, b in enumerate(entry["used_bytes"]))
    parts = [f"t={entry['t']:5.1f}s used {used}"]
    counters = zip(entry["pcie_rx_bytes"], entry["pcie_rx_bytes_per_second"], strict=True)
    rx = [f"{i}:{_mib(b)} {_rate(r)}" for i, (b, r) in enumerate(counters) if b is not None]
    parts.append(f"pcie rx {' '.join(rx)}" if rx else "pcie rx: no counter")
    if entry["attributed_bytes"] is not None:
        parts.append(f"allocator attributed {_mib(entry['attributed_bytes'])}")
    if entry["problem"]:
        parts.append(f"attribution refused: {entry['problem']}")
    if entry["errors"]:
        parts.append("errors: " + "; ".join(entry["errors"]))
    return " | ".join(parts)


def _cmdline(pid: int) -> str | None:
    """The command line, or None when the PID is no process here (another PID namespace?)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()


def _rate(value: float | None) -> str:
    return "(rate: first sample)" if value is None else f"({value / MIB:,.0f} MiB/s)"


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / MIB:,.0f} MiB"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    sys.exit(main())
