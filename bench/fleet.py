"""Benchmark: a fleet of GPU hosts on a real Prometheus: series, rules and dashboard at size.

    .venv/bin/python bench/fleet.py --hosts 1000 [--targets 8] [--seconds 300] [--scrape 15]
                                    [--native] [--all-hosts] [--repeats 3] [--json FILE]

One process serves the /metrics of every host on one port, one path per host
(`/host/N/metrics`); Prometheus (Debian's `prometheus`) finds them through a file_sd list that
gives each its `__metrics_path__` and its `instance` label, so a thousand hosts cost one socket.
Each exposition is the exporter's own collector (exporter/exposition/collector.py) rendering a
snapshot of M targets that live through loads (cold and warm, stalled, failed, evicted, ready
for hours), re-rendered every scrape interval. Rendering a thousand hosts every interval would
take one of the machine's two cores, so the hosts share `VARIANTS` lives (host h shows life
h % VARIANTS, its own targets, loads and histories, each in its own phase): every host is its
own series to Prometheus, and the mix of states across the fleet is what a fleet shows.

By default Prometheus scrapes and evaluates the rules every 15 s, as shipped: what a rule group
costs is only comparable with its interval when Prometheus ingests what a real fleet sends in that
interval. `--scrape S` runs time `15 / S` times faster than life (as
tests/test_dashboard_prometheus.py runs the rules 60 times faster): the loads, the rules' `for:`
and range windows, and the dashboard's range and step all scale together, so each series holds as
many samples per window as at the shipped scrape, but Prometheus then ingests and evaluates
`15 / S` times as often, and each rule group has S seconds, not 15. The dashboard's default range
(1 h: 240 steps) is filled when `--seconds` reaches it; when it is shorter the range queries cover
what was filled, still with Grafana's 240 steps (the per-step work over every series, what
dominates a range query, stays the same).

The harness shares the machine with the Prometheus it measures: its renderer and its HTTP
threads run at `HARNESS_NICE`, so that Prometheus wins the cores when both want them, and its own
CPU share is reported beside Prometheus's (`harness_cpu_share`).

A tenth of the lives keep their last target as a standby (its server stopped, its weights all
in the page cache on every other one, none on the rest): what the placement rules rank.

Measured: series per target (by state, and by metric family) and per host, Prometheus's head
series and resident memory (peak), bytes per sample (a head snapshot's block: chunk bytes over its
samples), each rule group's evaluation time (median and worst after its first evaluations) and
each rule's, and every dashboard panel's queries as Grafana sends them (instant at now, range at
the default range and step, `$instance` and `$target` as the dashboard opens), the median of
`--repeats`, in seconds; and the placement against the standbys (every host holding a model's
weights ranks above every host holding none, each standby's forecast its own host's).
bench/README.md says more; docs/costs.md has the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
import yaml
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.config.reader import parse_config
from exporter.config.schema import TargetConfig
from exporter.exposition.collector import ExporterCollector
from exporter.exposition.http import protobuf
from exporter.history.forecast import Forecast
from exporter.history.histograms import Histograms
from exporter.history.pastloads import PastLoads
from exporter.load.progress import temperature
from exporter.load.records import LoadState
from exporter.runtime.sampler import Reading
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.sources import (
    ENDPOINT,
    LOGS,
    MEMORY,
    NVML,
    PAGECACHE,
    PROCESS,
    STORAGE,
    WEIGHT_FILES,
    SourceKey,
)
from exporter.sources.disk import DISK, DeviceReads, DiskSample
from exporter.sources.endpoint import ProbeSample
from exporter.sources.gpu import GpuDevice, GpuSample
from exporter.sources.memory import MemorySample
from exporter.sources.netfs import NETFS
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.zfs import ZFS
from exporter.vocabulary import Cache, Outcome, Phase, ProbeResult, ServerKind, Step

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.support import free_port  # noqa: E402
from test_dashboard import RULES, committed  # noqa: E402
from test_dashboard_prometheus import fast_rules, grafana_queries, grafana_regex  # noqa: E402

GIB = 1 << 30
SIZE = 140 * GIB  # every target's weights
SHIPPED_SCRAPE = 15.0  # seconds: prometheus/prometheus.yml's scrape and evaluation interval
GRAFANA_STEPS = 240  # the default range (now-1h) at Grafana's step, the 15-s scrape interval
VARIANTS = 50  # distinct host lives rendered each interval (host h shows life h % VARIANTS)
MODELS = 24  # models served across the fleet (the recording rules group by model)
# Host lives h % VARIANTS with h % STANDBY_EVERY == 0 keep their last target configured with its
# server stopped: a standby for its model, weights fully cached on every other such life and
# evicted on the rest. They are what the placement rules must rank (docs/placement.md).
STANDBY_EVERY = 10
GPUS = 8  # H200s per host
STALL_AFTER = 300.0  # seconds, the default stall_after
WARMUP_EVALUATIONS = 3  # rule evaluations left out of the worst (the first ones compile)
HARNESS_NICE = 10  # the renderer's and the HTTP threads' niceness: Prometheus comes first


# -- the hosts: targets living through loads --------------------------------------------------


@dataclass
class Load:
    """One load of a target and the serving after it, in sim seconds from its start."""

    start: float
    cache: Cache
    starting: float
    weights: float
    initializing: float
    serving: float  # ready this long after the load (or failed this long, then the next load)
    fails: bool
    stall_at: float | None  # a stall of STALL_AFTER + 120 s at this share of the weights
    evicted_after: float | None  # seconds into serving when most weights leave the page cache

    @property
    def stall(self) -> float:
        return STALL_AFTER + 120 if self.stall_at is not None else 0.0

    @property
    def loading(self) -> float:
        return self.starting + self.weights + self.stall + self.initializing

    @property
    def end(self) -> float:
        return self.start + self.loading + self.serving


def next_load(rng: random.Random, start: float) -> Load:
    cache = rng.choice((Cache.COLD, Cache.WARM, Cache.WARM, Cache.MIXED))
    weights = {Cache.COLD: 900.0, Cache.WARM: 120.0, Cache.MIXED: 400.0}[cache]
    fails = rng.random() < 0.08
    return Load(
        start=start,
        cache=cache,
        starting=rng.uniform(20, 60),
        weights=weights * rng.uniform(0.7, 1.3),
        initializing=rng.uniform(60, 240),
        serving=rng.uniform(600, 1800) if fails else rng.uniform(1800, 4 * 3600),
        fails=fails,
        stall_at=rng.uniform(0.2, 0.8) if rng.random() < 0.25 else None,
        evicted_after=rng.uniform(600, 1800) if rng.random() < 0.15 else None,
    )


@dataclass
class TargetLife:
    """A target's loads one after another, from a seed; history kept as the exporter keeps it."""

    config: TargetConfig
    rng: random.Random
    logs: bool  # its log is read: fine steps, and their phase durations
    load: Load
    standby: float | None = None  # a standby's share of its weights cached; None: it lives
    loads: Histograms = field(default_factory=Histograms)
    phases: Histograms = field(default_factory=Histograms)
    medians: dict[Cache, float] = field(default_factory=dict)
    last: float | None = None

    @classmethod
    def new(cls, config: TargetConfig, seed: int, now: float) -> TargetLife:
        rng = random.Random(seed)
        # Up to a few hours into its current load or serving; a third on their first load.
        life = cls(config, rng, rng.random() < 0.5, next_load(rng, now - rng.uniform(0, 7200)))
        for _ in range(0 if rng.random() < 0.33 else rng.randint(1, 12)):
            life.finish(next_load(rng, 0.0))
        return life

    @classmethod
    def stopped(cls, config: TargetConfig, seed: int, cached: float) -> TargetLife:
        """A standby: its server stopped after a cold and a warm load (a forecast either way),
        `cached` of its weights in the page cache."""
        rng = random.Random(seed)
        life = cls(config, rng, False, next_load(rng, 0.0), standby=cached)
        for cache in (Cache.COLD, Cache.WARM):
            life.finish(replace(next_load(rng, 0.0), cache=cache, fails=False))
        return life

    def finish(self, load: Load) -> None:
        name = self.name
        outcome = Outcome.FAILED if load.fails else Outcome.READY
        self.loads.observe((name, load.cache, outcome), load.loading)
        self.phases.observe((name, Phase.STARTING), load.starting)
        self.phases.observe((name, Phase.LOADING_WEIGHTS), load.weights + load.stall)
        if load.fails:
            return
        self.phases.observe((name, Phase.INITIALIZING), load.initializing)
        if self.logs:
            for step, share in ((Step.KV_CACHE, 0.1), (Step.COMPILE, 0.4), (Step.CUDA_GRAPH, 0.4)):
                self.phases.observe((name, step), load.initializing * share)
        self.medians[load.cache] = load.loading
        self.last = load.loading

    @property
    def name(self) -> str:
        return self.config.name

    def advance(self, now: float) -> None:
        while self.load.end <= now:
            self.finish(self.load)
            self.load = next_load(self.rng, self.load.end)

    def view(self, now: float, gpu: int) -> TargetView:
        if self.standby is not None:
            return self.standing(now)
        self.advance(now)
        load, since = self.load, now - self.load.start
        size = SIZE
        state: dict[str, Any] = {
            "started_at": load.start,
            "elapsed_seconds": 0.0,
            "cache": load.cache,
            "stalled": False,
        }
        resident = size * (0.05 if load.cache == Cache.COLD else 0.97)
        in_weights = since - load.starting
        weights_end = load.weights + load.stall
        if since < load.starting:
            phase, progress, step = Phase.STARTING, 0.0, Step.NONE
        elif in_weights < weights_end:
            phase, step = Phase.LOADING_WEIGHTS, Step.WEIGHTS
            stall_at = (load.stall_at or 2.0) * load.weights
            moving = min(in_weights, stall_at) + max(0.0, in_weights - stall_at - load.stall)
            progress = min(1.0, moving / load.weights)
            stuck = in_weights - stall_at if stall_at <= in_weights < stall_at + load.stall else 0
            state["stalled"] = stuck >= STALL_AFTER
            state["seconds_since_progress"] = stuck
            state["throughput_bytes_per_second"] = 0.0 if stuck else size / load.weights
            state["weights_eta_seconds"] = (1 - progress) * load.weights
            if load.cache in self.medians:
                state["eta_seconds"] = state["weights_eta_seconds"] + load.initializing
        elif since < load.loading:
            phase, progress, step = Phase.INITIALIZING, 1.0, Step.CUDA_GRAPH
            state["seconds_since_progress"] = 0.0
        elif load.fails:
            phase, progress, step = Phase.FAILED, 0.4, Step.NONE
        else:
            phase, progress, step = Phase.READY, 1.0, Step.NONE
            evicted = load.evicted_after is not None and since - load.loading > load.evicted_after
            resident = size * 0.2 if evicted else size
        if phase.in_progress:
            state["elapsed_seconds"] = since
            if phase != Phase.LOADING_WEIGHTS:
                resident = size
            elif load.cache == Cache.COLD:
                resident = max(resident, size * progress)
        state["progress_ratio"] = progress
        ready = phase == Phase.READY
        holds_gpu = phase in (Phase.INITIALIZING, Phase.READY)
        return TargetView(
            config=self.config,
            state=target_state(self.name, phase, step if self.logs else None, **state),
            readings=self.readings(now, ready, size, resident, load.start),
            gpu_memory={gpu: 120 * GIB} if holds_gpu else {},
            forecast=self.forecast(resident / size),
            past=PastLoads(expected=dict(self.medians), last=self.last or None),
        )

    def forecast(self, share: float) -> Forecast | None:
        """A restart now: the median load of the temperature this residency makes it."""
        if not self.medians:
            return None
        return Forecast(self.medians.get(temperature(share)), share, None)

    def standing(self, now: float) -> TargetView:
        """A standby's view: down, its weights measured, its forecast from its history."""
        assert self.standby is not None
        size = SIZE
        resident = size * self.standby
        return TargetView(
            config=self.config,
            state=target_state(self.name, Phase.DOWN, None, started_at=None,
                               elapsed_seconds=None, cache=None, stalled=False),
            readings=self.readings(now, False, size, resident, None),
            gpu_memory={},
            forecast=self.forecast(self.standby),
            past=PastLoads(expected=dict(self.medians), last=self.last or None),
        )  # fmt: skip

    def readings(
        self, now: float, ready: bool, size: int, resident: float, started: float | None
    ) -> dict[str, Reading[Any]]:
        """`started`: the running server's start; None: no server process."""
        name = self.name
        probes = {ProbeResult.READY: 4000, ProbeResult.REFUSED: 300, ProbeResult.TIMEOUT: 3}
        result = ProbeResult.READY if ready else ProbeResult.REFUSED
        process = (
            ProcessSample(True, (4242,), 4242, started, int(resident), None, "vllm")
            if started is not None
            else ProcessSample(False, (), None, None, None, None, None)
        )
        values: dict[SourceKey[Any], Any] = {
            ENDPOINT: ProbeSample(result, 0.004, 200 if ready else None, "", ServerKind.VLLM,
                                  probes),
            PROCESS: process,
            PAGECACHE: ResidencySample(16, size, int(resident), (), "cachestat", now, 0.0, now,
                                       None),
            STORAGE: None,
            WEIGHT_FILES: None,
        }  # fmt: skip
        if self.logs:
            values[LOGS] = None
        return {key.name: reading(key, value, name, now) for key, value in values.items()}


