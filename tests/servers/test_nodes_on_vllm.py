"""A model over two hosts for real: vLLM 0.32 (CPU) at `--tensor-parallel-size 2 --nnodes 2`,
one rank per node, without Ray, each node watched by an exporter of its own that finds it.

Two "hosts" are two network namespaces on a bridge (HOSTS_NET.1 and .2; the test reaches both
through the bridge's .254), each node in a PID namespace of its own whose first process is that
host's exporter (discovery alone: no target configured), vLLM started inside it (nsenter). Node 0
serves; node 1 runs `--headless`: no API server, its readiness its log's end of start-up
(docs/how-it-decides.md#a-follower-node). Both exporters find the node under the same target
name (same model, same port), node 1's as a follower. A real Prometheus (Debian's, the shipped
rules 60 times faster: tests/test_dashboard_prometheus.py) scrapes both every 500 ms.

Checked: node 1's load ends ready at its own log's line and its exporter never probes it; the
model answers a completion (both ranks compute it); at every evaluation the model's recorded
ready (`model:model_load_ready:min`) agrees with its two hosts', and it is not ready while only
the follower is; node 1 stays alive, quiet and ready, longer than its stall_after, and the model
is never stalled for it; SIGKILLed, it is dead at once, and the model not ready. Each node's
boundaries, as its exporter saw them, beside its own log's stamps, and the model's ready as
Prometheus recorded it: .servers/reports/nodes-on-vllm.json.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from helpers.kubelet import Prober
from helpers.support import wait_for
from test_dashboard_prometheus import SCRAPE, Prometheus

from exporter.exposition import liveness
from servers import launched
from servers.vllm_server import (
    DTYPE,
    ENV,
    SERVERS,
    START_TIMEOUT,
    console_script,
    set_cache,
    stamp_of,
)
from servers.watch import write_report

HOSTS_NET = "10.79.0"  # the hosts' /24, on the bridge BRIDGE
BRIDGE = "mle-nodes-br"
PORT = 8000  # vLLM's, on both nodes: the same target name on both hosts
MASTER_PORT = 29511
EXPORTER_PORT = 9847
STALL_AFTER = 30.0  # discovery.stall_after: node 1 stays ready, quiet, longer than this
DEAD_WITHIN = 3.0  # seconds from SIGKILL to alive 503: a sample interval and a probe
REPORT = "nodes-on-vllm.json"
# The log lines each node's boundaries are held to (whole-second stamps).
LINES = {
    "weights_begin": "Starting to load model",
    "weights_end": "Loading weights took",
    "node_up": "GiB for KV cache on node",
    "serving": "Starting vLLM server on",
}

pytestmark = pytest.mark.timeout(3 * START_TIMEOUT)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def children(pid: int) -> list[int]:
    with contextlib.suppress(FileNotFoundError):
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    return []


class Node:
    """One host: a network namespace on the bridge and a PID namespace whose first process is
    its exporter; vLLM started in both."""

    def __init__(self, tmp: Path, rank: int) -> None:
        self.rank = rank
        self.netns = f"mle-nodes-h{rank}"
        self.address = f"{HOSTS_NET}.{rank + 1}"
        self.url = f"http://{self.address}:{EXPORTER_PORT}"
        self.dir = tmp / f"node{rank}"
        self.dir.mkdir()
        self.vllm_log = self.dir / "vllm.log"
        veth = f"mle-nodes-v{rank}"
        ip("netns", "add", self.netns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", self.netns)
        ip("link", "set", veth, "master", BRIDGE, "up")
        inside = ("netns", "exec", self.netns, "ip")
        ip(*inside, "addr", "add", f"{self.address}/24", "dev", "eth0")
        ip(*inside, "link", "set", "eth0", "up")
        ip(*inside, "link", "set", "lo", "up")
        config = self.dir / "exporter.yaml"
        config.write_text(yaml.safe_dump({
            "history_path": str(self.dir / "history.sqlite"),
            "discovery": {"interval": "1s", "stall_after": f"{STALL_AFTER:.0f}s"},
        }))  # fmt: skip
        self.exporter_log = (self.dir / "exporter.log").open("w")
        # The namespace's first process: when it dies, every process of the node dies with it.
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", self.netns, "unshare", "--pid", "--fork", "--mount-proc",
             sys.executable, "-m", "exporter", f"--config.file={config}",
             f"--web.listen-address={self.address}:{EXPORTER_PORT}"],
            stdout=self.exporter_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.init_pid = int(wait_for(lambda: (c := children(self.proc.pid)) and c[0]))
        wait_for(self._answers, timeout=60)
        self.vllm: subprocess.Popen[bytes] | None = None

    def _answers(self) -> bool:
        assert self.proc.poll() is None, (self.dir / "exporter.log").read_text()
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.RequestException:
            return False

    def start(self, script: Path, model: Path) -> None:
        env = {
            **ENV,
            "VLLM_CACHE_ROOT": str(SERVERS / "cache" / f"vllm-node{self.rank}"),
            "VLLM_CPU_OMP_THREADS_BIND": str(self.rank),  # one core per node
            "VLLM_HOST_IP": self.address,
            "GLOO_SOCKET_IFNAME": "eth0",
            # The platform is found from the distribution's name, which the console script's
            # `vllm-cpu` is not (the API server module's start does not ask).
            "VLLM_TARGET_DEVICE": "cpu",
        }
        argv = [str(script), "serve", str(model), "--dtype", DTYPE, "--max-model-len", "512",
                "--port", str(PORT), "--tensor-parallel-size", "2", "--nnodes", "2",
                "--node-rank", str(self.rank), "--master-addr", f"{HOSTS_NET}.1",
                "--master-port", str(MASTER_PORT),
                *(["--headless"] if self.rank else [])]  # fmt: skip
        with self.vllm_log.open("ab") as out:
            self.vllm = subprocess.Popen(
                ["nsenter", "--target", str(self.init_pid), "--pid", "--mount", "--net", "--",
                 "env", *(f"{k}={v}" for k, v in env.items()), *argv],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip

    @property
    def vllm_pid(self) -> int:
        """vLLM's own process (nsenter's child, in the node's PID namespace)."""
        assert self.vllm is not None
        nsenter = self.vllm.pid
        return int(wait_for(lambda: (c := children(nsenter)) and c[0]))

    def target(self) -> dict[str, Any]:
        """The node's one discovered target; {} until found."""
        targets = requests.get(f"{self.url}/api/v1/status", timeout=10).json()["targets"]
        return dict(targets[0]) if targets else {}

    def ready_target(self) -> dict[str, Any] | None:
        """The node's target once its load is ready."""
        target = self.target()
        return target if target.get("phase") == "ready" else None

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):  # its death ends every process of the node
            os.kill(self.init_pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        if self.vllm is not None:
            self.vllm.wait(timeout=30)
        self.exporter_log.close()
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, timeout=30)


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[Node, Node]]:
    ip("link", "add", BRIDGE, "type", "bridge")
    made: list[Node] = []
    try:
        ip("addr", "add", f"{HOSTS_NET}.254/24", "dev", BRIDGE)
        ip("link", "set", BRIDGE, "up")
        made.append(Node(tmp_path, 0))
        made.append(Node(tmp_path, 1))
        yield made[0], made[1]
    finally:
        for node in made:
            node.close()
        subprocess.run(["ip", "link", "del", BRIDGE], capture_output=True, timeout=30)


