"""A follower node: one host of a model served over several that runs no API server.

The rules (docs/how-it-decides.md#a-follower-node) one by one, then a look-alike of vLLM's
headless node 1 (tests/helpers/lookalike.py: `vllm serve MODEL --headless --nnodes 2 --node-rank
1 ...`, writing the real node-1 log of tests/fixtures/logs/vllm-0.32-cpu-2nodes-follower.log at
its own pace) under an exporter that finds it by itself: ready at the log's line, alive long
after stall_after, dead once SIGKILLed, never probed.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.kubelet import Prober
from helpers.logreplay import FIXTURES
from helpers.lookalike import install
from helpers.support import free_port, sample_value, wait_for
from test_tracker import COLD_RATE, T0, WEIGHTS, Sim

from exporter.config.schema import EndpointConfig, TargetConfig
from exporter.discovery.serverargs import recognise
from exporter.exposition import liveness
from exporter.load.events import EventKind
from exporter.load.tracker import Tracker
from exporter.logs.markers import MarkerParser
from exporter.runtime.snapshot import TargetView
from exporter.sim.shards import generate_shards
from exporter.sources.process import process_start_time
from exporter.vocabulary import TargetRole

FOLLOWER_LOG = FIXTURES / "vllm-0.32-cpu-2nodes-follower.log"

# -- recognised from its command line ---------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "follower"),
    [
        (["vllm", "serve", "m", "--nnodes", "2", "--node-rank", "1", "--headless"], True),
        (["vllm", "serve", "--headless", "--model", "m"], True),  # a switch takes no value
        (["vllm", "serve", "m", "--api-server-count", "0"], True),
        (["vllm", "serve", "m", "-asc", "0"], True),
        (["vllm", "serve", "m", "--api_server_count=0"], True),
        # vLLM's cli/serve.py: `--node-rank` alone, or API servers, still start one.
        (["vllm", "serve", "m", "--nnodes", "2", "--node-rank", "1"], False),
        (["vllm", "serve", "m", "--api-server-count", "2"], False),
        (["vllm", "serve", "m", "--data-parallel-start-rank", "2"], False),
        (["python", "-m", "sglang.launch_server", "--model-path", "m", "--node-rank", "1"], True),
        (["sglang", "serve", "--model-path", "m", "--node_rank=3", "--nnodes", "4"], True),
        (["python", "-m", "sglang.launch_server", "--model-path", "m", "--node-rank", "0"], False),
        (["python", "-m", "sglang.launch_server", "--model-path", "m"], False),
        (["llama-server", "-m", "x.gguf", "--headless"], False),  # not a flag of llama-server
    ],
)
def test_a_follower_is_recognised_from_its_command_line(argv: list[str], follower: bool) -> None:
    found = recognise(argv, {})
    assert found is not None and found.follower is follower
    roles = [(e.value, e.source) for e in found.evidence if e.what == "role"]
    assert bool(roles) is follower
    if follower:
        [(value, why)] = roles
        assert value == "follower" and "runs no API server" in why


def test_the_switch_leaves_the_positional_model_alone() -> None:
    found = recognise(["vllm", "serve", "/models/k2", "--headless", "--port", "8001"], {})
    assert found is not None
    assert (found.model, found.port, found.follower) == ("/models/k2", 8001, True)


def test_a_config_file_can_make_a_follower() -> None:
    documents = {"/c.yaml": {"headless": True}, "/d.yaml": {"headless": False}}
    for path, follower in (("/c.yaml", True), ("/d.yaml", False)):
        argv = ["vllm", "serve", "m", "--config", path]
        found = recognise(argv, {}, read_config=documents.get)
        assert found is not None and found.follower is follower


# -- its log ----------------------------------------------------------------------------------


def test_a_followers_log_ends_each_start_at_its_node_up_line() -> None:
    """Node 1's real start-up, written twice into one file (a follower killed once up, and
    started again, its output appended): each start is a load of its own, each with its end of
    start-up, though nothing (no ready, no fatal) ended the first one's lines."""
    text = FOLLOWER_LOG.read_text()
    text = text[: text.index("\n", text.index("GiB for KV cache on node")) + 1]
    parser = MarkerParser("vllm")
    kinds = [e.kind for e in parser.feed(text + text, time.time())]
    starts = [i for i, k in enumerate(kinds) if k is EventKind.WEIGHTS_BEGIN]
    ups = [i for i, k in enumerate(kinds) if k is EventKind.NODE_UP]
    assert len(starts) == len(ups) == 2 and starts[0] < ups[0] < starts[1] < ups[1]


