"""End to end at the source level: the simulator writes each server's startup log, and a LogSource
follows it through a file and, as root, through a real journald, seeing each marker within one
sample of when the simulator wrote it (the simulator's report says when)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers import containerlog, loglines
from helpers.cgroups import cgroups, hierarchies, joining
from helpers.support import RunningExporter, free_port, wait_for

from exporter.config.schema import LogConfig
from exporter.load.events import LogEvent
from exporter.sim.serverlog import STEP_SHARES
from exporter.sources.logs import LogSample, LogSource
from exporter.vocabulary import Step

pytestmark = pytest.mark.system

INTERVAL = 0.25
SLACK = 0.35  # scheduling on a busy 2-core machine
JOURNAL_SLACK = 0.75
INIT_SECONDS = 2.0
SIM_FLAGS = (
    "--generate", "4", "--shard-size", "1MB", "--read-rate", "4MB/s", "--cached-read-rate",
    "4MB/s", "--startup-seconds", "0.3", "--init-seconds", str(INIT_SECONDS), "--port", "0",
    "--exit-after", "60s",
)  # fmt: skip


def simulate(tmp: Path, kind: str, *extra: str, log_file: Path | None = None) -> list[str]:
    command = [sys.executable, "-m", "exporter", "simulate", "--weights", str(tmp / "weights")]
    command += [*SIM_FLAGS, "--log-format", kind, "--report", str(tmp / "report.json"), *extra]
    return command + (["--log-file", str(log_file)] if log_file else [])


class Follower:
    """Samples a LogSource every INTERVAL and notes when each event was first reported."""

    def __init__(self, source: LogSource) -> None:
        self.source = source
        self.seen_at: dict[int, float] = {}
        self.events: dict[int, LogEvent] = {}
        self.sample: LogSample | None = None

    def poll(self) -> LogSample:
        self.sample = self.source.sample()
        now = time.time()
        for event in self.sample.events:
            if event.seq not in self.events:
                self.events[event.seq] = event
                self.seen_at[event.seq] = now
        return self.sample

    def first(self, kind: str) -> tuple[LogEvent, float]:
        seq = next(s for s, e in sorted(self.events.items()) if e.kind == kind)
        return self.events[seq], self.seen_at[seq]

    @property
    def kinds(self) -> list[str]:
        return [e.kind.value for _, e in sorted(self.events.items())]

    @property
    def done(self) -> bool:
        sample = self.sample
        return sample is not None and (sample.ready_at is not None or sample.fatal is not None)


def follow_all(followers: list[Follower], timeout: float = 40.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for follower in followers:
            follower.poll()
        if all(f.done for f in followers):
            return
        time.sleep(INTERVAL)
    raise AssertionError(f"not done in {timeout} s: {[f.kinds for f in followers]}")


def within_one_sample(
    follower: Follower, kind: str, written_at: float, slack: float = SLACK
) -> None:
    """The event's time is the marker's, and some sample reported it one interval later at most."""
    event, seen_at = follower.first(kind)
    assert written_at - 0.05 <= event.time <= written_at + INTERVAL + slack, (kind, event)
    assert seen_at - written_at <= INTERVAL + slack, (kind, seen_at - written_at)


SIM_STEPS = {  # the fine steps each simulated server goes through (serverlog.py), all sleeping
    "sglang": ("kv_cache", "compile", "cuda_graph", "warmup"),
    "vllm": ("compile", "kv_cache", "cuda_graph", "warmup"),
    "llamacpp": ("kv_cache", "warmup"),
    "tgi": ("warmup", "kv_cache", "cuda_graph"),
}
# Steps whose log shows both ends; vLLM logs nothing when its warm-up begins.
SEEN_STEPS = {**SIM_STEPS, "vllm": ("compile", "kv_cache", "cuda_graph")}


def step_seconds(kind: str) -> dict[Step, float]:
    steps = SIM_STEPS[kind]
    scale = INIT_SECONDS / sum(STEP_SHARES[s] for s in steps)
    return {Step(s): STEP_SHARES[s] * scale for s in SEEN_STEPS[kind]}


@contextlib.contextmanager
def running_command(command: list[str], **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL, **popen)
    try:
        yield child
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def test_simulator_logs_through_files(tmp_path: Path) -> None:
    """All four servers' formats at once, one file each, followed from before they exist."""
    cases = {kind: tmp_path / kind for kind in SIM_STEPS}
    followers: dict[str, Follower] = {}
    with contextlib.ExitStack() as stack:
        for kind, tmp in cases.items():
            tmp.mkdir()
            log = tmp / "server.log"
            followers[kind] = Follower(LogSource(LogConfig(file=str(log))))
            followers[kind].poll()
            stack.enter_context(running_command(simulate(tmp, kind, log_file=log)))
        follow_all(list(followers.values()))
    for kind, follower in followers.items():
        report = json.loads((cases[kind] / "report.json").read_text())
        sample = follower.sample
        assert sample is not None and sample.up and sample.format == kind
        assert sample.format_reason.startswith("auto: line 1 matched")
        assert follower.kinds[0] == "weights_begin" and follower.kinds[-1] == "ready"
        within_one_sample(follower, "weights_begin", report["weights_started_at"])
        within_one_sample(follower, "weights_end", report["weights_done_at"])
        within_one_sample(follower, "ready", report["ready_at"])
        steps = dict(sample.steps)
        for step, seconds in step_seconds(kind).items():
            # Whole-second stamps and read times: each end within a sample (and a second).
            assert steps[step] == pytest.approx(seconds, abs=INTERVAL + SLACK), (kind, step)
        if kind in ("sglang", "vllm"):
            assert sample.weights == (4, 4)
            assert sample.cuda_graphs is not None and sample.cuda_graphs[0] == sample.cuda_graphs[1]
        follower.source.close()


