"""Soak: the exporter for half an hour under everything at once, watched for leaks.

    .venv/bin/python bench/soak.py [--minutes 30] [--report-every 60] [--dir /var/tmp]

One exporter (1-s sampling, history on) watches 4 targets with 16 weight files each (64 files,
1 GiB) and 8 fake H200 GPUs (tests/helpers/fake_nvml.py: there is no GPU here), while each
target's `model-load-exporter simulate` server loads, serves for 20 s, exits and starts again
(cold every third load, warm otherwise), and 50 scrapers fetch /metrics once a second each over
kept-alive connections, as 50 Prometheus servers would. Every --report-every seconds it prints
the exporter's RSS, open fds and threads, the scrapes' p50 and p99, errors, and loads finished.
Pass: no errors, and RSS growth after the first report (warm-up) under 5 MB.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = 4
FILES_PER_TARGET = 16
FILE_SIZE = 16 << 20
SCRAPERS = 50
GPUS = 8


def child(config: str, port: int) -> None:
    """The exporter, as `serve` runs it, with 8 fake GPUs whose processes are the servers."""
    sys.path[:0] = [str(REPO), str(REPO / "tests")]
    from helpers.fake_nvml import GIB, FakeNvml, FakeProcess, h200_node

    from exporter.config.reader import load_config
    from exporter.exposition.http.app import HttpServer, WebApp
    from exporter.runtime.wiring import Runtime

    parsed = load_config(config)
    gpus = h200_node(GPUS)
    runtime = Runtime(parsed, nvml=FakeNvml(gpus))
    server = HttpServer(WebApp(runtime), f"127.0.0.1:{port}")
    pidfiles = [Path(t.process.pidfile) for t in parsed.targets if t.process and t.process.pidfile]
    stop = threading.Event()

    def attach() -> None:
        """Each server holds 60 GiB on two GPUs while its pidfile names it."""
        while not stop.wait(1.0):
            for i, pidfile in enumerate(pidfiles):
                with contextlib.suppress(OSError, ValueError):
                    pid = int(pidfile.read_text())
                    for gpu in gpus[2 * i : 2 * i + 2]:
                        gpu.processes = [FakeProcess(pid, 60 * GIB)]
                        gpu.used_bytes = 61 * GIB

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    runtime.start()
    server.start()
    threading.Thread(target=attach, daemon=True).start()
    print("READY", flush=True)
    signal.sigwait({signal.SIGTERM})
    stop.set()
    server.stop()
    runtime.stop()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Servers:
    """Each target's simulated server, restarted whenever it exits (cold every third start)."""

    def __init__(self, work: Path, weights: list[Path], ports: list[int]) -> None:
        self.work, self.weights, self.ports = work, weights, ports
        self.starts = [0] * len(weights)
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * len(weights)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _start(self, i: int) -> None:
        sys.path.insert(0, str(REPO))
        from exporter.storage.cachectl import evict

        if self.starts[i] % 3 == 0:
            for shard in self.weights[i].glob("*.safetensors"):
                evict(str(shard))
        self.starts[i] += 1
        self.procs[i] = subprocess.Popen(
            [sys.executable, "-m", "exporter", "simulate", "--port", str(self.ports[i]),
             "--weights", str(self.weights[i]), "--pidfile", str(self.work / f"server-{i}.pid"),
             "--read-rate", "200MB/s", "--startup-seconds", "2", "--init-seconds", "3",
             "--exit-after", "20s", "--log-file", str(self.work / f"server-{i}.log")],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for i, proc in enumerate(self.procs):
                if proc is None or proc.poll() is not None:
                    self._start(i)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


class Scrapers:
    """50 scrapers, each fetching /metrics once a second on a kept-alive connection."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.latencies: list[float] = []
        self.errors: list[str] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)
        self._thread.start()

    async def _one(self, offset: float) -> None:
        await asyncio.sleep(offset)
        reader = writer = None
        request = b"GET /metrics HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n"
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                async with asyncio.timeout(10):
                    if writer is None:
                        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
                    assert reader is not None
                    writer.write(request)
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    )
                    await reader.readexactly(length)
                    if head[9:12] != b"200":
                        raise RuntimeError(head.split(b"\r\n")[0].decode())
                with self._lock:
                    self.latencies.append(time.perf_counter() - started)
            except Exception as exc:  # every failure is counted and shown, never fatal here
                with self._lock:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                if writer is not None:
                    writer.close()
                reader = writer = None
            await asyncio.sleep(max(0.0, 1.0 - (time.perf_counter() - started)))

    async def _run(self) -> None:
        await asyncio.gather(*(self._one(i / SCRAPERS) for i in range(SCRAPERS)))

    def take(self) -> tuple[list[float], list[str]]:
        with self._lock:
            taken = (self.latencies, self.errors)
            self.latencies, self.errors = [], []
        return taken

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=15)


def proc_stats(pid: int) -> tuple[float, int, int]:
    rss, threads = 0.0, 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) / 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def loads_finished(port: int) -> int:
    import urllib.request

    with urllib.request.urlopen(
        f"http://127.0.0.1:{port}/api/v1/loads?limit=1000", timeout=10
    ) as r:
        return len(json.load(r)["loads"])


def series(port: int) -> int:
    """Samples in one uncompressed exposition: a growing count would be a leak of series."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return sum(1 for line in r.read().decode().splitlines() if not line.startswith("#"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=30)
    parser.add_argument("--report-every", type=float, default=60, metavar="SECONDS")
    parser.add_argument("--dir", default="/var/tmp")
    parser.add_argument("--child", nargs=2, metavar=("CONFIG", "PORT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], int(args.child[1]))
        return 0
    sys.path.insert(0, str(REPO))
    from exporter.sim.shards import generate_shards

    work = Path(tempfile.mkdtemp(prefix="mle-soak-", dir=args.dir))
    servers: Servers | None = None
    scrapers: Scrapers | None = None
    exporter: subprocess.Popen[str] | None = None
    try:
        weights = [work / f"model-{i}" for i in range(TARGETS)]
        for directory in weights:
            directory.mkdir()
            generate_shards(directory, FILES_PER_TARGET, FILE_SIZE)
        ports = [free_port() for _ in range(TARGETS)]
        targets = [
            {"name": f"model-{i}", "endpoint": {"url": f"http://127.0.0.1:{ports[i]}"},
             "weights": {"paths": [str(weights[i])]},
             "process": {"pidfile": str(work / f"server-{i}.pid")}}
            for i in range(TARGETS)
        ]  # fmt: skip
        config = work / "config.yaml"
        config.write_text(
            json.dumps(
                {
                    "sample_interval": "1s",
                    "history_path": str(work / "h.sqlite"),
                    "targets": targets,
                }
            )
        )
        port = free_port()
        exporter = subprocess.Popen(
            [sys.executable, __file__, "--child", str(config), str(port)],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert exporter.stdout is not None and "READY" in exporter.stdout.readline()
        servers = Servers(work, weights, ports)
        scrapers = Scrapers(port)
        print(
            f"soak: {args.minutes:g} min, 1-s sampling, {TARGETS} targets, "
            f"{TARGETS * FILES_PER_TARGET} weight files, {GPUS} fake GPUs, {SCRAPERS} scrapers/s"
        )
        print(
            f"{'minute':>6} {'RSS MB':>7} {'fds':>5} {'threads':>7} {'scrapes':>8} "
            f"{'p50 ms':>7} {'p99 ms':>7} {'errors':>6} {'loads':>5} {'series':>6} {'load':>5}"
        )
        started = time.monotonic()
        end = started + args.minutes * 60
        rss_series: list[float] = []
        all_errors: list[str] = []
        while time.monotonic() < end:
            time.sleep(min(args.report_every, max(0.0, end - time.monotonic())))
            latencies, errors = scrapers.take()
            all_errors.extend(errors)
            rss, fds, threads = proc_stats(exporter.pid)
            rss_series.append(rss)
            print(
                f"{(time.monotonic() - started) / 60:>6.1f} {rss:>7.1f} {fds:>5} {threads:>7} "
                f"{len(latencies):>8} {pct(latencies, 0.5):>7.1f} {pct(latencies, 0.99):>7.1f} "
                f"{len(errors):>6} {loads_finished(port):>5} {series(port):>6} "
                f"{os.getloadavg()[0]:>5.2f}",
                flush=True,
            )
        growth = rss_series[-1] - rss_series[0] if len(rss_series) > 1 else 0.0
        ok = not all_errors and growth < 5
        print(
            f"RSS growth after warm-up: {growth:+.1f} MB; errors: {len(all_errors)}; "
            f"loads started: {sum(servers.starts)}: {'PASS' if ok else 'FAIL'}"
        )
        for error in sorted(set(all_errors))[:10]:
            print(f"  error: {error}")
        return 0 if ok else 1
    finally:
        if scrapers is not None:
            scrapers.stop()
        if servers is not None:
            servers.stop()
        if exporter is not None:
            exporter.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                exporter.wait(timeout=30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