def target_state(target: str, phase: Phase, step: Step | None, **fields: Any) -> LoadState:
    base: dict[str, Any] = {
        "progress_ratio": None,
        "throughput_bytes_per_second": None,
        "weights_eta_seconds": None,
        "eta_seconds": None,
        "seconds_since_progress": None,
        "partial": False,
        "seen_late": False,
        "progress_source": None,
        "signals": {},
        "last_record": None,
        "fatal": None,
    }
    return LoadState(
        target=target, phase=phase, in_progress=phase.in_progress, step=step, **(base | fields)
    )


def reading(key: SourceKey[Any], value: Any, target: str, now: float) -> Reading[Any]:
    return Reading(key.name, target, value, True, None, 0.0125, now)


class HostLife:
    """The targets of one host and its host-wide readings."""

    def __init__(self, variant: int, targets: int, now: float) -> None:
        config = parse_config(
            {
                "targets": [
                    {
                        "name": f"{model_name(variant * targets + j)}-{j}",
                        "endpoint": {"url": f"http://127.0.0.1:{30000 + j}",
                                     "model": model_name(variant * targets + j)},
                    }
                    for j in range(targets)
                ]
            }
        )  # fmt: skip
        self.targets = [
            TargetLife.new(c, variant * 1000 + j, now) for j, c in enumerate(config.targets)
        ]
        if variant % STANDBY_EVERY == 0:
            cached = 1.0 if variant // STANDBY_EVERY % 2 == 0 else 0.0
            last = config.targets[-1]
            self.targets[-1] = TargetLife.stopped(last, variant * 1000 + targets, cached)
        self.read = 0.0

    def snapshot(self, now: float) -> Snapshot:
        views = [life.view(now, j % GPUS) for j, life in enumerate(self.targets)]
        self.read += 2e9
        host: dict[SourceKey[Any], Any] = {
            DISK: DiskSample(
                (DeviceReads("nvme0n1", int(self.read), 2e9), DeviceReads("nvme1n1", 0, 0.0)),
                {}, {},
            ),
            MEMORY: MemorySample(2048 * GIB, 900 * GIB, 1100 * GIB),
            NVML: GpuSample(
                "570.133.20",
                tuple(
                    GpuDevice(i, f"GPU-{i:04d}", "NVIDIA H200", 120 * GIB, 141 * GIB,
                              pcie_rx_bytes=int(self.read))
                    for i in range(GPUS)
                ),
                (), (),
            ),
            NETFS: None,
            ZFS: None,
        }  # fmt: skip
        loads, phases = {}, {}
        for life in self.targets:
            loads.update(life.loads.snapshot())
            phases.update(life.phases.snapshot())
        return Snapshot(
            time=now,
            build={"version": "0.1.0", "python_version": "3.11.7"},
            host={key.name: reading(key, value, "", now) for key, value in host.items()},
            targets=tuple(views),
            load_durations=loads,
            phase_durations=phases,
            history_enabled=True,
            history_problem=None,
            config_reload_successful=True,
            history_up=True,
        )


