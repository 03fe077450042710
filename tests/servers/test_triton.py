"""The exporter with no config, watching a real Triton load a Python model, cold then warm.

Triton's model (tests/servers/triton_server.py) reads 4 safetensors shards (400 MB) in its
initialize() through safe_open, which maps each shard and lets it go at once: the file view has to
see the pages mapped into the instance's stub, not descriptors or read() bytes. The server runs in
a blkio cgroup that reads the disk at THROTTLE, so a cold load takes seconds. Against Triton's own
answers and log: the load ends within 1 s of the model's first ready answer (polled by the test
every 20 ms, from the process's start), and the weights phase lies within 1 s of the log's
`TRITONBACKEND_ModelInstanceInitialize` and `successfully loaded` lines (microsecond stamps).
The figures land in .servers/reports/triton.json.
"""

from __future__ import annotations

import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from helpers.filesystems import scratch
from helpers.require import require_all
from test_disk import lsblk_whole_disk

from exporter.sources.process import process_start_time
from exporter.storage.cachectl import evict, prewarm
from servers import triton_server
from servers.triton_server import TritonServer
from servers.watch import (
    follow,
    follow_load,
    last_load,
    live,
    target_of,
    write_report,
    zero_config_exporter,
)

THROTTLE = 100_000_000  # bytes per second from the disk: about 4 s for the cold load
TOLERANCE = 1.0  # seconds, the issue's bar for the duration and the weights' boundaries
_STAMP = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d{6}) ")


@pytest.fixture(scope="session")
def triton_dir() -> Path:
    require_all("triton")
    found = triton_server.find_dir()
    assert found is not None
    return found


@pytest.fixture(scope="session")
def triton_repo(triton_dir: Path) -> Path:
    return triton_server.ensure_repository()