@pytest.fixture
def prometheus(tmp_path: Path, nodes: tuple[Node, Node]) -> Iterator[Prometheus]:
    """A real Prometheus scraping both hosts' exporters through the bridge."""
    home = tmp_path / "prometheus"
    home.mkdir()
    server = Prometheus(home, *(f"{node.address}:{EXPORTER_PORT}" for node in nodes))
    try:
        wait_for(server.scraping, timeout=60)
        yield server
    finally:
        server.stop()


def hosts_ready(prometheus: Prometheus, target: str, at: float) -> dict[str, float]:
    """Each host's `model_load_phase{phase="ready"}` for `target` at `at`, by instance."""
    query = f'model_load_phase{{phase="ready", target="{target}"}}'
    result = prometheus.api("query", query=query, time=at)["result"]
    return {s["metric"]["instance"]: float(s["value"][1]) for s in result}


def evaluations(
    prometheus: Prometheus, rule: str, since: float, until: float
) -> dict[float, float]:
    """Every sample the rule `rule` wrote between `since` and `until`, by timestamp (one model)."""
    window = f"{round(until - since + 1)}s"
    result = prometheus.api("query", query=f"{rule}[{window}]", time=until)["result"]
    assert len(result) <= 1, result
    return {float(t): float(v) for series in result for t, v in series["values"]}


