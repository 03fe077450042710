"""Fault drills: everything that can go wrong on a GPU host, at once, against one exporter.

One exporter watches eight targets, each with its own fault, while hostile clients hold
connections and a scraper watches /metrics every 100 ms. Every fault is switched on, seen (the
affected signal goes to 0), switched off, and seen to recover. Throughout: /metrics answers, no
sampling thread dies, none is left behind, memory stays bounded.

The faults: an endpoint that resets connections, one that answers 10 MB of garbage, one that
trickles its headers; weights deleted, weights replaced, 10,000 weight files; a 64-worker
process tree whose workers exit one by one, then its root; NVML raising on every call; the
history disk full; the wall clock jumping an hour ahead and back; 300 idle and 50 slowloris
clients. Item-by-item reproductions of issue 9 live in tests/test_hardening.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest
import requests
from helpers.fake_nvml import FakeNvml, h200_node
from helpers.hostile import CONNECTION_THREAD, IdleClients, Listener, fill, tiny_tmpfs
from helpers.support import RunningExporter, sample_value, wait_for

from exporter.config.reader import parse_config
from exporter.sources import ENDPOINT, PROCESS

pytestmark = pytest.mark.system

COMPLETION = b'{"choices":[{"text":"."}]}'
GARBAGE = os.urandom(10 << 20)  # made once: a fresh 10 MB per connection would grow our own RSS
NVML_CALLS = (
    "nvmlInit",
    "nvmlShutdown",
    "nvmlSystemGetDriverVersion",
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetName",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
)


class FaultyEndpoint(Listener):
    """A model server whose every connection gets the current mode's treatment."""

    def __init__(self) -> None:
        self.mode = "ready"
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        mode = self.mode
        try:
            conn.settimeout(5)
            conn.recv(65536)
            if mode == "ready":
                head = f"HTTP/1.1 200 OK\r\nContent-Length: {len(COMPLETION)}\r\n\r\n"
                conn.sendall(head.encode() + COMPLETION)
            elif mode == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            elif mode == "garbage":
                conn.sendall(GARBAGE)
            elif mode == "trickle":
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not self._stop.wait(0.5):
                    conn.sendall(b"X")
        except OSError:
            pass
        finally:
            conn.close()


TREE = textwrap.dedent(
    """
    import os, sys, time
    children = []
    for i in range(64):
        pid = os.fork()
        if pid == 0:
            time.sleep(float(sys.argv[2]) + i * 0.03)
            os._exit(0)
        children.append(pid)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(f"{os.getpid()}\\n")
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    for pid in children:
        os.waitpid(pid, 0)
    time.sleep(float(sys.argv[3]))
    """
)


def start_tree(pidfile: Path, workers_after: float, root_after: float) -> subprocess.Popen[bytes]:
    """A root with 64 workers; the workers exit one by one, then the root."""
    pidfile.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", TREE, str(pidfile), str(workers_after), str(root_after)]
    )
    wait_for(pidfile.exists, timeout=10)
    return proc


class JumpingClock:
    """Wall time plus an offset the drill can move (an NTP step, a VM resumed)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.time() + self.offset


class Scraper:
    """Scrapes /metrics every 100 ms on its own thread; remembers failures and the slowest."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.failures: list[str] = []
        self.slowest = 0.0
        self.count = 0
        self.last = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with requests.Session() as session:
            while not self._stop.wait(0.1):
                started = time.monotonic()
                try:
                    response = session.get(self.url + "/metrics", timeout=10)
                    response.raise_for_status()
                    self.last = response.text
                except requests.RequestException as exc:
                    self.failures.append(f"{type(exc).__name__}: {exc}")
                self.slowest = max(self.slowest, time.monotonic() - started)
                self.count += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def value(text: str, name: str, **labels: str) -> float | None:
    return sample_value(text, name, **labels)


