"""How the operator commands print: plain lines for pipes and logs, rich renderables for terminals.

The plain lines are a stable format (CI logs, scripts and agents read them), so they carry no
colour, no width-dependent layout and fields only when they were measured. Sizes are binary
(GiB, as `ls -h` and nvidia-smi show memory), rates decimal (GB/s, as `dd` and disk vendors do).
Only the client commands import this module (and so `rich`); `serve` never does.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from rich.console import Console, Group, RenderableType
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from exporter.exposition import api
from exporter.units import age

if TYPE_CHECKING:  # only its attributes are read here; prewarm need not import requests
    from exporter.commands.client import ShownTarget

PHASE_STYLES = {
    "ready": "bold green",
    "failed": "bold red",
    "starting": "bold blue",
    "loading_weights": "bold blue",
    "initializing": "bold blue",
    "down": "dim",
}
PHASE_ABBREVIATIONS = {"starting": "start", "loading_weights": "weights", "initializing": "init"}


def fail(command: str, message: str) -> None:
    """A usage or input problem: one line on stderr, like argparse's own errors."""
    print(f"model-load-exporter {command}: error: {message}", file=sys.stderr)


def show(renderable: RenderableType) -> None:
    """Print to a terminal as rich does; to a pipe without colour, wrapping or trailing blanks."""
    if sys.stdout.isatty():
        Console().print(renderable)
        return
    console = Console(width=1000, no_color=True, highlight=False)
    with console.capture() as captured:
        console.print(renderable)
    for text in captured.get().splitlines():
        print(text.rstrip())