def stamp_of(log: str, marker: str) -> float:
    """Unix time of Triton's stamp on the first line holding `marker` (local time, no year)."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and marker in line:
            month, day, hour, minute = (int(g) for g in m.groups()[:4])
            second = float(m.group(5))
            year = datetime.now().year
            return datetime(year, month, day, hour, minute).timestamp() + second
    raise AssertionError(f"no {marker!r} line in Triton's log")


class ReadyClock:
    """When the model first answered ready, polled every 20 ms from a thread of its own."""

    def __init__(self, server: TritonServer) -> None:
        self.at: float | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(server,), daemon=True)
        self._thread.start()

    def _run(self, server: TritonServer) -> None:
        try:
            self.at = server.wait()
        except BaseException as exc:  # reported by the test's thread
            self.error = exc

    def result(self) -> float:
        self._thread.join(triton_server.START_TIMEOUT)
        if self.error is not None:
            raise self.error
        assert self.at is not None
        return self.at


def test_a_zero_config_exporter_follows_real_triton_cold_then_warm(
    triton_dir: Path, triton_repo: Path, tmp_path: Path
) -> None:
    shards = triton_server.shards(triton_repo)
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(triton_repo), THROTTLE)
            for cache in ("cold", "warm"):
                for shard in shards:
                    (evict if cache == "cold" else prewarm)(str(shard))
                log = tmp_path / f"triton-{cache}.log"
                server = TritonServer(triton_dir, triton_repo, log, procs)
                try:
                    clock = ReadyClock(server)
                    seen = follow_load(exporter, server.proc.pid, server.tail)
                    ready_at = clock.result()
                    started = process_start_time(server.proc.pid)
                    assert started is not None
                finally:
                    assert server.stop() == []
                text = log.read_text(errors="replace")
                record = last_load(exporter, seen[-1]["target"])
                report[cache] = figures(record, seen, text, ready_at - started)
                time.sleep(1.5)  # the exporter sees the exit before the next start
    finally:
        exporter.stop()
        write_report("triton.json", report)
    for cache in ("cold", "warm"):
        r = report[cache]
        assert r["outcome"] == "ready" and r["cache"] == cache, r
        assert abs(r["duration_minus_first_ready"]) <= TOLERANCE, r
        assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
        assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
        assert r["probe"] == "/v2/models/tiny/ready", r
        assert r["log_found_by"] and "triton" in r["log_format"], r
    cold = report["cold"]["live"]
    # Progress seen while the shards were mapped and read, from the mapped pages of the files.
    assert any(
        s["phase"] == "loading_weights" and 0.0 < (s["progress"] or 0) < 1.0 for s in cold
    ), cold
    assert any(s["source"] == "weight_files" for s in cold), cold


def figures(
    record: dict[str, Any], seen: list[dict[str, Any]], log: str, truth: float
) -> dict[str, Any]:
    """The exporter's record beside Triton's own answers and stamps."""
    phases = record["phase_seconds"]
    began = record["started_at"] + phases.get("starting", float("nan"))
    ended = began + phases.get("loading_weights", float("nan"))
    began_log = stamp_of(log, "TRITONBACKEND_ModelInstanceInitialize")
    ended_log = stamp_of(log, "successfully loaded")
    final = seen[-1]
    return {
        "outcome": record["outcome"],
        "cache": record["cache"],
        "duration": record["duration_seconds"],
        "first_ready_since_start": round(truth, 3),
        "duration_minus_first_ready": round(record["duration_seconds"] - truth, 3),
        "phases": phases,
        "log_weights_seconds": round(ended_log - began_log, 3),
        "weights_began_minus_log": round(began - began_log, 3),
        "weights_ended_minus_log": round(ended - ended_log, 3),
        "probe": next(
            (e["value"] for e in final["discovered"]["why"] if e["what"] == "probe"), None
        ),
        "log_found_by": (final.get("log") or {}).get("found_by"),
        "log_format": (final.get("log") or {}).get("format"),
        "live": live(seen),
    }


def test_a_model_loaded_into_a_running_triton_is_a_load_of_its_target(
    triton_dir: Path, triton_repo: Path, tmp_path: Path
) -> None:
    """Explicit model-control mode: the server is up and ready at once with nothing loaded;
    `POST /v2/repository/models/tiny/load` then loads the model (cold, from the throttled disk)
    and answers once it is in. The exporter, with no config, records that as a load of the
    target (the same process) within 1 s of the answer, with progress while it ran, its phases
    against the log's stamps, and its duration in the histogram; the unload is said so."""
    shards = triton_server.shards(triton_repo)
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(triton_repo), THROTTLE)
            log = tmp_path / "triton-explicit.log"
            server = TritonServer(triton_dir, triton_repo, log, procs, explicit=True)
            try:
                server.wait(ready=False)
                pid = server.proc.pid
                name, before, observed = ready_with_nothing_loaded(exporter, server, shards)
                answer: dict[str, float] = {}

                def load() -> None:
                    answer["sent"], answer["answered"] = server.repository("load")

                loader = threading.Thread(target=load, daemon=True)
                loader.start()
                seen = follow(
                    exporter,
                    lambda: target_of(exporter, pid),
                    lambda states: bool(answer) and in_server_load_ended(states),
                    server.tail,
                )
                loader.join(10)
                recorded_after = None
                while recorded_after is None and time.time() < answer["answered"] + 5:
                    loads = exporter.get(f"/api/v1/loads?target={name}").json()["loads"]
                    if len(loads) > before:
                        recorded_after = time.time() - answer["answered"]
                    time.sleep(0.02)
                record = last_load(exporter, name)
                metrics = exporter.get("/metrics").text
                server.repository("unload")
                unloaded = until_unloaded(exporter, server)
            finally:
                assert server.stop() == []
    finally:
        exporter.stop()
    text = log.read_text(errors="replace")
    phases = record["phase_seconds"]
    began = record["started_at"] + phases.get("starting", float("nan"))
    ended = began + phases.get("loading_weights", float("nan"))
    report["explicit"] = {
        "load_request_sent": answer["sent"],
        "load_request_answered_after": round(answer["answered"] - answer["sent"], 3),
        "load_began_minus_log": round(record["started_at"] - stamp_of(text, "loading: tiny"), 3),
        "ended_minus_answer": round(record["ended_at"] - answer["answered"], 3),
        "recorded_after_answer": recorded_after,
        "outcome": record["outcome"],
        "cache": record["cache"],
        "duration": record["duration_seconds"],
        "phases": phases,
        "log_weights_seconds": round(
            stamp_of(text, "successfully loaded") - stamp_of(text, "ModelInstanceInitialize"), 3
        ),
        "weights_began_minus_log": round(began - stamp_of(text, "ModelInstanceInitialize"), 3),
        "weights_ended_minus_log": round(ended - stamp_of(text, "successfully loaded"), 3),
        "histogram_observations": histogram_count(metrics, name) - observed,
        "unloaded": unloaded.get("unloaded"),
        "live": live(seen),
    }
    write_report("triton-explicit.json", report)
    r = report["explicit"]
    assert r["outcome"] == "ready" and r["cache"] == "cold", r
    assert recorded_after is not None and recorded_after <= TOLERANCE, r
    assert abs(r["ended_minus_answer"]) <= TOLERANCE, r
    assert abs(r["load_began_minus_log"]) <= TOLERANCE, r
    assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
    assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
    assert r["histogram_observations"] == 1, r  # the model's load, in the histogram
    assert r["unloaded"] == "tiny", r
    in_server = [s for s in r["live"] if s["in_server"]]
    assert any(
        s["phase"] == "loading_weights" and 0.0 < (s["progress"] or 0) < 1.0 for s in in_server
    ), r["live"]