@pytest.fixture
def drill(tmp_path: Path) -> Iterator[dict[str, Any]]:
    endpoints = {name: FaultyEndpoint() for name in ("reset", "garbage", "trickle", "ok")}
    weights = {name: tmp_path / name for name in ("gone", "replaced", "many")}
    for directory in weights.values():
        directory.mkdir()
    (weights["gone"] / "a.safetensors").write_bytes(b"\0" * 65536)
    (weights["replaced"] / "a.safetensors").write_bytes(b"\0" * 65536)
    for i in range(10_000):
        (weights["many"] / f"shard-{i:05d}.safetensors").write_bytes(b"\0")
    pidfile = tmp_path / "tree.pid"
    tree = start_tree(pidfile, workers_after=4, root_after=60)
    nvml = FakeNvml(h200_node(2))
    clock = JumpingClock()
    with tiny_tmpfs(tmp_path / "history", "256k") as history:

        def target(name: str, url: str, **extra: Any) -> dict[str, Any]:
            return {"name": name, "endpoint": {"url": url, "timeout": "1s"}, **extra}

        targets = [
            target("reset", endpoints["reset"].url),
            target("garbage", endpoints["garbage"].url),
            target("trickle", endpoints["trickle"].url),
            target("gone", endpoints["ok"].url, weights={"paths": [str(weights["gone"])]}),
            target("replaced", endpoints["ok"].url, weights={"paths": [str(weights["replaced"])]}),
            target("many", endpoints["ok"].url, weights={"paths": [str(weights["many"])]}),
            target("tree", endpoints["ok"].url, process={"pidfile": str(pidfile)}),
        ]
        config = parse_config(
            {
                "sample_interval": "200ms",
                "history_path": str(history / "history.sqlite"),
                "targets": targets,
            },
            source="drill",
        )
        running = RunningExporter(config, nvml=nvml, clock=clock)
        # NvmlSource retries a failed init every 60 s by default; a drill cannot wait that long.
        running.runtime.nvml._retry_interval = 0.5
        try:
            yield {
                "running": running,
                "endpoints": endpoints,
                "weights": weights,
                "pidfile": pidfile,
                "tree": tree,
                "nvml": nvml,
                "clock": clock,
                "history": history,
            }
        finally:
            running.stop()
            tree.kill()
            tree.wait()
            for endpoint in endpoints.values():
                endpoint.close()


def test_every_fault_at_once_is_seen_and_recovered_from(drill: dict[str, Any]) -> None:
    running: RunningExporter = drill["running"]
    endpoints: dict[str, FaultyEndpoint] = drill["endpoints"]
    weights: dict[str, Path] = drill["weights"]
    nvml: FakeNvml = drill["nvml"]
    clock: JumpingClock = drill["clock"]
    runtime = running.runtime

    def up(name: str) -> float | None:
        return value(scraper.last, "model_load_endpoint_up", target=name)

    def source_up(source: str, target: str = "") -> float | None:
        return value(scraper.last, "model_load_source_up", source=source, target=target)

    scraper = Scraper(running.url)
    try:
        # Healthy first: every endpoint ready, weights seen, GPUs read, history kept.
        wait_for(
            lambda: (
                all(up(n) == 1 for n in ("reset", "garbage", "trickle", "gone", "tree"))
                and value(scraper.last, "model_load_weights_files", target="many") == 10_000
                and source_up("nvml") == 1
                and value(scraper.last, "model_load_history_up") == 1
                and value(scraper.last, "model_load_process_up", target="tree") == 1
            ),
            timeout=30,
        )
        assert tree_pids(runtime) == 65
        threads = thread_names()
        rss = rss_bytes()

        # Break everything.
        idle = IdleClients(running.http.port, 300)
        slow = IdleClients(running.http.port, 50, trickle=b"GET /metrics HTTP/1.1\r\nX: ")
        for name in ("reset", "garbage", "trickle"):
            endpoints[name].mode = name
        shutil.rmtree(weights["gone"])
        replacement = weights["replaced"] / ".a.safetensors.new"
        replacement.write_bytes(b"\0" * 131072)
        os.replace(replacement, weights["replaced"] / "a.safetensors")
        for call in NVML_CALLS:
            nvml.failing[call] = pynvml.NVMLError_Unknown
        filler = fill(drill["history"])
        clock.offset = 3600.0

        wait_for(
            lambda: (
                up("reset") == 0
                and up("garbage") == 0
                and up("trickle") == 0
                and source_up("pagecache", "gone") == 0
                and value(scraper.last, "model_load_weights_bytes", target="replaced") == 131072
                and source_up("nvml") == 0
            ),
            timeout=15,
        )
        text = scraper.last
        for name, result in (("reset", "refused"), ("garbage", "error"), ("trickle", "timeout")):
            assert value(text, "model_load_endpoint_probes_total", target=name, result=result)
        assert "no weight files" in running.status()["targets"][3]["sources"]["pagecache"]["error"]
        assert value(text, "model_load_weights_files", target="many") == 10_000

        # The 64 workers exit one by one and the tree is followed; then the root is killed.
        wait_for(lambda: tree_pids(runtime) == 1, timeout=15)
        assert value(scraper.last, "model_load_process_up", target="tree") == 1
        drill["tree"].kill()
        drill["tree"].wait()
        wait_for(lambda: value(scraper.last, "model_load_process_up", target="tree") == 0)

        # Repair. Each endpoint outage was a load (3 failed probes, no process matching): it
        # ends when the endpoint answers, and its record meets the full disk.
        for name in ("reset", "garbage", "trickle"):
            endpoints[name].mode = "ready"
        weights["gone"].mkdir()
        (weights["gone"] / "a.safetensors").write_bytes(b"\0" * 65536)
        nvml.failing.clear()
        new_tree = start_tree(drill["pidfile"], workers_after=60, root_after=60)
        try:
            wait_for(
                lambda: (
                    all(up(n) == 1 for n in ("reset", "garbage", "trickle"))
                    and source_up("pagecache", "gone") == 1
                    and source_up("nvml") == 1
                    and value(scraper.last, "model_load_process_up", target="tree") == 1
                ),
                timeout=20,
            )
            wait_for(lambda: value(scraper.last, "model_load_history_up") == 0, timeout=10)
            filler.unlink()
            wait_for(lambda: value(scraper.last, "model_load_history_up") == 1, timeout=10)
            loads = requests.get(running.url + "/api/v1/loads?target=reset", timeout=5).json()
            assert loads["loads"], "the load the full disk held back was written after all"

            # The wall clock steps back the hour: tracking restarts and follows on.
            stepped = runtime.targets["reset"].tracker
            clock.offset = 0.0
            wait_for(
                lambda: (
                    (tracker := runtime.targets["reset"].tracker) is not stepped
                    and tracker.state(time.time()).phase == "ready"
                )
            )
            endpoints["reset"].mode = "reset"
            wait_for(
                lambda: (
                    value(scraper.last, "model_load_phase", target="reset", phase="starting") == 1
                ),
                timeout=10,
            )
            endpoints["reset"].mode = "ready"
            wait_for(
                lambda: value(scraper.last, "model_load_phase", target="reset", phase="ready") == 1,
                timeout=10,
            )
        finally:
            new_tree.kill()
            new_tree.wait()
        idle.close()
        slow.close()

        # Nothing died, nothing was left behind, memory stayed bounded, scrapes never failed.
        assert all(loop.alive for loop in runtime.sampler._loops.values())
        with contextlib.suppress(AssertionError):
            wait_for(lambda: thread_names() == threads, timeout=10)
        assert thread_names() == threads  # which thread was left behind, if one was
        assert len([t for t in threading.enumerate() if t.name.startswith("http-")]) <= 5
        assert rss_bytes() - rss < 64 << 20
        assert runtime.sampler.latest(ENDPOINT, "reset") is not None
    finally:
        scraper.stop()
    assert scraper.failures == []
    assert scraper.count > 50
    assert scraper.slowest < 3.0, scraper.slowest