def test_a_crash_is_fatal_within_one_sample(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    follower = Follower(LogSource(LogConfig(file=str(log), format="llamacpp")))
    with running_command(
        simulate(tmp_path, "llamacpp", "--crash-at", "0.5", log_file=log)
    ) as child:
        follow_all([follower])
        ended = time.time()
        assert child.wait(10) == 1
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["outcome"] == "failed"
    event, seen_at = follower.first("fatal")
    assert "simulated crash after loading 50% of weights" in event.detail
    assert seen_at - (report["start_time"] + report["load_seconds"]) <= INTERVAL + SLACK
    assert seen_at <= ended


# --- a real journal ---------------------------------------------------------------------------


@pytest.fixture
def unit_cgroup() -> Iterator[tuple[str, Path]]:
    """A `system.slice/NAME.service` cgroup: journald derives `_SYSTEMD_UNIT=NAME.service` from a
    writer's cgroup, so `journalctl -u` matches it exactly as it matches a real unit."""
    unit = f"mle-logtest-{os.getpid()}.service"
    with cgroups(f"system.slice/{unit}", hierarchies(named=False)) as (path,):
        yield unit, path


def in_unit(cgroup: Path, command: list[str]) -> list[str]:
    """`command` in the unit's cgroup, its output to the journal as a unit's goes."""
    return joining([cgroup], ["systemd-cat", "-t", "sim", *command])


def test_simulator_logs_through_journald(
    tmp_path: Path, journald: None, unit_cgroup: tuple[str, Path]
) -> None:
    unit, cgroup = unit_cgroup
    since = time.time()
    follower = Follower(LogSource(LogConfig(journald_unit=unit), since=since))
    follower.poll()
    try:
        with running_command(in_unit(cgroup, simulate(tmp_path, "sglang"))):
            follow_all([follower])
    finally:
        follower.source.close()
    sample = follower.sample
    assert sample is not None and sample.up and sample.format == "sglang"
    assert sample.source == f"journald:{unit}"
    report = json.loads((tmp_path / "report.json").read_text())
    # journald stores, then journalctl wakes and writes: up to ~0.6 s more on this busy machine.
    within_one_sample(follower, "weights_begin", report["weights_started_at"], JOURNAL_SLACK)
    within_one_sample(follower, "ready", report["ready_at"], JOURNAL_SLACK)
    # The \r-redrawn bars reach journald as byte-array MESSAGEs, once each bar ends its line.
    assert follower.kinds.count("weights_progress") == 5
    assert follower.kinds.count("cuda_graph_progress") == 10
    steps = dict(sample.steps)
    for step, seconds in step_seconds("sglang").items():
        # journald's microsecond times refine the whole-second stamps.
        assert steps[step] == pytest.approx(seconds, abs=0.1), step


# --- the exporter following a server's log ------------------------------------------------------


def watch_load(running: RunningExporter, until: str, timeout: float = 40) -> list[dict[str, Any]]:
    """/api/v1/status every 0.1 s until the target's phase is `until`; each state with its time."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = running.status()
        seen.append({**status["targets"][0], "time": status["time"]})
        if seen[-1].get("phase") == until:
            return seen
        time.sleep(0.1)
    raise AssertionError(f"never {until}: {[(s.get('phase'), s.get('step')) for s in seen][-9:]}")


def first(seen: list[dict[str, Any]], key: str, value: str) -> float:
    return float(next(s["time"] for s in seen if s.get(key) == value))


def log_status(running: RunningExporter) -> dict[str, Any]:
    return dict(running.status()["targets"][0]["log"])


def exporter_with_log(
    start_exporter: Any, tmp_path: Path, port: int, log: dict[str, str] | None, **kwargs: Any
) -> RunningExporter:
    """An exporter watching one simulator (by its pidfile) and following its log: the one
    configured, or with `log` None the one it finds for itself."""
    target = {
        "name": "logged",
        "endpoint": {"url": f"http://127.0.0.1:{port}", "timeout": "1s"},
        "process": {"pidfile": str(tmp_path / "server.pid")},
    }
    if log is not None:
        target["log"] = log
    running: RunningExporter = start_exporter(
        {
            "sample_interval": f"{int(INTERVAL * 1000)}ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [target],
        },
        **kwargs,
    )
    return running


def exporter_follows_the_log(
    tmp_path: Path,
    start_exporter: Any,
    log: dict[str, str] | None,
    command: Callable[[list[str]], list[str]],
    slack: float,
    **kwargs: Any,
) -> RunningExporter:
    """Phases and steps in /api/v1/status follow the simulator's markers within one interval,
    and the finished load records the steps the log timed."""
    port = free_port()
    running = exporter_with_log(start_exporter, tmp_path, port, log, **kwargs)
    # A configured log is followed from the start; a found one once the server's process is.
    idle = ("step", "none") if log is not None else ("phase", "down")
    wait_for(lambda: running.status()["targets"][0].get(idle[0]) == idle[1])
    extra = ["--port", str(port), "--pidfile", str(tmp_path / "server.pid")]
    report_file = tmp_path / "report.json"
    with running_command(command(extra)):
        seen = watch_load(running, "ready")
        loads = wait_for(lambda: requests.get(f"{running.url}/api/v1/loads", timeout=5).json())
        report = json.loads(wait_for(lambda: report_file.exists() and report_file.read_text()))
    for key, value, written in (
        ("phase", "loading_weights", report["weights_started_at"]),
        ("phase", "initializing", report["weights_done_at"]),
        ("step", "cuda_graph", None),
        ("phase", "ready", report["ready_at"]),
    ):
        shown = first(seen, key, value)
        if written is not None:  # the report's ready_at is noted just after the port opens
            assert abs(shown - written) <= INTERVAL + slack, (value, shown - written)
    [load] = loads["loads"]
    phases = load["phase_seconds"]
    assert phases["starting"] == pytest.approx(
        report["weights_started_at"] - report["start_time"], abs=INTERVAL + slack
    )
    timed = step_seconds("sglang")
    # SGLang opens its port for the warm-up request, and a completion probe is answered during
    # it: the load ends there, and the warm-up is not part of it.
    assert set(timed) - set(phases) <= {Step.WARMUP}, phases
    for step in set(timed) & set(phases):
        assert phases[step] == pytest.approx(timed[step], abs=INTERVAL + slack), (step, phases)
    assert running.status()["targets"][0]["server"] == "sglang"
    text = running.metrics()
    assert 'model_load_phase_duration_seconds_count{phase="cuda_graph",target="logged"}' in text
    if log is not None:
        assert log_status(running)["found_by"] == "configured"
    return running


def test_exporter_follows_a_log_file(tmp_path: Path, start_exporter: Any) -> None:
    log_file = tmp_path / "server.log"
    exporter_follows_the_log(
        tmp_path,
        start_exporter,
        {"file": str(log_file)},
        lambda extra: simulate(tmp_path, "sglang", *extra, log_file=log_file),
        slack=SLACK,
    )


def test_exporter_follows_a_units_journal(
    tmp_path: Path, start_exporter: Any, journald: None, unit_cgroup: tuple[str, Path]
) -> None:
    unit, cgroup = unit_cgroup

    exporter_follows_the_log(
        tmp_path,
        start_exporter,
        {"journald_unit": unit},
        lambda extra: in_unit(cgroup, simulate(tmp_path, "sglang", *extra)),
        slack=JOURNAL_SLACK,
    )


def test_a_fatal_line_fails_the_load_with_the_servers_message(
    tmp_path: Path, start_exporter: Any
) -> None:
    port = free_port()
    log_file = tmp_path / "server.log"
    running = exporter_with_log(start_exporter, tmp_path, port, {"file": str(log_file)})
    command = simulate(tmp_path, "vllm", "--crash-during-init", log_file=log_file)
    with running_command(
        [*command, "--port", str(port), "--pidfile", str(tmp_path / "server.pid")]
    ):
        watch_load(running, "failed")
    state = running.status()["targets"][0]
    assert "simulated crash during initialization" in (state["fatal"] or "")
    [load] = requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"]
    assert load["outcome"] == "failed" and load["fatal"] == state["fatal"]


# --- the exporter finding the server's log by itself (exporter/logs/find.py) ----------------------

SHIM = Path(containerlog.__file__)  # dockerd's or containerd-shim's part: pipes -> log records


def redirected(redirects: str, command: list[str]) -> list[str]:
    """`command` with its output redirected as a shell line does it: `exec server >a 2>b`."""
    return ["sh", "-c", f'exec "$@" {redirects}', "sh", *command]


def in_container(
    dirs: list[Path], encoding: str, log: Path, command: list[str], *options: str
) -> list[str]:
    """`command` in the container's cgroups, its output written to `log` by a shim outside them."""
    shim = [sys.executable, str(SHIM), encoding, str(log), *options, "--"]
    return [*shim, *joining(dirs, command)]


def loads_of(running: RunningExporter, count: int) -> list[dict[str, Any]]:
    def loads() -> list[dict[str, Any]] | None:
        found = requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"]
        return found if len(found) >= count else None

    return list(wait_for(loads))


def test_exporter_finds_the_servers_stderr_file(tmp_path: Path, start_exporter: Any) -> None:
    stderr = tmp_path / "sglang.err"
    running = exporter_follows_the_log(
        tmp_path,
        start_exporter,
        None,
        lambda extra: redirected(f">/dev/null 2>{stderr}", simulate(tmp_path, "sglang", *extra)),
        slack=SLACK,
    )
    log = log_status(running)
    assert log["source"] == f"file:{stderr}" and log["up"] is True
    # The shell's `2>` truncates (the descriptor wrote every byte) and, on a busy machine, may
    # also create the file a clock tick after the process started: either shows it is its own.
    own = "(written from its first byte through this descriptor|created after the process started)"
    assert re.fullmatch(rf"stderr of pid \d+ is the regular file {re.escape(str(stderr))}, "
                        rf"{own}: read from its start", log["found_by"]), log  # fmt: skip


def test_an_exporter_started_mid_load_reads_the_found_log_from_the_start_and_refinds_it(
    tmp_path: Path, start_exporter: Any
) -> None:
    """The server writes its log (TGI's, stamped to the microsecond) to a file through `2>`; the
    exporter starts after the weights began, finds that file, reads it from its start, so the
    load's starting phase and fine steps are the log's own. The server restarts writing to
    another file: the new process's log is found afresh."""
    port = free_port()
    extra = ["--port", str(port), "--pidfile", str(tmp_path / "server.pid")]
    first_log, second_log = tmp_path / "tgi-1.log", tmp_path / "tgi-2.log"
    command = simulate(tmp_path, "tgi", *extra)
    with running_command(redirected(f">/dev/null 2>{first_log}", command)):
        wait_for(lambda: first_log.exists() and b"Starting shard" in first_log.read_bytes())
        running = exporter_with_log(start_exporter, tmp_path, port, None)
        watch_load(running, "ready")
        [load] = loads_of(running, 1)
        report = json.loads(wait_for(lambda: (tmp_path / "report.json").read_text()))
        log = log_status(running)
    assert not load["partial"]
    assert log["source"] == f"file:{first_log}" and log["found_by"].endswith("read from its start")
    phases = load["phase_seconds"]
    assert phases["starting"] == pytest.approx(
        report["weights_started_at"] - report["start_time"], abs=INTERVAL + SLACK
    )
    for step, seconds in step_seconds("tgi").items():
        if step in phases:  # the warm-up may end after the endpoint answered
            assert phases[step] == pytest.approx(seconds, abs=INTERVAL + SLACK), (step, phases)
    assert {Step.KV_CACHE, Step.CUDA_GRAPH} <= set(phases), phases
    (tmp_path / "report.json").unlink()
    with running_command(redirected(f">/dev/null 2>{second_log}", command)):
        watch_load(running, "ready")
        second = loads_of(running, 2)[0]
    assert log_status(running)["source"] == f"file:{second_log}"
    assert {Step.KV_CACHE, Step.CUDA_GRAPH} <= set(second["phase_seconds"]), second


def test_exporter_finds_a_units_journal(
    tmp_path: Path, start_exporter: Any, journald: None, unit_cgroup: tuple[str, Path]
) -> None:
    unit, cgroup = unit_cgroup
    running = exporter_follows_the_log(
        tmp_path,
        start_exporter,
        None,
        lambda extra: in_unit(cgroup, simulate(tmp_path, "sglang", *extra)),
        slack=JOURNAL_SLACK,
    )
    log = log_status(running)
    assert log["source"] == f"journald:{unit}"
    pattern = rf"pid \d+ runs in systemd unit {re.escape(unit)} \(from /proc/\d+/cgroup\)"
    assert re.fullmatch(pattern, log["found_by"]), log


def test_exporter_finds_a_docker_containers_json_file_log(
    tmp_path: Path, start_exporter: Any
) -> None:
    """Under a host root laid out as dockerd lays it, for a process in the cgroup Docker's
    systemd driver gives a container. The container's previous process crashed just before, and
    Docker appends a restart's output to the same file: its fatal line is not this load's."""
    container, host = secrets.token_hex(32), tmp_path / "host"
    log = host / "var/lib/docker/containers" / container / f"{container}-json.log"
    stamp = time.strftime("[%Y-%m-%d %H:%M:%S]")
    crashed = tmp_path / "crashed.err"
    lines = ("Load weight begin. avail mem=70.00 GB", "Initialization failed. warmup error: OOM")
    crashed.write_text("".join(f"{stamp} {line}\n" for line in lines))
    restarted = ("--restarted-after", str(crashed))
    with cgroups(f"system.slice/docker-{container}.scope", hierarchies()) as dirs:
        running = exporter_follows_the_log(
            tmp_path,
            start_exporter,
            None,
            lambda extra: in_container(
                dirs, "docker", log, simulate(tmp_path, "sglang", *extra), *restarted
            ),
            slack=SLACK,
            host_root=str(host),
        )
    state = running.status()["targets"][0]
    assert state["fatal"] is None and state["log"]["source"] == f"docker:{log}"
    where = f"/var/lib/docker/containers/{container}/{container}-json.log"
    assert re.fullmatch(rf"pid \d+ runs in Docker container {container[:12]} \(from "
                        rf"/proc/\d+/cgroup\): its json-file log {where}",
                        state["log"]["found_by"]), state["log"]  # fmt: skip
    assert b"warmup error: OOM" in log.read_bytes()


def pod(host: Path, uid: str, container: str) -> tuple[Path, str]:
    """The kubelet's /var/log/containers link to a container's /var/log/pods file, and the
    cgroup its systemd driver gives that container (burstable QoS, containerd)."""
    relative = f"var/log/pods/inference_sglang-0_{uid}/server/0.log"
    links = host / "var/log/containers"
    links.mkdir(parents=True)
    (links / f"sglang-0_inference_server-{container}.log").symlink_to(f"/{relative}")
    slice_ = f"kubepods-burstable-pod{uid.replace('-', '_')}.slice"
    cgroup = f"kubepods.slice/kubepods-burstable.slice/{slice_}/cri-containerd-{container}.scope"
    return host / relative, cgroup


def test_exporter_finds_a_pod_containers_file_under_var_log_pods(
    tmp_path: Path, start_exporter: Any
) -> None:
    container, uid, host = secrets.token_hex(32), str(uuid.uuid4()), tmp_path / "host"
    log, cgroup = pod(host, uid, container)
    with cgroups(cgroup, hierarchies()) as dirs:
        running = exporter_follows_the_log(
            tmp_path,
            start_exporter,
            None,
            lambda extra: in_container(dirs, "cri", log, simulate(tmp_path, "sglang", *extra)),
            slack=SLACK,
            host_root=str(host),
        )
    found = log_status(running)
    assert found["source"] == f"cri:{log}"
    assert re.fullmatch(rf"pid \d+ runs in container {container[:12]} of pod {uid} \(from "
                        rf"/proc/\d+/cgroup\): /{log.relative_to(host)}, named by "
                        rf"/var/log/containers/sglang-0_inference_server-{container}\.log",
                        found["found_by"]), found  # fmt: skip


def test_a_found_log_that_cannot_be_read_is_logged_once_and_the_load_goes_on(
    tmp_path: Path, start_exporter: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """/var/log/containers mounted but not /var/log/pods: the link names a file not there."""
    container, uid, host = secrets.token_hex(32), str(uuid.uuid4()), tmp_path / "host"
    missing, cgroup = pod(host, uid, container)
    elsewhere = tmp_path / "runtime" / "0.log"
    port = free_port()
    extra = ["--port", str(port), "--pidfile", str(tmp_path / "server.pid")]
    running = exporter_with_log(start_exporter, tmp_path, port, None, host_root=str(host))
    with (
        cgroups(cgroup, hierarchies()) as dirs,
        running_command(in_container(dirs, "cri", elsewhere, simulate(tmp_path, "sglang", *extra))),
    ):
        watch_load(running, "ready")
    log = log_status(running)
    assert log["source"] == f"cri:{missing}" and log["up"] is False
    assert log["reason"] == f"{missing} does not exist (yet)"
    downs = [r.getMessage() for r in caplog.records if "source logs:logged" in r.getMessage()]
    assert downs == [f"source logs:logged is down: {missing} does not exist (yet)"]
    assert 'model_load_source_up{source="logs",target="logged"} 0.0' in running.metrics()


def test_no_log_found_says_why_in_the_status(tmp_path: Path, start_exporter: Any) -> None:
    port = free_port()
    extra = ["--port", str(port), "--pidfile", str(tmp_path / "server.pid")]
    running = exporter_with_log(start_exporter, tmp_path, port, None)
    wait_for(lambda: running.status()["targets"][0].get("phase") == "down")
    assert log_status(running) == {
        "source": None,
        "found_by": None,
        "not_found": "no server process seen yet",
    }
    child = subprocess.Popen(simulate(tmp_path, "sglang", *extra), stdin=subprocess.DEVNULL,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
    try:
        log = wait_for(lambda: (s := log_status(running)).get("not_found", "").startswith("pid ")
                       and s)  # fmt: skip
    finally:
        child.kill()
        child.communicate()
    assert log["source"] is None and log["found_by"] is None
    assert re.fullmatch(r"pid \d+: stdout is a pipe, stderr is a pipe, and its cgroup \(.*\) is "
                        r"no systemd service, Docker container or Kubernetes pod",
                        log["not_found"]), log  # fmt: skip
    assert "logs" not in running.status()["targets"][0]["sources"]


# --- a step's end line read just before the server answers (issue 32, row 1) -------------------

LOGLINES = Path(loglines.__file__)
_VLLM = "(EngineCore_DP0 pid=12) INFO {vllm} [gpu_model_runner.py:1] "
_VLLM_OLD = "(VllmWorker rank=0 pid=13) INFO {vllm} [model_runner.py:1] "
_SGLANG = "[{sglang}] "
# (weights lines, the KV cache lines, the end line that states 3 s, the last line before the
# port opens): the graph step has no begin line in any of them.
_INIT = "init engine (profile, create kv cache, warmup model) took 6.00 seconds"
END_LINE_LOGS = {
    "vllm": (
        [_VLLM + "Starting to load model /m...", _VLLM + "Loading weights took 1.00 seconds"],
        [_VLLM + "Available KV cache memory: 10.00 GiB",
         "(EngineCore_DP0 pid=12) INFO {vllm} [kv.py:1] GPU KV cache size: 9,000 tokens"],
        _VLLM + "Graph capturing finished in 3 secs, took 0.45 GiB",
        _VLLM + _INIT,
    ),
    "vllm-old": (
        [_VLLM_OLD + "Starting to load model /m...",
         _VLLM_OLD + "Loading weights took 1.00 seconds"],
        ["INFO {vllm} [executor_base.py:1] # cuda blocks: 1000, # CPU blocks: 500"],
        _VLLM_OLD + "Graph capturing finished in 3 secs, took 0.45 GiB",
        "INFO {vllm} [llm_engine.py:1] " + _INIT,
    ),
    "sglang": (
        [_SGLANG + "Load weight begin. avail mem=20.27 GB",
         _SGLANG + "Load weight end. elapsed=1.00 s, type=LlamaForCausalLM, avail mem=18.93 GB"],
        [_SGLANG + "KV Cache is allocated. dtype: torch.bfloat16, #tokens: 16384"],
        _SGLANG + "Capture target decode CUDA graph end. bs=[1], elapsed=3.00 s, mem usage=0.1 GB",
        _SGLANG + "INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
    ),
}  # fmt: skip


@pytest.mark.parametrize("shape", sorted(END_LINE_LOGS))
def test_a_step_ended_just_before_the_port_opens_is_in_the_load(
    shape: str, tmp_path: Path, start_exporter: Any
) -> None:
    """A real process writes the log as it goes and opens its port 20 ms after the end line
    that states the step's 3 s, before the exporter's log thread can have read it: the finished
    load still has the step, and the KV cache only the time before it began."""
    weights, kv, end, last = END_LINE_LOGS[shape]
    script = [[1.0, line] for line in weights[:1]] + [[2.0, line] for line in weights[1:]]
    script += [[3.0, line] for line in kv] + [[6.0, end], [6.02, last]]
    port, log, pidfile = free_port(), tmp_path / "server.log", tmp_path / "server.pid"
    running = start_exporter(
        {
            "sample_interval": "200ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [
                {
                    "name": "t",
                    "endpoint": {"url": f"http://127.0.0.1:{port}", "probe": "health"},
                    "process": {"pidfile": str(pidfile)},
                    "log": {"file": str(log)},
                }
            ],
        }
    )
    argv = [sys.executable, str(LOGLINES), str(port), str(pidfile), json.dumps(script)]
    with log.open("wb") as out, running_command(argv, stdout=out):
        [load] = loads_of(running, 1)
    phases = load["phase_seconds"]
    assert load["outcome"] == "ready", load
    assert phases.get("cuda_graph") == pytest.approx(3.0, abs=0.05), phases
    # The KV cache ran from its line (3 s) until the graphs began (6 s - 3 s): whole-second
    # stamps, each refined by when it was read, put that under a second.
    assert phases.get("kv_cache", -1) < 1.0, phases
