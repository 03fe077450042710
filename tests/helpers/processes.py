"""The exporter and the simulator as child processes, started through the CLI like an operator
would, for the tests of the operator commands (wait, status, history) and the live page."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import requests

from exporter.sim.shards import generate_shards
from exporter.storage.cachectl import evict
from helpers.support import free_port, wait_for

CLI = (sys.executable, "-m", "exporter")


def cli(*args: str, timeout: float = 60, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """Run one `model-load-exporter` command to completion, capturing its output."""
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=timeout, check=False, **kwargs
    )


def evict_dir(directory: Path) -> None:
    for shard in directory.glob("*.safetensors"):
        evict(str(shard))


def cold_checkpoint(directory: Path, shards: int, size: int) -> Path:
    """A simulator checkpoint written afresh with none of it left in the page cache: writing
    a file caches it, and a load of a just-written file would read warm."""
    directory.mkdir(parents=True, exist_ok=True)
    generate_shards(directory, shards, size)
    evict_dir(directory)
    return directory


class ExitClock:
    """Wall-clock time at which a child process exited, taken the moment wait() returns."""

    def __init__(self, proc: subprocess.Popen[Any]) -> None:
        self.proc = proc
        self.exited_at: float | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        self.proc.wait()
        self.exited_at = time.time()

    def join(self, timeout: float) -> float:
        self._thread.join(timeout)
        assert self.exited_at is not None, f"{self.proc.args!r} still running after {timeout}s"
        return self.exited_at


# What the operator commands' tests load at: a cold and a warm load of the same few seconds.
PACE = ("--read-rate", "40MB/s", "--cached-read-rate", "40MB/s", "--startup-seconds", "0.5",
        "--init-seconds", "1")  # fmt: skip


class Simulator:
    """One run of `model-load-exporter simulate` on `port`, reading the shards in `weights`;
    `pace` is its speed flags (`extra` may override any of them: the last one wins)."""

    def __init__(
        self, tmp_path: Path, weights: Path, port: int, *extra: str, pace: tuple[str, ...] = PACE
    ) -> None:
        self.report = tmp_path / f"report-{time.monotonic_ns()}.json"
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [*CLI, "simulate", "--port", str(port), "--weights", str(weights),
             "--pidfile", str(tmp_path / "server.pid"), "--report", str(self.report), *pace,
             "--log-file", str(tmp_path / "server.log"), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self.exit = ExitClock(self.proc)

    def result(self, timeout: float = 30) -> dict[str, Any]:
        text = wait_for(lambda: self.report.exists() and self.report.read_text(), timeout)
        return dict(json.loads(text))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)


class Answering:
    """An exporter started as a process at `url`, asked over HTTP for its one target."""

    url: str

    def _ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def target(self) -> dict[str, Any]:
        status = requests.get(f"{self.url}/api/v1/status", timeout=5).json()
        return dict(status["targets"][0])


class Exporter(Answering):
    """`model-load-exporter serve` watching one simulated target named `sim`."""

    def __init__(self, tmp_path: Path, weights: Path, sim_port: int, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.history = tmp_path / "history.sqlite"
        self.log = (tmp_path / "exporter.log").open("w")
        self.proc = subprocess.Popen(
            [*CLI, "serve", "--target", "sim", "--endpoint", f"http://127.0.0.1:{sim_port}",
             "--probe", "completion", "--weights", str(weights),
             "--pidfile", str(tmp_path / "server.pid"), "--sample.interval", "250ms",
             "--history.path", str(self.history), "--web.listen-address", f"127.0.0.1:{self.port}",
             *extra],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(self._ready, 20)

    def until(self, *phases: str, timeout: float = 30) -> dict[str, Any]:
        """Poll until the target is in one of `phases`; its status entry then."""
        return dict(wait_for(lambda: (t := self.target())["phase"] in phases and t, timeout, 0.05))

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=10)
        self.log.close()


class Host:
    """One exporter (flags `exporter_flags`) on a module's worth of simulated loads of one set of
    shards, one load at a time."""

    def __init__(self, tmp: Path, shards: int, shard_size: int, *exporter_flags: str) -> None:
        self.tmp = tmp
        self.weights = tmp / "model"
        generate_shards(self.weights, shards, shard_size)
        self.sim_port = free_port()
        self.exporter = Exporter(tmp, self.weights, self.sim_port, *exporter_flags)
        self.sims: list[Simulator] = []

    def simulate(self, *extra: str) -> Simulator:
        """A cold load, started once the exporter has seen the previous server go."""
        for sim in self.sims:
            sim.stop()
        self.exporter.until("down", "failed")
        evict_dir(self.weights)
        sim = Simulator(self.tmp, self.weights, self.sim_port, *extra)
        self.sims.append(sim)
        return sim

    def wait_cmd(self, *extra: str) -> list[str]:
        return [*CLI, "wait", "--exporter", self.exporter.url, "--target", "sim", *extra]

    def close(self) -> None:
        for sim in self.sims:
            sim.stop()
        self.exporter.stop()
