#!/usr/bin/env python3
"""One prepared check for a real GPU host: NVML as the driver says it, the exporter's reading of
it, and the GPU tests, with one verdict line per check.

Installs nothing: run it with the interpreter that has the exporter and its test extras
(`.venv/bin/python scripts/gpu_check.py --out DIR`). It runs scripts/nvml_probe.py --json, which
allocates 1 GiB on GPU 0 through libcuda in a child process and copies host memory into it while
sampling, then checks:
- the source reads the same GPUs, totals and used memory as pynvml directly;
- v2 memory: total = reserved + used + free, and v1 used = v2 used + reserved;
- used and total match nvidia-smi's (when installed): the figure users compare with;
- the allocation is attributed to the child, or the source refuses attribution and says why
  (a PID namespace that is not the host's);
- the PCIe RX counter: where the driver has it (the field's own return), the source reads it
  on every GPU, never backwards, and GPU 0's moved by at least the bytes copied into it (the raw
  RX and TX growth and the value type are in the detail, so a 32-bit counter that wraps, or RX
  and TX the other way round, show); where the driver has none, the source has none either;
- no per-call errors in the source's samples;
- the tests that talk to the real NVML (marker `nvml`) and the GPU tests pass here.
Exit status 0 when every check passes. The probe's JSON and the test output go to --out.

On a machine without the venv (a lent GPU host), bring the packages instead, built here with the
same Python minor version as there (25 MB):
    python3 -m pip install --target .gpu-deps prometheus_client psutil nvidia-ml-py requests \
        PyYAML bcrypt pytest pytest-timeout
    PYTHONPATH=.gpu-deps:. python3 scripts/gpu_check.py --out "$OUT"     # there
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 1024 * 1024
DRIFT = 64 * MIB  # memory that may move between two reads on an idle GPU
CONTEXT = 1024 * MIB  # what a CUDA context may add to an allocation on GPU 0
GPU_TESTS = [
    "tests/test_gpu.py",
    "tests/test_nvml_contract.py",
    "tests/test_nvml_pids.py",
    "tests/test_gpu_metrics.py",
]
# The other test marked `nvml`: the GPU series of /metrics against pynvml, checked by promtool.
PROMTOOL_TEST = (
    "tests/test_exporter_http.py::test_metrics_reflect_a_real_endpoint_and_pass_promtool"
)

Check = tuple[str, bool | None, str]  # name, passed (None: information), detail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="where the probe JSON and test log go")
    parser.add_argument("--allocate-gib", type=float, default=1.0)
    parser.add_argument("--skip-tests", action="store_true", help="only the probe's checks")
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    out.mkdir(parents=True, exist_ok=True)

    checks: list[Check] = []
    report = _probe(out, args.allocate_gib, checks)
    if report is not None:
        _print_header(report)
        checks.extend(_judge(report))
    if not args.skip_tests:
        checks.append(_tests(out))
    for name, passed, detail in checks:
        mark = "INFO" if passed is None else ("PASS" if passed else "FAIL")
        print(f"{mark} {name:<12} {detail}")
    failed = [name for name, passed, _ in checks if passed is False]
    passes = sum(1 for _, ok, _ in checks if ok)
    verdict = "PASS" if not failed else f"FAIL ({', '.join(failed)})"
    print(f"VERDICT: {verdict}; {passes} passed, {len(failed)} failed; details in {out}")
    return 0 if not failed else 1


def _probe(out: Path, gib: float, checks: list[Check]) -> dict[str, Any] | None:
    argv = [sys.executable, str(ROOT / "scripts" / "nvml_probe.py"), "--json"]
    argv += ["--seconds", "4", "--interval", "1", "--allocate-gib", str(gib)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired:
        checks.append(("probe", False, "nvml_probe.py did not finish within 180 s"))
        return None
    (out / "probe.json").write_text(done.stdout)
    (out / "probe.stderr").write_text(done.stderr)
    try:
        report = json.loads(done.stdout)
    except json.JSONDecodeError:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        checks.append(("probe", False, f"exit {done.returncode}, no JSON: {tail}"))
        return None
    ok = done.returncode == 0 and report.get("schema") == 1
    checks.append(("probe", ok, f"exit {done.returncode}, schema {report.get('schema')}"))
    if not report["nvml"]:
        checks.append(("nvml", False, f"no NVML: {report['reason']}"))
        return None
    return report


def _print_header(report: dict[str, Any]) -> None:
    namespace = report["pid_namespace"]
    names = sorted({d["name"] for d in report["devices"]})
    print(
        f"gpu_check: driver {report['driver_version']}, nvidia-ml-py {report['binding']},"
        f" {len(report['devices'])} GPU(s) {', '.join(names)};"
        f" PID namespace {'host' if namespace['host'] else namespace['inode']}"
    )


def _judge(report: dict[str, Any]) -> Iterator[Check]:
    raw, source = report["devices"], report["source"]["devices"]
    yield (
        "gpus",
        len(raw) > 0 and [d["uuid"] for d in raw] == [d["uuid"] for d in source],
        (f"{len(raw)} from pynvml, {len(source)} from the source, same UUIDs in order"),
    )
    yield "raw errors", not report["errors"], "; ".join(report["errors"]) or "none"
    yield _agreement(report)
    yield _accounting(raw)
    yield _nvidia_smi(raw, report["nvidia_smi"])
    yield from _attribution(report["attribution"])
    yield _pcie(report)
    errors = sorted({e for s in report["samples"] for e in s["errors"]})
    unavailable = [s["unavailable"] for s in report["samples"] if s["unavailable"]]
    yield "source errs", not errors and not unavailable, "; ".join(errors + unavailable) or "none"


def _agreement(report: dict[str, Any]) -> Check:
    """The source's last sample against pynvml's read (GPU 0 also holds the allocation)."""
    allocated = (report["attribution"]["allocator"] or {}).get("allocated_bytes") or 0
    problems = []
    for raw, read in zip(report["devices"], report["source"]["devices"], strict=False):
        memory = raw["memory"]
        if memory is None or read["memory_used_bytes"] is None:
            problems.append(f"gpu {raw['index']}: no memory reading")
            continue
        if read["memory_total_bytes"] != memory["total"]:
            problems.append(f"gpu {raw['index']}: total {read['memory_total_bytes']}")
        grown = read["memory_used_bytes"] - memory["used"]
        low, high = (allocated, allocated + CONTEXT) if raw["index"] == 0 else (0, 0)
        if not low - DRIFT <= grown <= high + DRIFT:
            problems.append(f"gpu {raw['index']}: used grew {grown / MIB:+.0f} MiB")
        if read["memory_reserved_bytes"] != memory["reserved"]:
            problems.append(f"gpu {raw['index']}: reserved {read['memory_reserved_bytes']}")
    detail = "; ".join(problems) or (
        f"totals, reserved and used as pynvml reads them (GPU 0 + {allocated / MIB:.0f} MiB)"
    )
    return "agreement", not problems, detail


def _accounting(raw: list[dict[str, Any]]) -> Check:
    problems, shown = [], []
    for gpu in raw:
        memory, v1 = gpu["memory"], gpu["memory_v1"]
        if memory is None or memory["version"] != 2:
            problems.append(f"gpu {gpu['index']}: no v2 memory info")
            continue
        parts = memory["reserved"] + memory["used"] + memory["free"]
        if abs(memory["total"] - parts) > memory["total"] // 100:
            problems.append(f"gpu {gpu['index']}: reserved+used+free {parts} != {memory['total']}")
        if v1 is not None and abs(v1["used"] - memory["used"] - memory["reserved"]) > DRIFT:
            problems.append(
                f"gpu {gpu['index']}: v1 used {v1['used'] / MIB:.0f} MiB !="
                f" v2 used+reserved {(memory['used'] + memory['reserved']) / MIB:.0f} MiB"
            )
        shown.append(f"{memory['reserved'] / MIB:.0f}")
    detail = "; ".join(problems) or f"v2 adds up; reserved MiB per GPU: {', '.join(shown)}"
    return "v2 memory", not problems, detail


def _nvidia_smi(raw: list[dict[str, Any]], smi: list[dict[str, Any]] | None) -> Check:
    if smi is None:
        return "nvidia-smi", None, "not installed: used not compared with it"
    problems = []
    for gpu, row in zip(raw, smi, strict=False):
        memory = gpu["memory"] or {}
        used = (memory.get("used") or 0) / MIB
        if row["memory_used_mib"] is None or abs(row["memory_used_mib"] - used) > 16:
            problems.append(
                f"gpu {gpu['index']}: nvidia-smi {row['memory_used_mib']} vs {used:.0f}"
            )
        total = (memory.get("total") or 0) / MIB
        if row["memory_total_mib"] is None or abs(row["memory_total_mib"] - total) > 1:
            problems.append(f"gpu {gpu['index']}: total {row['memory_total_mib']} vs {total:.0f}")
    detail = "; ".join(problems) or "used and total (MiB) as nvidia-smi shows them"
    return "nvidia-smi", not problems, detail


def _pcie(report: dict[str, Any]) -> Check:
    """The PCIe RX counter as the driver reports it against the source's reading of it."""
    raw = [(d["pcie"] or {}).get("rx") for d in report["devices"]]
    read = [d["pcie_rx_bytes"] for d in report["source"]["devices"]]
    problems = [
        f"gpu {i}: driver {'has' if has else 'has no'} counter, source {'none' if r is None else r}"
        for i, (field, r) in enumerate(zip(raw, read, strict=True))
        if (has := field is not None and field["error"] is None) != (r is not None)
    ]
    if not raw or raw[0] is None or raw[0]["error"] is not None:
        reason = raw[0]["error"] if raw and raw[0] is not None else "not read"
        return "pcie rx", None if not problems else False, f"no counter on GPU 0 ({reason})"
    series = [s["pcie_rx_bytes"][0] for s in report["samples"] if s["pcie_rx_bytes"]]
    if None in series or any(b < a for a, b in itertools.pairwise(series)):
        problems.append(f"gpu 0: the source's counter went back or missed a sample: {series}")
    end = {k: (report["pcie_end"][0] if report["pcie_end"] else {}).get(k) for k in ("rx", "tx")}
    grew = {k: _growth((report["devices"][0]["pcie"] or {}).get(k), end[k]) for k in end}
    copied = (report["attribution"]["allocator"] or {}).get("allocated_bytes")
    if copied is not None and (grew["rx"] is None or grew["rx"] < copied):
        problems.append(f"gpu 0: RX moved {_mib(grew['rx'])} for {_mib(copied)} copied")
    rates = [s["pcie_rx_bytes_per_second"][0] for s in report["samples"] if s["pcie_rx_bytes"]]
    peak = max((r for r in rates if r is not None), default=None)
    detail = (
        f"gpu 0: RX +{_mib(grew['rx'])}, TX +{_mib(grew['tx'])} for {_mib(copied)} copied;"
        f" value type {raw[0]['value_type']}; peak {_mib(peak)}/s while sampling"
    )
    return "pcie rx", not problems, "; ".join([*problems, detail])


