"""The dashboard and the alert rules against a real Prometheus scraping the real exporter.

The simulator performs a cold load, a stalled load and a crash while Prometheus (Debian's
`prometheus`) scrapes the exporter every 500 ms and evaluates a copy of the shipped rules that
runs 60 times faster (every `for:` and range window in minutes becomes seconds). Every query of
the committed dashboard JSON, with its template variables substituted as Grafana would, must be
valid PromQL and return data at the moment its generator tag names; the stall and failure
alerts must reach `firing` and resolve. Only the GPU is faked (NVML, at the module boundary).
"""

from __future__ import annotations

import math
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from helpers.fake_nvml import GIB, FakeNvml, FakeProcess, h200_node
from helpers.processes import Simulator, evict_dir
from helpers.support import RunningExporter, free_port, wait_for
from test_dashboard import REPO, RULES, committed, load_generator, panel_queries
from test_e2e import PACE

from exporter.sim.shards import generate_shards

SCRAPE = 0.5  # seconds, scrape and rule evaluation interval
EVERY = f"{int(SCRAPE * 1000)}ms"
SHARDS, SHARD_SIZE = 4, 4 << 20
SIM = ("--read-rate", "4MB/s", "--init-seconds", "1", "--startup-seconds", "1")

pytestmark = pytest.mark.system


def fast_rules(text: str, speed: float = 60) -> str:
    """The shipped rules `speed` times faster, in `for:` and in range windows (at 60, minutes
    become seconds)."""

    def faster(match: re.Match[str]) -> str:
        return f"{round(int(match[1]) * 60_000 / speed)}ms"

    rules = yaml.safe_load(text)
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = re.sub(r"^(\d+)m$", faster, rule["for"])
            rule["expr"] = re.sub(r"\[(\d+)m\]", lambda m: f"[{faster(m)}]", rule["expr"])
    return str(yaml.safe_dump(rules, sort_keys=False))


def grafana_regex(value: str) -> str:
    """A variable value as Grafana puts it into a `=~` matcher (regex-escaped in a string)."""
    return re.sub(r"([\\.*+?^${}()|\[\]])", r"\\\\\1", value)


def grafana_queries(
    dashboard: dict[str, Any], instance: str, target: str, scrape: float, range_: str
) -> list[tuple[str, str, str, bool]]:
    """(panel, refId, expr, instant) of every query with its variables substituted as Grafana
    does: `instance` and `target` as the variables' regex values (".*" is the dashboard's "All"),
    $__interval the step (the scrape interval, Grafana's minimum), $__rate_interval
    max($__interval + scrape interval, 4 * scrape interval), $__range the time range."""
    ms = round(scrape * 1000)
    substitutions = {
        "$__rate_interval": f"{4 * ms}ms",
        "$__interval": f"{ms}ms",
        "$__range": range_,
        "$instance": instance,
        "$target": target,
    }
    queries = []
    for panel, ref_id, expr, instant in panel_queries(dashboard):
        for name, value in substitutions.items():
            expr = expr.replace(name, value)
        assert not re.search(r"\$[A-Za-z_{]", expr), f"unsubstituted variable in {expr}"
        queries.append((panel, ref_id, expr, instant))
    return queries


class Prometheus:
    """A real Prometheus on loopback with the shipped scrape config, pointed at `targets`."""

    def __init__(self, tmp_path: Path, *targets: str) -> None:
        rules = tmp_path / "model-load.yml"
        rules.write_text(fast_rules(RULES.read_text()))
        config = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": EVERY, "evaluation_interval": EVERY}
        config["rule_files"] = [str(rules)]
        config["scrape_configs"][0]["static_configs"] = [{"targets": list(targets)}]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--log.level=warn",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; a PromQL error fails the test with Prometheus's own message."""
        response = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=10)
        body = response.json()
        assert body["status"] == "success", f"{params}: {body.get('error')}"
        return body["data"]

    def scraping(self) -> bool:
        assert self.proc.poll() is None, f"prometheus exited: {self.proc.communicate()[1]}"
        try:
            return bool(self.api("query", query='up{job="model-load"} == 1')["result"])
        except (requests.ConnectionError, requests.JSONDecodeError):
            return False  # not listening yet, or 503 while its TSDB opens

    def alert_state(self, name: str) -> str:
        for group in self.api("rules", type="alert")["groups"]:
            for rule in group["rules"]:
                if rule["name"] == name:
                    return str(rule["state"])
        raise AssertionError(f"no alert rule {name}")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