def ready_with_nothing_loaded(
    exporter: Any, server: TritonServer, shards: list[Path]
) -> tuple[str, int, float]:
    """The server's own target once ready with nothing loaded (the process's own start), after
    its model's shards were evicted and measured so: its name, how many loads it has filed and
    its histogram's count, to tell the model's load from what came before."""
    pid = server.proc.pid
    up = follow(
        exporter,
        lambda: target_of(exporter, pid),
        lambda states: states[-1].get("phase") == "ready",
        server.tail,
    )
    name = up[-1]["target"]
    for shard in shards:
        evict(str(shard))
    time.sleep(1.5)  # the exporter has measured the evicted shards
    before = len(exporter.get(f"/api/v1/loads?target={name}").json()["loads"])
    return name, before, histogram_count(exporter.get("/metrics").text, name)


def until_unloaded(exporter: Any, server: TritonServer) -> dict[str, Any]:
    """The server's target's state once it says a model was unloaded."""
    pid = server.proc.pid
    states = follow(
        exporter,
        lambda: target_of(exporter, pid),
        lambda states: states[-1].get("unloaded") is not None,
        server.tail,
        timeout=15,
    )
    return states[-1]


def histogram_count(metrics: str, target: str) -> float:
    """Loads of `target` observed into model_load_duration_seconds, over every label set."""
    pattern = (
        rf'^model_load_duration_seconds_count{{[^}}]*target="{re.escape(target)}"[^}}]*}} (\S+)'
    )
    return sum(float(m.group(1)) for m in re.finditer(pattern, metrics, re.MULTILINE))


def in_server_load_ended(states: list[dict[str, Any]]) -> bool:
    """A load inside the running server was seen in progress and has ended."""
    return any(s.get("in_server") for s in states) and states[-1].get("phase") in (
        "ready",
        "failed",
    )


POLL_SECONDS = 1  # --repository-poll-secs: the added model is seen within a second


class ModelReadyClock:
    """When model `name` first answered ready, polled every 20 ms from a thread of its own."""

    def __init__(self, server: TritonServer, name: str) -> None:
        self.at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(server, name), daemon=True)
        self._thread.start()

    def _run(self, server: TritonServer, name: str) -> None:
        while not self._stop.is_set() and self.at is None:
            if server.model_ready(name):
                self.at = time.time()
            time.sleep(0.02)

    def result(self, timeout: float) -> float | None:
        self._thread.join(timeout)
        self._stop.set()
        return self.at


