"""`model-load-exporter serve`: turn flags into a Config and run the exporter until signalled."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import queue
import resource
import signal
import ssl
import sys
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from exporter.commands.exits import UsageError
from exporter.config.reader import load_config, parse_config
from exporter.config.schema import Config
from exporter.config.values import ConfigError, format_duration, parse_duration
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.exposition.http.webconfig import WebConfig, allowed_hosts, load_web_config
from exporter.logsetup import LEVELS, UNFOLDED, setup_logging
from exporter.runtime.wiring import Runtime
from exporter.vocabulary import ProbeKind, TargetRole

log = logging.getLogger(__name__)

RELOAD_WAIT_SECONDS = 60.0  # how long POST /-/reload waits for the main thread to reload

SINGLE_TARGET_FLAGS = (
    "target",
    "endpoint",
    "model",
    "weights",
    "unit",
    "pidfile",
    "cmdline",
    "log_source",
    "stall_after",
    "role",
)


class Commands:
    """Work for the main thread (stop, reload), from signal handlers and POST /-/reload.

    The main thread sleeps in a read of a pipe, at no CPU cost, rather than waking to poll.
    Python runs signal handlers only in the main thread, and the kernel may deliver a signal to
    any sampler thread; `signal.set_wakeup_fd` has the C-level handler write to the pipe from
    whichever thread received it, so the main thread wakes and runs the handler at once.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[str, Future[str | None] | None]] = queue.SimpleQueue()
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)

    def put(self, command: str, answer: Future[str | None] | None = None) -> None:
        self._queue.put((command, answer))
        with contextlib.suppress(BlockingIOError):  # a full pipe wakes the reader all the same
            os.write(self._write, b"\0")

    def get(self) -> tuple[str, Future[str | None] | None]:
        """Block until there is a command."""
        while True:
            try:
                return self._queue.get_nowait()
            except queue.Empty:
                os.read(self._read, 512)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of `serve`, in Prometheus style."""
    p.add_argument("--config.file", dest="config_file", metavar="PATH", help="YAML config")
    p.add_argument(
        "--config.check",
        dest="config_check",
        action="store_true",
        help="validate the config, print a summary and exit 0/1",
    )
    p.add_argument(
        "--web.listen-address",
        dest="web_listen_address",
        default=":9847",
        metavar="HOST:PORT",
        help="address to serve /metrics on (default :9847)",
    )
    p.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="PATH",
        help="TLS and basic auth, exporter-toolkit format",
    )
    p.add_argument(
        "--web.allowed-hosts",
        dest="web_allowed_hosts",
        metavar="HOST,...",
        help="answer only requests whose Host header is one of these (default: any)",
    )
    single = p.add_argument_group("one target without a config file")
    single.add_argument("--target", help="target name (label value)")
    single.add_argument("--endpoint", metavar="URL", help="server base URL")
    single.add_argument(
        "--probe",
        choices=tuple(ProbeKind),
        default=ProbeKind.COMPLETION,
        help="readiness probe (default completion)",
    )
    single.add_argument("--model", help="model name sent in the completion probe")
    single.add_argument(
        "--role",
        choices=tuple(TargetRole),
        help="follower: a node of a model over several hosts, never probed (default server)",
    )
    single.add_argument(
        "--weights", action="append", metavar="PATH", help="weights file or directory (repeatable)"
    )
    single.add_argument("--unit", metavar="SYSTEMD_UNIT", help="find the server by systemd unit")
    single.add_argument("--pidfile", metavar="PATH", help="find the server by pidfile")
    single.add_argument("--cmdline", metavar="REGEX", help="find the server by command line")
    single.add_argument(
        "--log.source",
        dest="log_source",
        metavar="journald:UNIT|file:PATH|docker:PATH|cri:PATH",
        help="server log (default: found from the server process)",
    )
    single.add_argument("--stall.after", dest="stall_after", metavar="DURATION", help="default 5m")
    p.add_argument(
        "--sample.interval", dest="sample_interval", metavar="DURATION", help="default 1s"
    )
    p.add_argument(
        "--history.path", dest="history_path", metavar="PATH", help='SQLite file; "" disables'
    )
    p.add_argument(
        "--metrics.phase-buckets",
        dest="phase_buckets",
        action="store_true",
        help="buckets of model_load_phase_duration_seconds too (config: metrics.phase_buckets)",
    )
    p.add_argument(
        "--metrics.native-histograms",
        dest="native_histograms",
        action="store_true",
        help="native histograms to a Prometheus that asks for protobuf "
        "(config: metrics.native_histograms)",
    )
    p.add_argument("--log.level", dest="log_level", choices=LEVELS, default="info")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), default="logfmt")


def _log_source(value: str) -> dict[str, str]:
    """`journald:UNIT`, `file:PATH`, or a container log as `docker:PATH` / `cri:PATH`: the same
    words `/api/v1/status` shows as the log's source."""
    kind, sep, rest = value.partition(":")
    if not sep or kind not in ("journald", "file", "docker", "cri") or not rest:
        raise ConfigError(
            f"--log.source: expected journald:UNIT, file:PATH, docker:PATH or cri:PATH, "
            f"got {value!r}"
        )
    if kind == "journald":
        return {"journald_unit": rest}
    return {"file": rest} if kind == "file" else {"file": rest, "encoding": kind}


