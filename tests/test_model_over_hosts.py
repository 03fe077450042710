"""A model served over two hosts, on a real Prometheus with the shipped rules and dashboard.

Two "hosts" are two PID namespaces here (`unshare --pid --fork --mount-proc`, as root): each runs
its own exporter (`serve`) as the namespace's first process, watching the simulator's
tensor-parallel ranks started inside that namespace (`nsenter`), so that each exporter sees its
own host's processes only. The second host runs the model's follower node (`simulate
--follower`), as vLLM's `--headless` node or SGLang's node ranked 1 does: it serves nothing and
is ready when its log says its part is up (docs/how-it-decides.md#a-follower-node). The
simulator stands in for the engine (docs/placement.md says what a real one adds): vLLM runs one
model over two namespaces here too, in minutes per load, not seconds. Each host has its own copy
of the weights: the page cache is this one kernel's, and separate files keep each host's
residency its own. A real Prometheus scrapes both every 500 ms with the shipped rules 60 times
faster (tests/test_dashboard_prometheus.py).

The scenario runs once (module fixture); the tests then read what Prometheus recorded, at every
rule evaluation, against what each host's exporter said at that moment:

1. both hosts load cold, the second at half the read rate: the model is ready only when both are;
2. both load cold again, the second stalls 60 % in for 4 s: its stall is the model's;
3. the first host restarts warm while the second is down: the model has no ETA; then both
   servers stop, the second host's weights evicted: the placement view ranks the host holding
   the weights first, each with its own forecast.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass, field
from itertools import product
from pathlib import Path
from typing import Any

import pytest
from helpers.mcp_agent import Agent
from helpers.processes import CLI, Answering, cli, evict_dir
from helpers.support import free_port, wait_for
from test_dashboard import REPO, committed, panel_queries
from test_dashboard_prometheus import SCRAPE, Prometheus

from exporter.commands.terminal import duration
from exporter.sim.shards import generate_shards

# The scenario runs in the first test's setup: about a minute, three on a machine busy with
# other work (the suite's limit is two).
pytestmark = [
    pytest.mark.system,
    pytest.mark.requires("root", "unshare"),
    pytest.mark.timeout(300),
]

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


class NamespaceHost(Answering):
    """One "host": a PID namespace whose first process is the exporter, and the simulator's
    runs inside it, one at a time, on this host's own weights. A `follower` host runs the
    model's follower node (`simulate --follower`: no port, its log's last line its end of
    start-up), its exporter told so (`--role follower`) and given that log."""

    def __init__(self, tmp: Path, name: str, follower: bool = False) -> None:
        self.dir = tmp / name
        self.follower = follower
        self.server_log = self.dir / "server.log"
        self.weights = self.dir / "model"
        generate_shards(self.weights, SHARDS, SHARD_SIZE)
        self.pidfile = self.dir / "server.pid"
        self.sim_port, port = free_port(), free_port()
        self.address = f"127.0.0.1:{port}"
        self.url = f"http://{self.address}"
        self.log = (self.dir / "exporter.log").open("w")
        self.server_log.touch()
        role = ("--role", "follower", "--log.source", f"file:{self.server_log}") if follower else ()
        # unshare itself ignores SIGTERM while it waits: the namespace's first process is
        # signalled, and all the namespace's processes die with it.
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", *CLI, "serve",
             "--target", TARGET, "--model", MODEL, "--probe", "completion",
             "--endpoint", f"http://127.0.0.1:{self.sim_port}", "--weights", str(self.weights),
             "--pidfile", str(self.pidfile), "--sample.interval", "250ms", "--stall.after", "1s",
             "--history.path", str(self.dir / "history.sqlite"),
             "--web.listen-address", self.address, *role],
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
        return self._ready()

    def start(self, *extra: str) -> None:
        """The simulator in this host's namespace (its pidfile holds its pid there)."""
        assert self.server is None
        self.report.unlink(missing_ok=True)
        self.server = subprocess.Popen(
            ["nsenter", "--target", str(self.init_pid), "--pid", "--mount", "--", *CLI,
             "simulate", "--port", str(self.sim_port), "--weights", str(self.weights),
             "--model", MODEL, "--pidfile", str(self.pidfile), "--report", str(self.report),
             "--log-file", str(self.server_log), *SIM,
             *(("--follower",) if self.follower else ()), *extra],
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
        wait_for(lambda: self.target().get("phase") == "down", 15)

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

    def settle(self, name: str, condition: Both, timeout: float = 30) -> None:
        """Note the moment `name` once `condition` of both hosts' targets has held for SETTLE
        seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if condition(self.a.target(), self.b.target()):
                time.sleep(SETTLE)
                if condition(self.a.target(), self.b.target()):
                    self.moments[name] = time.time()
                    return
            time.sleep(0.05)
        said = [{k: t.get(k) for k in SHOWN} for t in (self.a.target(), self.b.target())]
        raise AssertionError(f"never {name}: {said}")


Target = dict[str, Any]
Both = Callable[[Target, Target], bool]
SHOWN = ("phase", "stalled", "eta_seconds", "progress_ratio")  # of a target, in a failure


def loading(target: Target) -> bool:
    return target.get("phase") in IN_PROGRESS


def ready(target: Target) -> bool:
    return target.get("phase") == "ready"


def eta(target: Target) -> bool:
    return target.get("eta_seconds") is not None


def stalled(target: Target) -> bool:
    return bool(target.get("stalled"))


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scenario]:
    tmp = tmp_path_factory.mktemp("hosts")
    hosts: list[NamespaceHost] = []
    prometheus = None
    try:
        a = NamespaceHost(tmp, "gpu-a")
        hosts.append(a)
        b = NamespaceHost(tmp, "gpu-b", follower=True)
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
        run.settle("one host ready", lambda ta, tb: ready(ta) and loading(tb))
        run.settle("both ready", lambda ta, tb: ready(ta) and ready(tb))
        a.stop()
        b.stop()

        # 2. Both cold again, with history now (ETAs); the second stalls 60 % in for 4 s.
        evict_dir(a.weights)
        evict_dir(b.weights)
        a.start("--read-rate", "2.5MB/s")
        b.start("--read-rate", "3MB/s", "--stall-at", "0.6", "--stall-for", "4s")
        run.settle("both loading with an ETA",
                   lambda ta, tb: eta(ta) and eta(tb) and not stalled(tb), timeout=20)  # fmt: skip
        run.settle("one host stalled, the other loading",
                   lambda ta, tb: stalled(tb) and loading(ta) and eta(ta))  # fmt: skip
        run.settle("both ready again", lambda ta, tb: ready(ta) and ready(tb))
        a.stop()
        b.stop()

        # 3. The first host restarts warm while the second stays down: the model has no ETA.
        # Then both servers are stopped; the second host's weights are evicted, the first's
        # stay in its page cache.
        a.start("--read-rate", "4MB/s")
        run.settle("one host loading, the other down",
                   lambda ta, tb: loading(ta) and eta(ta) and tb["phase"] == "down")  # fmt: skip
        wait_for(lambda: ready(a.target()), 30)
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


def test_the_follower_host_is_one_of_the_models_hosts(scenario: Scenario) -> None:
    """Host b runs the follower: never probed (no endpoint series), `role="follower"`, and one
    of the model's two hosts, its ready counted once its log said its part is up."""
    prometheus, at = scenario.prometheus, scenario.moments["both ready"]
    info = prometheus.api("query", query=f'model_load_target_info{{target="{TARGET}"}}', time=at)
    roles = {s["metric"]["instance"]: s["metric"]["role"] for s in info["result"]}
    assert roles == {scenario.a.address: "server", scenario.b.address: "follower"}
    probed = by_instance(prometheus, f'model_load_endpoint_up{{target="{TARGET}"}}', at)
    assert set(probed) == {scenario.a.address}
    for rule, value in (("model:model_load_hosts:count", 2.0),
                        ("model:model_load_hosts_ready:sum", 2.0),
                        ("model:model_load_ready:min", 1.0)):  # fmt: skip
        answer = prometheus.api("query", query=f'{rule}{{model="{MODEL}"}}', time=at)["result"]
        assert [float(s["value"][1]) for s in answer] == [value], rule


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
    ("moment", "ready_", "loading", "not_ready"),
    [
        ("one host ready", 0, 1, {"b": "loading"}),
        ("both ready", 1, 0, {}),
        ("both loading with an ETA", 0, 2, {"a": "loading", "b": "loading"}),
        ("one host stalled, the other loading", 0, 2, {"a": "loading", "b": "loading"}),
        ("both ready again", 1, 0, {}),
        ("one host loading, the other down", 0, 1, {"a": "loading", "b": "down"}),
    ],
)
def test_the_fleet_row_shows_the_model_at_each_moment(
    scenario: Scenario, moment: str, ready_: int, loading: int, not_ready: dict[str, str]
) -> None:
    prometheus, at = scenario.prometheus, scenario.moments[moment]
    row = fleet_row(prometheus, at)
    assert set(row) == {
        "Loads in progress/A", "Loads in progress/B", "Models ready on every host/A",
        "Slowest ETA per model/A", "Targets not ready/A", "Models stalled on a host/A",
    }  # fmt: skip
    assert of_model(row["Models ready on every host/A"]) == ready_
    assert [v for _, v in row["Loads in progress/A"]] == [loading]
    assert [v for _, v in row["Loads in progress/B"]] == ([loading] if loading else [])
    hosts = {"a": scenario.a.address, "b": scenario.b.address}
    listed = {labels["instance"]: labels["phase"] for labels, _ in row["Targets not ready/A"]}
    shown = {h: "loading" if p in IN_PROGRESS else p for h, p in listed.items()}
    assert shown == {hosts[h]: phase for h, phase in not_ready.items()}
    # Stall and ETA as the hosts had them then (a host slow to start on this busy machine may
    # stall too, at stall_after 1 s), with a scrape's leeway.
    evaluated = max(t for t in recorded(prometheus, "model:model_load_hosts:count",
                                        at - 5, at) if t <= at)  # fmt: skip
    stalled_ = of_model(row["Models stalled on a host/A"])
    eta = of_model(row["Slowest ETA per model/A"])
    for value, rule in ((stalled_, "model:model_load_stalled:max"),
                        (eta, "model:model_load_eta_seconds:max")):  # fmt: skip
        assert value in possible(prometheus, evaluated, rule, list(hosts.values())), rule
    if moment == "one host stalled, the other loading":
        assert stalled_ == 1
    if moment == "one host loading, the other down":
        assert eta is None
    if moment == "both loading with an ETA":
        assert eta is not None


# -- where the model would start warm ----------------------------------------------------------


PLACEMENT = (
    "model_instance:model_load_weights_cached:ratio",
    "model_instance:model_load_restart_forecast_seconds:min",
    "model_instance:model_load_placement:score",
)


def by_instance(prometheus: Prometheus, query: str, at: float) -> dict[str, float]:
    result = prometheus.api("query", query=query, time=at)["result"]
    return {s["metric"]["instance"]: float(s["value"][1]) for s in result}


@pytest.fixture(scope="module")
def placed(scenario: Scenario) -> dict[str, dict[str, float]]:
    """Once both servers are down and each exporter's forecast and residency say so in
    Prometheus: each placement record by instance, with each host's own forecast (its exporter's
    series) and its status's, all read at one moment."""
    prometheus, hosts = scenario.prometheus, (scenario.a, scenario.b)

    def settled() -> dict[str, dict[str, float]] | None:
        at = time.time()
        now = {
            name: by_instance(prometheus, f'{name}{{model="{MODEL}"}}', at) for name in PLACEMENT
        }
        now["own"] = by_instance(prometheus, "model_load_restart_forecast_seconds", at)
        now["status"] = {
            h.address: h.target()["restart_forecast"]["seconds"]
            for h in hosts
            if h.target().get("restart_forecast", {}).get("seconds") is not None
        }
        cached = now["model_instance:model_load_weights_cached:ratio"]
        complete = all(len(values) == 2 for values in now.values())
        moved = cached.get(scenario.a.address) != 1.0 or cached.get(scenario.b.address) != 0.0
        forecasts = now["model_instance:model_load_restart_forecast_seconds:min"]
        return None if not complete or moved or forecasts != now["own"] else now

    return dict(wait_for(settled, timeout=60, interval=0.5))


def test_the_placement_rule_ranks_the_host_holding_the_weights_first(
    scenario: Scenario, placed: dict[str, dict[str, float]]
) -> None:
    """Neither host runs the model now: a configured target keeps its weights' residency and its
    forecast measured while its server is down, and that is what the placement reads."""
    a, b = scenario.a.address, scenario.b.address
    score = placed["model_instance:model_load_placement:score"]
    assert score[a] > score[b]
    # Each host's forecast is its own: its exporter's series, and its status document's.
    forecast = placed["model_instance:model_load_restart_forecast_seconds:min"]
    assert forecast == placed["own"] == placed["status"]
    # The dashboard's placement panels, as committed, at the same time.
    at = time.time()
    queries = {
        f"{title}/{ref}": expr
        for title, ref, expr, _ in panel_queries(committed())
        if "warm" in title
    }
    assert set(queries) == {
        "Hosts that would start each model warm/A",
        "Where each model would start warm/A",
        "Where each model would start warm/B",
    }
    warm = prometheus_answer(
        scenario.prometheus, queries["Hosts that would start each model warm/A"], at
    )
    assert warm == [({"__name__": "model:model_load_hosts_warm:count", "model": MODEL}, 1.0)]
    table = by_instance(scenario.prometheus, queries["Where each model would start warm/A"], at)
    assert table == {a: 1.0, b: 0.0}
    table = by_instance(scenario.prometheus, queries["Where each model would start warm/B"], at)
    assert table == forecast


def prometheus_answer(
    prometheus: Prometheus, query: str, at: float
) -> list[tuple[dict[str, str], float]]:
    result = prometheus.api("query", query=query, time=at)["result"]
    return [(s["metric"], float(s["value"][1])) for s in result]


def test_status_and_the_agents_tool_give_the_same_ranking(
    scenario: Scenario, placed: dict[str, dict[str, float]], tmp_path: Path
) -> None:
    a, b = scenario.a.address, scenario.b.address
    forecast = placed["model_instance:model_load_restart_forecast_seconds:min"]
    fleet = scenario.prometheus.url
    asked = cli("status", "--placement", "--prometheus", fleet, "--model", MODEL, "--json")
    assert asked.returncode == 0, asked.stderr
    answer = json.loads(asked.stdout)
    assert (answer["scope"], answer["source"]) == ("fleet", fleet)
    assert answer["hosts"] == [
        {"model": MODEL, "host": a, "cached_share": 1.0, "forecast_seconds": forecast[a],
         "warm": True},
        {"model": MODEL, "host": b, "cached_share": 0.0, "forecast_seconds": forecast[b],
         "warm": False},
    ]  # fmt: skip
    shown = cli("status", "--placement", "--prometheus", fleet)
    assert shown.returncode == 0, shown.stderr
    header, *table = shown.stdout.splitlines()
    assert header == (
        f"where each model would start warm: every host, as Prometheus at {fleet} records them"
    )
    assert [re.split(r"\s{2,}", row.strip()) for row in table] == [
        ["MODEL", "HOST", "WEIGHTS CACHED", "RESTART FORECAST"],
        [MODEL, a, "100 %", duration(forecast[a])],
        [MODEL, b, "0 %", duration(forecast[b])],
    ]
    # Without a Prometheus: the asked exporter's host alone, said to be that.
    own = json.loads(cli("status", "--placement", "--exporter", scenario.b.url, "--json").stdout)
    assert (own["scope"], own["source"]) == ("host", scenario.b.url)
    assert [(h["host"], h["cached_share"], h["forecast_seconds"]) for h in own["hosts"]] == [
        (b, 0.0, forecast[b])
    ]

    agent = Agent(tmp_path / "mcp.stderr", "--exporter", scenario.b.url, "--prometheus", fleet)
    try:
        told = agent.answer("where_to_start", {"model": MODEL})
        alone = Agent(tmp_path / "mcp-host.stderr", "--exporter", scenario.b.url)
        try:
            host_only = alone.answer("where_to_start", {})
        finally:
            alone.close()
    finally:
        agent.close()
    assert (told["scope"], told["hosts"]) == ("fleet", answer["hosts"])
    assert told["summary"] == (
        f"{MODEL}: warm on 1 of 2 hosts, best {a} (100 % cached, a restart there ready in about "
        f"{duration(forecast[a])}) [the fleet: {fleet}]"
    )
    assert (host_only["scope"], host_only["hosts"]) == ("host", own["hosts"])
    assert host_only["summary"].endswith(f"[this host only: {scenario.b.url}]")


def test_the_placement_docs_queries_and_script_answer_as_documented(
    scenario: Scenario, placed: dict[str, dict[str, float]], tmp_path: Path
) -> None:
    """docs/placement.md's copy-paste PromQL and its script, run as written (they name this
    test's model) against the Prometheus of the two hosts."""
    a, b = scenario.a.address, scenario.b.address
    forecast = placed["model_instance:model_load_restart_forecast_seconds:min"]
    page = (REPO / "docs" / "placement.md").read_text()
    queries = re.findall(r"```promql\n(.*?)```", page, re.DOTALL)
    at = time.time()
    answers = [prometheus_answer(scenario.prometheus, query, at) for query in queries]
    best, warm, moved, scores = ([(s["instance"], v) for s, v in found] for found in answers)
    assert [host for host, _ in best] == [a, b]  # topk: the best first
    assert warm == moved == [(a, forecast[a])]  # warm on a only; neither serves it now
    assert sorted(scores) == sorted([(a, 100.0), (b, 0.0)])
    (script,) = re.findall(r"```python\n(.*?)```", page, re.DOTALL)
    path = tmp_path / "placement.py"
    path.write_text(script.replace("http://prometheus:9090", scenario.prometheus.url))
    ran = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == [
        f"{a}: 100% cached, restart in {forecast[a]:.0f} s",
        f"{b}: 0% cached, restart in {forecast[b]:.0f} s",
    ]
