#!/usr/bin/env python3
"""Check what NVML reports on a real GPU host, and what the exporter's GPU source makes of it.

Prints the driver, each GPU, the compute processes per GPU with their command lines, one
`NvmlSource.sample()`, then samples for a while. With `--allocate-gib N` (and torch importable) a
child process allocates N GiB on GPU 0 during that window, so one can see whether the per-process
attribution grows. It does not when NVML's pids are not this PID namespace's (a container without
the host's PID namespace): worth knowing before trusting `model_load_process_gpu_memory_bytes`.

    python scripts/nvml_probe.py [--seconds 10] [--interval 1] [--allocate-gib 8] [--json]

Exits 0 with "no NVML: <reason>" on a host without a GPU or driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from exporter.sources.gpu import (
    GpuSample,
    NvmlSource,
    NvmlUnavailable,
    process_gpu_memory,
)

MIB = 1024 * 1024
GIB = 1024 * MIB
CHUNK_BYTES = 256 * MIB

# Runs in the child: allocate in chunks spread over `spread` seconds, then hold until killed.
ALLOCATOR = f"""
import sys, time, torch
total, spread = int(sys.argv[1]), float(sys.argv[2])
chunk = {CHUNK_BYTES}
count = max(1, total // chunk)
held = []
for _ in range(count):
    held.append(torch.empty(chunk, dtype=torch.uint8, device="cuda:0"))
    torch.cuda.synchronize()
    time.sleep(spread / count)
print("allocated", len(held) * chunk, flush=True)
time.sleep(86400)
"""


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # The probe prints the source's reasons itself; its once-only warnings would repeat them.
    logging.getLogger("exporter.sources.gpu").setLevel(logging.ERROR)
    try:
        import pynvml
    except ImportError as err:
        return _no_nvml(f"pynvml not installed ({err})", args.json)
    source = NvmlSource(pynvml)
    try:
        first = source.sample()
    except NvmlUnavailable as err:
        return _no_nvml(str(err), args.json)
    report: dict[str, Any] = {
        "nvml": True,
        "raw": _raw(pynvml),
        "sample": dataclasses.asdict(first),
    }
    if not args.json:
        _print_raw(report["raw"])
        print("\nNvmlSource.sample():")
        print(f"  {first!r}")
    child = _start_allocator(args.allocate_gib, args.seconds, args.json)
    report["allocator_pid"] = child.pid if child else None
    try:
        report["samples"] = _watch(source, args.seconds, args.interval, child, args.json)
    finally:
        if child is not None:
            child.kill()
            child.wait()
        source.close()
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        print()
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="how long to sample")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument(
        "--allocate-gib",
        type=float,
        default=0.0,
        help="allocate this much on GPU 0 in a child process while sampling (needs torch)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON document on stdout")
    return parser.parse_args(argv)


def _no_nvml(reason: str, as_json: bool) -> int:
    if as_json:
        print(json.dumps({"nvml": False, "reason": reason}))
    else:
        print(f"no NVML: {reason}")
    return 0


def _raw(nvml: Any) -> dict[str, Any]:
    """What the driver says directly, without the exporter's source in between."""
    gpus = []
    for index in range(nvml.nvmlDeviceGetCount()):
        gpu: dict[str, Any] = {"index": index}
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpu["name"] = _text(nvml.nvmlDeviceGetName(handle))
            gpu["uuid"] = _text(nvml.nvmlDeviceGetUUID(handle))
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            gpu["used_bytes"], gpu["total_bytes"] = int(memory.used), int(memory.total)
            gpu["processes"] = [
                {"pid": p.pid, "used_bytes": p.usedGpuMemory, "cmdline": _cmdline(p.pid)}
                for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle)
            ]
        except (nvml.NVMLError, getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError)) as err:
            gpu["error"] = _text(err)
        gpus.append(gpu)
    return {"driver_version": _text(nvml.nvmlSystemGetDriverVersion()), "gpus": gpus}