def config_from_args(args: argparse.Namespace) -> Config:
    """Build the Config from --config.file or the single-target flags, validated the same way."""
    single = [f for f in SINGLE_TARGET_FLAGS if getattr(args, f)]
    if args.config_file:
        if single:
            raise UsageError(
                f"--{single[0].replace('_', '.')} cannot be combined with --config.file"
            )
        config = load_config(args.config_file)
    elif not single:
        # No config at all: discover the model servers on this host.
        config = parse_config({}, source="no config (discovery)")
    else:
        if not args.target or not args.endpoint:
            raise UsageError("one target needs both --target and --endpoint")
        target: dict[str, Any] = {
            "name": args.target,
            "endpoint": {"url": args.endpoint, "probe": args.probe},
            "stall_after": args.stall_after or "5m",
        }
        if args.model:
            target["endpoint"]["model"] = args.model
        if args.role:
            target["role"] = args.role
        if args.weights:
            target["weights"] = {"paths": args.weights}
        process = {"systemd_unit": args.unit, "pidfile": args.pidfile, "cmdline": args.cmdline}
        process = {k: v for k, v in process.items() if v}
        if process:
            target["process"] = process
        if args.log_source:
            target["log"] = _log_source(args.log_source)
        config = parse_config({"targets": [target]}, source="flags")
    if args.sample_interval:
        interval = parse_duration(args.sample_interval, "--sample.interval")
        config = dataclasses.replace(config, sample_interval=interval)
    if args.history_path is not None:
        config = dataclasses.replace(config, history_path=args.history_path)
    flags = {"phase_buckets": args.phase_buckets, "native_histograms": args.native_histograms}
    if any(flags.values()):
        on = {name: True for name, given in flags.items() if given}
        config = dataclasses.replace(config, metrics=dataclasses.replace(config.metrics, **on))
    return config


def summary(config: Config) -> str:
    """What --config.check prints: enough to see the config means what you meant."""
    history = config.history_path or "disabled"
    lines = [
        f"config OK: {config.source}: {len(config.targets)} target(s), "
        f"sample interval {format_duration(config.sample_interval)}, history {history}, "
        f"residency CPU budget {config.residency_cpu_budget:.1%} of a core"
    ]
    found = config.discovery
    if found.active(bool(config.targets)):
        lines.append(
            f"  discovery: {', '.join(found.servers)} servers from /proc every "
            f"{format_duration(found.interval)}, kept {format_duration(found.keep_for)} "
            "after they exit"
        )
    for t in config.targets:
        e = t.endpoint
        probe = (
            f"{e.probe} probe {e.display_url}{e.path}, timeout {format_duration(e.timeout)}, "
            f"every {format_duration(e.ready_interval)} while ready"
        )
        weights = (
            f"weights {', '.join(t.weights.paths)} ({' '.join(t.weights.include)})"
            if t.weights
            else "no weights"
        )
        process = "endpoint-only load detection"
        if t.process:
            kind, value = next((k, v) for k, v in vars(t.process).items() if v)
            process = f"process by {kind} {value}"
        if t.role is TargetRole.FOLLOWER:
            probe = f"a follower, not probed ({e.display_url}), ready by its log"
        lines.append(
            f"  {t.name}: {probe}; {weights}; {process}; gpus {t.gpus}; "
            f"stall after {format_duration(t.stall_after)}"
        )
    return "\n".join(lines)


