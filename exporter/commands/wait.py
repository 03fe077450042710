"""`model-load-exporter wait`: block until a model server is ready, and say how it is going.

Replaces the `sleep 30; curl` loop: readiness is seen within a fraction of a second, a crash ends
the wait at once (exit 1) instead of at the timeout, and a caller whose commands are cut off after
two minutes passes `--max-wait` and gets exit 75 plus one line to act on, then calls again.

Two sources: `--exporter URL --target NAME` reads the exporter's /api/v1/status (phase, progress,
ETA, stall, failure), `--url URL` probes the server itself with the exporter's own prober (only
readiness: without the exporter nothing knows about progress or a crash).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO
from urllib.parse import urlsplit

from rich.console import Console
from rich.live import Live

from exporter.commands import terminal
from exporter.commands.client import (
    ClientError,
    ExporterClient,
    ShownTarget,
    add_exporter_arguments,
    client_from_args,
    find_target,
)
from exporter.commands.exits import Exit, UsageError
from exporter.config.reader import parse_config
from exporter.config.schema import EndpointConfig
from exporter.config.values import ConfigError, parse_duration
from exporter.sources.endpoint import EndpointProber
from exporter.vocabulary import ProbeKind, ProbeResult

DEFAULT_TIMEOUT = "15m"
POLL_SECONDS = 0.2  # readiness is seen within this (plus the exporter's own sampling)
HEARTBEAT_SECONDS = 30.0  # a pipe gets a line at least this often
JSON_EVERY_SECONDS = 1.0
URL_PROBE_TIMEOUT_SECONDS = 8.0


def _duration(text: str) -> float:
    try:
        return parse_duration(text, "")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_exporter_arguments(parser)
    parser.add_argument("--target", metavar="NAME", help="target to wait for (with --exporter)")
    parser.add_argument(
        "--url", metavar="URL", help="probe this server endpoint directly instead of an exporter"
    )
    parser.add_argument(
        "--probe", choices=list(ProbeKind), help="readiness probe with --url (default completion)"
    )
    parser.add_argument("--model", help="model name sent by the completion probe with --url")
    parser.add_argument(
        "--timeout",
        type=_duration,
        default=_duration(DEFAULT_TIMEOUT),
        metavar="DURATION",
        help=f"give up with exit 124 after this long (default {DEFAULT_TIMEOUT})",
    )
    parser.add_argument(
        "--max-wait",
        dest="max_wait",
        type=_duration,
        metavar="DURATION",
        help="return exit 75 with a status line after this long while still loading",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per line")


# --- where the state comes from --------------------------------------------------------------


class Watch(Protocol):
    def poll(self, budget: float) -> ShownTarget:
        """The state now, taking at most about `budget` seconds."""

    def outcome(self, view: ShownTarget) -> str | None:
        """'ready' or 'failed' once that is the answer for this wait, else None."""


class ExporterWatch:
    """Polls a running exporter for one target.

    A ready or failed phase already there when the wait began may belong to the server's previous
    run (`systemctl restart x; wait ...` asks before the exporter saw the restart), so it counts
    only once the load's end lies after the wait began or two sample intervals have passed.
    """

    def __init__(self, client: ExporterClient, target: str | None) -> None:
        self.client = client
        status = client.status()  # unreachable, or unknown target: exit 2 before anything shows
        self.target = find_target(status, target).target
        self._began = status.time
        self._settle = 2 * status.sample_interval_seconds
        self._status_time = self._began
        self._last: ShownTarget | None = None

    def poll(self, budget: float) -> ShownTarget:
        try:
            status = self.client.status(timeout=min(max(budget, 0.1), 2.0))
        except ClientError as exc:
            # An exporter restarting mid-wait is not the load failing: keep waiting.
            last = self._last or ShownTarget(self.target, "unknown")
            return dataclasses.replace(last, detail=f"exporter not answering: {exc}")
        try:
            entry = find_target(status, self.target)
        except ClientError:
            raise UsageError(
                f"target {self.target!r} is no longer watched by the exporter"
            ) from None
        self._status_time = status.time
        self._last = ShownTarget.from_status(entry)
        return self._last

    def outcome(self, view: ShownTarget) -> str | None:
        if view.phase not in ("ready", "failed") or view.detail:
            return None
        ended = view.last_load.ended_at if view.last_load is not None else None
        if (ended is not None and ended >= self._began) or (
            self._status_time >= self._began + self._settle
        ):
            return view.phase
        return None


class UrlWatch:
    """Probes the server endpoint itself, as the exporter would."""

    def __init__(self, config: EndpointConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self._began = clock()

    def poll(self, budget: float) -> ShownTarget:
        timeout = min(self.config.timeout, max(budget, 0.1))
        config = dataclasses.replace(self.config, timeout=timeout)
        sample = EndpointProber(config).sample()
        ready = sample.result == ProbeResult.READY
        return ShownTarget(
            target=self.config.probe_url,
            phase="ready" if ready else "waiting",
            endpoint=self.config.probe_url,
            server=sample.server,
            elapsed_seconds=self._clock() - self._began,
            detail=None if ready else f"{sample.result}: {sample.detail}",
        )

    def outcome(self, view: ShownTarget) -> str | None:
        return "ready" if view.phase == "ready" else None


def endpoint_config(url: str, probe: str | None, model: str | None) -> EndpointConfig:
    """Validated like the exporter's own config; a path in the URL is the probe's path."""
    target: dict[str, Any] = {
        "name": "wait",
        "endpoint": {"url": url, "probe": probe or "completion"},
    }
    endpoint = target["endpoint"]
    try:
        parts = urlsplit(url)
        if parts.path not in ("", "/") and endpoint["probe"] != "tcp":
            endpoint["url"] = f"{parts.scheme}://{parts.netloc}"
            endpoint["path"] = parts.path + (f"?{parts.query}" if parts.query else "")
        if model is not None:
            endpoint["model"] = model
        endpoint["timeout"] = f"{URL_PROBE_TIMEOUT_SECONDS:g}s"
        config = parse_config({"targets": [target]}, source="flags", env={})
    except (ConfigError, ValueError) as exc:
        message = str(exc).replace("targets[0].endpoint.", "--")
        raise UsageError(message.replace("--path", "--url path")) from None
    return config.targets[0].endpoint


# --- how it is shown ---------------------------------------------------------------------------


class Output(Protocol):
    def update(self, view: ShownTarget, waited: float) -> None: ...

    def finish(self, view: ShownTarget, result: str, code: int, waited: float) -> None: ...

    def close(self) -> None: ...


class PlainOutput:
    """A pipe or log: one line per phase change, and one every HEARTBEAT_SECONDS."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._clock = clock
        self._key: tuple[Any, ...] | None = None
        self._printed = 0.0

    def update(self, view: ShownTarget, waited: float) -> None:
        # A probe's detail changes with every answer ("HTTP 503", "refused"); its kind is the news.
        key = (view.phase, view.stalled, (view.detail or "").split(":")[0])
        now = self._clock()
        if key != self._key or now - self._printed >= HEARTBEAT_SECONDS:
            self._key, self._printed = key, now
            print(terminal.line(view), file=self._out, flush=True)

    def finish(self, view: ShownTarget, result: str, code: int, waited: float) -> None:
        if result == "timeout":
            print(timeout_line(view, waited), file=sys.stderr, flush=True)
        elif result == "max_wait":
            print(terminal.still_line(view), file=self._out, flush=True)
        else:
            print("\n".join(final_lines(view, waited)), file=self._out, flush=True)

    def close(self) -> None:
        """Nothing to tear down."""


