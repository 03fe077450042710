"""Benchmark: one page-cache residency pass, ours against fincore and vmtouch, on the same files.

Run as `.venv/bin/python bench/residency.py [--quick] [--dir DIR]`. Three scenarios:
1 TiB of sparse shards (nothing cached), 10,000 small files (half cached), and several GB of
really cached data (cost per cached GB). Prints medians and ratios; removes everything it made.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exporter.config.schema import WeightsConfig
from exporter.sources.residency import ResidencySource

GiB = 1 << 30
MiB = 1 << 20
KiB = 1 << 10


@dataclass(frozen=True)
class Row:
    scenario: str
    tool: str
    median_s: float | None
    note: str = ""


def median_time(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_tool(argv: list[str]) -> None:
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ours(directory: Path, methods: tuple[str, ...] = ("cachestat", "mincore")) -> ResidencySource:
    """A source whose first (discovery) pass is done, so timings are of steady-state passes."""
    src = ResidencySource(WeightsConfig(paths=(str(directory),)), methods=methods)
    src.sample()
    return src


def time_ours(src: ResidencySource, reps: int) -> tuple[float, float]:
    """Median wall time and median CPU time of a forced full pass."""
    walls, cpus = [], []
    for _ in range(reps):
        src.request_full_pass()
        start = time.perf_counter()
        sample = src.sample()
        walls.append(time.perf_counter() - start)
        cpus.append(sample.pass_cpu_seconds)
    return statistics.median(walls), statistics.median(cpus)


def compare(
    scenario: str, directory: Path, files: list[Path], reps: int, mincore_row: bool
) -> list[Row]:
    rows: list[Row] = []
    src = ours(directory)
    sample = src.sample()
    cached = "unknown" if sample.resident_bytes is None else f"{sample.resident_bytes / GiB:.2f}"
    wall, cpu = time_ours(src, reps)
    note = f"{sample.files} files, {cached} GiB cached, CPU {cpu * 1000:.3f} ms"
    rows.append(Row(scenario, "ours (cachestat)", wall, note))
    if mincore_row:
        wall, cpu = time_ours(ours(directory, ("mincore",)), reps)
        rows.append(Row(scenario, "ours (mincore fallback)", wall, f"CPU {cpu * 1000:.3f} ms"))
    if shutil.which("fincore"):
        argv = ["fincore", "--bytes", "--raw", "--noheadings", *map(str, files)]
        rows.append(Row(scenario, "fincore", median_time(lambda: run_tool(argv), reps)))
    else:
        rows.append(Row(scenario, "fincore", None, "not installed"))
    if shutil.which("vmtouch"):
        argv = ["vmtouch", "-f", "-m", "64G", str(directory)]
        rows.append(Row(scenario, "vmtouch -f", median_time(lambda: run_tool(argv), reps)))
    else:
        rows.append(Row(scenario, "vmtouch -f", None, "not installed (apt install vmtouch)"))
    return rows


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_all(path: Path, random_mode: bool = False) -> None:
    """Read a file into the page cache; in random mode without readahead, one page per folio."""
    with open(path, "rb", buffering=0) as f:
        if random_mode:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        while f.read(8 * MiB):
            pass


def sparse_shards(directory: Path, reps: int) -> list[Row]:
    directory.mkdir()
    files = [directory / f"model-{i:05d}-of-00064.safetensors" for i in range(64)]
    for path in files:
        with open(path, "wb") as f:
            f.truncate(16 * GiB)
    return compare("1 TiB sparse, 64 x 16 GiB", directory, files, reps, mincore_row=True)


def small_files(directory: Path, reps: int) -> list[Row]:
    directory.mkdir()
    block = os.urandom(64 * KiB)
    files = [directory / f"{i // 1000:02d}" / f"part-{i:05d}.safetensors" for i in range(10_000)]
    for path in files:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(block)
    os.sync()
    for i, path in enumerate(files):
        drop(path)
        if i % 2 == 0:
            read_all(path)
    return compare("10,000 x 64 KiB, half cached", directory, files, reps, mincore_row=True)


def cached_data(directory: Path, size: int, reps: int) -> list[Row]:
    """The same data cached twice: in large folios (as written) and in 4 KiB pages.

    cachestat walks the page cache's xarray, so its cost follows the number of folios: ext4
    (Linux >= 6.16), XFS and others cache sequential I/O in large folios; random-mode reads
    (POSIX_FADV_RANDOM) and filesystems without large folios leave one entry per 4 KiB page.
    """
    directory.mkdir()
    chunk = os.urandom(64 * MiB)
    files = [directory / f"model-{i:05d}.safetensors" for i in range(size // GiB)]
    for path in files:
        with open(path, "wb") as f:
            for _ in range(GiB // len(chunk)):
                f.write(chunk)
            f.flush()
            os.fsync(f.fileno())
        read_all(path)
    gib = size / GiB
    rows = compare(f"{gib:.0f} GiB cached, large folios", directory, files, reps, True)
    for path in files:
        drop(path)
        read_all(path, random_mode=True)
    rows += compare(f"{gib:.0f} GiB cached, 4 KiB pages", directory, files, reps, True)
    return rows + [
        Row(r.scenario, f"{r.tool}: per cached GiB", r.median_s / gib)
        for r in rows
        if r.median_s is not None
    ]


def check_room(directory: Path, size: int) -> str | None:
    free_disk = shutil.disk_usage(directory).free
    available = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * KiB
    if free_disk < size + 2 * GiB:
        return f"needs {size / GiB + 2:.0f} GiB free disk, {free_disk / GiB:.1f} GiB free"
    if available < size + 4 * GiB:
        return f"needs {size / GiB + 4:.0f} GiB available memory, {available / GiB:.1f} GiB"
    return None


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.3f}"


def print_table(rows: list[Row]) -> None:
    baseline: dict[str, float] = {}
    for r in rows:
        if r.tool == "ours (cachestat)" and r.median_s is not None:
            baseline[r.scenario] = r.median_s
        if r.tool == "ours (cachestat): per cached GiB" and r.median_s is not None:
            baseline[r.scenario + "/GiB"] = r.median_s
    print(f"{'scenario':<30} {'tool':<38} {'median ms':>12} {'x ours':>9}  note")
    for r in rows:
        base = baseline.get(r.scenario + ("/GiB" if "per cached GiB" in r.tool else ""))
        ratio = "" if base is None or r.median_s is None else f"{r.median_s / base:,.1f}"
        print(f"{r.scenario:<30} {r.tool:<38} {fmt_ms(r.median_s):>12} {ratio:>9}  {r.note}")


def verdicts(rows: list[Row]) -> list[str]:
    def get(scenario_prefix: str, tool: str) -> float | None:
        for r in rows:
            if r.scenario.startswith(scenario_prefix) and r.tool == tool:
                return r.median_s
        return None

    out = []
    sparse, sparse_vm = get("1 TiB", "ours (cachestat)"), get("1 TiB", "vmtouch -f")
    if sparse is not None:
        out.append(f"1 TiB sparse pass < 1 ms: {'yes' if sparse < 0.001 else 'NO'}")
        if sparse_vm is not None:
            speedup = sparse_vm / sparse
            out.append(f">= 1000x faster than vmtouch: {'yes' if speedup >= 1000 else 'NO'}")
    small = get("10,000", "ours (cachestat)")
    if small is not None:
        out.append(f"10,000 small files < 50 ms: {'yes' if small < 0.05 else 'NO'}")
    for kind in ("large folios", "4 KiB pages"):
        for r in rows:
            if r.scenario.endswith(kind) and r.tool == "ours (cachestat): per cached GiB":
                out.append(f"cachestat cost per cached GiB, {kind}: {fmt_ms(r.median_s)} ms")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions, 1 GiB cached")
    parser.add_argument("--dir", help="parent of the scratch directory (default /var/tmp)")
    parser.add_argument("--reps", type=int, help="repetitions per measurement (default 7)")
    args = parser.parse_args()
    reps = args.reps or (3 if args.quick else 7)
    cached_size = (1 if args.quick else 4) * GiB

    scratch = Path(tempfile.mkdtemp(prefix="residency-bench-", dir=args.dir or "/var/tmp"))
    rows: list[Row] = []
    try:
        print(f"scratch {scratch}, {reps} repetitions, medians", file=sys.stderr)
        rows += sparse_shards(scratch / "sparse", reps)
        shutil.rmtree(scratch / "sparse")
        rows += small_files(scratch / "small", reps)
        shutil.rmtree(scratch / "small")
        short = check_room(scratch, cached_size)
        if short is None:
            rows += cached_data(scratch / "cached", cached_size, reps)
        else:
            rows.append(Row("cached data", "skipped", None, short))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print_table(rows)
    for line in verdicts(rows):
        print(line)
    print("external tools' times include process start-up (about 1 ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
