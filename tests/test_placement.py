"""`status --placement` as an operator runs it: one host's answer from its exporter, and what it
says when the Prometheus to ask is missing, wrong or without the rules. The fleet's answer on a
real Prometheus over two hosts is in tests/test_model_over_hosts.py."""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.documents import status, target
from helpers.processes import cli
from helpers.scripted import ScriptedExporter
from helpers.support import free_port, wait_for
from test_dashboard_prometheus import Prometheus

from exporter.exposition import api

pytestmark = pytest.mark.system

GIB = 1 << 30


def placed(
    name: str, model: str | None, resident: int | None, forecast: float | None, **state: Any
) -> api.Target:
    """A target whose weights (1 GiB) have `resident` bytes cached and `forecast` seconds."""
    residency = api.Residency(4, GIB, resident, "cachestat", 1.0, 0.0, None, None)
    reason = None if forecast is not None else "no finished load of this target in history"
    known = api.RestartForecast(forecast, None if resident is None else resident / GIB, reason)
    return dataclasses.replace(
        target(name, "down", restart_forecast=known, **state), model=model, residency=residency
    )


def one_host(_elapsed: float, began: float) -> dict[str, Any]:
    """A host with two targets of one model (a restarted server under another name), one
    named after its model, one whose loader reads around the page cache, one unmeasured."""
    return status(
        began,
        placed("kimi-old", "Kimi-K2", GIB // 5, 400.0),
        placed("kimi", "Kimi-K2", GIB, 95.0),
        placed("llama", None, 0, None),
        placed("qwen-direct", "Qwen", GIB, 30.0, cache="bypass"),
        placed("zfs", "Mistral", None, None),
    )


@pytest.fixture
def exporter() -> Iterator[ScriptedExporter]:
    server = ScriptedExporter(one_host)
    yield server
    server.close()


def test_without_a_prometheus_it_answers_for_the_exporters_host_only(
    exporter: ScriptedExporter,
) -> None:
    done = cli("status", "--placement", "--exporter", exporter.url, "--json")
    assert done.returncode == 0, done.stderr
    answer = json.loads(done.stdout)
    host = exporter.url.removeprefix("http://")
    assert (answer["scope"], answer["source"]) == ("host", exporter.url)
    # Per model, the best its targets offer here: the larger share, the shorter forecast; a
    # loader that bypasses the page cache gains nothing from it, and unmeasured is unknown.
    assert [(h["model"], h["cached_share"], h["forecast_seconds"], h["warm"])
            for h in answer["hosts"]] == [
        ("Kimi-K2", 1.0, 95.0, True),
        ("Mistral", None, None, False),
        ("Qwen", None, 30.0, False),
        ("llama", 0.0, None, False),
    ]  # fmt: skip
    assert {h["host"] for h in answer["hosts"]} == {host}

    shown = cli("status", "--placement", "--exporter", exporter.url, "--model", "Kimi-K2")
    assert shown.returncode == 0, shown.stderr
    header, *table = shown.stdout.splitlines()
    assert header == (
        f"where each model would start warm: this host only (the exporter at {exporter.url}); "
        "--prometheus URL ranks every host"
    )
    assert [re.split(r"\s{2,}", row.strip()) for row in table] == [
        ["MODEL", "HOST", "WEIGHTS CACHED", "RESTART FORECAST"],
        ["Kimi-K2", host, "100 %", "1m35s"],
    ]


def test_a_model_no_host_reports_is_one_line_and_exit_2(exporter: ScriptedExporter) -> None:
    done = cli("status", "--placement", "--exporter", exporter.url, "--model", "Kimi")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == (
        "model-load-exporter status: error: no host reports model 'Kimi' "
        "(known: Kimi-K2, Mistral, Qwen, llama)\n"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("--prometheus", "http://127.0.0.1:9090"), "--model and --prometheus go with --placement"),
        (("--placement", "--prometheus", "prometheus:9090"),
         "--prometheus: expected an http or https URL, got 'prometheus:9090'"),
        (("--placement", "--prometheus.ca-file", "/etc/ca.crt"),
         "--prometheus.ca-file needs --prometheus"),
        (("--placement", "--prometheus", "https://ops@127.0.0.1:9090"),
         "--prometheus names user 'ops': set $MODEL_LOAD_PROMETHEUS_PASSWORD"),
    ],
)  # fmt: skip
def test_bad_flags_are_one_line_and_exit_2(args: tuple[str, ...], said: str) -> None:
    done = cli("status", *args, env={"PATH": "/usr/bin:/bin"})
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"model-load-exporter status: error: {said}\n"


def test_a_prometheus_that_is_down_or_is_not_one(exporter: ScriptedExporter) -> None:
    port = free_port()
    down = cli("status", "--placement", "--prometheus", f"http://127.0.0.1:{port}")
    assert down.returncode == 2
    assert down.stderr == (
        "model-load-exporter status: error: cannot reach Prometheus at "
        f"http://127.0.0.1:{port}: connection refused\n"
    )
    # An exporter's URL given for Prometheus's: its answer is no query result.
    wrong = cli("status", "--placement", "--prometheus", exporter.url)
    assert wrong.returncode == 2
    assert wrong.stderr == (
        f"model-load-exporter status: error: {exporter.url}: not a Prometheus query answer "
        "(is this Prometheus?)\n"
    )


def test_a_prometheus_that_records_no_placement_says_why_it_may_be(tmp_path: Path) -> None:
    """The shipped rules, and no exporter up to scrape: nothing recorded."""
    prometheus = Prometheus(tmp_path, f"127.0.0.1:{free_port()}")
    try:
        wait_for(lambda: answers(prometheus), timeout=30, interval=0.2)
        done = cli("status", "--placement", "--prometheus", prometheus.url)
    finally:
        prometheus.stop()
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[1:] == [
        f"Prometheus at {prometheus.url} records no placement: it scrapes no exporter that "
        "watches a target, or prometheus/rules/model-load.yml is not in its rule_files"
    ]


def answers(prometheus: Prometheus) -> bool:
    try:
        return prometheus.api("query", query="vector(1)")["result"] != []
    except (requests.ConnectionError, requests.JSONDecodeError):
        return False  # not listening yet, or 503 while its TSDB opens