# --- numbers ---------------------------------------------------------------------------------


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def rate(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(n) < 1000 or unit == "GB/s":
            return f"{n:.0f} {unit}" if unit == "B/s" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def duration(seconds: float | None) -> str:
    """45s, 2m10s, 1h05m; tenths below 10 s, where a load's end is judged."""
    if seconds is None or not math.isfinite(seconds):
        return "-"
    seconds = max(0.0, seconds)
    if round(seconds, 1) < 10:
        return f"{seconds:.1f}s"
    return age(seconds)


def percent(ratio: float | None) -> str:
    """Rounded down: 99.9 % of the weights is not 100 %."""
    return "-" if ratio is None else f"{math.floor(ratio * 100 + 1e-9)} %"


def local_time(unix: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(unix))


def phases(load: api.Load) -> str:
    order = [p for p in PHASE_ABBREVIATIONS if p in load.phase_seconds]
    order += sorted(p for p in load.phase_seconds if p not in PHASE_ABBREVIATIONS)
    return " ".join(
        f"{PHASE_ABBREVIATIONS.get(p, p)} {duration(load.phase_seconds[p])}" for p in order
    )


# --- one target as a line --------------------------------------------------------------------


def facts(view: ShownTarget) -> list[str]:
    """The measured parts of a load in progress, in reading order."""
    parts = []
    if view.progress_ratio is not None and view.phase != "down":
        parts.append(percent(view.progress_ratio))
    if view.throughput_bytes_per_second:
        parts.append(rate(view.throughput_bytes_per_second))
    if view.resident_ratio is not None:
        parts.append(f"resident {percent(view.resident_ratio)}")
    if view.gpu_bytes is not None:
        parts.append(f"GPU {size(view.gpu_bytes)}")
    if view.eta_seconds is not None:
        parts.append(f"ETA {duration(view.eta_seconds)}")
    elif view.weights_eta_seconds is not None and view.phase == "loading_weights":
        parts.append(f"weights in {duration(view.weights_eta_seconds)}")
    if view.in_progress and view.elapsed_seconds is not None:
        parts.append(f"elapsed {duration(view.elapsed_seconds)}")
    return parts


def load_summary(load: api.Load) -> str:
    cache = f", {load.cache} cache" if load.cache else ""
    partial = ", partial" if load.partial else ""
    return f"{load.outcome} after {duration(load.duration_seconds)}{cache}{partial}"


def line(view: ShownTarget) -> str:
    """`sim: loading_weights 64 % 1.2 GB/s ... ETA 2m10s elapsed 45s`: one state, one line."""
    if (
        view.phase in ("ready", "failed")
        and view.last_load
        and view.last_load.outcome == view.phase
    ):
        text = f"{view.target}: {load_summary(view.last_load)}"
    else:
        text = " ".join([f"{view.target}: {view.phase}", *facts(view)])
    if view.stalled:
        text += f" STALLED (no progress for {duration(view.seconds_since_progress)})"
    if view.detail:
        text += f" ({view.detail})"
    return text


def forecast_text(forecast: api.RestartForecast) -> str:
    """`a restart now: ~4m10s, 62 % of the weights cached`: what a restart would cost before
    anyone begins one (exporter/history/forecast.py); without a forecast, why there is none."""
    share = forecast.resident_share
    cached = f", {percent(share)} of the weights cached" if share is not None else ""
    if forecast.seconds is None:
        return f"a restart now: no forecast{cached}: {forecast.reason or 'no reason given'}"
    return f"a restart now: ~{duration(forecast.seconds)}{cached}"


def forecast_line(view: ShownTarget) -> str | None:
    """`sim: a restart now: ...`; None from an exporter that makes no forecasts."""
    known = view.restart_forecast
    return None if known is None else f"{view.target}: {forecast_text(known)}"


def probe_lines(view: ShownTarget) -> list[str]:
    """`sim: alive 503: stalled in ...` and the startupProbe window its cold loads need (or why
    there is none); nothing from an exporter older than the probes."""
    lines = []
    if view.probes is not None:
        code = 200 if view.probes.alive else 503
        lines.append(f"{view.target}: alive {code}: {view.probes.alive_line}")
    advice = view.startup_probe
    if advice is not None:
        lines.append(f"{view.target}: {startup_text(advice)}")
    return lines


def startup_text(advice: api.StartupProbe) -> str:
    """`startupProbe without the exporter: periodSeconds 10 x failureThreshold 95 (15m50s; cold
    p99 12m35s of 12 loads)`, or why there is no advice."""
    if advice.window_seconds is None:
        return f"startupProbe without the exporter: no advice: {advice.reason or 'no basis'}"
    return (
        f"startupProbe without the exporter: periodSeconds {advice.period_seconds}"
        f" x failureThreshold {advice.failure_threshold} ({duration(advice.window_seconds)};"
        f" cold p99 {duration(advice.cold_p99_seconds)} of {advice.cold_loads}"
        f" load{'s' if advice.cold_loads != 1 else ''})"
    )


def still_line(view: ShownTarget) -> str:
    """What `wait --max-wait` leaves: "still loading: sim loading_weights 64 %, ETA 2m10s"."""
    if not view.in_progress:
        return f"still waiting: {view.target} is {view.phase}" + (
            f" ({view.detail})" if view.detail else ""
        )
    parts = [f"{view.target} {view.phase}"]
    if view.progress_ratio is not None:
        parts[0] += f" {percent(view.progress_ratio)}"
    parts.append(f"ETA {duration(view.eta_seconds)}" if view.eta_seconds is not None else "no ETA")
    if view.elapsed_seconds is not None:
        parts.append(f"elapsed {duration(view.elapsed_seconds)}")
    stalled = " STALLED" if view.stalled else ""
    return f"still loading: {', '.join(parts)}{stalled}"


# --- rich renderables ------------------------------------------------------------------------


def phase_text(view: ShownTarget) -> Text:
    if view.stalled:
        return Text(f"{view.phase} STALLED", style="bold white on red")
    return Text(view.phase, style=PHASE_STYLES.get(view.phase, ""))


def wait_panel(view: ShownTarget, waited: float) -> RenderableType:
    """The live display of `wait` on a terminal."""
    title = Text.assemble((view.target, "bold"), "  ", phase_text(view))
    if view.server and view.server != "unknown":
        title.append(f"  {view.server}", style="dim")
    if view.endpoint and view.endpoint != view.target:
        title.append(f"  {view.endpoint}", style="dim")
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    if view.progress_ratio is not None or view.in_progress:
        ratio = view.progress_ratio or 0.0
        bar = Table.grid(padding=(0, 1))
        bar.add_row(
            ProgressBar(total=1.0, completed=ratio, width=40),
            percent(view.progress_ratio),
            rate(view.throughput_bytes_per_second) if view.throughput_bytes_per_second else "",
        )
        grid.add_row("weights", bar)
    if view.weights_bytes is not None:
        grid.add_row(
            "resident",
            f"{percent(view.resident_ratio)} of {size(view.weights_bytes)} in page cache",
        )
    if view.gpu_memory:
        grid.add_row(
            "GPU memory", "  ".join(f"GPU{g.gpu} {size(g.used_bytes)}" for g in view.gpu_memory)
        )
    if view.in_progress:
        eta = duration(view.eta_seconds) if view.eta_seconds is not None else "unknown"
        if view.weights_eta_seconds is not None and view.phase == "loading_weights":
            eta += f" (weights in {duration(view.weights_eta_seconds)})"
        grid.add_row("ETA", eta)
        expected = view.expected_duration
        grid.add_row(
            "elapsed",
            duration(view.elapsed_seconds)
            + (f" of ~{duration(expected)} expected ({view.cache})" if expected else ""),
        )
    if view.stalled:
        grid.add_row(
            "stalled", Text(f"no progress for {duration(view.seconds_since_progress)}", "red")
        )
    if view.restart_forecast is not None and not view.in_progress:
        grid.add_row("restart", forecast_text(view.restart_forecast).removeprefix("a restart "))
    if view.detail:
        grid.add_row("detail", view.detail)
    grid.add_row("waited", duration(waited))
    return Group(title, grid)


STATUS_COLUMNS = (
    "TARGET", "PHASE", "PROGRESS", "ETA", "ELAPSED", "CACHE", "ENDPOINT", "RESIDENT", "GPU MEMORY",
    "LAST LOAD",
)  # fmt: skip


def status_rows(views: Iterable[ShownTarget], now: float) -> list[list[str]]:
    rows = []
    for v in views:
        last = "-"
        if v.last_load is not None:
            last = f"{load_summary(v.last_load)}, {duration(now - v.last_load.ended_at)} ago"
        rows.append(
            [
                v.target,
                v.phase + (" STALLED" if v.stalled else ""),
                percent(v.progress_ratio) if v.in_progress or v.phase == "ready" else "-",
                duration(v.eta_seconds) if v.in_progress else "-",
                duration(v.elapsed_seconds) if v.in_progress else "-",
                v.cache or "-",
                v.endpoint or "-",
                (
                    f"{percent(v.resident_ratio)} of {size(v.weights_bytes)}"
                    if v.resident_ratio is not None
                    else "-"
                ),
                " ".join(f"GPU{g.gpu} {size(g.used_bytes)}" for g in v.gpu_memory) or "-",
                last,
            ]
        )
    return rows


def storage_lines(view: ShownTarget) -> list[str]:
    """What holds a target's weights and what can be measured there, each with its reason:
    `sim storage: overlay over erofs on loop4 ...`, then one indented line per fact."""
    storage = view.storage
    if storage is None:
        return []
    lines = []
    for mount in storage.mounts:
        lines.append(f"{view.target} storage: {mount.summary}")
        facts = (("reads", mount.read_rate), ("residency", mount.residency),
                 ("page cache", mount.page_cache), ("bypass", mount.bypass))  # fmt: skip
        for name, fact in facts:
            verdict = "unknown" if fact.value is None else "yes" if fact.value else "no"
            lines.append(f"  {name}: {verdict}" + (f": {fact.reason}" if fact.reason else ""))
        lines.extend(f"  note: {note}" for note in mount.notes)
    lines.extend(f"{view.target} storage: cannot look at {u}" for u in storage.unplaced)
    rule = storage.cache_label
    label = rule.fixed or ("never cold" if rule.never_cold else "from residency")
    lines.append(f"  cache label: {label}" + (f": {rule.reason}" if rule.reason else ""))
    return lines


def table(columns: Sequence[str], rows: Sequence[Sequence[str]], phase_column: int | None) -> Table:
    """A borderless table: aligned columns that read the same in a pipe and on a terminal."""
    out = Table(box=None, pad_edge=False, show_edge=False, header_style="bold")
    for name in columns:
        out.add_column(name, no_wrap=True, overflow="fold")
    for row in rows:
        cells: list[str | Text] = list(row)
        if phase_column is not None:
            phase = row[phase_column].split()[0]
            style = (
                "bold white on red"
                if "STALLED" in row[phase_column]
                else PHASE_STYLES.get(phase, "")
            )
            cells[phase_column] = Text(row[phase_column], style=style)
        out.add_row(*cells)
    return out