# -- the tracker's rules ----------------------------------------------------------------------


def follower(stall_after: float = 30.0, *, is_one: bool = True) -> Tracker:
    return Tracker("k2", stall_after=stall_after, interval=1.0, follower=is_one)


def started(sim: Sim, weights_seconds: int = 20) -> None:
    """A node that imports for 5 s, then reads its weights while its log says so."""
    sim.spawn()
    sim.tick(5)
    sim.say(EventKind.WEIGHTS_BEGIN)
    sim.tick(weights_seconds, read=WEIGHTS // weights_seconds)
    sim.say(EventKind.WEIGHTS_END)
    sim.say(EventKind.COMPILE_BEGIN)
    sim.tick()


NEVER = 10**9  # probe_every: a follower is never probed


def test_a_follower_is_ready_at_its_logs_end_of_start_up_and_stays_so_while_quiet() -> None:
    sim = Sim(follower(), logged=True, probe_every=NEVER)
    started(sim)
    sim.tick(20)
    sim.say(EventKind.NODE_UP, ago=0.4)
    sim.tick()
    [record] = sim.records
    assert (record.outcome, record.ended_at) == ("ready", sim.time - 0.4)
    assert record.phase_seconds["initializing"] == pytest.approx(20.6)
    sim.tick(10 * 30)  # quiet for ten times stall_after: it serves its part
    assert sim.state.phase == "ready" and not sim.state.stalled and not sim.state.end_unseen

    # The head's workers write the same line: there it is no readiness (the endpoint is).
    head = Sim(follower(is_one=False), logged=True)
    started(head)
    head.tick(20)
    head.say(EventKind.NODE_UP)
    head.tick(5)
    assert head.records == [] and head.state.phase == "initializing"


def test_a_follower_quiet_before_its_end_of_start_up_stalls() -> None:
    sim = Sim(follower(stall_after=30), logged=True, probe_every=NEVER)
    started(sim)
    sim.tick(29)
    assert sim.state.phase == "initializing" and not sim.state.stalled
    sim.tick(2)
    assert sim.state.stalled and not sim.state.end_unseen


def test_a_follower_that_dies_before_its_end_failed() -> None:
    sim = Sim(follower(), logged=True, probe_every=NEVER)
    started(sim)
    sim.say(EventKind.FATAL, detail="[shutdown] Executor: waiting for worker exit count=1")
    sim.tick()
    [record] = sim.records
    assert record.outcome == "failed" and sim.state.phase == "failed"


def test_without_a_log_a_follower_is_never_ready_nor_stalled_by_its_quiet() -> None:
    sim = Sim(follower(stall_after=30), probe_every=NEVER)
    sim.spawn()
    sim.tick(5)
    sim.tick(20, read=COLD_RATE)
    sim.tick(31)  # weights' bytes stopped for more than stall_after: that is evidence
    assert sim.state.phase == "loading_weights" and sim.state.stalled
    sim.tick(200, read=WEIGHTS // 200)
    sim.tick(10 * 30)
    state = sim.state
    assert state.phase == "initializing" and state.end_unseen and not state.stalled
    assert sim.records == []


def test_a_follower_found_late_still_starting_up_has_its_load_recorded() -> None:
    """Found 3 s after its start (seen late), before its end line: the exporter saw it start
    up, and its load is kept, whole from its process's start, as any server's seen late."""
    sim = Sim(follower(), logged=True, probe_every=NEVER)
    sim.spawn()
    sim.time += 3
    sim.say(EventKind.WEIGHTS_BEGIN, ago=2)
    sim.tick(20, read=WEIGHTS // 20)
    sim.say(EventKind.WEIGHTS_END)
    sim.tick(10)
    sim.say(EventKind.NODE_UP)
    sim.tick()
    [record] = sim.records
    assert record.seen_late and record.outcome == "ready"
    assert (record.started_at, record.ended_at) == (T0, sim.time)


def test_a_follower_found_by_a_later_exporter_with_its_log_from_the_end_invents_nothing() -> None:
    """The exporter restarted while the follower served: a log read from its start still dates
    the end (and no load is recorded: none was watched); one read from its end cannot."""
    for from_start in (True, False):
        sim = Sim(follower(stall_after=30), logged=True, probe_every=NEVER)
        sim.spawn()
        sim.time += 600  # the exporter looks first ten minutes after the follower started
        if from_start:
            sim.say(EventKind.WEIGHTS_BEGIN, ago=590)
            sim.say(EventKind.WEIGHTS_END, ago=580)
            sim.say(EventKind.NODE_UP, ago=500)
        sim.tick(100)
        state = sim.state
        assert sim.records == []
        if from_start:
            assert state.phase == "ready" and not state.in_progress
        else:
            assert state.in_progress and state.end_unseen and not state.stalled


# -- what the kubelet's probes answer ---------------------------------------------------------


def view(sim: Sim, role: TargetRole = TargetRole.FOLLOWER) -> TargetView:
    config = TargetConfig("k2", EndpointConfig("http://127.0.0.1:8000"), role=role)
    return TargetView(config, sim.tracker.state(sim.time), {}, {})


def test_the_probes_say_what_a_followers_answer_rests_on() -> None:
    sim = Sim(follower(), logged=True, probe_every=NEVER)
    started(sim)
    sim.say(EventKind.NODE_UP)
    sim.tick(100)
    for question in (liveness.alive(view(sim), sim.time, 1.0), liveness.ready(view(sim))):
        assert (question.ok, question.line) == (True, liveness.FOLLOWER_READY)
    assert liveness.ready(view(sim, TargetRole.SERVER)).line == "ready"
    sim.kill()
    sim.tick(2)  # seen gone at the first tick
    alive = liveness.alive(view(sim), sim.time, 1.0)
    assert (alive.ok, alive.line) == (False, "process exited 1s ago")

    unseen = Sim(follower(stall_after=30), probe_every=NEVER)  # no log
    unseen.spawn()
    unseen.tick(5)
    unseen.tick(100, read=WEIGHTS // 100)
    unseen.tick(300)
    alive = liveness.alive(view(unseen), unseen.time, 1.0)
    ready = liveness.ready(view(unseen))
    assert alive.ok and alive.line == (
        f"initializing at 100 %: {liveness.END_UNSEEN}: quiet is not a stall"
    )
    assert not ready.ok and ready.line == f"not ready: initializing at 100 %: {liveness.END_UNSEEN}"


# -- a look-alike of vLLM's node 1, found by the exporter by itself ---------------------------

SPEED = 20.0  # the log's 92 s of start-up in under 5 s; its longest quiet (33 s) is 1.7 s
STALL_AFTER = 3.0
INTERVAL = 0.25
END_LINE = r"GiB for KV cache on node"


@dataclass
class Node:
    proc: subprocess.Popen[bytes]
    name: str
    port: int
    marks: Path
    accepted: Path
    started_at: float


@dataclass
class Exporter:
    url: str
    pid: int


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Exporter]:
    """The exporter with discovery alone: the config sets only its pace and stall window."""
    config = tmp_path / "exporter.yaml"
    config.write_text(
        f"sample_interval: {int(INTERVAL * 1000)}ms\n"
        f"history_path: {tmp_path / 'history.sqlite'}\n"
        f"discovery: {{interval: 1s, stall_after: {STALL_AFTER}s}}\n"
    )
    port = free_port()
    log = (tmp_path / "exporter.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", f"--config.file={config}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(f"{url}/-/ready"), timeout=30)
    yield Exporter(url, proc.pid)
    proc.terminate()
    proc.wait(timeout=15)
    log.close()
    assert "Traceback" not in (tmp_path / "exporter.log").read_text()


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    """`vllm serve DIR --headless --nnodes 2 --node-rank 1 ...`, writing node 1's real log."""
    weights = tmp_path / "llama-2nodes"
    generate_shards(weights, 2, 8 << 20)
    script = install(tmp_path / "lookalike")
    port = free_port()
    marks, accepted = tmp_path / "marks.json", tmp_path / "accepted"
    accepted.write_text("")
    env = {
        **os.environ,
        "LOOKALIKE_LOG": str(FOLLOWER_LOG),
        "LOOKALIKE_SPEED": str(SPEED),
        "LOOKALIKE_IMPORTS": "3",  # vLLM imports for 20 s here before its first line
        "LOOKALIKE_UNTIL": END_LINE,
        "LOOKALIKE_MARK_WEIGHTS": "Starting to load model",
        "LOOKALIKE_MARK_END": END_LINE,
        "LOOKALIKE_MARKS": str(marks),
        "LOOKALIKE_ACCEPTED": str(accepted),
    }
    with (tmp_path / "node1.log").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, str(script), "serve", str(weights), "--dtype", "float32",
             "--port", str(port), "--tensor-parallel-size", "2", "--nnodes", "2",
             "--node-rank", "1", "--master-addr", "10.77.0.1", "--headless"],
            env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    start = wait_for(lambda: process_start_time(proc.pid), timeout=10)
    yield Node(proc, f"vllm-llama-2nodes-{port}", port, marks, accepted, start)
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def target_of(url: str, name: str) -> dict[str, Any]:
    """The target's status; {} while the exporter has not found it."""
    status = requests.get(f"{url}/api/v1/status", timeout=10).json()
    return next((t for t in status["targets"] if t["target"] == name), {})


@pytest.mark.system
@pytest.mark.timeout(180)
def test_a_headless_vllm_node_is_ready_at_its_logs_line_alive_while_quiet_and_never_probed(
    running: Exporter, node: Node
) -> None:
    exporter = running.url
    target = wait_for(lambda: target_of(exporter, node.name), timeout=30)
    assert target["role"] == "follower"
    assert ("role", "follower") in {(e["what"], e["value"]) for e in target["discovered"]["why"]}
    alive = Prober(f"{exporter}/probe/alive?target={node.name}", period=0.5).start()
    try:
        ready = wait_for(lambda: (t := target_of(exporter, node.name)).get("phase") == "ready"
                         and t, timeout=60, interval=0.2)  # fmt: skip
        written = json.loads(wait_for(node.marks.read_text, timeout=5))
        record = ready["last_record"]
        # Ready at its log's own line: a whole-second stamp, placed within its second by when
        # the exporter read it.
        assert record["outcome"] == "ready"
        assert math.floor(written["end"]) <= record["ended_at"] <= written["end"] + 1.0
        assert record["started_at"] == pytest.approx(node.started_at, abs=0.01)
        # Its weights began at its own line too (the files it read came right after).
        assert "starting" in record["phase_seconds"], (record, ready)
        began = record["started_at"] + record["phase_seconds"]["starting"]
        assert math.floor(written["weights"]) <= began <= written["weights"] + 1.0
        assert ready["log"]["found_by"]
        time.sleep(3 * STALL_AFTER)  # quiet, as a follower is once up
        answer = requests.get(f"{exporter}/probe/ready?target={node.name}", timeout=5)
        assert (answer.status_code, answer.text) == (200, liveness.FOLLOWER_READY + "\n")
        quiet_until = time.time()
    finally:
        alive.stop()
    assert alive.probes and all(p.ok for p in alive.probes), alive.probes
    assert alive.probes[-1].body == liveness.FOLLOWER_READY
    assert alive.probes[-1].at - record["ended_at"] > 2 * STALL_AFTER
    assert quiet_until - written["end"] > 3 * STALL_AFTER
    # Never probed: the exporter never connected to its port (other exporters on this host
    # may), and it has no endpoint series or reading.
    assert str(running.pid) not in node.accepted.read_text().split()
    metrics = requests.get(f"{exporter}/metrics", timeout=10).text
    assert sample_value(metrics, "model_load_endpoint_up", target=node.name) is None
    assert sample_value(metrics, "model_load_target_info", target=node.name,
                        role="follower", discovered="true") == 1  # fmt: skip
    assert "endpoint" not in target_of(exporter, node.name)["sources"]

    node.proc.send_signal(signal.SIGKILL)
    killed = time.time()
    dead = wait_for(lambda: (r := requests.get(f"{exporter}/probe/alive?target={node.name}",
                                               timeout=5)).status_code == 503 and r.text,
                    timeout=10, interval=0.1)  # fmt: skip
    assert dead.startswith("process exited"), dead
    assert time.time() - killed < 3.0