def test_a_model_added_to_a_polled_repository_is_a_load_of_its_target(
    triton_dir: Path, triton_repo: Path, tmp_path: Path
) -> None:
    """Poll model-control mode (`--model-control-mode=poll --repository-poll-secs=1`): the
    server starts on an empty repository, ready with nothing loaded; a model then added to the
    repository (cold, from the throttled disk) is loaded by the running server at its next poll.
    The exporter, with no config, records that as a load of the target (the same process): from
    the log's `loading: tiny:1` line to within 1 s of the model's first ready answer, with its
    weights against the log's stamps, progress while it ran and one histogram observation. The
    model then removed from the repository is unloaded: counted and logged by the exporter."""
    repo = tmp_path / "repo"
    repo.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE, "poll_seconds": POLL_SECONDS}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(triton_repo), THROTTLE)
            log = tmp_path / "triton-poll.log"
            server = TritonServer(triton_dir, repo, log, procs, poll_seconds=POLL_SECONDS)
            try:
                server.wait(ready=False)
                pid = server.proc.pid
                # The added model's shards are hard links of these.
                shards = triton_server.shards(triton_repo)
                name, before, observed = ready_with_nothing_loaded(exporter, server, shards)
                clock = ModelReadyClock(server, triton_server.MODEL)
                added_at = time.time()
                added = triton_server.add_model(triton_repo, repo, triton_server.MODEL, staging)
                seen = follow(
                    exporter,
                    lambda: target_of(exporter, pid),
                    lambda states: (
                        in_server_load_ended(states)
                        and len(exporter.get(f"/api/v1/loads?target={name}").json()["loads"])
                        > before
                    ),
                    server.tail,
                )
                ready_at = clock.result(triton_server.START_TIMEOUT)
                assert ready_at is not None, server.tail()
                record = last_load(exporter, name)
                metrics = exporter.get("/metrics").text
                added.rename(staging / "removed")  # the next poll unloads it
                unloaded = until_unloaded(exporter, server)
                unloads = unloads_total(exporter.get("/metrics").text, name)
            finally:
                assert server.stop() == []
    finally:
        exporter.stop()
    text = log.read_text(errors="replace")
    phases = record["phase_seconds"]
    began = record["started_at"] + phases.get("starting", float("nan"))
    ended = began + phases.get("loading_weights", float("nan"))
    said = [line for line in exporter.stderr().splitlines() if "unloaded model" in line]
    report["poll"] = {
        "model_added": added_at,
        "loading_line_after_added": round(stamp_of(text, "loading: tiny") - added_at, 3),
        "first_ready_after_added": round(ready_at - added_at, 3),
        "load_began_minus_log": round(record["started_at"] - stamp_of(text, "loading: tiny"), 3),
        "ended_minus_first_ready": round(record["ended_at"] - ready_at, 3),
        "outcome": record["outcome"],
        "cache": record["cache"],
        "duration": record["duration_seconds"],
        "log_duration": round(ready_at - stamp_of(text, "loading: tiny"), 3),
        "phases": phases,
        "log_weights_seconds": round(
            stamp_of(text, "successfully loaded") - stamp_of(text, "ModelInstanceInitialize"), 3
        ),
        "weights_began_minus_log": round(began - stamp_of(text, "ModelInstanceInitialize"), 3),
        "weights_ended_minus_log": round(ended - stamp_of(text, "successfully loaded"), 3),
        "histogram_observations": histogram_count(metrics, name) - observed,
        "unloaded": unloaded.get("unloaded"),
        "unloads_total": unloads,
        "exporter_said": said,
        "live": live(seen),
    }
    write_report("triton-poll.json", report)
    r = report["poll"]
    assert r["outcome"] == "ready" and r["cache"] == "cold", r
    assert abs(r["ended_minus_first_ready"]) <= TOLERANCE, r
    assert abs(r["load_began_minus_log"]) <= TOLERANCE, r
    assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
    assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
    assert r["histogram_observations"] == 1, r
    assert r["unloaded"] == "tiny" and r["unloads_total"] == 1, r
    assert len(said) == 1 and f"target {name}: the server unloaded model tiny" in said[0], said
    in_server = [s for s in r["live"] if s["in_server"]]
    assert any(
        s["phase"] == "loading_weights" and 0.0 < (s["progress"] or 0) < 1.0 for s in in_server
    ), r["live"]


def unloads_total(metrics: str, target: str) -> float | None:
    """model_load_unloads_total of `target`; None while it is absent."""
    pattern = rf'^model_load_unloads_total{{target="{re.escape(target)}"}} (\S+)'
    m = re.search(pattern, metrics, re.MULTILINE)
    return float(m.group(1)) if m else None


