"""Real tensor-parallel ranks: vLLM's CPU engine at `--tensor-parallel-size 2`, watched by an
exporter with no config at all, as the other server tests watch one rank.

Its tree is the API server, `VLLM::EngineCore`, and two workers, `VLLM::Worker_TP0` and
`VLLM::Worker_TP1` (one core each, vllm_server.rank_cores), each mapping every shard and copying
its own slice out. The checkpoint is read cold from a disk throttled to THROTTLE (13 s of
weights), so the exporter sees the ranks mid-shard. One load serves every check of the first
test (the test peer's own: it answers, it stops clean); the second kills a rank mid-weights.

Truths beside the exporter's: vLLM's own log lines (whole-second stamps), the page cache
(fincore: a page either rank mapped was in it), and /proc polled by the test itself every
WATCH_EVERY (when the last rank let go of its last shard). Only the first rank writes "Loading
weights took" (vLLM's `info_once`); the others' end is what the tree's files say. Numbers:
.servers/reports/ranks-on-vllm.json.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.filesystems import fincore_bytes, scratch
from helpers.hostile import ExporterProcess
from helpers.support import free_port, wait_for
from test_disk import lsblk_whole_disk

from servers import launched
from servers.vllm_server import START_TIMEOUT, VllmServer, set_cache, stamp_of
from servers.watch import REPORTS, follow, target_of, write_report, zero_config_exporter

RANKS = 2
THROTTLE = 100_000_000
WATCH_EVERY = 0.1
SAMPLE_INTERVAL = 1.0  # the zero-config exporter's
# From the SIGKILL to a `failed` load: vLLM's executor says it at once, the exporter reads the
# log and samples every second (vLLM's own fatal line comes 14 s after the kill).
FAILED_WITHIN = 2 * SAMPLE_INTERVAL + 1.0
REPORT = "ranks-on-vllm.json"

pytestmark = pytest.mark.timeout(3 * START_TIMEOUT)


class TreeWatch:
    """Which shards each process of vLLM's session names (a descriptor or a mapping), every
    WATCH_EVERY, read from /proc by the test itself: when the ranks held their last shard."""

    def __init__(self, server: VllmServer) -> None:
        self._server = server
        self._shards = {str(p) for p in server.model.glob("*.safetensors")}
        self.titles: dict[int, str] = {}  # every process of the tree seen: pid -> its last title
        self.last_held: float | None = None  # the last poll some process held a shard
        self.free_after: float | None = None  # the poll after it: none held
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tree-watch", daemon=True)

    def __enter__(self) -> TreeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(WATCH_EVERY):
            now, held = time.time(), False
            for process in launched.group(self._server.pid):
                with contextlib.suppress(OSError, psutil.Error):  # gone meanwhile
                    self.titles[process.pid] = " ".join(process.cmdline()).strip()
                    held = held or self._holds(process.pid)
            if held:
                self.last_held, self.free_after = now, None
            elif self.last_held is not None and self.free_after is None:
                self.free_after = now

    def _holds(self, pid: int) -> bool:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{pid}/fd/{fd}") in self._shards:
                    return True
        with open(f"/proc/{pid}/maps") as maps:
            return any(line.rstrip("\n").split(" ")[-1] in self._shards for line in maps)

    def pids_titled(self, title: str) -> list[int]:
        return [pid for pid, line in self.titles.items() if line.startswith(title)]


@pytest.fixture
def throttled(tmp_path: Path, llama_checkpoint: Path) -> Iterator[Path]:
    """The cgroup.procs of a blkio cgroup reading the checkpoint's disk at THROTTLE."""
    with scratch(tmp_path / "scratch") as s:
        yield s.throttle(lsblk_whole_disk(llama_checkpoint), THROTTLE)


@pytest.fixture
def start_ranks(
    vllm_python: str, llama_checkpoint: Path, tmp_path: Path, throttled: Path
) -> Iterator[Callable[[], VllmServer]]:
    """vLLM at RANKS ranks, cold and throttled, its log kept in the reports; stopped after."""
    started: list[VllmServer] = []

    def start() -> VllmServer:
        set_cache(llama_checkpoint, "cold")
        log = tmp_path / f"vllm-tp{RANKS}-{len(started)}.log"
        server = VllmServer(vllm_python, llama_checkpoint, free_port(), log, throttled, ranks=RANKS)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
        REPORTS.mkdir(parents=True, exist_ok=True)
        (REPORTS / server.log.name).write_bytes(server.log.read_bytes())


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[ExporterProcess]:
    running = zero_config_exporter(tmp_path)
    yield running
    running.stop()


