"""CPU cost of the weight-file view at 1 Hz, beside node_exporter's cost of one scrape.

    .venv/bin/python bench/weightfiles.py [--processes 8] [--mappings 2000] [--files 500]
                                          [--ticks 30]

Starts --processes processes (a TP-8 tree's ranks), each holding --files open descriptors and
--mappings file mappings of unrelated files (libraries, as torch's .so files are) plus one weight
shard open and mapped, and samples a WeightFilesSource over them once a second:

* steady: nothing changes between looks (the weights loaded, or a rank waiting on NCCL);
* loading: every rank faults in 32 MiB more of its shard between looks (mmap loaders), so
  `numa_maps` is read each look.

Beside it, node_exporter's CPU per scrape of /metrics in the same run (its own utime+stime from
/proc). Goal: the steady file view under 1 ms a tick.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests
from exporter_cpu import free_port, wait_http

from exporter.config.schema import WeightsConfig
from exporter.sources.process import ProcessSample
from exporter.sources.weightfiles import WeightFilesSource

MIB = 1 << 20

RANK = r"""
import ctypes, ctypes.util, mmap, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libs, weights, mappings, files = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
names = sorted(os.listdir(libs))
fds = [os.open(os.path.join(libs, names[i % len(names)]), os.O_RDONLY) for i in range(files)]
for i in range(mappings):
    # libc's mmap, not Python's (which dups the descriptor): exactly `files` descriptors.
    libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_SHARED, fds[i % files], 0)
    libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)  # a gap
shard = os.open(weights, os.O_RDONLY)
weight_map = mmap.mmap(shard, 0, prot=mmap.PROT_READ)
print("ready", flush=True)
step = 0
for line in sys.stdin:  # "touch": fault in the next 32 MiB of the shard
    start = step * (32 << 20) % len(weight_map)
    sum(weight_map[i] for i in range(start, start + (32 << 20), mmap.PAGESIZE))
    step += 1
    print("ok", flush=True)
"""


def rank_tree(root: Path, count: int, mappings: int, files: int) -> list[subprocess.Popen[str]]:
    libs = root / "libs"
    libs.mkdir()
    for i in range(64):
        (libs / f"lib{i}.so").write_bytes(os.urandom(8192))
    model = root / "model"
    model.mkdir()
    ranks = []
    for rank in range(count):
        shard = model / f"model-{rank + 1:05d}-of-{count:05d}.safetensors"
        shard.write_bytes(os.urandom(512 * MIB // count))
        argv = [sys.executable, "-c", RANK, str(libs), str(shard), str(mappings), str(files)]
        ranks.append(
            subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        )
    for proc in ranks:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    return ranks


def touch(ranks: list[subprocess.Popen[str]]) -> None:
    for proc in ranks:
        assert proc.stdin is not None
        proc.stdin.write("touch\n")
        proc.stdin.flush()
    for proc in ranks:
        assert proc.stdout is not None and proc.stdout.readline() == "ok\n"


def tick_cost(source: WeightFilesSource, ticks: int, between: object = None) -> list[float]:
    costs = []
    for _ in range(ticks):
        if callable(between):
            between()
        start = time.thread_time()
        source.sample()
        costs.append((time.thread_time() - start) * 1000)
        time.sleep(1.0)
    return costs


def node_exporter_scrape_ms(scrapes: int) -> float | None:
    node = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    if node is None:
        return None
    port = free_port()
    proc = subprocess.Popen(
        [node, f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        wait_http(url)
        requests.get(url, timeout=10)  # the first scrape warms its caches
        before = _cpu_seconds(proc.pid)
        for _ in range(scrapes):
            requests.get(url, timeout=10)
        return (_cpu_seconds(proc.pid) - before) / scrapes * 1000
    finally:
        proc.terminate()
        proc.wait()


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--mappings", type=int, default=2000)
    parser.add_argument("--files", type=int, default=500)
    parser.add_argument("--ticks", type=int, default=30)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="mle-bench-files-") as tmp:
        root = Path(tmp)
        ranks = rank_tree(root, args.processes, args.mappings, args.files)
        try:
            pids = tuple(proc.pid for proc in ranks)
            tree = ProcessSample(True, pids, pids[0], time.time(), 0, 0, None)
            weights = WeightsConfig(paths=(str(root / "model"),), include=("*.safetensors",))
            source = WeightFilesSource(weights, lambda: tree)
            start = time.thread_time()
            first = source.sample()
            cold = (time.thread_time() - start) * 1000
            assert first.held_files == args.processes, first
            steady = tick_cost(source, args.ticks)
            loading = tick_cost(source, max(5, args.ticks // 3), lambda: touch(ranks))
        finally:
            for proc in ranks:
                proc.kill()
                proc.wait()
    node = node_exporter_scrape_ms(args.ticks)
    print(f"{args.processes} processes x {args.mappings} mappings, {args.files} descriptors each")
    print(f"first look (every descriptor and mapping): {cold:8.2f} ms CPU")
    for name, costs in (("steady", steady), ("loading (mmap)", loading)):
        ratio = f"   {median(costs) / node:5.2f}x a node_exporter scrape" if node else ""
        print(f"{name:>15} look, median: {median(costs):8.3f} ms CPU (max {max(costs):.3f}){ratio}")
    if node is not None:
        print(f"node_exporter, one scrape: {node:8.2f} ms CPU")
    verdict = "met" if median(steady) < 1.0 else "missed"
    print(f"goal, steady look under 1 ms: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