def model_name(index: int) -> str:
    return f"model-{index % MODELS:02d}"


def yield_cpu() -> None:
    """Lower this thread's priority (Linux's niceness is per thread, and inherited by the threads
    it starts), so that the harness does not take the cores from the Prometheus it measures."""
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), HARNESS_NICE)


class QuietServer(ThreadingHTTPServer):
    """Prometheus drops connections (a scrape timeout, its shutdown): not worth a traceback."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        error = sys.exc_info()[1]
        if not isinstance(error, ConnectionError):
            print(f"fleet: serving {client_address}: {error!r}", file=sys.stderr)


def render(snapshot: Snapshot) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector(lambda: snapshot))
    return generate_latest(registry)


def render_native(snapshot: Snapshot) -> bytes:
    """What the exporter answers with metrics.native_histograms to a protobuf scrape."""
    return protobuf.render(ExporterCollector(lambda: snapshot, native=True).collect())


# -- serving them ----------------------------------------------------------------------------


class Fleet:
    """Every host's exposition, re-rendered each interval by one thread, served on one port."""

    def __init__(self, hosts: int, targets: int, speed: float, native: bool) -> None:
        self.hosts, self.speed, self.native = hosts, speed, native
        self.served: list[bytes] = []  # the protobuf pages when native, else the text pages
        self.epoch, self.wall0 = time.time(), time.monotonic()
        self.lives = [HostLife(v, targets, self.epoch) for v in range(min(hosts, VARIANTS))]
        self.pages: list[bytes] = []
        self.snapshots: list[Snapshot] = []
        self.refresh()
        fleet = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                match = re.fullmatch(r"/host/(\d+)/metrics", self.path)
                if match is None or int(match[1]) >= fleet.hosts:
                    self.send_error(404)
                    return
                body = fleet.served[int(match[1]) % len(fleet.served)]
                self.send_response(200)
                kind = protobuf.CONTENT_TYPE if fleet.native else "text/plain; version=0.0.4"
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = QuietServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        yield_cpu()  # and every connection's thread, started from this one
        self.server.serve_forever()

    def now(self) -> float:
        return self.epoch + (time.monotonic() - self.wall0) * self.speed

    def refresh(self) -> None:
        now = self.now()
        self.snapshots = [life.snapshot(now) for life in self.lives]
        self.pages = [render(s) for s in self.snapshots]
        self.served = [render_native(s) for s in self.snapshots] if self.native else self.pages

    def keep_fresh(self, every: float, stop: threading.Event) -> None:
        yield_cpu()
        while not stop.wait(every):
            self.refresh()

    def sd_targets(self) -> list[dict[str, Any]]:
        return [
            {
                "targets": [f"127.0.0.1:{self.port}"],
                "labels": {
                    "__metrics_path__": f"/host/{h}/metrics",
                    "instance": f"gpu-{h:04d}:9847",
                },
            }
            for h in range(self.hosts)
        ]