def model_follows_its_hosts(
    prometheus: Prometheus, target: str, instances: list[str], since: float, until: float
) -> tuple[float, int]:
    """Check that every evaluation of `model:model_load_ready:min` is the least of its hosts'
    ready at that moment or a scrape before (a scrape stamped just before an evaluation may
    land just after it); return the first evaluation that found the model ready and how many
    found one host ready and the model not."""
    recorded = evaluations(prometheus, "model:model_load_ready:min", since, until)
    wrong, one_host_only, first_ready = [], 0, None
    for at, value in sorted(recorded.items()):
        moments = [hosts_ready(prometheus, target, t) for t in (at, at - SCRAPE)]
        if not all(set(instances) <= set(hosts) for hosts in moments):
            continue  # before both hosts' exporters found the node
        head, follower = ({hosts[i] for hosts in moments} for i in instances)
        if value not in {min(h, f) for h in head for f in follower}:
            wrong.append((at, value, moments))
        if value == 0 and all(sum(hosts[i] for i in instances) == 1 for hosts in moments):
            one_host_only += 1
        if value == 1 and first_ready is None:
            first_ready = at
    assert not wrong, wrong[:5]
    assert first_ready is not None, recorded
    return first_ready, one_host_only


def model_ready_now(prometheus: Prometheus) -> list[float]:
    result = prometheus.api("query", query="model:model_load_ready:min")["result"]
    return [float(series["value"][1]) for series in result]


def boundaries(record: dict[str, Any]) -> dict[str, float | None]:
    """A finished load's start, weights begin and end, and end, as the exporter recorded it."""
    phases, at = record["phase_seconds"], record["started_at"]
    weights_begin = at + phases["starting"] if "starting" in phases else None
    weights_end = (
        weights_begin + phases["loading_weights"]
        if weights_begin is not None and "loading_weights" in phases
        else None
    )
    return {"start": at, "weights_begin": weights_begin, "weights_end": weights_end,
            "ready": record["ended_at"]}  # fmt: skip


