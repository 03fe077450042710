"""CPU time of one discovery pass on a host with 1,000 unrelated processes.

    .venv/bin/python bench/discovery.py [--processes 1000] [--passes 60] [--interval 5]

Starts --processes `sleep` processes (plus two processes recognised as llama.cpp servers: a copy
of `sleep` named `llama-server`), then measures the CPU time of Discoverer.scan(): the first
(cold) pass, the second (every new pid is looked at twice, for fork-exec races), and --passes
steady passes. Beside it, one pass of what users would otherwise run to find their servers:
`ps -eo pid,args`, `pgrep -af`, and psutil.process_iter reading every command line. Prints
milliseconds of CPU per pass, the ratio to our steady pass, and discovery's share of one core
at the --interval cadence. Target: under 20 ms a steady pass.

Then, with the two stand-in servers gone and the 1,000 sleeps still there, the whole exporter's
idle CPU share with no config at all (discovery on, nothing to find) beside node_exporter, each
scraped every 15 s for --idle-seconds, interleaved as bench/exporter_cpu.py does (0 skips it).
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from exporter_cpu import REPO, cpu_shares, free_port, wait_http

from exporter.discovery.scan import Discoverer

PATTERN = "sglang|vllm|llama-server|llama_cpp|text-generation-launcher|tritonserver"


def cpu_ms(action: Callable[[], object]) -> float:
    """CPU milliseconds of this process and its waited-for children during action()."""
    own = time.process_time()
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    action()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    child = (after.ru_utime - children.ru_utime) + (after.ru_stime - children.ru_stime)
    return (time.process_time() - own + child) * 1000


def idle_shares(seconds: float) -> dict[str, float]:
    """CPU share of the exporter with no config (discovery only) and of node_exporter."""
    port = free_port()
    exporter = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}",
                "--history.path=", "--log.level=warn"]  # fmt: skip
    shares: dict[str, float] = {}
    node = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
    runs = [("model-load-exporter, no config", exporter, port)]
    if node:
        node_port = free_port()
        runs.append(("node_exporter (defaults)",
                     [node, f"--web.listen-address=127.0.0.1:{node_port}", "--log.level=warn"],
                     node_port))  # fmt: skip
    for name, argv, listen in runs:
        proc = subprocess.Popen(
            argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            url = f"http://127.0.0.1:{listen}/metrics"
            wait_http(url)
            time.sleep(5)  # past start-up and the first discovery passes
            shares[name] = cpu_shares({name: (proc, url)}, seconds)[name]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    return shares


def run_quiet(*argv: str) -> None:
    subprocess.run(argv, stdout=subprocess.DEVNULL, check=False)


def psutil_pass() -> None:
    for proc in psutil.process_iter(["cmdline"]):
        _ = proc.info["cmdline"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=1000)
    parser.add_argument("--passes", type=int, default=60)
    parser.add_argument("--interval", type=float, default=5.0, help="discovery.interval, s")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    args = parser.parse_args()

    scratch = Path(tempfile.mkdtemp(prefix="discovery-bench-"))
    fake_server = scratch / "llama-server"
    shutil.copy(shutil.which("sleep") or "/bin/sleep", fake_server)
    started: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(args.processes):
            started.append(subprocess.Popen(["sleep", "3600"], close_fds=True))
        for _ in range(2):
            started.append(subprocess.Popen([str(fake_server), "3600"], close_fds=True))
        time.sleep(1.0)  # let every child finish exec
        total = sum(1 for name in os.listdir("/proc") if name.isdigit())

        discoverer = Discoverer()
        found: list[object] = []
        cold = cpu_ms(lambda: found.extend(discoverer.scan()))
        second = cpu_ms(discoverer.scan)
        steady = [cpu_ms(discoverer.scan) for _ in range(args.passes)]
        others = {
            "ps -eo pid,args": cpu_ms(lambda: run_quiet("ps", "-eo", "pid,args")),
            "pgrep -af": cpu_ms(lambda: run_quiet("pgrep", "-af", PATTERN)),
            "psutil.process_iter(cmdline)": cpu_ms(psutil_pass),
        }
        for proc in started[-2:]:  # the stand-in servers: an idle host has none
            proc.kill()
            proc.wait()
        idle = idle_shares(args.idle_seconds) if args.idle_seconds > 0 else {}
    finally:
        for proc in started:
            proc.kill()
        for proc in started:
            proc.wait()
        shutil.rmtree(scratch, ignore_errors=True)

    median = statistics.median(steady)
    worst = max(steady)
    print(f"{total} processes on the host ({args.processes} sleep), servers found: {len(found)}")
    print(f"{'pass':<32} {'CPU ms':>8} {'x ours':>8}")
    rows = [
        ("ours, first (cold)", cold),
        ("ours, second (new pids again)", second),
        (f"ours, steady (median of {args.passes})", median),
        (f"ours, steady (worst of {args.passes})", worst),
        *others.items(),
    ]
    for name, value in rows:
        print(f"{name:<32} {value:8.2f} {value / median:8.1f}")
    share = median / 1000 / args.interval
    print(f"discovery every {args.interval:g} s: {share:.3%} of one core")
    print(f"target < 20 ms a steady pass: {'yes' if median < 20 else 'NO'} ({median:.2f} ms)")
    node = idle.get("node_exporter (defaults)")
    for name, value in idle.items():
        ratio = f"   {value / node:5.2f}x node_exporter" if node else ""
        print(f"idle, {name:36s} {value:7.3%} of one core{ratio}")
    return 0 if median < 20 else 1


if __name__ == "__main__":
    sys.exit(main())
