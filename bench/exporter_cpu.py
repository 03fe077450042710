"""The exporter's whole CPU share at 1-s sampling, watching a ready server with its weights cached.

    .venv/bin/python bench/exporter_cpu.py [--seconds 60] [--size 8GiB] [--dir /var/tmp]

Writes the shards (cached, since they were just written), starts the `simulate` server on them and
waits until it is ready, then runs the exporter for --seconds while a scraper fetches /metrics
every 15 s as Prometheus would. Prints the exporter's CPU share of one core, and beside it
`prometheus-node-exporter` under the same scrape load, the tool a GPU host already runs.
Target: under 1 % of a core with 8 GB cached.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from exporter.cachectl import evict
from exporter.sim.shards import generate_shards
from exporter.units import parse_size

REPO = Path(__file__).resolve().parent.parent

SCRAPE_EVERY = 15.0
SHARD = 512 << 20


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(url, timeout=2).ok:
                return
        except requests.RequestException:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer within {timeout:.0f}s")


def reread_random(path: Path) -> None:
    """Read a file back with readahead off, one 4 KiB page per page-cache entry."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        while os.read(fd, 1 << 20):
            pass
    finally:
        os.close(fd)


def cpu_share(proc: subprocess.Popen[bytes], metrics_url: str, seconds: float) -> float:
    """CPU seconds per wall second of proc (and its children) while it is scraped every 15 s."""
    stop = threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            requests.get(metrics_url, timeout=10)
            stop.wait(SCRAPE_EVERY)

    before = on_cpu_seconds(proc.pid)
    started = time.monotonic()
    scraper = threading.Thread(target=scrape, daemon=True)
    scraper.start()
    time.sleep(seconds)
    used = on_cpu_seconds(proc.pid) - before
    wall = time.monotonic() - started
    stop.set()
    return used / wall


def on_cpu_seconds(pid: int) -> float:
    """Time on CPU of every thread, from schedstat: exact, unlike tick-sampled utime/stime."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--size", default="8GiB")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument(
        "--small-pages",
        action="store_true",
        help="re-read the shards in random mode so the cache holds 4 KiB pages, not large "
        "folios: the worst case for cachestat, and what a real server's mmap reads leave",
    )
    args = parser.parse_args()
    size = parse_size(args.size)
    work = Path(tempfile.mkdtemp(prefix="mle-bench-cpu-", dir=args.dir))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        weights = work / "weights"
        weights.mkdir()
        print(f"writing {size / 1e9:.1f} GB of shards to {weights} ...", flush=True)
        generate_shards(weights, max(1, size // SHARD), min(SHARD, size))
        if args.small_pages:
            for shard in weights.glob("*.safetensors"):
                evict(str(shard))
                reread_random(shard)
        sim_port, port = free_port(), free_port()
        pidfile = work / "server.pid"
        python = sys.executable
        server = subprocess.Popen(
            [python, "-m", "exporter", "simulate", "--port", str(sim_port),
             "--weights", str(weights), "--pidfile", str(pidfile), "--init-seconds", "0",
             "--log-file", str(work / "server.log")],
            cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(server)
        wait_http(f"http://127.0.0.1:{sim_port}/health", timeout=600)
        exporter = subprocess.Popen(
            [python, "-m", "exporter", "--target", "bench",
             "--endpoint", f"http://127.0.0.1:{sim_port}", "--weights", str(weights),
             "--pidfile", str(pidfile), "--history.path=", "--sample.interval=1s",
             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
            cwd=REPO, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(exporter)
        metrics = f"http://127.0.0.1:{port}/metrics"
        wait_http(metrics)
        time.sleep(5)  # past start-up: imports, first residency pass
        text = requests.get(metrics, timeout=10).text
        resident = next(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("model_load_weights_resident_bytes{")
        )
        print(f"exporter sees {resident / 1e9:.2f} GB of {size / 1e9:.2f} GB cached", flush=True)
        ours = cpu_share(exporter, metrics, args.seconds)
        rows = [("model-load-exporter (1 s sampling)", ours)]
        node = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        if node:
            node_port = free_port()
            node_proc = subprocess.Popen(
                [node, f"--web.listen-address=127.0.0.1:{node_port}", "--log.level=warn"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            procs.append(node_proc)
            wait_http(f"http://127.0.0.1:{node_port}/metrics")
            rows.append(
                (
                    "node_exporter (defaults)",
                    cpu_share(node_proc, f"http://127.0.0.1:{node_port}/metrics", args.seconds),
                )
            )
        print(f"\nCPU share of one core over {args.seconds:.0f} s, scraped every 15 s:")
        for name, share in rows:
            print(f"  {name:38s} {share:7.2%}   {share / ours:5.2f}x ours")
        verdict = "meets" if ours < 0.01 else "MISSES"
        print(f"target < 1 % of a core with {size / 1e9:.1f} GB cached: {verdict}")
        return 0
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
