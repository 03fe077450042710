"""The whole exporter against a server tree that churns: descriptors (CPU), children (memory).

    .venv/bin/python bench/tree_churn.py fds [--fds 15000] [--seconds 120] [--baseline CHECKOUT]
    .venv/bin/python bench/tree_churn.py fork [--files 300] [--child-life 1] [--seconds 600]
                                              [--baseline CHECKOUT]

Issue 37 rows 5 and 2, as its author ran them: the exporter as root with no config (discovery
on, 1-s sampling), and a process of an unprivileged user whose command line says `vllm serve MODEL
--port P` (a Python script named `vllm`; nothing listens on the port, so the target never settles
and every source keeps the 1-s pace, the worst case). The user is one of the tree's own (uid
61733, `discovery.users`), so other fakes on a shared host are never targets here.

* `fds`: the tree holds --fds descriptors of 64 library-like files and opens one more or
  closes it every 0.2 s, so the count moves between any two looks. Prints each exporter's CPU
  share of one core over --seconds (after --warmup), and each source's CPU per sample (the
  sampler thread's, plus what it ran with the process's rights on the actor's threads).
* `fork`: the tree maps --files files of its own under paths of 2,000 characters and forks a
  child every 0.2 s that lives --child-life seconds (each child maps them too, so about five
  children are in the tree at any sample). Prints each exporter's RSS every
  --report-every seconds; flat means within +-10 % of the first report after --warmup. A
  baseline is stopped once its RSS passes --baseline-cap (it grew ~8 MB/s before the fix).

With --baseline, another checkout (`git worktree add /tmp/before main`) runs beside this one,
watching the same tree over the same window, so a change shows as a ratio in one run. CPU time
comes from /proc/PID/task/*/schedstat (exact). Run as root (it needs setpriv).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from exporter_cpu import on_cpu_seconds  # noqa: E402
from helpers.support import free_port  # noqa: E402

# The tree's user: one of its own, named in `discovery.users`, so that nothing else a shared host
# runs that looks like a server (other tests' fakes) becomes a target of the exporters measured.
TREE_UID = 61_733
SETPRIV = ["setpriv", f"--reuid={TREE_UID}", f"--regid={TREE_UID}", "--clear-groups"]
CHURN_EVERY = 0.2  # seconds: the pace, for a descriptor and for a child

# The tree: a script named `vllm`, so that discovery takes `python3 .../vllm serve M --port P`
# for a vLLM server. What it does comes in its environment.
FAKE_VLLM = r"""#!/usr/bin/python3
import mmap, os, resource, signal, sys, time
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
libs, mode, count = os.environ["FAKE_LIBS"], os.environ["FAKE_MODE"], int(os.environ["FAKE_N"])
every, life = float(os.environ["FAKE_EVERY"]), float(os.environ["FAKE_LIFE"])
names = sorted(os.path.join(libs, n) for n in os.listdir(libs))
held = []
if mode == "fds":
    held = [os.open(names[i % len(names)], os.O_RDONLY) for i in range(count)]
else:
    for name in names:
        fd = os.open(name, os.O_RDONLY)
        held.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
        os.close(fd)
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children reaped by the kernel
print("ready", flush=True)
extra = None
while True:
    time.sleep(every)
    if mode == "fds":
        if extra is None:
            extra = os.open(names[0], os.O_RDONLY)
        else:
            os.close(extra)
            extra = None
    elif os.fork() == 0:
        time.sleep(life)
        os._exit(0)
"""

# The exporter as `serve` runs it, each source's sample timed on its own thread and on the
# actor's threads while it acts for a process (tests' helpers stay out: any checkout runs it).
LAUNCH = r"""
import collections, json, signal, sys, threading, time
from exporter.trust.asprocess import Actor
from exporter.config.schema import load_config
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.runtime.wiring import Runtime
from exporter.runtime.sampler import Sampler

config, listen, out = sys.argv[1:4]
cpu, runs = collections.Counter(), collections.Counter()
lock, here = threading.Lock(), threading.local()

def timed(name, fn):
    def run(*args, **kwargs):
        outer, here.name = getattr(here, "name", None), name
        started = time.thread_time()
        try:
            return fn(*args, **kwargs)
        finally:
            spent = time.thread_time() - started
            with lock:
                cpu[name] += spent
                runs[name] += 1
            here.name = outer
    return run

add, add_loop, call = Sampler.add, Sampler.add_loop, Actor.call
Sampler.add = lambda self, source, target, sample, *a, **k: add(
    self, source, target, timed(source.name, sample), *a, **k)
Sampler.add_loop = lambda self, name, fn, *a, **k: add_loop(self, name, timed(name, fn), *a, **k)
Actor.call = lambda self, rights, fn, timeout=None: call(
    self, rights, timed(f"{getattr(here, 'name', None) or 'other'} as the process", fn), timeout)