def has_data(result: dict[str, Any]) -> bool:
    """A non-empty result with at least one real number in it."""
    samples = [
        value
        for series in result["result"]
        for value in ([series["value"]] if "value" in series else series["values"])
    ]
    return any(math.isfinite(float(v)) for _, v in samples)


class Panels:
    """The committed dashboard's queries, substituted, with the moment each must have data at."""

    def __init__(self, prometheus: Prometheus, instance: str) -> None:
        self.prometheus = prometheus
        moments = {(q.panel, q.ref_id): q.moment for q in load_generator().build()[1]}
        self.queries: list[tuple[str, str, bool, str]] = [
            (f"{panel}/{ref_id}", expr, instant, moments[(panel, ref_id)])
            for panel, ref_id, expr, instant in grafana_queries(
                committed(), grafana_regex(instance), grafana_regex("sim"), SCRAPE, "5m"
            )
        ]

    def of(self, moment: str) -> list[tuple[str, str, bool]]:
        return [(name, expr, instant) for name, expr, instant, m in self.queries if m == moment]

    def run(self, expr: str, instant: bool, since: float) -> dict[str, Any]:
        now = time.time()
        if instant:
            return dict(self.prometheus.api("query", query=expr, time=now))
        return dict(
            self.prometheus.api("query_range", query=expr, start=since, end=now, step=EVERY)
        )

    def empty(self, moment: str, since: float) -> list[str]:
        """The queries of `moment` that return no data now (range queries: since `since`)."""
        return [
            name
            for name, expr, instant in self.of(moment)
            if not has_data(self.run(expr, instant, since))
        ]


def until_all_answered(
    panels: Panels, moment: str, since: float, still: Callable[[], bool], every: float = 0.25
) -> set[str]:
    """Poll the queries of `moment` while `still()` holds; return the ones that never had data."""
    waiting = {name for name, _, _ in panels.of(moment)}
    assert waiting, f"no query is tagged {moment}"
    while waiting and still():
        waiting &= set(panels.empty(moment, since))
        time.sleep(every)
    return waiting


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    generate_shards(directory, SHARDS, SHARD_SIZE)
    return directory


@pytest.fixture
def stack(
    tmp_path: Path, weights: Path, start_exporter: Any
) -> Iterator[tuple[RunningExporter, Prometheus, FakeNvml, Callable[..., Simulator]]]:
    port = free_port()
    nvml = FakeNvml(h200_node(2))
    running: RunningExporter = start_exporter(
        {
            "sample_interval": "200ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [
                {
                    "name": "sim",
                    "endpoint": {"url": f"http://127.0.0.1:{port}", "timeout": "1s"},
                    "weights": {"paths": [str(weights)]},
                    "process": {"pidfile": str(tmp_path / "server.pid")},
                    "stall_after": "1s",
                }
            ],
        },
        nvml=nvml,
    )
    prometheus = Prometheus(tmp_path, running.url.removeprefix("http://"))
    sims: list[Simulator] = []

    def simulate(*extra: str) -> Simulator:
        sim = Simulator(tmp_path, weights, port, *SIM, *extra, pace=PACE)
        sims.append(sim)
        return sim

    try:
        yield running, prometheus, nvml, simulate
    finally:
        for sim in sims:
            sim.stop()
        prometheus.stop()


def phase(running: RunningExporter) -> str:
    return str(running.status()["targets"][0].get("phase"))


def in_progress(running: RunningExporter) -> Callable[[], bool]:
    return lambda: phase(running) in ("starting", "loading_weights", "initializing")


class AlertStates:
    """The states alert `name` went through, as seen by calling this (which returns the latest)."""

    def __init__(self, prometheus: Prometheus, name: str) -> None:
        self.prometheus, self.name = prometheus, name
        self.seen: list[str] = []

    def __call__(self) -> str:
        state = self.prometheus.alert_state(self.name)
        if not self.seen or self.seen[-1] != state:
            self.seen.append(state)
        return state