def _growth(start: dict[str, Any] | None, end: dict[str, Any] | None) -> float | None:
    if start is None or end is None or start["error"] or end["error"]:
        return None
    return float(end["value"] - start["value"])


def _mib(value: float | None) -> str:
    return "unknown" if value is None else f"{value / MIB:,.0f} MiB"


def _attribution(attribution: dict[str, Any]) -> Iterator[Check]:
    allocator = attribution["allocator"]
    if allocator is None:
        yield "allocation", None, "not asked: attribution not exercised"
        return
    if allocator["allocated_bytes"] is None:
        yield "allocation", False, f"failed: {allocator['error']}"
        return
    allocated = allocator["allocated_bytes"]
    attributed = attribution["allocator_attributed_bytes"] or 0
    listed = attribution["allocator_listed_bytes"]
    if attribution["trusted"]:
        yield (
            "attribution",
            attributed >= allocated,
            (
                f"pid {allocator['pid']}: {attributed / MIB:.0f} MiB attributed"
                f" for {allocated / MIB:.0f} MiB allocated"
            ),
        )
    else:
        yield (
            "attribution",
            attributed == 0 and bool(attribution["problem"]),
            (f"refused, nothing attributed: {attribution['problem']}"),
        )
    yield (
        "nvml pids",
        None,
        (
            f"NVML lists {'no entry' if listed is None else f'{listed / MIB:.0f} MiB'}"
            f" under the child's PID {allocator['pid']} as this namespace numbers it"
        ),
    )


def _tests(out: Path) -> Check:
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TESTS]
    note = ""
    if shutil.which("promtool") is not None:
        argv.append(PROMTOOL_TEST)
    else:
        note = " (promtool missing: the /metrics test marked nvml left out)"
    env = {k: v for k, v in os.environ.items() if k != "MLE_STRICT"}
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=420, cwd=ROOT, env=env)
    except subprocess.TimeoutExpired:
        return "tests", False, "pytest did not finish within 420 s"
    (out / "pytest.log").write_text(done.stdout + done.stderr)
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1]
    failed = [line for line in done.stdout.splitlines() if line.startswith("FAILED")]
    return "tests", done.returncode == 0, "; ".join([summary + note, *failed[:5]])


if __name__ == "__main__":
    sys.exit(main())