def series_counts(fleet: Fleet) -> dict[str, Any]:
    """Series per target by its phase (the largest of each), per family for the largest target,
    and per host, from the expositions as served."""
    per_state: dict[str, int] = defaultdict(int)
    largest: tuple[int, Counter[str]] = (0, Counter())
    hosts = []
    for page, snap in zip(fleet.pages, fleet.snapshots, strict=True):
        by_target: dict[str, Counter[str]] = defaultdict(Counter)
        for family in text_string_to_metric_families(page.decode()):
            native = fleet.native and family.type == "histogram"
            for sample in family.samples:
                # A native histogram is one series per label set: its _count sample stands in.
                if not native or sample.name.endswith("_count"):
                    by_target[sample.labels.get("target", "")][family.name] += 1
        hosts.append(sum(sum(c.values()) for c in by_target.values()))
        for view in snap.targets:
            count = sum(by_target[view.name].values())
            state = view.state
            assert state is not None
            kind = "loading" if state.in_progress else str(state.phase)
            per_state[kind] = max(per_state[kind], count)
            if state.in_progress and not snap.load_durations.keys() & first_loads(view.name):
                per_state["loading_first"] = max(per_state["loading_first"], count)
            if count > largest[0]:
                largest = (count, by_target[view.name])
    return {
        "series_per_target": {
            "ready": per_state.get("ready", 0),
            "loading": per_state.get("loading", 0),
            "max": largest[0],
            **{k: v for k, v in per_state.items() if k not in ("ready", "loading")},
        },
        "series_per_host": {"mean": round(statistics.mean(hosts)), "max": max(hosts)},
        "host_wide_series": sum(fleet_host_only(fleet.pages[0]).values()),
        "families_of_largest_target": dict(largest[1].most_common()),
    }