def _print_raw(raw: dict[str, Any]) -> None:
    print(f"driver {raw['driver_version']}, {len(raw['gpus'])} GPU(s)")
    for gpu in raw["gpus"]:
        line = f"gpu {gpu['index']}: {gpu.get('name', '?')} {gpu.get('uuid', '?')}"
        if "total_bytes" in gpu:
            line += f"  used {_mib(gpu['used_bytes'])} / {_mib(gpu['total_bytes'])}"
        if "error" in gpu:
            line += f"  error: {gpu['error']}"
        print(line)
        for proc in gpu.get("processes", []):
            print(f"    pid {proc['pid']:>8}  {_mib(proc['used_bytes']):>12}  {proc['cmdline']}")


def _start_allocator(gib: float, seconds: float, as_json: bool) -> subprocess.Popen[str] | None:
    if gib <= 0:
        return None
    if importlib.util.find_spec("torch") is None:
        _note("torch not importable: sampling without allocating", as_json)
        return None
    child = subprocess.Popen(
        [sys.executable, "-c", ALLOCATOR, str(int(gib * GIB)), str(seconds / 2)],
        stdout=sys.stderr if as_json else None,
        text=True,
    )
    _note(f"allocator child pid {child.pid}: {gib:g} GiB on GPU 0 over {seconds / 2:g}s", as_json)
    return child


def _watch(
    source: NvmlSource,
    seconds: float,
    interval: float,
    child: subprocess.Popen[str] | None,
    as_json: bool,
) -> list[dict[str, Any]]:
    """Samples until `seconds` pass; prints device usage and the child's attributed usage."""
    start = time.monotonic()
    samples = []
    while (elapsed := time.monotonic() - start) <= seconds:
        try:
            sample = source.sample()
        except NvmlUnavailable as err:
            _note(f"t={elapsed:5.1f}s unavailable: {err}", as_json)
        else:
            entry = _entry(sample, elapsed, child)
            samples.append(entry)
            if not as_json:
                print(_line(entry))
        time.sleep(interval)
    if child is not None and child.poll() is not None:
        _note(f"allocator child exited early with status {child.returncode}", as_json)
    elif child is not None and samples and not samples[-1]["child_gpu_bytes"]:
        _note(
            f"pid {child.pid} never appeared in NVML's process list: NVML reports host pids,"
            " so this PID namespace differs from the host's (or the allocation failed)",
            as_json,
        )
    return samples


def _entry(
    sample: GpuSample, elapsed: float, child: subprocess.Popen[str] | None
) -> dict[str, Any]:
    return {
        "t": round(elapsed, 2),
        "used_bytes": {d.index: d.memory_used_bytes for d in sample.devices},
        "processes": [dataclasses.asdict(p) for p in sample.processes],
        "child_gpu_bytes": process_gpu_memory(sample, [child.pid]) if child else {},
        "errors": list(sample.errors),
    }


def _line(entry: dict[str, Any]) -> str:
    used = " ".join(f"{i}:{_mib(b)}" for i, b in entry["used_bytes"].items())
    parts = [f"t={entry['t']:5.1f}s used {used}"]
    if entry["child_gpu_bytes"]:
        child = " ".join(f"gpu{i}={_mib(b)}" for i, b in entry["child_gpu_bytes"].items())
        parts.append(f"child {child}")
    for proc in entry["processes"]:
        parts.append(f"pid {proc['pid']} gpu{proc['gpu_index']}={_mib(proc['used_bytes'])}")
    if entry["errors"]:
        parts.append("errors: " + "; ".join(entry["errors"]))
    return " | ".join(parts)


def _note(message: str, as_json: bool) -> None:
    print(message, file=sys.stderr if as_json else sys.stdout)


def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "(no /proc entry here: another PID namespace?)"
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip() or "(empty)"


def _mib(value: int | None) -> str:
    return "unknown" if value is None else f"{value / MIB:,.0f} MiB"


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


if __name__ == "__main__":
    sys.exit(main())