class JsonOutput:
    """Machines: one JSON object per line, on each phase change and at most every second."""

    def __init__(self, out: TextIO, clock: Callable[[], float] = time.monotonic) -> None:
        self._out = out
        self._clock = clock
        self._phase: str | None = None
        self._printed = 0.0

    def _emit(self, view: ShownTarget, waited: float, **extra: Any) -> None:
        record = {
            "time": round(time.time(), 3),
            "target": view.target,
            "phase": view.phase,
            "stalled": view.stalled,
            "progress_ratio": view.progress_ratio,
            "throughput_bytes_per_second": view.throughput_bytes_per_second,
            "eta_seconds": view.eta_seconds,
            "elapsed_seconds": view.elapsed_seconds,
            "cache": view.cache,
            "resident_ratio": view.resident_ratio,
            "gpu_memory_bytes": view.gpu_bytes,
            "detail": view.detail,
            "waited_seconds": round(waited, 3),
            **extra,
        }
        print(json.dumps(record), file=self._out, flush=True)

    def update(self, view: ShownTarget, waited: float) -> None:
        now = self._clock()
        if view.phase != self._phase or now - self._printed >= JSON_EVERY_SECONDS:
            self._phase, self._printed = view.phase, now
            self._emit(view, waited)

    def finish(self, view: ShownTarget, result: str, code: int, waited: float) -> None:
        load = view.last_load if result in ("ready", "failed") else None
        seconds = load.duration_seconds if load is not None else None
        known = view.restart_forecast
        forecast = known.to_json() if known is not None and load is not None else None
        self._emit(
            view, waited, result=result, exit_code=code, load_seconds=seconds,
            restart_forecast=forecast,
        )  # fmt: skip

    def close(self) -> None:
        """Nothing to tear down."""