def _load(args: argparse.Namespace) -> tuple[Config, WebConfig]:
    config = config_from_args(args)
    web = load_web_config(args.web_config_file) if args.web_config_file else WebConfig()
    if args.web_allowed_hosts is not None:
        hosts = allowed_hosts(args.web_allowed_hosts, "--web.allowed-hosts")
        web = dataclasses.replace(web, allowed_hosts=hosts)
    return config, web


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT; SIGHUP or POST /-/reload re-reads the config."""
    setup_logging(args.log_level, args.log_format)
    try:
        config, web = _load(args)
    except UsageError as exc:
        print(f"model-load-exporter: error: {exc}", file=sys.stderr)
        return 2
    except ConfigError as exc:
        print(f"model-load-exporter: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # a case the checks missed must still be one line, not a traceback
        log.debug("config error", exc_info=True)
        print(f"model-load-exporter: config: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if args.config_check:
        print(summary(config))
        return 0
    raise_fd_limit()
    # Signal handlers and POST /-/reload only queue work; the main thread does it.
    commands = Commands()
    app = WebApp(Runtime(config), web, reload=lambda: _request_reload(commands))
    try:
        server = HttpServer(app, args.web_listen_address)
    except (OSError, ValueError, ssl.SSLError) as exc:
        print(
            f"model-load-exporter: cannot listen on {args.web_listen_address}: {exc}",
            file=sys.stderr,
        )
        return 1
    signal.signal(signal.SIGTERM, lambda *_: commands.put("stop"))
    signal.signal(signal.SIGINT, lambda *_: commands.put("stop"))
    signal.signal(signal.SIGHUP, lambda *_: commands.put("reload"))
    app.runtime.start()
    server.start()
    log.info(
        "listening on %s://%s:%d with %d target(s)",
        server.scheme,
        args.web_listen_address.rpartition(":")[0] or "0.0.0.0",
        server.port,
        len(config.targets),
    )
    while True:
        command, answer = commands.get()
        if command == "stop":
            break
        error = reload(app, server, args)
        if answer is not None:
            answer.set_result(error)
    log.info("shutting down")
    server.stop()
    app.runtime.stop()
    return 0


def _request_reload(commands: Commands) -> str | None:
    """POST /-/reload: have the main thread reload, as SIGHUP does, and wait for the outcome."""
    answer: Future[str | None] = Future()
    commands.put("reload", answer)
    try:
        return answer.result(timeout=RELOAD_WAIT_SECONDS)
    except FutureTimeout:
        return f"reload did not finish within {RELOAD_WAIT_SECONDS:g}s"


def raise_fd_limit() -> None:
    """Raise the soft open-files limit to the hard one, as Go programs (node_exporter) do.

    systemd's default soft limit is 1024: a thousand idle connections would otherwise starve the
    sources of file descriptors. The HTTP server still bounds its connections below the limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (OSError, ValueError) as exc:
            log.debug("cannot raise the open-files limit: %s", exc)


def reload(app: WebApp, server: HttpServer, args: argparse.Namespace) -> str | None:
    """SIGHUP or POST /-/reload: swap in a runtime built from the re-read config, or keep the
    running one; returns the one-line error, or None.

    Like Prometheus, a bad file never takes the exporter down, whatever is wrong with it: the old
    config keeps running and `model_load_config_last_reload_successful` drops to 0 until a reload
    succeeds. The web config (certificates, users, headers) is re-read too. Loads in progress
    are picked up again by the new trackers (from the process start time).
    """
    fresh: Runtime | None = None
    try:
        config, web = _load(args)
        fresh = Runtime(config)
        server.configure(web)
    except Exception as exc:  # ConfigError, UsageError, and anything the checks missed
        if fresh is not None:
            fresh.stop()
        error = f"config reload failed, keeping the running config: {exc}"
        log.error("%s", error, extra=UNFOLDED)
        app.runtime.reload_successful = False
        return error
    fresh.start()
    old, app.runtime, app.web = app.runtime, fresh, web
    old.stop()
    log.info("config reloaded: %d target(s)", len(config.targets), extra=UNFOLDED)
    return None