def first_loads(target: str) -> set[tuple[str, ...]]:
    """The duration label sets a target would have after any finished load."""
    return {(target, cache, outcome) for cache in Cache for outcome in Outcome}


def fleet_host_only(page: bytes) -> Counter[str]:
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(page.decode()):
        for sample in family.samples:
            if not sample.labels.get("target"):
                counts[family.name] += 1
    return counts


# -- Prometheus -------------------------------------------------------------------------------


class Prometheus:
    """Debian's prometheus with the shipped rules and scrape job, over the fleet's file_sd."""

    def __init__(self, workdir: Path, fleet: Fleet, scrape: float, speed: float) -> None:
        native = ["--enable-feature=native-histograms"] if fleet.native else []
        every = f"{round(scrape * 1000)}ms"
        rules = workdir / "model-load.yml"
        rules.write_text(fast_rules(RULES.read_text(), speed))
        sd = workdir / "hosts.json"
        sd.write_text(json.dumps(fleet.sd_targets()))
        config = yaml.safe_load((REPO / "prometheus" / "prometheus.yml").read_text())
        timeout = f"{round(min(scrape, 10) * 1000)}ms"
        config["global"] = {"scrape_interval": every, "evaluation_interval": every,
                            "scrape_timeout": timeout}  # fmt: skip
        config["rule_files"] = [str(rules)]
        job = config["scrape_configs"][0]
        del job["static_configs"]
        job["file_sd_configs"] = [{"files": [str(sd)]}]
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.tsdb = workdir / "tsdb"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={self.tsdb}", "--storage.tsdb.retention.time=2h",
             "--web.enable-admin-api", "--log.level=warn", *native,
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("w"),
        )  # fmt: skip

    def api(self, path: str, **params: Any) -> Any:
        response = requests.get(f"{self.url}/api/v1/{path}", params=params, timeout=120)
        body = response.json()
        if body["status"] != "success":
            raise RuntimeError(f"{path} {params}: {body.get('error')}")
        return body["data"]

    def own_metrics(self) -> dict[str, list[tuple[dict[str, str], float]]]:
        text = requests.get(f"{self.url}/metrics", timeout=30).text
        out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                out[sample.name].append((sample.labels, sample.value))
        return out

    def rules(self, group: str) -> list[dict[str, Any]]:
        groups = self.api("rules")["groups"]
        return [rule for g in groups if g["name"] == group for rule in g["rules"]]

    def up_hosts(self) -> int:
        try:
            result = self.api("query", query='count(up{job="model-load"} == 1)')["result"]
        except (requests.ConnectionError, RuntimeError):
            return 0
        return int(float(result[0]["value"][1])) if result else 0

    def bytes_per_sample(self) -> dict[str, float]:
        """Snapshot the head into a block and divide its chunk bytes by its samples."""
        response = requests.post(f"{self.url}/api/v1/admin/tsdb/snapshot", timeout=600)
        name = response.json()["data"]["name"]
        samples = chunk_bytes = index_bytes = series = 0
        for meta in (self.tsdb / "snapshots" / name).glob("*/meta.json"):
            stats = json.loads(meta.read_text())["stats"]
            samples += stats["numSamples"]
            series += stats["numSeries"]
            chunk_bytes += sum(p.stat().st_size for p in (meta.parent / "chunks").iterdir())
            index_bytes += (meta.parent / "index").stat().st_size
        return {
            "bytes_per_sample": round(chunk_bytes / samples, 3) if samples else 0.0,
            "index_bytes_per_series": round(index_bytes / series, 1) if series else 0.0,
            "block_samples": samples,
        }

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@dataclass
class Watch:
    """Prometheus's own numbers sampled over the run: each rule evaluation once (its time, and
    each rule's with its active alerts), evaluations missed, CPU, peak memory, the load average."""

    interval: float  # the rule groups' evaluation interval in this run, seconds
    durations: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rule_seconds: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    rule_alerts: dict[str, list[int]] = field(default_factory=lambda: defaultdict(list))
    seen: dict[str, float] = field(default_factory=dict)  # group: the evaluations counted
    missed: dict[str, float] = field(default_factory=dict)
    cpu: list[tuple[float, float]] = field(default_factory=list)  # (wall, Prometheus CPU s)
    harness_cpu: list[tuple[float, float]] = field(default_factory=list)
    load: list[float] = field(default_factory=list)
    rss_peak: float = 0.0
    head_series: float = 0.0

    def look(self, prometheus: Prometheus) -> None:
        own = prometheus.own_metrics()
        now = time.monotonic()
        self.rss_peak = max(self.rss_peak, own["process_resident_memory_bytes"][0][1])
        self.head_series = own["prometheus_tsdb_head_series"][0][1]
        self.cpu.append((now, own["process_cpu_seconds_total"][0][1]))
        usage = resource.getrusage(resource.RUSAGE_SELF)
        self.harness_cpu.append((now, usage.ru_utime + usage.ru_stime))
        self.load.append(os.getloadavg()[0])
        evaluations = {
            labels["rule_group"]: value
            for labels, value in own.get("prometheus_rule_group_iterations_total", [])
        }
        for labels, value in own.get("prometheus_rule_group_iterations_missed_total", []):
            self.missed[labels["rule_group"].rsplit(";", 1)[-1]] = value
        for labels, seconds in own.get("prometheus_rule_group_last_duration_seconds", []):
            group = labels["rule_group"].rsplit(";", 1)[-1]
            count = evaluations.get(labels["rule_group"], 0)
            if count <= max(WARMUP_EVALUATIONS, self.seen.get(group, 0)):
                continue  # still warming up, or the evaluation seen at the last look
            self.seen[group] = count
            self.durations[group].append(seconds)
            for rule in prometheus.rules(group):
                self.rule_seconds[rule["name"]].append(rule["evaluationTime"])
                if rule["type"] == "alerting":
                    self.rule_alerts[rule["name"]].append(len(rule.get("alerts", [])))

    @staticmethod
    def share(samples: list[tuple[float, float]]) -> float:
        """CPU seconds per wall second between the first and the last look."""
        (wall0, cpu0), (wall1, cpu1) = samples[0], samples[-1]
        return round((cpu1 - cpu0) / (wall1 - wall0), 3) if wall1 > wall0 else 0.0

    @property
    def rules(self) -> dict[str, dict[str, float]]:
        """Each rule's median evaluation time (Prometheus's own, from /api/v1/rules), and an alert
        rule's median count of active alerts (each expands its annotations every evaluation)."""
        return {
            name: {"seconds": round(statistics.median(seen), 4)}
            | (
                {"alerts": statistics.median(self.rule_alerts[name])}
                if name in self.rule_alerts
                else {}
            )
            for name, seen in self.rule_seconds.items()
        }

    @property
    def rule_groups(self) -> dict[str, dict[str, float]]:
        """Each group's median and worst evaluation seen, against its interval in this run."""
        return {
            group: {
                "seconds": round(statistics.median(seen), 4),
                "worst_seconds": round(max(seen), 4),
                "interval_seconds": self.interval,
                "evaluations": len(seen),
                "missed_evaluations": self.missed.get(group, 0.0),
            }
            for group, seen in sorted(self.durations.items())
        }


