"""The plain text the operator commands print: units, rounding and the pipe's cadence."""

from __future__ import annotations

import dataclasses
import io
import json

import pytest
from helpers.documents import load

from exporter.commands import terminal
from exporter.commands.client import ShownTarget
from exporter.commands.wait import JsonOutput, PlainOutput
from exporter.exposition import api


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.04, "0.0s"), (9.94, "9.9s"), (9.96, "10s"), (59.4, "59s"), (59.6, "1m00s"),
     (130, "2m10s"), (3599.4, "59m59s"), (3600, "1h00m"), (7384, "2h03m"), (None, "-")],
)  # fmt: skip
def test_durations(seconds: float | None, text: str) -> None:
    assert terminal.duration(seconds) == text


def test_sizes_are_binary_rates_decimal_and_percent_rounds_down() -> None:
    assert [terminal.size(n) for n in (512, 1536, 64 << 20, 2.5 * (1 << 30))] == [
        "512 B", "1.5 KiB", "64.0 MiB", "2.5 GiB",
    ]  # fmt: skip
    assert [terminal.rate(n) for n in (999, 240e6, 3.2e9)] == ["999 B/s", "240.0 MB/s", "3.2 GB/s"]
    assert [terminal.percent(r) for r in (0.999, 0.64, 1.0)] == ["99 %", "64 %", "100 %"]


def test_lines_show_only_what_was_measured() -> None:
    loading = ShownTarget(
        "kimi", "loading_weights", in_progress=True, progress_ratio=0.64,
        throughput_bytes_per_second=1.2e9, eta_seconds=130, elapsed_seconds=45,
    )  # fmt: skip
    assert terminal.line(loading) == "kimi: loading_weights 64 % 1.2 GB/s ETA 2m10s elapsed 45s"
    assert terminal.still_line(loading) == (
        "still loading: kimi loading_weights 64 %, ETA 2m10s, elapsed 45s"
    )
    unknown = dataclasses.replace(loading, eta_seconds=None, throughput_bytes_per_second=None)
    assert (
        terminal.still_line(unknown)
        == "still loading: kimi loading_weights 64 %, no ETA, elapsed 45s"
    )
    last = load("kimi", 100.0, 190.5, cache="warm", phase_seconds={"starting": 1.0})
    ready = ShownTarget("kimi", "ready", last_load=last)
    assert terminal.line(ready) == "kimi: ready after 1m30s, warm cache"


def test_wait_in_a_pipe_repeats_an_unchanged_state_every_30_seconds() -> None:
    now = [0.0]
    out = io.StringIO()
    output = PlainOutput(out, clock=lambda: now[0])
    view = ShownTarget("sim", "loading_weights", in_progress=True, progress_ratio=0.5)
    for now[0] in (0.0, 10.0, 29.0, 30.5, 31.0, 61.0):
        output.update(view, now[0])
    output.update(dataclasses.replace(view, phase="initializing"), 62.0)
    assert out.getvalue().splitlines() == [
        "sim: loading_weights 50 %", "sim: loading_weights 50 %", "sim: loading_weights 50 %",
        "sim: initializing 50 %",
    ]  # fmt: skip


def test_a_restart_forecast_reads_as_one_phrase_or_says_why_there_is_none() -> None:
    known = api.RestartForecast(250.4, 0.624, None)
    assert terminal.forecast_text(known) == "a restart now: ~4m10s, 62 % of the weights cached"
    unknown = api.RestartForecast(None, 1.0, "no warm load in history to time the page cache")
    assert terminal.forecast_text(unknown) == (
        "a restart now: no forecast, 100 % of the weights cached: no warm load in history to "
        "time the page cache"
    )
    unmeasured = api.RestartForecast(
        None, None, "the weights' page-cache residency is not measured"
    )
    assert terminal.forecast_text(unmeasured) == (
        "a restart now: no forecast: the weights' page-cache residency is not measured"
    )
    view = ShownTarget("kimi", "ready", restart_forecast=known)
    assert terminal.forecast_line(view) == "kimi: a restart now: ~4m10s, 62 % of the weights cached"
    assert terminal.forecast_line(ShownTarget("kimi", "ready")) is None  # an older exporter


def test_wait_ends_with_the_outcome_then_what_a_restart_would_cost_now() -> None:
    last = load("kimi", 100.0, 190.5, cache="cold", phase_seconds={"starting": 1.0})
    forecast = api.RestartForecast(30.0, 1.0, None)
    ready = ShownTarget("kimi", "ready", last_load=last, restart_forecast=forecast)
    out = io.StringIO()
    PlainOutput(out).finish(ready, "ready", 0, 91.0)
    assert out.getvalue().splitlines() == [
        "kimi: ready after 1m30s, cold cache; waited 1m31s",
        "kimi: a restart now: ~30s, 100 % of the weights cached",
    ]
    out = io.StringIO()
    JsonOutput(out).finish(ready, "ready", 0, 91.0)
    record = json.loads(out.getvalue())
    assert record["restart_forecast"] == {"seconds": 30.0, "resident_share": 1.0, "reason": None}
    assert record["load_seconds"] == 90.5