def tree_pids(runtime: Any) -> int:
    process = runtime.sampler.value(PROCESS, "tree")
    return len(process.pids) if process is not None and process.found else 0


def thread_names() -> list[str]:
    """Threads of this process but the HTTP server's pool (made on demand, at most 5) and the
    fake endpoints' thread per connection (one lives while a probe is answered: a snapshot
    taken then counted it)."""
    return sorted(
        t.name
        for t in threading.enumerate()
        if not t.name.startswith("http-") and t.name != CONNECTION_THREAD
    )


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def test_a_clock_stepped_back_restarts_tracking_and_follows_the_probes_after_it() -> None:
    """Deterministic: readings and ticks stepped by hand around a one-hour step back."""
    from exporter.runtime.wiring import Runtime
    from exporter.sources.endpoint import ProbeSample
    from exporter.vocabulary import ProbeResult, ServerKind

    clock = JumpingClock()
    config = parse_config(
        {"sample_interval": "1s", "history_path": "",
         "targets": [{"name": "m", "endpoint": {"url": "http://127.0.0.1:1"}}]}
    )  # fmt: skip
    runtime = Runtime(config, clock=clock)

    def probe(result: ProbeResult) -> None:
        sample = ProbeSample(result, 0.001, None, "", ServerKind.UNKNOWN, {})
        runtime.sampler.run_once(ENDPOINT, "m", lambda: sample)

    def phase() -> str:
        return runtime.targets["m"].tracker.state(clock()).phase

    clock.offset = 3600.0
    probe(ProbeResult.READY)
    runtime.tick()
    assert phase() == "ready"
    clock.offset = 0.0  # stepped back; the newest reading is still stamped an hour ahead
    runtime.tick()
    assert phase() == "ready"
    for _ in range(3):  # three failed probes after the step: an endpoint-only load begins
        clock.offset += 1.0
        probe(ProbeResult.REFUSED)
        runtime.tick()
    assert phase() == "starting"
    runtime.stop()