def placement(prometheus: Prometheus, fleet: Fleet) -> dict[str, Any]:
    """The placement rules against the standbys the harness knows: per model, every host holding
    all of its weights must rank (score) above every host holding none, and each standby's
    recorded forecast must be its own host's, as the harness rendered it."""
    at = time.time()

    def recorded(name: str) -> dict[tuple[str, str], float]:
        result = prometheus.api("query", query=name, time=at)["result"]
        return {(s["metric"]["model"], s["metric"]["instance"]): float(s["value"][1])
                for s in result}  # fmt: skip

    score = recorded("model_instance:model_load_placement:score")
    forecast = recorded("model_instance:model_load_restart_forecast_seconds:min")
    full: dict[str, list[float]] = defaultdict(list)
    empty: dict[str, list[float]] = defaultdict(list)
    own = wrong = 0
    for host in range(fleet.hosts):
        life = fleet.lives[host % len(fleet.lives)].targets[-1]
        if life.standby is None:
            continue
        model = life.config.endpoint.model or life.name
        place = (model, f"gpu-{host:04d}:9847")
        (full if life.standby == 1.0 else empty)[model].append(score[place])
        expected = life.forecast(life.standby)
        assert expected is not None and expected.seconds is not None
        own, wrong = (
            (own + 1, wrong) if forecast.get(place) == expected.seconds else (own, wrong + 1)
        )
    models = sorted(full.keys() & empty.keys())
    return {
        "models_with_both": models,
        "full_ranks_above_none": all(min(full[m]) > max(empty[m]) for m in models),
        "standbys": {"full": sum(map(len, full.values())), "none": sum(map(len, empty.values()))},
        "forecast_is_the_hosts_own": {"matched": own, "differed": wrong},
        "places": len(score),
    }


