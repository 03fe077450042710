"""Issue 37, rows 1 and 6: a target's name is its user's, and root's servers are never crowded out.

The exporter runs as root with no config, a real subprocess. Root's server is the vLLM stand-in
(tests/helpers/standins.py: `vllm serve /tmp/root-only-.../llama --port P`, the simulator
underneath: real weights in a directory only root may enter, a real endpoint); the other users'
servers are real processes of `nobody` (and of uid 60001, a user with no passwd entry) whose
command lines say `vllm serve ./llama --port P` in a directory of their own, their standard
error a log with vLLM's fatal line. A kubelet's probe loop (tests/helpers/kubelet.py) asks
/probe/alive and /probe/ready for root's name all along, across root's restarts and their gaps.
Each row's test failed on the code before this change (the report says how); the controls show
a user's own servers found, probed, named and followed as before.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.fakeservers import FakeServers, world_dir
from helpers.hostile import ExporterProcess, discovering_exporter
from helpers.kubelet import Probe, Prober
from helpers.standins import install
from helpers.support import ModelServer, free_port, wait_for
from helpers.users import NOBODY
from test_trust import refused, targets

from exporter.sim.shards import generate_shards

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv")]

OTHER = 60001  # a second ordinary user
PERIOD = 0.25  # the probe loops' period (a pod would use 10 s)
VLLM_HEAD = "(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.32"
FATAL = "RuntimeError: Engine core initialization failed. See root cause above."
# What root's server is told to be: a second or two of start-up, weights and initialising.
SIM_ARGS = "--startup-seconds 0.3 --init-seconds 0.5 --read-rate 32MB/s --cached-read-rate 64MB/s"


@pytest.fixture
def standins(tmp_path: Path) -> tuple[Path, Path]:
    return install(tmp_path / "standins")


@pytest.fixture
def root_weights() -> Iterator[Path]:
    """Root's model, `llama`, in a directory only root may enter."""
    path = world_dir("root-only-")
    path.chmod(0o700)
    generate_shards(path / "llama", 2, 4 << 20)
    yield path / "llama"
    shutil.rmtree(path)


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """nobody's own directory: a `llama` of its own beside its server's log."""
    path = world_dir("nobody-")
    (path / "llama").mkdir()
    (path / "llama" / "model.safetensors").write_bytes(b"\1" * 4096)
    for entry in (path, path / "llama", path / "llama" / "model.safetensors"):
        os.chown(entry, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path)