runtime = Runtime(load_config(config))
server = HttpServer(WebApp(runtime), listen)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
runtime.start()
server.start()
print("READY", flush=True)
signal.sigwait({signal.SIGTERM})
with lock:
    json.dump({"cpu": cpu, "runs": runs}, open(out, "w"))
server.stop()
runtime.stop()
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Exporter:
    """One checkout's exporter process as root, discovering the tree's user's servers, with no
    target configured and no history."""

    def __init__(self, name: str, checkout: Path, work: Path) -> None:
        self.name = name
        self.out = work / f"sources-{len(list(work.glob('sources-*')))}.json"
        config = work / f"config-{self.out.stem}.yaml"
        settings = {"history_path": "", "discovery": {"users": [TREE_UID]}}
        config.write_text(json.dumps(settings))
        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LAUNCH, str(config), f"127.0.0.1:{self.port}", str(self.out)],
            cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        if self.proc.stdout.readline() != "READY\n":
            raise SystemExit(f"{name}: the exporter did not start")
        self.stopped_at: float | None = None

    def discovered(self) -> int:
        import urllib.request

        url = f"http://127.0.0.1:{self.port}/api/v1/status"
        with urllib.request.urlopen(url, timeout=10) as answer:
            return len(json.load(answer)["targets"])

    def stop(self) -> dict[str, dict[str, float]]:
        """Stop it; what its sources spent ({} when it was stopped already)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=60)
        with contextlib.suppress(OSError, ValueError):
            return dict(json.loads(self.out.read_text()))
        return {}


def tree(work: Path, mode: str, count: int, life: float) -> subprocess.Popen[str]:
    """The fake server as TREE_UID, ready: `count` descriptors (fds) or mapped files (fork)."""
    libs = work / "libs"
    if mode == "fork":  # long paths: the memory they took was the row's multiplier
        for part in "abcdefghij":
            libs = libs / (part * 200)
    libs.mkdir(parents=True)
    files = 64 if mode == "fds" else count
    for i in range(files):
        (libs / f"lib{'x' * 40 if mode == 'fork' else ''}{i:05d}.so").write_bytes(os.urandom(4096))
    model = work / "models" / "llama"
    model.mkdir(parents=True)
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (model / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    script = work / "bin" / "vllm"
    script.parent.mkdir()
    script.write_text(FAKE_VLLM)
    for path in [work, *work.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or path == script else 0o644)
    env = {"PATH": os.defpath, "FAKE_LIBS": str(libs), "FAKE_MODE": mode, "FAKE_N": str(count),
           "FAKE_EVERY": str(CHURN_EVERY), "FAKE_LIFE": str(life)}  # fmt: skip
    server = subprocess.Popen(
        [*SETPRIV, "/usr/bin/python3", str(script), "serve", str(model), "--port",
         str(free_port())],
        env=env, stdout=subprocess.PIPE, text=True, cwd="/",
    )  # fmt: skip
    assert server.stdout is not None
    if server.stdout.readline() != "ready\n":
        raise SystemExit("the fake server did not start")
    return server


def wait_discovered(exporters: list[Exporter], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(e.discovered() for e in exporters):
        if time.monotonic() > deadline:
            raise SystemExit("the fake server was not discovered")
        time.sleep(0.5)


def per_source(spent: dict[str, dict[str, float]], seconds: float) -> list[str]:
    """Each source's CPU per sample (its thread's, plus what it ran as the process)."""
    cpu, runs = spent.get("cpu", {}), spent.get("runs", {})
    lines = []
    for name in sorted(n for n in runs if not n.endswith(" as the process")):
        own, acting = cpu.get(name, 0.0), cpu.get(f"{name} as the process", 0.0)
        lines.append(
            f"    {name:<14} {runs[name]:>6} samples {1000 * (own + acting) / runs[name]:>8.3f} ms"
            f" each ({1000 * acting / runs[name]:.3f} as the process)"
            f" {100 * (own + acting) / seconds:>7.3f} % of a core"
        )
    return lines


def run_fds(exporters: list[Exporter], args: argparse.Namespace) -> None:
    time.sleep(args.warmup)
    before = {e.name: on_cpu_seconds(e.proc.pid) for e in exporters}
    started = time.monotonic()
    time.sleep(args.seconds)
    wall = time.monotonic() - started
    shares = {e.name: (on_cpu_seconds(e.proc.pid) - before[e.name]) / wall for e in exporters}
    print(f"\nCPU share of one core over {wall:.0f} s ({args.fds} descriptors, one opened or "
          f"closed every {CHURN_EVERY} s), {time.strftime('%Y-%m-%d')}:")  # fmt: skip
    for exporter in exporters:
        print(f"  {exporter.name:<28} {100 * shares[exporter.name]:6.2f} %")
    if len(exporters) == 2:
        ours, theirs = (shares[e.name] for e in exporters)
        print(f"  this checkout costs {ours / theirs:.2f}x the baseline's CPU")
    verdict = "meets" if shares[exporters[0].name] <= 0.05 else "MISSES"
    print(f"  goal, this checkout at most 5 % of a core: {verdict}")
    for exporter in exporters:
        seconds = args.warmup + args.seconds
        print(f"  {exporter.name}, per source since its start (about {seconds:.0f} s):")
        print("\n".join(per_source(exporter.stop(), seconds)))


def run_fork(exporters: list[Exporter], args: argparse.Namespace) -> None:
    time.sleep(args.warmup)
    first = {e.name: rss_mib(e.proc.pid) for e in exporters}
    seen: dict[str, list[float]] = {e.name: [first[e.name]] for e in exporters}
    started = time.monotonic()
    print(f"\nRSS (MiB) every {args.report_every:.0f} s, a child forked every {CHURN_EVERY} s "
          f"living {args.child_life} s mapping {args.files} files, "
          f"{time.strftime('%Y-%m-%d')}:")  # fmt: skip
    print(f"  {'seconds':>8} " + " ".join(f"{e.name:>28}" for e in exporters))
    print(f"  {0:>8.0f} " + " ".join(f"{first[e.name]:>28.1f}" for e in exporters))
    while (elapsed := time.monotonic() - started) < args.seconds:
        time.sleep(min(args.report_every, args.seconds - elapsed))
        row = []
        for exporter in exporters:
            if exporter.proc.poll() is not None:
                row.append(f"{'stopped':>28}")
                continue
            rss = rss_mib(exporter.proc.pid)
            seen[exporter.name].append(rss)
            row.append(f"{rss:>28.1f}")
            if exporter is not exporters[0] and rss > args.baseline_cap:
                exporter.stopped_at = time.monotonic() - started
                exporter.stop()
        print(f"  {time.monotonic() - started:>8.0f} " + " ".join(row), flush=True)
    for exporter in exporters:
        values = seen[exporter.name]
        spread = (max(values) - min(values)) / values[0]
        flat = "flat" if spread <= 0.10 else "NOT flat"
        stopped = (
            f", stopped at {exporter.stopped_at:.0f} s past {args.baseline_cap:.0f} MiB"
            if exporter.stopped_at is not None
            else ""
        )
        print(f"  {exporter.name}: {values[0]:.1f} -> {values[-1]:.1f} MiB, "
              f"min {min(values):.1f}, max {max(values):.1f} "
              f"({100 * spread:.1f} % of the first: {flat}){stopped}")  # fmt: skip
    for exporter in exporters:
        seconds = args.warmup + args.seconds
        print(f"  {exporter.name}, per source since its start (about {seconds:.0f} s):")
        print("\n".join(per_source(exporter.stop(), seconds)))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenario", choices=("fds", "fork"))
    parser.add_argument("--fds", type=int, default=15_000)
    parser.add_argument("--files", type=int, default=300)
    parser.add_argument("--child-life", type=float, default=1.0, help="seconds (fork)")
    parser.add_argument("--seconds", type=float, help="measured (fds: 120, fork: 600)")
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--report-every", type=float, default=30.0)
    parser.add_argument("--baseline", type=Path, help="another checkout to run beside this one")
    parser.add_argument("--baseline-cap", type=float, default=1024.0, help="MiB (fork)")
    parser.add_argument("--dir", default="/var/tmp")
    args = parser.parse_args()
    if args.seconds is None:
        args.seconds = 120.0 if args.scenario == "fds" else 600.0
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        raise SystemExit("run as root, with setpriv (util-linux): the tree runs as another user")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: clean up all the same
    checkouts = {"this checkout": REPO}
    if args.baseline is not None:
        if not (args.baseline / "exporter" / "__main__.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: not a checkout of model-load-exporter")
        checkouts[f"baseline {args.baseline.name}"] = args.baseline.resolve()
    work = Path(tempfile.mkdtemp(prefix="mle-tree-churn-", dir=args.dir))
    server = None
    exporters: list[Exporter] = []
    try:
        count = args.fds if args.scenario == "fds" else args.files
        server = tree(work, args.scenario, count, args.child_life)
        exporters = [Exporter(name, checkout, work) for name, checkout in checkouts.items()]
        wait_discovered(exporters)
        (run_fds if args.scenario == "fds" else run_fork)(exporters, args)
        return 0
    finally:
        for exporter in exporters:
            exporter.stop()
        if server is not None:
            server.kill()
            server.wait()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