def variable_defaults(prometheus: Prometheus, all_hosts: bool) -> dict[str, str]:
    """$instance and $target as Grafana sets them when the dashboard opens: a variable whose
    `current` is All gets its allValue, one without a `current` its first value (natural sort,
    regex-escaped); `all_hosts`: All for both, as a user who picks every host."""
    dashboard = committed()
    values: dict[str, str] = {}
    for variable in dashboard["templating"]["list"]:
        name = variable["name"]
        if variable["type"] != "query":
            continue
        if all_hosts or variable.get("current", {}).get("value") == "$__all":
            values[name] = variable["allValue"]
            continue
        match = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"])
        assert match is not None, variable["query"]
        series = match[1]
        for known, value in values.items():
            series = series.replace(f"${known}", value)
        found = prometheus.api(f"label/{match[2]}/values", **{"match[]": series})
        values[name] = grafana_regex(min(found, key=natural))
    return values


def natural(text: str) -> list[Any]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def panel_latencies(
    prometheus: Prometheus, scrape: float, filled: float, variables: dict[str, str], repeats: int
) -> tuple[dict[str, float | None], dict[str, str]]:
    """Each panel's queries one after another as Grafana sends them, the median of `repeats`;
    a panel Prometheus refuses to draw (too many samples, a timeout) is None, with the reason."""
    range_seconds = min(GRAFANA_STEPS * scrape, filled)
    step = range_seconds / GRAFANA_STEPS
    queries = grafana_queries(
        committed(), variables["instance"], variables["target"], scrape, f"{round(range_seconds)}s"
    )
    times: dict[str, list[float]] = defaultdict(list)
    errors: dict[str, str] = {}
    for _ in range(repeats):
        totals: dict[str, float] = defaultdict(float)
        for panel, _ref, expr, instant in queries:
            if panel in errors:
                continue
            end = time.time()
            started = time.perf_counter()
            try:
                if instant:
                    prometheus.api("query", query=expr, time=end)
                else:
                    prometheus.api("query_range", query=expr, start=end - range_seconds, end=end,
                                   step=f"{step:.3f}")  # fmt: skip
            except (RuntimeError, requests.RequestException) as exc:
                errors[panel] = f"{time.perf_counter() - started:.1f} s: {exc}"[-300:]
            totals[panel] += time.perf_counter() - started
        for panel, seconds in totals.items():
            times[panel].append(seconds)
    panels = {
        panel: None if panel in errors else round(statistics.median(s), 4)
        for panel, s in times.items()
    }
    return panels, errors