def test_every_dashboard_query_and_the_alerts_on_a_real_prometheus(
    stack: tuple[RunningExporter, Prometheus, FakeNvml, Callable[..., Simulator]],
    weights: Path,
) -> None:
    running, prometheus, nvml, simulate = stack
    instance = running.url.removeprefix("http://")
    evict_dir(weights)
    wait_for(prometheus.scraping, timeout=30, interval=0.2)
    panels = Panels(prometheus, instance)
    # Every moment the generator knows is one this scenario reaches.
    assert {m for *_, m in panels.queries} == {
        "watching", "gpu", "loading", "finished", "serving", "reloading", "forecast"
    }  # fmt: skip
    started = time.time()

    # Valid PromQL, all of it, before any moment: Prometheus rejects a bad query with 400.
    for _, expr, instant, _ in panels.queries:
        panels.run(expr, instant, started)
    # The variables' own queries (label_values) list this host and target.
    assert instance in prometheus.api(
        "label/instance/values", **{"match[]": "model_load_target_info"}
    )
    assert "sim" in prometheus.api(
        "label/target/values", **{"match[]": f'model_load_target_info{{instance="{instance}"}}'}
    )
    deadline = time.monotonic() + 10
    for moment in ("watching", "gpu"):
        assert not until_all_answered(panels, moment, started, lambda: time.monotonic() < deadline)

    # A cold first load: progress, throughput and the weights' ETA while the weights stream in.
    loading = time.time()
    cold = simulate()
    wait_for(in_progress(running), timeout=15, interval=0.05)
    assert not until_all_answered(panels, "loading", loading, in_progress(running))
    wait_for(lambda: phase(running) == "ready", timeout=20)
    assert cold.result()["cache"] == "cold"
    finished = time.time()
    deadline = time.monotonic() + 10
    assert not until_all_answered(panels, "finished", finished, lambda: time.monotonic() < deadline)
    # A model over hosts is ready when every host is: here one host, named after its target.
    ready = prometheus.api("query", query='model:model_load_ready:min{model="sim"}')["result"]
    assert ready and ready[0]["value"][1] == "1"

    # The ready server holds GPU memory on GPU 0.
    nvml.gpus[0].processes = [FakeProcess(cold.proc.pid, 6 * GIB)]
    nvml.gpus[0].used_bytes += 6 * GIB
    deadline = time.monotonic() + 10
    assert not until_all_answered(panels, "serving", finished, lambda: time.monotonic() < deadline)
    cold.stop()
    wait_for(lambda: phase(running) == "down", timeout=10)

    # A second cold load stalls halfway for 4 s: history now says what to expect of it.
    evict_dir(weights)
    reloading = time.time()
    stalled = AlertStates(prometheus, "ModelLoadStalled")
    stall = simulate("--stall-at", "0.5", "--stall-for", "4s")
    wait_for(in_progress(running), timeout=15, interval=0.05)

    def loading_and_watching() -> bool:
        stalled()
        return in_progress(running)()

    assert not until_all_answered(panels, "reloading", reloading, loading_and_watching)
    while loading_and_watching():
        time.sleep(0.2)
    assert stall.result()["outcome"] == "ready"
    wait_for(lambda: stalled() == "inactive", timeout=10)
    assert "firing" in stalled.seen, stalled.seen
    stall.stop()
    wait_for(lambda: phase(running) == "down", timeout=10)

    # A crash a third into the weights: the load ends failed and pages, until the next load.
    failed = AlertStates(prometheus, "ModelLoadFailed")
    assert failed() == "inactive"
    crash = simulate("--crash-at", "0.3")
    wait_for(lambda: phase(running) == "failed", timeout=20)
    assert crash.proc.wait(timeout=10) == 1
    wait_for(lambda: failed() == "firing", timeout=10)
    restart = simulate()
    wait_for(lambda: phase(running) == "ready", timeout=20)
    wait_for(lambda: failed() == "inactive", timeout=10)
    assert restart.result()["outcome"] == "ready"

    # The weights evicted from under the ready server: a restart now would read all of them
    # from storage, at the rate the cold loads measured, so it has a forecast (what a warm
    # restart adds to it, the page cache's rate, is not always timed: a warm mmap load can be
    # over between two looks at its files), and the placement table shows it beside the share.
    evict_dir(weights)
    forecasting = time.time()
    deadline = time.monotonic() + 15
    assert not until_all_answered(
        panels, "forecast", forecasting, lambda: time.monotonic() < deadline
    )