def report(section: str, figures: dict[str, Any]) -> None:
    """Each test's figures under its own key of one report."""
    path = REPORTS / REPORT
    document = json.loads(path.read_text()) if path.exists() else {}
    write_report(REPORT, {**document, section: figures})


def test_two_ranks_are_one_load_counted_once_with_the_servers_phases(
    start_ranks: Callable[[], VllmServer], exporter: ExporterProcess, llama_checkpoint: Path
) -> None:
    shards = sorted(llama_checkpoint.glob("*.safetensors"))
    sizes = {s.name: s.stat().st_size for s in shards}
    checkpoint_bytes = sum(sizes.values())
    resident_max = dict.fromkeys(sizes, 0)  # the most of each shard the page cache held
    over: list[dict[str, Any]] = []  # a file's consumed bytes above what was ever cached
    # fincore (mincore) counts pages read in; the exporter's bound (cachestat) also those the
    # kernel is still reading ahead: one readahead window per rank may be in flight.
    disk = Path("/sys/class/block") / lsblk_whole_disk(llama_checkpoint)
    in_flight = RANKS * int((disk / "queue" / "read_ahead_kb").read_text()) * 1024
    names: set[str] = set()  # every target the exporter had for a process of vLLM's tree
    server = start_ranks()

    def pick() -> dict[str, Any] | None:
        targets = exporter.get("/api/v1/status").json()["targets"]
        by_pid = {(t.get("discovered") or {}).get("pid"): t for t in targets}
        names.update(by_pid[p.pid]["target"] for p in launched.group(server.pid) if p.pid in by_pid)
        state = by_pid.get(server.pid)
        if state is not None and state.get("phase") == "loading_weights":
            for shard in shards:  # read after the state: the cache only grew meanwhile
                resident_max[shard.name] = max(resident_max[shard.name], fincore_bytes(shard))
            for held in (state.get("weight_files") or {}).get("held") or []:
                if held["consumed_bytes"] > resident_max[held["name"]] + in_flight:
                    over.append({**held, "resident": resident_max[held["name"]]})
        return state

    def ended(seen: list[dict[str, Any]]) -> bool:
        loaded = any(s.get("in_progress") for s in seen)
        return loaded and seen[-1].get("phase") in ("ready", "failed")

    with TreeWatch(server) as watch:
        seen = follow(exporter, pick, ended, server.tail, timeout=START_TIMEOUT)
        answer = server.complete("hello world", tokens=4)
    name = seen[-1]["target"]
    record = exporter.get(f"/api/v1/loads?target={name}").json()["loads"][0]
    log = server.log.read_text(errors="replace")
    phases = record["phase_seconds"]
    weights_began = record["started_at"] + phases["starting"]
    weights_ended = weights_began + phases["loading_weights"]
    began_log = stamp_of(log, "Starting to load model")
    tp0_ended_log = stamp_of(log, "Loading weights took")
    implied_log = stamp_of(log, "Warming up model for the compilation")
    progress = [
        s["progress_ratio"]
        for s in seen
        if s.get("in_progress") and s.get("progress_ratio") is not None
    ]
    consumed = [(s.get("weight_files") or {}).get("consumed_bytes") or 0 for s in seen]
    assert watch.last_held is not None and watch.free_after is not None
    report(
        "tp2",
        {
            "workers": {pid: t for pid, t in watch.titles.items() if "Worker" in t},
            "targets_of_the_tree": sorted(names),
            "phases": phases,
            "cache": record["cache"],
            "duration": record["duration_seconds"],
            "weights_began_minus_begin_line": weights_began - began_log,
            "weights_ended_minus_tp0_end_line": weights_ended - tp0_ended_log,
            "weights_ended_minus_implying_line": weights_ended - implied_log,
            "weights_ended_minus_last_shard_held": weights_ended - watch.last_held,
            "last_shard_held_minus_tp0_end_line": watch.last_held - tp0_ended_log,
            "tp0_log_weights_seconds": float(
                re.search(r"Loading weights took ([\d.]+)", log).group(1)  # type: ignore[union-attr]
            ),
            "checkpoint_bytes": checkpoint_bytes,
            "consumed_bytes_max": max(consumed),
            "consumed_bytes_at_end": consumed[-1],
            "files_seen": (seen[-1].get("weight_files") or {}).get("files_seen"),
            "progress_max": max(progress),
            "resident_max": resident_max,
            "readahead_in_flight_bytes": in_flight,
            "consumed_above_resident": over,
        },
    )

    # The workers are ranks of one server: one target, one load.
    assert len(watch.pids_titled("VLLM::Worker_TP")) == RANKS, watch.titles
    assert names == {name}, names
    assert record["outcome"] == "ready" and record["cache"] == "cold", record
    # Counted once: never above the checkpoint, every shard whole at the end, and no file
    # ahead of the pages the page cache ever held of it (what both ranks mapped is in there).
    assert progress == sorted(progress) and progress[-1] <= 1.0, progress
    assert max(consumed) <= checkpoint_bytes
    # Every shard seen is consumed whole at the end: a shard mapped and let go between two looks
    # (23.6 MB at 100 MB/s: 0.24 s) is not seen at all; the embedding's and LM head's (96 %) are.
    end = seen[-1]["weight_files"]
    whole = {sum(c) for c in itertools.combinations(sizes.values(), end["files_seen"])}
    assert end["consumed_bytes"] in whole and end["files_done"] == end["files_seen"], end
    assert end["consumed_bytes"] >= sizes[shards[0].name] + sizes[shards[-1].name], end
    assert over == []
    # The weights begin at the first rank's begin line (stamps are whole seconds) and end when
    # the last rank let go of its last shard: no earlier than the test saw one held, no later
    # than the exporter's next look after the test saw none (TP1 writes no end line; the
    # warm-up line that implies it came up to 5 s later here).
    assert -1.0 < weights_began - began_log < 2.0
    assert watch.last_held - 0.5 < weights_ended <= watch.free_after + SAMPLE_INTERVAL + 0.5
    assert tp0_ended_log - 1.0 < weights_ended < implied_log + 1.0
    # The test peer itself: it answers and stops with its whole tree.
    assert answer["usage"]["completion_tokens"] == 4
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["choices"][0]["text"].strip()
    assert server.stop() == []
    assert server.tree() == []