def test_two_models_loading_at_once_are_two_loads_of_their_own_targets(
    triton_dir: Path, triton_repo: Path, tmp_path: Path
) -> None:
    """A repository of two models in explicit mode, both loaded at once (two load requests
    sent together), cold, from the throttled disk. With no config the exporter watches each
    model as a target of its own, `<server's target>/<model>` (its ready answer, its model's
    directory, its own log lines), and records two loads, each from its own `loading:` line to
    within 1 s of its own request's answer, with its own weights against its own lines and
    progress from its own files; the server's target records no load of a model (it keeps its
    process's start), so the two are never merged into one."""
    repo = tmp_path / "repo"
    repo.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    triton_server.add_model(triton_repo, repo, "tiny", staging)  # 4 shards, hard links
    other = triton_server.write_model(repo, "other", 2, seed=1)  # 2 shards of its own
    models = {
        "tiny": triton_server.shards(triton_repo),
        "other": sorted(other.rglob("*.safetensors")),
    }
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(triton_repo), THROTTLE)
            log = tmp_path / "triton-two.log"
            server = TritonServer(triton_dir, repo, log, procs, explicit=True)
            try:
                server.wait(ready=False)
                pid = server.proc.pid
                up = follow(
                    exporter,
                    lambda: target_of(exporter, pid),
                    lambda states: states[-1].get("phase") == "ready",
                    server.tail,
                )
                name = up[-1]["target"]
                targets = {model: f"{name}/{model}" for model in models}
                follow(  # each model's target is there, down: not loaded
                    exporter,
                    lambda: {t: target_state(exporter, t) for t in targets.values()},
                    lambda states: all(
                        s is not None and s.get("phase") == "down" for s in states[-1].values()
                    ),
                    server.tail,
                    timeout=30,
                )
                for files in models.values():
                    for shard in files:
                        evict(str(shard))
                time.sleep(1.5)  # the exporter has measured the evicted shards
                server_loads = len(exporter.get(f"/api/v1/loads?target={name}").json()["loads"])
                answers: dict[str, tuple[float, float]] = {}

                def load(model: str) -> None:
                    answers[model] = server.repository("load", model)

                loaders = [threading.Thread(target=load, args=(m,)) for m in models]
                for loader in loaders:
                    loader.start()
                seen = follow(
                    exporter,
                    lambda: {t: target_state(exporter, t) for t in targets.values()},
                    lambda states: (
                        len(answers) == len(models)
                        and all(
                            len(exporter.get(f"/api/v1/loads?target={t}").json()["loads"]) == 1
                            for t in targets.values()
                        )
                    ),
                    server.tail,
                )
                for loader in loaders:
                    loader.join(10)
                records = {m: last_load(exporter, t) for m, t in targets.items()}
                metrics = exporter.get("/metrics").text
                after = exporter.get(f"/api/v1/loads?target={name}").json()["loads"]
                server_state = target_of(exporter, pid)
            finally:
                assert server.stop() == []
    finally:
        exporter.stop()
    text = log.read_text(errors="replace")
    for model, record in records.items():
        phases = record["phase_seconds"]
        began = record["started_at"] + phases.get("starting", float("nan"))
        ended = began + phases.get("loading_weights", float("nan"))
        instance = f"ModelInstanceInitialize: {model}_"
        loaded = f"successfully loaded '{model}'"
        report[model] = {
            "target": targets[model],
            "request_sent": answers[model][0],
            "request_answered_after": round(answers[model][1] - answers[model][0], 3),
            "load_began_minus_log": round(
                record["started_at"] - stamp_of(text, f"loading: {model}:"), 3
            ),
            "ended_minus_answer": round(record["ended_at"] - answers[model][1], 3),
            "outcome": record["outcome"],
            "cache": record["cache"],
            "duration": record["duration_seconds"],
            "phases": phases,
            "weights_bytes": record["weights_bytes"],
            "log_weights_seconds": round(stamp_of(text, loaded) - stamp_of(text, instance), 3),
            "weights_began_minus_log": round(began - stamp_of(text, instance), 3),
            "weights_ended_minus_log": round(ended - stamp_of(text, loaded), 3),
            "histogram_observations": histogram_count(metrics, targets[model]),
            "live": live([s[targets[model]] for s in seen if s[targets[model]]]),
        }
    report["server"] = {
        "target": name,
        "loads_before": server_loads,
        "loads_after": len(after),
        "phase": server_state.get("phase") if server_state else None,
    }
    write_report("triton-two-models.json", report)
    for model in models:
        r = report[model]
        assert r["outcome"] == "ready" and r["cache"] == "cold", r
        assert abs(r["ended_minus_answer"]) <= TOLERANCE, r
        assert abs(r["load_began_minus_log"]) <= TOLERANCE, r
        assert abs(r["weights_began_minus_log"]) <= TOLERANCE, r
        assert abs(r["weights_ended_minus_log"]) <= TOLERANCE, r
        assert r["histogram_observations"] == 1, r
        assert r["weights_bytes"] == sum(p.stat().st_size for p in models[model]), r
        assert any(
            s["phase"] == "loading_weights" and 0.0 < (s["progress"] or 0) < 1.0 for s in r["live"]
        ), r["live"]
    # The two loads overlapped, and neither was the server's target's.
    tiny, two = report["tiny"], report["other"]
    assert tiny["request_sent"] < two["request_sent"] + two["request_answered_after"], report
    assert two["request_sent"] < tiny["request_sent"] + tiny["request_answered_after"], report
    assert report["server"]["loads_after"] == report["server"]["loads_before"], report


