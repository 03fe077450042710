"""A model served over two hosts, on a real Prometheus with the shipped rules and dashboard.

Two "hosts" are two PID namespaces here (`unshare --pid --fork --mount-proc`, as root): each runs
its own exporter (`serve`) as the namespace's first process, watching the simulator's
tensor-parallel ranks started inside that namespace (`nsenter`), so that each exporter sees its
own host's processes only. No engine here runs one model across namespaces, so the simulator
stands in for one (docs/placement.md says what a real one would add). Each host has its own copy
of the weights: the page cache is this one kernel's, and separate files keep each host's
residency its own. A real Prometheus scrapes both every 500 ms with the shipped rules 60 times
faster (tests/test_dashboard_prometheus.py).

The scenario runs once (module fixture); the tests then read what Prometheus recorded, at every
rule evaluation, against what each host's exporter said at that moment:

1. both hosts load cold, the second at half the read rate: the model is ready only when both are;
2. both load cold again, the second stalls for 4 s: its stall is the model's;
3. the first host restarts warm while the second is down: the model has no ETA; then both
   servers stop, the second host's weights evicted: the placement view ranks the host holding
   the weights first, each with its own forecast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.processes import CLI, evict_dir
from helpers.support import free_port, wait_for
from test_dashboard import committed, panel_queries
from test_dashboard_prometheus import SCRAPE, Prometheus

from exporter.sim.shards import generate_shards

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "unshare")]

MODEL, TARGET = "Kimi-K2", "kimi"
SHARDS, SHARD_SIZE = 4, 4 << 20
SIM = ("--tensor-parallel", "2", "--init-seconds", "1", "--startup-seconds", "0.5",
       "--cached-read-rate", "8MB/s")  # fmt: skip
SETTLE = 1.2  # seconds a state must hold to be a moment: two scrapes and two rule evaluations
IN_PROGRESS = ("starting", "loading_weights", "initializing")


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


class NamespaceHost:
    """One "host": a PID namespace whose first process is the exporter, and the simulator's
    runs inside it, one at a time, on this host's own weights."""

    def __init__(self, tmp: Path, name: str) -> None:
        self.dir = tmp / name
        self.weights = self.dir / "model"
        generate_shards(self.weights, SHARDS, SHARD_SIZE)
        self.pidfile = self.dir / "server.pid"
        self.sim_port, port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"
        self.log = (self.dir / "exporter.log").open("w")
        # unshare itself ignores SIGTERM while it waits: the namespace's first process is
        # signalled, and all the namespace's processes die with it.
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", *CLI, "serve",
             "--target", TARGET, "--model", MODEL, "--probe", "completion",
             "--endpoint", f"http://127.0.0.1:{self.sim_port}", "--weights", str(self.weights),
             "--pidfile", str(self.pidfile), "--sample.interval", "250ms", "--stall.after", "1s",
             "--history.path", str(self.dir / "history.sqlite"),
             "--web.listen-address", self.address],
            stdout=self.log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.init_pid = int(
            wait_for(lambda: children(self.proc.pid) and children(self.proc.pid)[0])
        )
        wait_for(self._answers, 30)
        self.server: subprocess.Popen[bytes] | None = None
        self.report = self.dir / "report.json"

    def _answers(self) -> bool:
        assert self.proc.poll() is None, (self.dir / "exporter.log").read_text()
        try:
            return requests.get(f"{self.url}/-/ready", timeout=2).status_code == 200
        except requests.ConnectionError:
            return False

    def target(self) -> dict[str, Any]:
        status = requests.get(f"{self.url}/api/v1/status", timeout=5).json()
        return dict(status["targets"][0])

    def phase(self) -> str:
        return str(self.target().get("phase"))

    def start(self, *extra: str) -> None:
        """The simulator in this host's namespace (its pidfile holds its pid there)."""
        assert self.server is None
        self.report.unlink(missing_ok=True)
        self.server = subprocess.Popen(
            ["nsenter", "--target", str(self.init_pid), "--pid", "--mount", "--", *CLI,
             "simulate", "--port", str(self.sim_port), "--weights", str(self.weights),
             "--model", MODEL, "--pidfile", str(self.pidfile), "--report", str(self.report),
             "--log-file", str(self.dir / "server.log"), *SIM, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        """Stop the simulator (nsenter does not pass signals on: its child is signalled)."""
        if self.server is None:
            return
        for pid in children(self.server.pid):
            signal_quietly(pid, signal.SIGTERM)
        self.server.wait(timeout=15)
        self.server = None
        wait_for(lambda: self.phase() == "down", 15)

    def close(self) -> None:
        if self.server is not None:
            for pid in children(self.server.pid):
                signal_quietly(pid, signal.SIGKILL)
            self.server.wait(timeout=15)
        signal_quietly(self.init_pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            signal_quietly(self.init_pid, signal.SIGKILL)
            self.proc.wait(timeout=15)
        self.log.close()


def signal_quietly(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


@dataclass
class Scenario:
    a: NamespaceHost
    b: NamespaceHost
    prometheus: Prometheus
    began: float = 0.0
    ended: float = 0.0
    moments: dict[str, float] = field(default_factory=dict)

    def settle(self, name: str, condition: Callable[[], bool], timeout: float = 30) -> None:
        """Note the moment `name` once `condition` has held for SETTLE seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition():
                time.sleep(SETTLE)
                if condition():
                    self.moments[name] = time.time()
                    return
            time.sleep(0.05)
        raise AssertionError(f"never {name}: {self.a.target()} / {self.b.target()}")


def loading(host: NamespaceHost) -> bool:
    return host.phase() in IN_PROGRESS


def ready(host: NamespaceHost) -> bool:
    return host.phase() == "ready"


def stalled(host: NamespaceHost) -> bool:
    return bool(host.target().get("stalled"))


def has_eta(host: NamespaceHost) -> bool:
    return host.target().get("eta_seconds") is not None


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("hosts")
    hosts: list[NamespaceHost] = []
    prometheus = None
    try:
        a = NamespaceHost(tmp, "gpu-a")
        hosts.append(a)
        b = NamespaceHost(tmp, "gpu-b")
        hosts.append(b)
        prometheus = Prometheus(tmp, a.address, b.address)
        up = 'count(up{job="model-load"} == 1) == 2'
        wait_for(lambda: prometheus.scraping() and prometheus.api("query", query=up)["result"],
                 timeout=30, interval=0.2)  # fmt: skip
        run = Scenario(a, b, prometheus, began=time.time())

        # 1. Both cold; the second host reads at half the rate: one host ready is not the model.
        evict_dir(a.weights)
        evict_dir(b.weights)
        a.start("--read-rate", "8MB/s")
        b.start("--read-rate", "4MB/s")
        run.settle("one host ready", lambda: ready(a) and loading(b))
        run.settle("both ready", lambda: ready(a) and ready(b))
        a.stop()
        b.stop()

        # 2. Both cold again, with history now (ETAs); the second stalls a quarter in for 4 s.
        evict_dir(a.weights)
        evict_dir(b.weights)
        a.start("--read-rate", "4MB/s")
        b.start("--read-rate", "4MB/s", "--stall-at", "0.25", "--stall-for", "4s")
        run.settle("both loading with an ETA", lambda: has_eta(a) and has_eta(b), timeout=20)
        run.settle("one host stalled, the other loading",
                   lambda: stalled(b) and loading(a) and has_eta(a))  # fmt: skip
        run.settle("both ready again", lambda: ready(a) and ready(b))
        a.stop()
        b.stop()

        # 3. The first host restarts warm while the second stays down: the model has no ETA.
        # Then both servers are stopped; the second host's weights are evicted, the first's
        # stay in its page cache.
        a.start("--read-rate", "4MB/s")
        run.settle("one host loading, the other down",
                   lambda: loading(a) and has_eta(a) and b.phase() == "down")  # fmt: skip
        wait_for(lambda: ready(a), 30)
        a.stop()
        evict_dir(b.weights)
        run.ended = time.time()
        yield run
    finally:
        if prometheus is not None:
            prometheus.stop()
        for host in hosts:
            host.close()


# -- what each host said, and what the rules say it makes of the model -----------------------


@dataclass(frozen=True)
class HostNow:
    """One host's target as Prometheus held it at one moment."""

    phase: str | None
    eta: float | None
    stalled: float | None
    in_progress: float | None


STATE = f'{{__name__=~"model_load_(phase|eta_seconds|stalled|in_progress)", target="{TARGET}"}}'


def hosts_at(prometheus: Prometheus, at: float) -> dict[str, HostNow]:
    fields: dict[str, dict[str, Any]] = {}
    for series in prometheus.api("query", query=STATE, time=at)["result"]:
        labels, value = series["metric"], float(series["value"][1])
        known = fields.setdefault(labels["instance"], {})
        name = labels["__name__"].removeprefix("model_load_")
        if name == "phase":
            if value == 1:
                known["phase"] = labels["phase"]
        else:
            known[{"eta_seconds": "eta"}.get(name, name)] = value
    return {
        instance: HostNow(k.get("phase"), k.get("eta"), k.get("stalled"), k.get("in_progress"))
        for instance, k in fields.items()
    }


def model_eta(hosts: list[HostNow]) -> float | None:
    """The slowest host's ETA; none while a host that is not ready has none."""
    if any(h.phase != "ready" and h.eta is None for h in hosts):
        return None
    etas = [h.eta for h in hosts if h.eta is not None]
    return max(etas) if etas else None


# What each recorded series of the model must be, from its hosts.
SPEC: dict[str, Callable[[list[HostNow]], float | None]] = {
    "model:model_load_ready:min": lambda hs: min(float(h.phase == "ready") for h in hs),
    "model:model_load_hosts_ready:sum": lambda hs: sum(float(h.phase == "ready") for h in hs),
    "model:model_load_hosts:count": lambda hs: float(len(hs)),
    "model:model_load_in_progress:max": lambda hs: max(h.in_progress or 0.0 for h in hs),
    "model:model_load_stalled:max": lambda hs: max(h.stalled or 0.0 for h in hs),
    "model:model_load_eta_seconds:max": model_eta,
}


def recorded(prometheus: Prometheus, name: str, since: float, until: float) -> dict[float, float]:
    """Every sample the rule wrote for the model between `since` and `until`, by timestamp."""
    window = f"{round(until - since + 1)}s"
    result = prometheus.api("query", query=f'{name}{{model="{MODEL}"}}[{window}]', time=until)
    return {float(t): float(v) for series in result["result"] for t, v in series["values"]}


def possible(prometheus: Prometheus, at: float, rule: str, instances: list[str]) -> set[Any]:
    """What `rule` may have recorded at `at`: from each host's state at `at` or one scrape
    before (a scrape stamped just before an evaluation may land in the TSDB just after it)."""
    now, before = hosts_at(prometheus, at), hosts_at(prometheus, at - SCRAPE)
    choices = [[s[i] for s in (now, before) if i in s] for i in instances]
    return {SPEC[rule](list(combo)) for combo in product(*choices)}


def test_the_model_follows_its_slowest_host_at_every_evaluation(scenario: Scenario) -> None:
    """Every evaluation of the model's rules agrees with its two hosts' states then; and the
    run went through the states where the slowest host decides."""
    prometheus = scenario.prometheus
    instances = [scenario.a.address, scenario.b.address]
    evaluations = recorded(prometheus, "model:model_load_hosts:count", scenario.began,
                           scenario.ended)  # fmt: skip
    assert len(evaluations) > 40, evaluations
    values = {rule: recorded(prometheus, rule, scenario.began, scenario.ended) for rule in SPEC}
    wrong = []
    seen: set[str] = set()
    for at in sorted(evaluations):
        now, before = hosts_at(prometheus, at), hosts_at(prometheus, at - SCRAPE)
        if not set(instances) <= set(now) & set(before):
            continue  # before both hosts' first tick
        for rule in SPEC:
            if values[rule].get(at) not in possible(prometheus, at, rule, instances):
                wrong.append((rule, at, values[rule].get(at), now))
        for name, holds in SITUATIONS.items():
            if all(holds(*(state[i] for i in instances)) for state in (now, before)):
                seen.add(name)
    assert not wrong, wrong[:5]
    assert seen == set(SITUATIONS)


# Where the slowest host decides, held at an evaluation and a scrape before it (host a, host b).
SITUATIONS: dict[str, Callable[[HostNow, HostNow], bool]] = {
    "ready on one host only": lambda a, b: a.phase == "ready" and b.phase in IN_PROGRESS,
    "two different ETAs": lambda a, b: None not in (a.eta, b.eta) and a.eta != b.eta,
    "one host stalled": lambda a, b: bool(b.stalled) and not a.stalled,
    # what the old ETA rule got wrong: it gave the loading host's ETA for the model's
    "one host down while the other loads with an ETA": lambda a, b: (
        b.phase == "down" and a.phase in IN_PROGRESS and a.eta is not None
    ),
}


def fleet_row(prometheus: Prometheus, at: float) -> dict[str, list[tuple[dict[str, str], float]]]:
    """The committed dashboard's fleet-row queries ("panel/refId"), each answered at `at`."""
    answers = {}
    for title, ref_id, expr, _ in panel_queries(committed()):
        if title in FLEET_PANELS:
            result = prometheus.api("query", query=expr, time=at)["result"]
            answers[f"{title}/{ref_id}"] = [(s["metric"], float(s["value"][1])) for s in result]
    return answers


FLEET_PANELS = (
    "Loads in progress",
    "Models ready on every host",
    "Slowest ETA per model",
    "Targets not ready",
    "Models stalled on a host",
)


def of_model(answer: list[tuple[dict[str, str], float]]) -> float | None:
    values = [value for labels, value in answer if labels.get("model") == MODEL]
    assert len(values) <= 1, answer
    return values[0] if values else None


@pytest.mark.parametrize(
    ("moment", "ready_", "stalled_", "loading", "not_ready"),
    [
        ("one host ready", 0, 0, 1, {"b": "loading"}),
        ("both ready", 1, 0, 0, {}),
        ("both loading with an ETA", 0, 0, 2, {"a": "loading", "b": "loading"}),
        ("one host stalled, the other loading", 0, 1, 2, {"a": "loading", "b": "loading"}),
        ("both ready again", 1, 0, 0, {}),
        ("one host loading, the other down", 0, 0, 1, {"a": "loading", "b": "down"}),
    ],
)
def test_the_fleet_row_shows_the_model_at_each_moment(
    scenario: Scenario,
    moment: str,
    ready_: int,
    stalled_: int,
    loading: int,
    not_ready: dict[str, str],
) -> None:
    prometheus, at = scenario.prometheus, scenario.moments[moment]
    row = fleet_row(prometheus, at)
    assert set(row) == {
        "Loads in progress/A", "Loads in progress/B", "Models ready on every host/A",
        "Slowest ETA per model/A", "Targets not ready/A", "Models stalled on a host/A",
    }  # fmt: skip
    assert of_model(row["Models ready on every host/A"]) == ready_
    assert of_model(row["Models stalled on a host/A"]) == stalled_
    assert [v for _, v in row["Loads in progress/A"]] == [loading]
    assert [v for _, v in row["Loads in progress/B"]] == ([loading] if loading else [])
    hosts = {"a": scenario.a.address, "b": scenario.b.address}
    listed = {labels["instance"]: labels["phase"] for labels, _ in row["Targets not ready/A"]}
    shown = {h: "loading" if p in IN_PROGRESS else p for h, p in listed.items()}
    assert shown == {hosts[h]: phase for h, phase in not_ready.items()}
    # The model's ETA: the slowest host's, none while one has none (one scrape's leeway).
    evaluated = max(t for t in recorded(prometheus, "model:model_load_hosts:count",
                                        at - 5, at) if t <= at)  # fmt: skip
    eta = of_model(row["Slowest ETA per model/A"])
    rule = "model:model_load_eta_seconds:max"
    assert eta in possible(prometheus, evaluated, rule, list(hosts.values()))
    if moment == "one host loading, the other down":
        assert eta is None
    if moment == "both loading with an ETA":
        assert eta is not None