def test_a_rank_killed_mid_weights_fails_the_load_within_seconds(
    start_ranks: Callable[[], VllmServer], exporter: ExporterProcess
) -> None:
    server = start_ranks()

    def state() -> dict[str, Any]:
        return target_of(exporter, server.pid) or {}

    wait_for(
        lambda: (s := state()).get("phase") == "loading_weights"
        and (s.get("progress_ratio") or 0) >= 0.2,
        timeout=START_TIMEOUT, interval=0.05,
    )  # fmt: skip
    [rank] = [p for p in server.tree() if p.cmdline()[:1] == ["VLLM::Worker_TP1"]]
    killed_at = time.time()
    rank.send_signal(signal.SIGKILL)
    wait_for(lambda: state().get("phase") == "failed", timeout=START_TIMEOUT, interval=0.05)
    failed_seen = time.time()
    record = state()["last_record"]
    server.proc.wait(START_TIMEOUT)
    exited_at = time.time()
    log = server.log.read_text(errors="replace")
    figures = {
        "killed_after_process_start": killed_at - record["started_at"],
        "failed_seen_after_kill": failed_seen - killed_at,
        "record_ended_after_kill": record["ended_at"] - killed_at,
        "fatal": record["fatal"],
        "phases": record["phase_seconds"],
        # vLLM's own lines, whole seconds since the kill (each names a moment in [s, s + 1)).
        "vllm_executor_shutdown_line": stamp_of(log, "waiting for worker exit") - killed_at,
        "vllm_engine_failed_line": stamp_of(log, "EngineCore failed to start") - killed_at,
        "vllm_api_server_exit": exited_at - killed_at,
    }
    report("rank_killed", figures)
    assert record["outcome"] == "failed", record
    assert record["fatal"].startswith("[shutdown] Executor: waiting for worker exit"), record
    assert failed_seen - killed_at <= FAILED_WITHIN, figures
    assert server.stop() == []