def target_state(exporter: Any, name: str) -> dict[str, Any] | None:
    targets = exporter.get("/api/v1/status").json()["targets"]
    return next((t for t in targets if t["target"] == name), None)


def test_two_models_loaded_at_the_servers_start_are_a_load_each_and_the_servers(
    triton_dir: Path, triton_repo: Path, tmp_path: Path
) -> None:
    """The default model-control mode with two models: both load before the ports open. Each
    model's target has a load from its own `loading:` line to its own first ready answer (the
    ports open once both are in), its weights against its own lines; the server's target has
    the process's load, from its start to the server's ready answer."""
    repo = tmp_path / "repo"
    repo.mkdir()
    staging = tmp_path / "staging"
    staging.mkdir()
    triton_server.add_model(triton_repo, repo, "tiny", staging)
    other = triton_server.write_model(repo, "other", 2, seed=1)
    models = {
        "tiny": triton_server.shards(triton_repo),
        "other": sorted(other.rglob("*.safetensors")),
    }
    for files in models.values():
        for shard in files:
            evict(str(shard))
    exporter = zero_config_exporter(tmp_path)
    report: dict[str, Any] = {"throttle_bytes_per_second": THROTTLE}
    try:
        with scratch(tmp_path / "scratch") as s:
            procs = s.throttle(lsblk_whole_disk(triton_repo), THROTTLE)
            log = tmp_path / "triton-default-two.log"
            server = TritonServer(triton_dir, repo, log, procs)
            try:
                clocks = {m: ModelReadyClock(server, m) for m in models}
                seen = follow_load(exporter, server.proc.pid, server.tail)
                name = seen[-1]["target"]
                ready = {
                    m: clock.result(triton_server.START_TIMEOUT) for m, clock in clocks.items()
                }
                targets = {m: f"{name}/{m}" for m in models}
                follow(
                    exporter,
                    lambda: {t: target_state(exporter, t) for t in targets.values()},
                    lambda states: all(
                        len(exporter.get(f"/api/v1/loads?target={t}").json()["loads"]) == 1
                        for t in targets.values()
                    ),
                    server.tail,
                    timeout=30,
                )
                records = {m: last_load(exporter, t) for m, t in targets.items()}
                own = exporter.get(f"/api/v1/loads?target={name}").json()["loads"]
            finally:
                assert server.stop() == []
    finally:
        exporter.stop()
    text = log.read_text(errors="replace")
    for model, record in records.items():
        phases = record["phase_seconds"]
        began = record["started_at"] + phases.get("starting", float("nan"))
        ended = began + phases.get("loading_weights", float("nan"))
        at = ready[model]
        assert at is not None, server.tail()
        report[model] = {
            "outcome": record["outcome"],
            "cache": record["cache"],
            "duration": record["duration_seconds"],
            "load_began_minus_log": round(
                record["started_at"] - stamp_of(text, f"loading: {model}:"), 3
            ),
            "ended_minus_first_ready": round(record["ended_at"] - at, 3),
            "weights_began_minus_log": round(
                began - stamp_of(text, f"ModelInstanceInitialize: {model}_"), 3
            ),
            "weights_ended_minus_log": round(
                ended - stamp_of(text, f"successfully loaded '{model}'"), 3
            ),
        }
    report["server"] = {"loads": len(own), "outcome": own[0]["outcome"], "cache": own[0]["cache"]}
    write_report("triton-default-two-models.json", report)
    for model in models:
        r = report[model]
        assert r["outcome"] == "ready" and r["cache"] == "cold", r
        for key in ("load_began_minus_log", "ended_minus_first_ready"):
            assert abs(r[key]) <= TOLERANCE, r
        for key in ("weights_began_minus_log", "weights_ended_minus_log"):
            assert abs(r[key]) <= TOLERANCE, r
    assert report["server"] == {"loads": 1, "outcome": "ready", "cache": "cold"}, report