def run(args: argparse.Namespace) -> dict[str, Any]:
    speed = SHIPPED_SCRAPE / args.scrape
    workdir = Path(tempfile.mkdtemp(prefix="fleet-", dir=args.dir))
    stop = threading.Event()
    prometheus = None
    try:
        fleet = Fleet(args.hosts, args.targets, speed, args.native)
        started = time.perf_counter()
        fleet.refresh()
        render_seconds = time.perf_counter() - started
        threading.Thread(target=fleet.keep_fresh, args=(args.scrape, stop), daemon=True).start()
        counts = series_counts(fleet)
        prometheus = Prometheus(workdir, fleet, args.scrape, speed)
        deadline = time.monotonic() + max(120, 4 * args.scrape)
        while prometheus.up_hosts() < args.hosts:
            if time.monotonic() > deadline or prometheus.proc.poll() is not None:
                raise SystemExit(f"fleet: Prometheus never scraped every host: {workdir}")
            time.sleep(1)
        print(f"all {args.hosts} hosts up; filling {args.seconds:.0f} s", file=sys.stderr)
        watch, filled_from = Watch(args.scrape), time.monotonic()
        watch.look(prometheus)
        while (elapsed := time.monotonic() - filled_from) < args.seconds:
            time.sleep(min(5.0, args.seconds - elapsed))
            watch.look(prometheus)
        filled = time.monotonic() - filled_from
        cpu = {
            "prometheus_cpu_share": watch.share(watch.cpu),
            "harness_cpu_share": watch.share(watch.harness_cpu),
            "load_average": {
                "median": round(statistics.median(watch.load), 2),
                "max": round(max(watch.load), 2),
            },
        }
        variables = variable_defaults(prometheus, args.all_hosts)
        panels, errors = panel_latencies(prometheus, args.scrape, filled, variables, args.repeats)
        placed = placement(prometheus, fleet)
        watch.look(prometheus)
        stored = prometheus.bytes_per_sample()
    finally:
        stop.set()
        if prometheus is not None:
            prometheus.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {
        "hosts": args.hosts,
        "targets": args.targets,
        "native_histograms": args.native,
        **counts,
        "head_series": int(watch.head_series),
        "prometheus_rss_bytes": int(watch.rss_peak),
        **stored,
        "rule_groups": watch.rule_groups,
        "rules": watch.rules,
        **cpu,
        "panels": panels,
        "panel_errors": errors,
        "placement": placed,
        "variables": variables,
        "scrape_seconds": args.scrape,
        "filled_seconds": round(filled),
        "dashboard_range_filled": round(min(1.0, filled / (GRAFANA_STEPS * args.scrape)), 3),
        "render_seconds_per_host_life": round(render_seconds / len(fleet.lives), 4),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", type=int, default=10)
    parser.add_argument("--targets", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=300, help="scraping after all are up")
    parser.add_argument(
        "--scrape",
        type=float,
        default=SHIPPED_SCRAPE,
        help="scrape and rule interval, s (the shipped 15 s: life's pace; less runs time faster)",
    )
    parser.add_argument(
        "--all-hosts", action="store_true", help="panels with Host and Target at All"
    )
    parser.add_argument(
        "--native", action="store_true", help="metrics.native_histograms, and Prometheus asking"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs of each panel (median)")
    parser.add_argument("--dir", default="/var/tmp", help="where Prometheus keeps its TSDB")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)
    if args.hosts < 1 or args.targets < 1 or args.seconds <= 0 or args.scrape <= 0:
        parser.error("--hosts, --targets, --seconds and --scrape must be positive")
    if shutil.which("prometheus") is None:
        print("fleet: needs Debian's `prometheus` on PATH", file=sys.stderr)
        return 1
    result = run(args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