class LiveOutput:
    """A terminal: a live rich display, then the outcome as one line."""

    def __init__(self) -> None:
        self._console = Console()
        self._live = Live(console=self._console, refresh_per_second=8, transient=False)
        self._live.start()

    def update(self, view: ShownTarget, waited: float) -> None:
        self._live.update(terminal.wait_panel(view, waited))

    def finish(self, view: ShownTarget, result: str, code: int, waited: float) -> None:
        self._live.update(terminal.wait_panel(view, waited), refresh=True)
        self._live.stop()
        if result == "timeout":
            self._console.print(timeout_line(view, waited), style="bold red", highlight=False)
        elif result == "max_wait":
            self._console.print(terminal.still_line(view), highlight=False)
        else:
            outcome, *forecast = final_lines(view, waited)
            style = "bold green" if result == "ready" else "bold red"
            self._console.print(outcome, style=style, highlight=False)
            for line in forecast:
                self._console.print(line, highlight=False)

    def close(self) -> None:
        self._live.stop()


def final_lines(view: ShownTarget, waited: float) -> list[str]:
    """The outcome, then what the next restart would cost now that this load is over."""
    forecast = terminal.forecast_line(view)
    outcome = f"{terminal.line(view)}; waited {terminal.duration(waited)}"
    return [outcome] if forecast is None else [outcome, forecast]


def timeout_line(view: ShownTarget, waited: float) -> str:
    return f"timed out after {terminal.duration(waited)}: {terminal.still_line(view)}"


def _output(args: argparse.Namespace) -> Output:
    if args.json:
        return JsonOutput(sys.stdout)
    if sys.stdout.isatty():
        return LiveOutput()
    return PlainOutput(sys.stdout)


# --- the command -------------------------------------------------------------------------------


def _watch(args: argparse.Namespace) -> Watch:
    if args.url is not None:
        if args.target is not None or args.exporter is not None:
            raise UsageError("--url probes the server itself: leave out --exporter and --target")
        return UrlWatch(endpoint_config(args.url, args.probe, args.model))
    if args.probe is not None or args.model is not None:
        raise UsageError("--probe and --model go with --url")
    try:
        return ExporterWatch(client_from_args(args), args.target)
    except ClientError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    began = time.monotonic()
    try:
        watch = _watch(args)
    except UsageError as exc:
        terminal.fail("wait", str(exc))
        return Exit.USAGE
    deadline = began + args.timeout
    stop_at = began + args.max_wait if args.max_wait is not None else None
    output = _output(args)
    try:
        return follow(watch, output, began, deadline, stop_at)
    except UsageError as exc:
        output.close()
        terminal.fail("wait", str(exc))
        return Exit.USAGE
    finally:
        output.close()


def follow(
    watch: Watch, output: Output, began: float, deadline: float, stop_at: float | None
) -> int:
    """Poll until the outcome, `deadline` (timeout) or `stop_at` (max_wait); the exit code.

    The MCP server's wait tool runs this too, with an Output that keeps the answer.
    """
    while True:
        polled = time.monotonic()
        answer_by = min(deadline, stop_at if stop_at is not None else deadline)
        view = watch.poll(answer_by - polled)
        now = time.monotonic()
        waited = now - began
        result = watch.outcome(view)
        if result is not None:
            code = Exit.OK if result == "ready" else Exit.FAILED
            output.finish(view, result, code, waited)
            return code
        output.update(view, waited)
        if now >= deadline:
            output.finish(view, "timeout", Exit.TIMED_OUT, waited)
            return Exit.TIMED_OUT
        if stop_at is not None and now >= stop_at:
            output.finish(view, "max_wait", Exit.STILL_LOADING, waited)
            return Exit.STILL_LOADING
        time.sleep(max(0.0, min(polled + POLL_SECONDS, answer_by) - time.monotonic()))
