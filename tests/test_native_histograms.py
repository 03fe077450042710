"""`metrics.native_histograms`: a real Prometheus (Debian's 2.42, `--enable-feature=native-
histograms`) scrapes the exporter's protobuf and stores each histogram label set as one native
series, with the count, sum and quantiles of what was observed, and every other series exactly
as the text exposition says; text scrapes, and protobuf scrapes without the option, are unchanged.
"""

from __future__ import annotations

import dataclasses
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from helpers.support import free_port, wait_for
from prometheus_client.parser import text_string_to_metric_families
from test_dashboard import RULES
from test_exposition import exposition, golden_snapshot

from exporter.config.reader import parse_config
from exporter.config.schema import MetricsConfig
from exporter.exposition.http import protobuf
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.history.histograms import Histograms, native_index
from exporter.runtime.snapshot import Snapshot
from exporter.vocabulary import Cache, Outcome

pytestmark = pytest.mark.system
# What Prometheus 2.42 asks for with the feature on (protobuf first).
PROTOBUF_ACCEPT = (
    "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;"
    "encoding=delimited;q=0.5,application/openmetrics-text;version=0.0.1;q=0.4,"
    "text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


class FixedRuntime:
    """What the web app reads of a runtime: its config and the snapshot the test sets."""

    def __init__(self, snapshot: Snapshot, native: bool) -> None:
        metrics = MetricsConfig(native_histograms=native)
        self.config = dataclasses.replace(parse_config({}), metrics=metrics)
        self.current = dataclasses.replace(snapshot, metrics=metrics)

    def snapshot(self) -> Snapshot:
        return self.current


@pytest.fixture
def serve() -> Iterator[Any]:
    servers: list[HttpServer] = []

    def start(native: bool) -> tuple[str, FixedRuntime]:
        runtime = FixedRuntime(golden_snapshot(), native)
        server = HttpServer(WebApp(runtime), "127.0.0.1:0")  # type: ignore[arg-type]
        server.start()
        servers.append(server)
        return f"127.0.0.1:{server.port}", runtime

    yield start
    for server in servers:
        server.stop()


def test_text_scrapes_are_unchanged_and_protobuf_only_with_the_option(serve: Any) -> None:
    golden = exposition(golden_snapshot())
    (on, _), (off, _) = serve(True), serve(False)
    for address in (on, off):
        text = requests.get(f"http://{address}/metrics", timeout=10)
        assert text.headers["Content-Type"].startswith("text/plain") and text.text == golden
    asked = requests.get(f"http://{off}/metrics", headers={"Accept": PROTOBUF_ACCEPT}, timeout=10)
    assert asked.headers["Content-Type"].startswith("text/plain")
    answered = requests.get(f"http://{on}/metrics", headers={"Accept": PROTOBUF_ACCEPT}, timeout=10)
    assert answered.headers["Content-Type"] == protobuf.CONTENT_TYPE


class Prometheus:
    runtime: FixedRuntime  # the exporter it scrapes

    def __init__(self, tmp_path: Path, target: str) -> None:
        config = {
            "global": {"scrape_interval": "500ms", "evaluation_interval": "500ms"},
            "scrape_configs": [{"job_name": "native", "static_configs": [{"targets": [target]}]}],
        }
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.url = f"http://127.0.0.1:{free_port()}"
        self.proc = subprocess.Popen(
            ["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'tsdb'}", "--log.level=warn",
             "--enable-feature=native-histograms",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def query(self, expr: str) -> list[dict[str, Any]]:
        assert self.proc.poll() is None, self.proc.communicate()[1]
        try:
            body = requests.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        except requests.ConnectionError:
            return []
        assert body.json()["status"] == "success", body.json()
        return list(body.json()["data"]["result"])

    def scalar(self, expr: str) -> float:
        [result] = self.query(expr)
        return float(result["value"][1])


@pytest.fixture
def prometheus(tmp_path: Path, serve: Any) -> Iterator[Prometheus]:
    address, runtime = serve(True)
    server = Prometheus(tmp_path, address)
    server.runtime = runtime
    try:
        wait_for(lambda: server.query('up{job="native"} == 1'), timeout=30, interval=0.2)
        yield server
    finally:
        server.proc.terminate()
        server.proc.wait(timeout=30)


def test_a_real_prometheus_stores_native_histograms(prometheus: Prometheus) -> None:
    snapshot = golden_snapshot()
    # One series per histogram label set, no _bucket, _count or _sum series beside it.
    for family, observed in (
        ("model_load_duration_seconds", snapshot.load_durations),
        ("model_load_phase_duration_seconds", snapshot.phase_durations),
    ):
        stored = prometheus.query(f'{{__name__=~"{family}.*", job="native"}}')
        assert {r["metric"]["__name__"] for r in stored} == {family}
        assert len(stored) == len(observed)
    # qwen's warm loads: 5.0, 5.0001, 7200 and 8000 s.
    qwen = 'model_load_duration_seconds{target="qwen", cache="warm", outcome="ready"}'
    assert prometheus.scalar(f"histogram_count({qwen})") == 4
    assert prometheus.scalar(f"histogram_sum({qwen})") == pytest.approx(15210.0001)
    # The lowest quarter is in the native bucket holding 5 s: (2^(18/8), 2^(19/8)].
    assert native_index(5.0) == 19
    low = prometheus.scalar(f"histogram_quantile(0.25, {qwen})")
    assert 2 ** (18 / 8) < low <= 2 ** (19 / 8)
    assert 2 ** (102 / 8) < prometheus.scalar(f"histogram_quantile(0.75, {qwen})") <= 8192
    # A phase's native buckets are there even though its classic buckets are left out.
    cuda = 'model_load_phase_duration_seconds{target="qwen", phase="cuda_graph"}'
    assert 2 ** (34 / 8) < prometheus.scalar(f"histogram_quantile(0.5, {cuda})") <= 2 ** (36 / 8)


def test_every_other_series_arrives_as_the_text_says(prometheus: Prometheus) -> None:
    expected = {}
    for family in text_string_to_metric_families(exposition(golden_snapshot())):
        if family.type != "histogram":
            for sample in family.samples:
                labels = tuple(sorted((k, v) for k, v in sample.labels.items() if v))
                expected[(sample.name, labels)] = sample.value  # an empty label is no label
    stored = {}
    for result in prometheus.query('{__name__=~"model_load_.*", job="native"}'):
        labels = {k: v for k, v in result["metric"].items() if k not in ("job", "instance")}
        name = labels.pop("__name__")
        if "histogram" not in result:
            stored[(name, tuple(sorted(labels.items())))] = float(result["value"][1])
    assert stored == expected


def test_the_failure_alert_counts_native_histograms(prometheus: Prometheus) -> None:
    """ModelLoadFailed's crash-loop part (a failed load within 15 minutes, whatever the phase
    now) reads native histograms too: kimi-k2 fails a second load between two scrapes."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    [failed] = [r for g in groups for r in g["rules"] if r.get("alert") == "ModelLoadFailed"]
    wait_for(lambda: prometheus.query("model_load_duration_seconds"), timeout=10)
    assert prometheus.query(failed["expr"]) == []
    again = Histograms()
    for seconds in (50.0, 70.0):  # the golden's failed load, and another
        again.observe(("kimi-k2", Cache.COLD, Outcome.FAILED), seconds)
    snapshot = prometheus.runtime.current
    loads = {**snapshot.load_durations, **again.snapshot()}
    prometheus.runtime.current = dataclasses.replace(snapshot, load_durations=loads)
    firing = wait_for(lambda: prometheus.query(failed["expr"]), timeout=10, interval=0.2)
    assert [r["metric"]["target"] for r in firing] == ["kimi-k2"]