class RootServer:
    """Root's `vllm serve WEIGHTS --port PORT`: the stand-in's console script, as a vLLM
    installed in a venv runs, the simulator underneath."""

    def __init__(self, standins: tuple[Path, Path], weights: Path, port: int) -> None:
        site, scripts = standins
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
            "STANDIN_SIM_ARGS": SIM_ARGS,
        }
        self.proc = subprocess.Popen(
            [str(scripts / "vllm"), "serve", str(weights), "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.pid = self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=15)


class Lookalike:
    """`vllm serve ./llama --port PORT` of `uid` in its own directory, which says in its log,
    every half second, that its load failed (a log found for a process is read from its end:
    a line written before would be skipped)."""

    def __init__(self, user_dir: Path, port: int, uid: int = NOBODY) -> None:
        self.log = user_dir / f"server-{uid}-{time.monotonic_ns()}.log"
        self.log.touch()
        os.chown(self.log, uid, uid)
        argv = ["vllm", "serve", "./llama", "--port", str(port)]
        self.fakes = FakeServers([argv], uid=uid, cwd=user_dir, stderr=self.log)
        self.pid = self.fakes.pids[0]
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._say_failed, daemon=True)
        self._writer.start()

    def _say_failed(self) -> None:
        while not self._stop.wait(0.5):
            with self.log.open("a") as log:
                log.write(f"{VLLM_HEAD}\n{FATAL}\n")

    def stop(self) -> None:
        self._stop.set()
        self._writer.join()
        self.fakes.stop()


def target(exporter: ExporterProcess, name: str) -> dict[str, Any] | None:
    status = exporter.get("/api/v1/status").json()
    return next((t for t in status["targets"] if t["target"] == name), None)


def serving(exporter: ExporterProcess, name: str, pid: int, timeout: float = 40) -> dict[str, Any]:
    """The target `name` once it watches `pid` and its server is ready."""

    def ready() -> dict[str, Any] | None:
        entry = target(exporter, name)
        mine = entry is not None and entry.get("discovered", {}).get("pid") == pid
        return entry if mine and entry["probes"]["ready"] else None

    return dict(wait_for(ready, timeout=timeout, interval=0.2))


def served(exporter: ExporterProcess, name: str, pid: int) -> dict[str, Any] | None:
    """`serving`, or None when the name never came to watch `pid` (the probes say why)."""
    try:
        return serving(exporter, name, pid)
    except AssertionError:
        return None


def failing(exporter: ExporterProcess, name: str) -> dict[str, Any] | None:
    """The target `name` while alive fails for it."""
    entry = target(exporter, name)
    return entry if entry is not None and not entry["probes"]["alive"] else None


def probe_loops(exporter: ExporterProcess, name: str) -> tuple[Prober, Prober]:
    alive = Prober(f"{exporter.url}/probe/alive?target={name}", PERIOD, timeout=2.0)
    ready = Prober(f"{exporter.url}/probe/ready?target={name}", PERIOD, timeout=2.0)
    return alive.start(), ready.start()


def stop(*probers: Prober) -> None:
    for prober in probers:
        prober.stop()


def others_words(probes: list[Probe]) -> list[Probe]:
    """The answers that speak with the look-alike's log."""
    return [p for p in probes if "Engine core" in p.body]


def failed(probes: list[Probe], since: float = 0.0) -> list[Probe]:
    return [p for p in probes if p.at >= since and not p.ok]


def names_of(exporter: ExporterProcess) -> set[str]:
    return {t["target"] for t in exporter.get("/api/v1/status").json()["targets"]}


def why(entry: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {e["what"]: e for e in entry["discovered"]["why"]}


# -- row 1: a look-alike in the gap of root's restart ------------------------------------------


def test_row1_a_lookalike_in_the_restart_gap_never_speaks_for_roots_name(
    tmp_path: Path, standins: tuple[Path, Path], root_weights: Path, user_dir: Path
) -> None:
    port = free_port()
    name = f"vllm-llama-{port}"
    with discovering_exporter(tmp_path) as exporter:
        server = RootServer(standins, root_weights, port)
        fake: Lookalike | None = None
        restarted: RootServer | None = None
        try:
            serving(exporter, name, server.pid)
            alive, ready = probe_loops(exporter, name)
            time.sleep(4 * PERIOD)
            gap = time.time()
            server.stop()
            fake = Lookalike(user_dir, port)  # in the gap, before root's server is back
            time.sleep(3.0)  # discovery passes and log reads in the gap
            restarted = RootServer(standins, root_weights, port)
            back = time.time()
            entry = served(exporter, name, restarted.pid)
            time.sleep(4 * PERIOD)
            stop(alive, ready)
            said = refused(exporter, "name_owned")
        finally:
            for each in (fake, restarted, server):
                if each is not None:
                    each.stop()
    assert others_words(alive.probes) == [] and others_words(ready.probes) == []
    # alive failed only in the gap, and said why with root's own server's exit.
    down = failed(alive.probes)
    assert down and all(gap <= p.at <= back + 5 for p in down), down
    assert all(p.body.startswith("process exited") for p in down), down
    assert alive.probes[-1].ok and ready.probes[-1].ok
    assert entry is not None and entry["discovered"]["pid"] == restarted.pid
    assert said == 1  # the look-alike, refused once
    assert why(entry)["owner"]["value"] == "uid 0"
    assert why(entry)["name refused"]["value"] == f"pid {fake.pid} of uid {NOBODY}"


def test_row1_roots_server_takes_its_name_from_a_lookalike_that_started_first(
    tmp_path: Path, standins: tuple[Path, Path], root_weights: Path, user_dir: Path
) -> None:
    """The look-alike holds the name first and fails it (alive 503 with its fatal line): root's
    server, once seen, has that name all the same, never `NAME-PID`; the look-alike is refused,
    its load is no part of the name's history; root's restart with the look-alike still there
    keeps the name root's."""
    port = free_port()
    name = f"vllm-llama-{port}"
    with discovering_exporter(tmp_path) as exporter:
        fake = Lookalike(user_dir, port)
        server: RootServer | None = None
        restarted: RootServer | None = None
        try:
            held = wait_for(lambda: failing(exporter, name))
            assert held["discovered"]["pid"] == fake.pid  # the attack, as it was
            assert "Engine core" in held["probes"]["alive_line"]
            alive, ready = probe_loops(exporter, name)
            server = RootServer(standins, root_weights, port)
            served(exporter, name, server.pid)
            taken = time.time()
            gap = time.time()
            server.stop()
            time.sleep(2.0)
            restarted = RootServer(standins, root_weights, port)
            back = time.time()
            entry = served(exporter, name, restarted.pid)
            time.sleep(4 * PERIOD)
            stop(alive, ready)
            loads = exporter.get("/api/v1/loads", params={"target": name}).json()["loads"]
            every = exporter.get("/api/v1/loads").json()["loads"]
            names, watched = names_of(exporter), targets(exporter)
        finally:
            for each in (fake, restarted, server):
                if each is not None:
                    each.stop()
    assert all(p.at < taken for p in others_words(alive.probes))
    down = failed(alive.probes, since=taken)
    assert all(gap <= p.at <= back + 5 and p.body.startswith("process exited") for p in down), down
    assert alive.probes[-1].ok and ready.probes[-1].ok
    assert entry is not None and entry["discovered"]["pid"] == restarted.pid
    assert not [n for n in names if n.startswith(f"{name}-")], names  # root's is never renamed
    assert fake.pid not in watched
    assert all(load["outcome"] == "ready" and not load.get("fatal") for load in loads), loads
    assert len(loads) == 2  # root's two loads; the look-alike's failed one kept apart:
    assert any(load["target"] == name and load.get("fatal") for load in every), every


def test_row1_an_exporter_restart_does_not_forget_whose_the_name_was(
    tmp_path: Path, standins: tuple[Path, Path], root_weights: Path, user_dir: Path
) -> None:
    """Root's server loaded once under the name; the exporter and root's server both restart
    (a node's reboot), the look-alike first: history says whose the name is, and the
    look-alike is refused while root's server is not up yet."""
    port = free_port()
    name = f"vllm-llama-{port}"
    with discovering_exporter(tmp_path) as exporter:
        server = RootServer(standins, root_weights, port)
        try:
            serving(exporter, name, server.pid)
            wait_for(lambda: exporter.get("/api/v1/loads", params={"target": name}).json()["loads"])
        finally:
            server.stop()
    fake = Lookalike(user_dir, port)
    restarted: RootServer | None = None
    try:
        with discovering_exporter(tmp_path) as exporter:  # the same history file
            alive, ready = probe_loops(exporter, name)
            time.sleep(3.0)  # passes that see the look-alike, none root's server
            restarted = RootServer(standins, root_weights, port)
            entry = served(exporter, name, restarted.pid)
            time.sleep(4 * PERIOD)
            stop(alive, ready)
            said = refused(exporter, "name_owned")
    finally:
        fake.stop()
        if restarted is not None:
            restarted.stop()
    assert others_words(alive.probes) == [] and failed(alive.probes) == []
    assert entry is not None and said == 1
    assert ready.probes[-1].ok


# -- row 6: two users' look-alikes fill max_targets ---------------------------------------------


def test_row6_roots_server_is_watched_though_other_users_fill_max_targets(
    tmp_path: Path, standins: tuple[Path, Path], root_weights: Path
) -> None:
    """16 servers of nobody's and 16 of another user's: discovery.max_targets (32) is full, and
    root's server, started then, is watched, probed and ready; the newest target of a user
    holding most gives way, and the bounds still hold."""
    port = free_port()
    name = f"vllm-llama-{port}"
    crowds = []
    server: RootServer | None = None
    with discovering_exporter(tmp_path) as exporter:
        try:
            for uid in (NOBODY, OTHER):
                argvs = [["vllm", "serve", f"crowd-{uid}-{i}", "--port", str(free_port())]
                         for i in range(16)]  # fmt: skip
                crowds.append(FakeServers(argvs, uid=uid))
            wait_for(lambda: len(targets(exporter)) >= 32, timeout=30)
            crowd = {pid for fakes in crowds for pid in fakes.pids}
            before = len(crowd & targets(exporter).keys())  # this host may run others' servers
            alive, ready = probe_loops(exporter, name)
            server = RootServer(standins, root_weights, port)
            entry = served(exporter, name, server.pid)
            time.sleep(4 * PERIOD)
            stop(alive, ready)
            watched = targets(exporter)
            said = refused(exporter, "max_targets")
        finally:
            for each in (*crowds, server):
                if each is not None:
                    each.stop()
    assert entry is not None, ready.probes[-1]
    assert ready.probes[-1].ok and alive.probes[-1].body == "ready"
    assert len(watched) <= 32 and server.pid in watched
    assert len(crowd & watched.keys()) == before - 1  # one of theirs gave way
    assert said >= 1


# -- controls: a user's own servers, as before ------------------------------------------------


def test_a_users_own_server_is_found_probed_named_and_followed_as_before(
    tmp_path: Path, user_dir: Path
) -> None:
    endpoint = ModelServer()
    port = int(endpoint.url.rsplit(":", 1)[1])
    name = f"vllm-llama-{port}"
    argv = ["vllm", "serve", "./llama", "--port", str(port)]
    first = FakeServers([argv], cwd=user_dir)
    later: FakeServers | None = None
    try:
        with discovering_exporter(tmp_path) as exporter:
            serving(exporter, name, first.pids[0], timeout=20)
            answer = exporter.get(f"/probe/ready?target={name}")
            assert answer.status_code == 200, (answer.text, target(exporter, name))
            first.stop()  # its restart: the same user's, the same name
            later = FakeServers([argv], cwd=user_dir)
            serving(exporter, name, later.pids[0], timeout=20)
            assert exporter.get(f"/probe/alive?target={name}").status_code == 200
            assert refused(exporter, "name_owned") == 0
    finally:
        first.stop()
        if later is not None:
            later.stop()
        endpoint.close()


def test_two_servers_of_one_user_with_one_name_keep_theirs_across_a_restart(
    tmp_path: Path, user_dir: Path
) -> None:
    """The elder keeps the name, the younger is NAME-PID for as long as it runs: the elder's
    restart renames neither, its next process takes the name again."""
    endpoint = ModelServer()
    port = int(endpoint.url.rsplit(":", 1)[1])
    name = f"vllm-llama-{port}"
    argv = ["vllm", "serve", "./llama", "--port", str(port)]
    elder = FakeServers([argv], cwd=user_dir)
    younger = FakeServers([argv], cwd=user_dir)
    restarted: FakeServers | None = None
    try:
        with discovering_exporter(tmp_path) as exporter:
            second = f"{name}-{younger.pids[0]}"
            serving(exporter, name, elder.pids[0], timeout=20)
            serving(exporter, second, younger.pids[0], timeout=20)
            elder.stop()
            time.sleep(1.0)  # passes in the elder's gap
            restarted = FakeServers([argv], cwd=user_dir)
            serving(exporter, name, restarted.pids[0], timeout=20)
            entry = target(exporter, second)
            assert entry is not None and entry["discovered"]["pid"] == younger.pids[0]
            assert refused(exporter, "name_owned") == 0
    finally:
        for each in (elder, younger, restarted):
            if each is not None:
                each.stop()
        endpoint.close()
