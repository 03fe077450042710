"""`model-load-exporter demo`: the exporter watching the built-in simulator load real files.

A newcomer without GPUs sees the whole product in a minute: a cold load from disk (the shards are
evicted from the page cache first), then warm restarts from memory, each measured into the
histograms, with /metrics and /api/v1/status live on the usual port. Each load starts like a
real Python server: a few seconds of imports (`starting`), then the weights through the
safetensors library's mmap (`loading_weights`).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.live import Live
from rich.table import Table

from exporter.config.reader import parse_config
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.load.records import LoadState
from exporter.logsetup import setup_logging
from exporter.runtime.wiring import Runtime
from exporter.sim.shards import generate_shards
from exporter.storage.cachectl import evict
from exporter.storage.weighttree import walk_weights
from exporter.units import parse_size
from exporter.vocabulary import Cache

TARGET = "demo"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default="demo", help="where shards, logs and history go (./demo)")
    p.add_argument("--web.listen-address", dest="listen", default=":9847", metavar="HOST:PORT")
    p.add_argument("--sim-port", type=int, default=30001, help="simulated server port")
    p.add_argument("--shards", type=int, default=8)
    p.add_argument("--shard-size", default="128MiB")
    p.add_argument("--read-rate", default="240MB/s", help="simulated cold-disk throughput")
    p.add_argument(
        "--startup-seconds", type=float, default=3.0, help="imports and setup before the weights"
    )
    p.add_argument("--import-bytes", default="64MiB", help="libraries read while starting")
    p.add_argument("--init-seconds", type=float, default=6.0, help="KV cache, compile, graphs")
    p.add_argument("--serve-seconds", type=float, default=10.0, help="ready time per cycle")
    p.add_argument("--cycles", type=int, default=0, help="loads to run; 0 = until Ctrl-C")
    p.add_argument("--cold-every", type=int, default=3, help="evict before every Nth load")


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}"
        n /= 1000
    return "-"


def _seconds(s: float | None) -> str:
    return "-" if s is None else f"{s:.0f}s"


def _table(state: LoadState | None, cycle: int, kind: str) -> Table:
    table = Table(title=f"load {cycle} ({kind} cache)", show_header=False, min_width=48)
    table.add_column(style="bold")
    table.add_column()
    if state is None:
        table.add_row("phase", "waiting for the first sample")
        return table
    last = state.last_record
    rows = {
        "phase": state.phase + (" (STALLED)" if state.stalled else ""),
        "weights progress": "-" if state.progress_ratio is None else f"{state.progress_ratio:.0%}",
        "throughput": _bytes(state.throughput_bytes_per_second) + "/s",
        "weights ETA": _seconds(state.weights_eta_seconds),
        "ready ETA": _seconds(state.eta_seconds),
        "elapsed": _seconds(state.elapsed_seconds),
        "cache at start": state.cache or "-",
        "since progress": _seconds(state.seconds_since_progress),
        "last load": "-"
        if last is None
        else f"{last.outcome} in {last.duration_seconds:.1f}s ({last.cache or 'unknown'} cache)",
    }
    for key, value in rows.items():
        table.add_row(key, value)
    return table


def run(args: argparse.Namespace) -> int:
    setup_logging("warn")
    directory = Path(args.dir).absolute()
    weights = directory / "weights"
    weights.mkdir(parents=True, exist_ok=True)
    try:
        import_bytes = parse_size(args.import_bytes)
        generate_shards(weights, args.shards, parse_size(args.shard_size))
    except (OSError, ValueError) as exc:
        print(f"model-load-exporter demo: {exc}", file=sys.stderr)
        return 1
    pidfile = directory / "server.pid"
    config = parse_config(
        {
            "sample_interval": "1s",
            "history_path": str(directory / "history.sqlite"),
            "targets": [
                {
                    "name": TARGET,
                    "endpoint": {
                        "url": f"http://127.0.0.1:{args.sim_port}",
                        "probe": "completion",
                        "model": "demo-model",
                        "timeout": "2s",
                    },
                    "weights": {"paths": [str(weights)]},
                    "process": {"pidfile": str(pidfile)},
                    "stall_after": "30s",
                }
            ],
        },
        source="demo",
    )
    runtime = Runtime(config)
    try:
        http = HttpServer(WebApp(runtime), args.listen)
    except (OSError, ValueError) as exc:
        print(f"model-load-exporter demo: cannot listen on {args.listen}: {exc}", file=sys.stderr)
        return 1
    runtime.start()
    http.start()
    base = f"http://127.0.0.1:{http.port}"
    console = Console(soft_wrap=True)
    console.print(f"Simulated model server on :{args.sim_port}, weights in {weights}")
    console.print(f"Watch it: {base}/metrics  {base}/api/v1/status  (Ctrl-C stops)")
    cycle = 0
    try:
        with Live(console=console, refresh_per_second=4) as live:
            while args.cycles == 0 or cycle < args.cycles:
                kind = Cache.COLD if cycle % args.cold_every == 0 else Cache.WARM
                if kind is Cache.COLD:
                    for f in walk_weights(config.targets[0].weights).files:  # type: ignore[arg-type]
                        evict(f.path)
                cycle += 1
                server = subprocess.Popen(
                    [sys.executable, "-m", "exporter", "simulate",
                     "--port", str(args.sim_port), "--weights", str(weights),
                     "--read-rate", args.read_rate, "--init-seconds", str(args.init_seconds),
                     "--startup-seconds", str(args.startup_seconds),
                     "--import-bytes", str(import_bytes),
                     "--exit-after", f"{args.serve_seconds}s", "--pidfile", str(pidfile),
                     "--model", "demo-model", "--log-file", str(directory / "server.log")],
                    stdout=subprocess.DEVNULL,
                )  # fmt: skip
                while server.poll() is None:
                    state = runtime.snapshot().targets[0].state
                    live.update(_table(state, cycle, kind))
                    time.sleep(0.25)
                time.sleep(2 * config.sample_interval)  # let the tracker see the exit
                live.update(_table(runtime.snapshot().targets[0].state, cycle, kind))
    except KeyboardInterrupt:
        pass
    finally:
        records = runtime.loads(TARGET, limit=cycle)
        http.stop()
        runtime.stop()
    console.line()
    for record in reversed(records):
        phases = ", ".join(f"{k} {v:.1f}s" for k, v in record.phase_seconds.items())
        console.print(
            f"load {record.outcome} in {record.duration_seconds:.1f}s "
            f"({record.cache or Cache.UNKNOWN} cache): {phases}"
        )
    return 0
