"""A slow load explained by its report, end to end: the exporter and the simulator as processes,
real shards evicted before each load, two cold loads at the usual storage rate, then one with
storage throttled to a third (the simulator's `--read-rate`). The report's reason names the
weights and the rate against the earlier loads'; `/api/v1/loads/ID`, `history --explain` (from
the exporter and from its file) and `/metrics` show it, and the shipped rules, fed the series
the exporter wrote, put it in `ModelLoadSlowerThanExpected`'s description (promtool)."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.processes import Host, cli
from helpers.support import sample_value, wait_for

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parent.parent
SHARDS, SHARD = 4, 16 << 20  # 64 MiB: 1.4 s at the usual rate, 4.2 s throttled
USUAL, THROTTLED = 48e6, 16e6  # bytes per second
# A start-up long enough for the residency pass a load's start asks for to land before the
# weights are read (else the bytes read between that pass and the tree's read counter, on a busy
# CPU an interval or more apart, may make a cold load read as mixed), and a short
# initialization, so that the weights decide the load's length.
PACE = ("--startup-seconds", "1", "--import-bytes", "0", "--init-seconds", "0.3")
RUNBOOK = (
    "`model-load-exporter history --explain --target sim` shows each phase against its median and "
    "how fast the weights came against the best before: a slow or shared disk, a page cache that "
    "was evicted, or a longer initialization (KV cache, CUDA graphs) after a config change; wait "
    "or investigate the slow phase."
)
REASON = re.compile(
    r"weights took (\d+\.\d)x their cold median: storage delivered (\S+) MB/s against (\S+) MB/s"
)


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    running = Host(tmp_path_factory.mktemp("report"), SHARDS, SHARD)
    yield running
    running.close()


def loads(host: Host) -> list[dict[str, Any]]:
    answer = requests.get(f"{host.exporter.url}/api/v1/loads", timeout=5).json()
    return list(answer["loads"])


@pytest.fixture(scope="module")
def history(host: Host) -> list[dict[str, Any]]:
    """The three loads, newest (the throttled one) first, as /api/v1/loads gives them."""
    for n, rate in enumerate((USUAL, USUAL, THROTTLED), 1):
        sim = host.simulate(*PACE, "--read-rate", f"{rate / 1e6:.0f}MB/s")
        assert sim.result()["outcome"] == "ready"
        wait_for(lambda n=n: len(loads(host)) == n, 15)
    host.sims[-1].stop()  # ready seen: stopping it now is no failed load
    return loads(host)


def test_the_throttled_load_is_explained_by_its_weights(history: list[dict[str, Any]]) -> None:
    slow, *earlier = history
    assert [(x["outcome"], x["cache"]) for x in history] == [("ready", "cold")] * 3
    assert all(x["report"]["reason"] is None for x in earlier), earlier
    report = slow["report"]
    match = REASON.fullmatch(report["reason"] or "")
    assert match, report
    # Against history before it: the two earlier loads' median and their best rate.
    weights = next(p for p in report["phases"] if p["phase"] == "loading_weights")
    median = statistics.median(x["phase_seconds"]["loading_weights"] for x in earlier)
    assert weights["median_seconds"] == pytest.approx(median)
    assert match[1] == f"{weights['seconds'] / median:.1f}"
    assert report["expected_seconds"] == pytest.approx(
        statistics.median(x["duration_seconds"] for x in earlier)
    )
    rate, best = (
        report["read_rate"],
        max(x["report"]["read_rate"]["bytes_per_second"] for x in earlier),
    )
    assert rate["source"] == "storage" and rate["best_before_bytes_per_second"] == best
    assert float(match[2]) == pytest.approx(rate["bytes_per_second"] / 1e6, abs=0.5)
    assert float(match[3]) == pytest.approx(best / 1e6, abs=0.5)
    # Storage delivered about a third of the earlier loads' rate, as throttled.
    assert 0.2 < rate["bytes_per_second"] / best < 0.5, (rate, best)
    assert (
        0.6 * USUAL < best < 1.3 * USUAL
        and 0.6 * THROTTLED < rate["bytes_per_second"] < 1.3 * THROTTLED
    )


def test_the_bytes_came_from_the_device_under_the_weights(history: list[dict[str, Any]]) -> None:
    total = SHARDS * SHARD
    assert any(load["report"]["storage_reads"] for load in history), history
    for load in history:
        report = load["report"]
        assert report["page_cache_bytes"] < 0.1 * total  # evicted before each load
        assert report["storage_bytes"] >= 0.9 * total
        # The evicted shards were read from the block device under them, during the load
        # (where the device's counter was read before its start: a busy CPU may delay the first
        # look at the new process past the readings kept).
        if report["storage_reads"] is None:
            continue
        (device,) = report["storage_reads"]
        assert device["kind"] == "disk" and device["read_bytes"] >= 0.9 * total, report


def test_the_report_by_its_id_and_from_history_explain(
    host: Host, history: list[dict[str, Any]]
) -> None:
    slow = history[0]
    url = f"{host.exporter.url}/api/v1/loads/{slow['id']}"
    assert requests.get(url, timeout=5).json() == slow
    # The status's last load is the same load with the same report (its id is history's).
    last = host.exporter.target()["last_record"]
    assert last == {k: v for k, v in slow.items() if k not in ("id", "duration_seconds")}
    missing = requests.get(f"{host.exporter.url}/api/v1/loads/999999", timeout=5)
    assert (missing.status_code, missing.text) == (404, "no load 999999 in history\n")
    assert requests.get(f"{host.exporter.url}/api/v1/loads/x1", timeout=5).status_code == 404
    explain = ("history", "--explain", "--target", "sim", "--limit", "1")
    shown = cli(*explain, "--exporter", host.exporter.url)
    assert shown.returncode == 0, shown.stderr
    head, why, *rest = shown.stdout.splitlines()
    assert head.startswith(f"load {slow['id']}: sim, started ")
    assert why == f"  slower than expected: {slow['report']['reason']}"
    assert any(re.fullmatch(r"  weights +\S+  median \S+, \d+\.\dx", line) for line in rest), rest
    disk = [x for x in rest if re.fullmatch(r"  disk \S+: \S+ MiB read meanwhile \(host-wide\)", x)]
    assert len(disk) == len(slow["report"]["storage_reads"] or ()), rest
    assert re.fullmatch(r"  rate +\S+ MB/s from storage, best before \S+ MB/s", rest[-1]), rest
    # The simulator's own files (its interpreter's libraries), learned in the loads before and
    # measured before this one began (exporter/sources/environment.py).
    env = slow["environment_bytes"]
    assert env > 0 and slow["report"]["environment_bytes"] == env, slow
    share = slow["environment_resident_bytes"] / env
    assert f"  environment {env / 2**20:.1f} MiB, {share:.0%} cached at start" in rest, rest
    from_file = cli(*explain, "--history.path", str(host.exporter.history))
    assert from_file.stdout == shown.stdout


def test_the_alert_quotes_the_reason(
    host: Host, history: list[dict[str, Any]], tmp_path: Path
) -> None:
    """The reason as the exporter exposes it, through the shipped rules: the alert that fired
    while a load ran goes on once it is over, quoting the reason (promtool, 1 m steps)."""
    text = requests.get(f"{host.exporter.url}/metrics", timeout=5).text
    reason = history[0]["report"]["reason"]
    assert sample_value(text, "model_load_last_load_slower_info", target="sim", reason=reason) == 1
    labels = 'job="model-load",instance="gpu-1:9847",target="sim"'
    series = {  # a load of 5m20s expected to take 100 s, then over
        f"model_load_elapsed_seconds{{{labels}}}": "0+60x5 0x5",
        f"model_load_in_progress{{{labels}}}": "1x5 0x5",
        f'model_load_cache_temperature{{{labels},cache="cold"}}': "1x10",
        f'model_load_expected_duration_seconds{{{labels},cache="cold"}}': "100x10",
        f"model_load_last_duration_seconds{{{labels}}}": "_x5 320x5",
        f"model_load_last_load_slower_info{{{labels},reason={json.dumps(reason)}}}": "_x5 1x5",
    }
    description = (
        "sim on gpu-1:9847 took 5m 20s to load, more than 1.5 times the median of its earlier "
        f"cold-cache loads: {reason}."
    )
    alert = {
        "exp_labels": {"severity": "warning", "job": "model-load", "instance": "gpu-1:9847",
                       "target": "sim", "cache": "cold"},
        "exp_annotations": {
            "summary": "Model load slower than expected: sim on gpu-1:9847",
            "description": description,
            "runbook": RUNBOOK,
        },
    }  # fmt: skip
    tests = {
        "rule_files": [str(ROOT / "prometheus" / "rules" / "model-load.yml")],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in series.items()],
                "alert_rule_test": [
                    {"eval_time": "7m", "alertname": "ModelLoadSlowerThanExpected",
                     "exp_alerts": [alert]}
                ],
            }
        ],
    }  # fmt: skip
    path = tmp_path / "slow.test.yml"
    path.write_text(json.dumps(tests))  # JSON is YAML
    result = subprocess.run(
        ["promtool", "test", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr
