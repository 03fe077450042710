"""Benchmark: `model-load-exporter prewarm` against `vmtouch -t` and `cat > /dev/null`.

Run as `.venv/bin/python bench/prewarm.py [--size 4GiB] [--files 4] [--rounds 3] [--dir DIR]`.
Writes the files once, then per round runs every tool on the same files, each from a cold cache
(evicted and checked with cachestat before, checked fully resident after), in a shuffled order so
that a noisy neighbour does not always hit the same tool. Prints median wall time, throughput, CPU
time (of the tool's process, from rusage) and the ratio to the faster of vmtouch and cat; removes
what it made. Every time includes the tool's process start-up, ours (a Python interpreter) too.
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from exporter.sources.memory import read_meminfo
from exporter.storage.cachectl import evict, prewarm_files
from exporter.units import parse_size

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.pagecache_io import file_residency  # noqa: E402

GiB = 1 << 30
MiB = 1 << 20


@dataclass
class Tool:
    """A command to time, or (`argv` empty) our read path called in this process."""

    name: str
    argv: list[str]
    shell: bool = False
    walls: list[float] = field(default_factory=list)
    cpus: list[float] = field(default_factory=list)


def write_files(directory: Path, count: int, size: int) -> list[Path]:
    """Random data (nothing below the page cache can shortcut it), flushed to the disk."""
    files = []
    for index in range(count):
        path = directory / f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        with path.open("wb") as f:
            remaining = size
            while remaining:
                block = os.urandom(min(64 * MiB, remaining))
                f.write(block)
                remaining -= len(block)
            f.flush()
            os.fsync(f.fileno())
        files.append(path)
    return files


def resident(files: list[Path]) -> int:
    return sum(file_residency(str(p)).resident_bytes or 0 for p in files)


def run_cold(tool: Tool, files: list[Path], total: int, jobs: int) -> tuple[float, float]:
    """Wall and CPU seconds of one run of `tool` on evicted files."""
    for path in files:
        evict(str(path))
    left = resident(files)
    if left > total // 100:
        raise SystemExit(f"cannot make the files cold: {left} bytes still cached after eviction")
    time.sleep(0.5)  # let the device settle after the flush
    who = resource.RUSAGE_CHILDREN if tool.argv else resource.RUSAGE_SELF
    before = resource.getrusage(who)
    start = time.perf_counter()
    if tool.argv:
        subprocess.run(
            tool.argv if not tool.shell else " ".join(tool.argv),
            shell=tool.shell,
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    else:
        prewarm_files([(str(p), p.stat().st_size) for p in files], jobs)
    wall = time.perf_counter() - start
    after = resource.getrusage(who)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    warm = resident(files)
    if warm < total * 0.99:
        raise SystemExit(f"{tool.name} left only {warm / total:.1%} of the files resident")
    return wall, cpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="4GiB", help="total size of the files (default 4GiB)")
    parser.add_argument("--files", type=int, default=4, help="number of files (default 4)")
    parser.add_argument("--rounds", type=int, default=3, help="runs per tool (default 3)")
    parser.add_argument("--jobs", type=int, default=4, help="prewarm --jobs (default 4)")
    parser.add_argument("--dir", default="/var/tmp", help="where the scratch directory goes")
    args = parser.parse_args()
    total = parse_size(args.size)
    free = shutil.disk_usage(args.dir).free
    available = read_meminfo().available_bytes
    if total > free - GiB or total > available * 0.8:
        room = f"free disk {free / GiB:.1f} GiB, available memory {available / GiB:.1f} GiB"
        print(f"not enough room for {args.size} ({room}); pass a smaller --size")
        return 1
    if not shutil.which("vmtouch"):
        print("vmtouch is not installed (apt install vmtouch)")
        return 1
    scratch = Path(tempfile.mkdtemp(prefix="prewarm-bench-", dir=args.dir))
    try:
        print(f"writing {args.files} x {total // args.files / GiB:.2f} GiB in {scratch} ...")
        files = write_files(scratch, args.files, total // args.files)
        size = sum(p.stat().st_size for p in files)
        paths = [str(p) for p in files]
        cli = [sys.executable, "-m", "exporter", "prewarm"]
        tools = [
            Tool(f"prewarm --jobs {args.jobs}", [*cli, "--jobs", str(args.jobs), str(scratch)]),
            # cachectl.prewarm_files called here: the reads without the interpreter's start-up
            Tool("  its reads alone", []),
            Tool("prewarm --jobs 1", [*cli, "--jobs", "1", str(scratch)]),
            Tool("vmtouch -t", ["vmtouch", "-tq", *paths]),
            Tool("cat > /dev/null", ["cat", *paths, ">", "/dev/null"], shell=True),
        ]
        for round_no in range(1, args.rounds + 1):
            order = random.sample(tools, len(tools))
            for tool in order:
                wall, cpu = run_cold(tool, files, size, args.jobs)
                tool.walls.append(wall)
                tool.cpus.append(cpu)
            times = ", ".join(f"{t.name} {t.walls[-1]:.2f}s" for t in order)
            print(f"round {round_no}: {times}")
        report(tools, size, args.rounds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


def startup_seconds(argv: list[str], reps: int = 5) -> float:
    """Median wall time of a command that does no I/O (`--help`): the interpreter and imports."""
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def report(tools: list[Tool], size: int, rounds: int) -> None:
    medians = {t.name: statistics.median(t.walls) for t in tools}
    baseline = min(medians["vmtouch -t"], medians["cat > /dev/null"])
    print()
    print(f"{size / GiB:.2f} GiB in {len(tools)} tools x {rounds} rounds, cold cache each run")
    print(f"{'tool':<20} {'median s':>9} {'GB/s':>6} {'CPU s':>6} {'x faster of vmtouch/cat':>24}")
    for tool in tools:
        wall = medians[tool.name]
        cpu = statistics.median(tool.cpus)
        speed = baseline / wall
        print(f"{tool.name:<20} {wall:>9.2f} {size / wall / 1e9:>6.2f} {cpu:>6.2f} {speed:>24.2f}")
    ours = medians[tools[0].name]
    verdict = "yes" if ours <= baseline else "NO"
    print(
        f"target: {tools[0].name} at least as fast as the faster of vmtouch -t and cat: {verdict}"
    )
    startup = startup_seconds([sys.executable, "-m", "exporter", "prewarm", "--help"])
    print(f"of each prewarm time, {startup:.2f}s is Python start-up and imports (prewarm --help)")


if __name__ == "__main__":
    sys.exit(main())