def test_a_model_over_two_hosts_head_serves_and_the_follower_is_ready_by_its_log(
    vllm_python: str,
    llama_checkpoint: Path,
    tmp_path: Path,
    nodes: tuple[Node, Node],
    prometheus: Prometheus,
) -> None:
    head, follower = nodes
    script = console_script(vllm_python, tmp_path / "bin")
    set_cache(llama_checkpoint, "cold")
    began = time.time()
    head.start(script, llama_checkpoint)
    follower.start(script, llama_checkpoint)
    health = f"http://{head.address}:{PORT}/health"
    assert head.vllm is not None

    def serves() -> bool:
        try:
            return requests.get(health, timeout=5).status_code == 200
        except requests.RequestException:
            return False

    answered = launched.first_answer(head.vllm, serves, name="vLLM node 0",
                                     tail=lambda: launched.tail(head.vllm_log),
                                     timeout=START_TIMEOUT, every=0.25)  # fmt: skip
    healthy_after = answered - began
    body = {"model": str(llama_checkpoint), "prompt": "over two hosts", "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    completion = requests.post(f"http://{head.address}:{PORT}/v1/completions", json=body,
                               timeout=120)  # fmt: skip
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4

    ready = {node.rank: wait_for(node.ready_target, timeout=60, interval=0.5) for node in nodes}
    assert ready[0]["target"] == ready[1]["target"]  # one model: one name on every host
    assert (ready[0]["role"], ready[1]["role"]) == ("server", "follower")
    why = {(e["what"], e["value"], e["source"]) for e in ready[1]["discovered"]["why"]}
    assert ("headless", "true", "argument --headless") in why
    assert "endpoint" in ready[0]["sources"] and "endpoint" not in ready[1]["sources"]

    logs = {node.rank: node.vllm_log.read_text(errors="replace") for node in nodes}
    stamps = {rank: {name: _stamp(log, line) for name, line in LINES.items()}
              for rank, log in logs.items()}  # fmt: skip
    seen = {rank: boundaries(t["last_record"]) for rank, t in ready.items()}
    ready_at = {rank: float(t["last_record"]["ended_at"]) for rank, t in ready.items()}
    # The follower is ready at its own log's end of start-up (a whole-second stamp).
    up = stamps[1]["node_up"]
    assert up is not None and up <= ready_at[1] <= up + 1.0, (seen[1], stamps[1])
    # The head is ready when it serves: after its own "Starting vLLM server", before the test's
    # first /health 200 came (plus a sample interval).
    serving = stamps[0]["serving"]
    assert serving is not None and serving <= ready_at[0] <= answered + 1.0

    # Quiet and ready for longer than its stall_after: the kubelet's alive stays 200.
    name = ready[1]["target"]
    prober = Prober(f"{follower.url}/probe/alive?target={name}", period=2.0).start()
    try:
        time.sleep(STALL_AFTER + 5)
    finally:
        prober.stop()
    assert prober.probes and all(p.ok for p in prober.probes), prober.probes
    assert {p.body for p in prober.probes} == {liveness.FOLLOWER_READY}
    metrics = requests.get(f"{follower.url}/metrics", timeout=10).text
    assert f'model_load_endpoint_up{{target="{name}"}}' not in metrics
    assert 'role="follower"' in metrics

    # What the recording rules made of the two hosts, at every evaluation: the model ready
    # only once both are (the follower is first: its head serves after its workers are up),
    # two hosts, and never stalled for the follower's quiet.
    instances = [f"{node.address}:{EXPORTER_PORT}" for node in nodes]
    until = time.time()
    model_ready, follower_only = model_follows_its_hosts(prometheus, name, instances, began, until)
    assert follower_only > 0
    assert ready_at[0] <= model_ready <= ready_at[0] + 3 * SCRAPE + 1.0
    hosts = evaluations(prometheus, "model:model_load_hosts:count", model_ready, until)
    assert set(hosts.values()) == {2.0}, hosts
    stalled = evaluations(prometheus, "model:model_load_stalled:max", began, until)
    assert stalled and set(stalled.values()) == {0.0}, stalled

    pid = follower.vllm_pid
    os.kill(pid, signal.SIGKILL)
    killed = time.time()
    alive = f"{follower.url}/probe/alive?target={name}"
    dead = wait_for(lambda: (r := requests.get(alive, timeout=5)).status_code == 503 and r.text,
                    timeout=15, interval=0.1)  # fmt: skip
    dead_after = time.time() - killed
    assert dead.startswith("process exited") and dead_after < DEAD_WITHIN, (dead, dead_after)
    wait_for(lambda: model_ready_now(prometheus) == [0.0], timeout=10)  # a host gone: not ready

    write_report(REPORT, {
        "healthy_after_seconds": round(healthy_after, 1),
        "test_seconds": round(time.time() - began, 1),
        "dead_after_seconds": round(dead_after, 2),
        # Prometheus's first evaluation that found the model ready, and how many found only
        # the follower ready (the model not)
        "model_ready_at": model_ready,
        "evaluations_follower_only_ready": follower_only,
        "nodes": {
            str(rank): {
                "log_stamps": stamps[rank],
                "exporter": seen[rank],
                "role": ready[rank]["role"],
            }
            for rank in (0, 1)
        },
    })  # fmt: skip


def _stamp(log: str, line: str) -> float | None:
    try:
        return stamp_of(log, line)
    except AssertionError:
        return None
