"""A stand-in model server that loads weights and starts up like SGLang, vLLM, llama.cpp or TGI.

The exporter has to be demonstrated, tested and drilled without GPUs or 500 GB checkpoints. This
process does the parts of a real startup that the exporter can observe, for real: it reads weight
files from disk (so page-cache residency, process `read_bytes` and disk throughput move), paced to
a cold-disk or page-cache rate decided per chunk by asking the kernel what was cached; it writes
the server's own startup log lines; and it keeps its port closed (or answering 503) until ready.
Stalls, crashes and timed exits can be scripted for alert drills.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import select
import signal
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import psutil

from exporter.config import ConfigError, parse_duration
from exporter.sim.serverlog import LOG_WRITERS, STEP_SHARES, LogContext, ServerLog, fs_type
from exporter.sim.shards import (
    CHUNK_SIZE,
    MIN_SHARD_SIZE,
    WEIGHTS_GLOB,
    Shard,
    Throttle,
    cache_temperature,
    find_shards,
    generate_shards,
    read_chunk,
)
from exporter.sources.process import process_start_time
from exporter.units import MiB, parse_rate, parse_size
from exporter.vocabulary import ServerKind

PORT_STYLES: tuple[str, ...] = ("closed", "503")
DEFAULT_PORTS: dict[ServerKind, int] = {
    ServerKind.SGLANG: 30000,
    ServerKind.VLLM: 8000,
    ServerKind.LLAMACPP: 8080,
    ServerKind.TGI: 3000,
}
LOADING_BODY = json.dumps(
    {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
).encode()


class SimulationError(Exception):
    """A setup problem (weights, port, files) to report as one line; the exit code is 1."""


class _Stopped(Exception):
    """SIGTERM or SIGINT arrived: unwind to `run` and exit cleanly."""


class _Crash(Exception):
    """A scripted failure (`--crash-at`, `--crash-during-init`)."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


# --- flags ------------------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        size = parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if size < MIN_SHARD_SIZE:
        raise argparse.ArgumentTypeError(f"must be at least {MIN_SHARD_SIZE} bytes, got {text!r}")
    return size


def _rate_arg(text: str) -> float:
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text, "")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(": ")) from None


def _seconds_arg(text: str) -> float:
    """Plain seconds (`10`, `0.5`, `0`) or a duration (`2m`)."""
    try:
        seconds = float(text)
    except ValueError:
        return _duration_arg(text)
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"expected seconds >= 0, got {text!r}")
    return seconds


def _fraction_arg(text: str) -> float:
    try:
        fraction = float(text)
    except ValueError:
        fraction = math.nan
    if not 0.0 <= fraction <= 1.0:
        raise argparse.ArgumentTypeError(f"expected a fraction between 0 and 1, got {text!r}")
    return fraction


def _count_arg(text: str) -> int:
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return count


def _port_arg(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port number 0-65535, got {text!r}")
    return port


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the flags of `simulate` to a (sub)command parser."""
    add = parser.add_argument
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=_port_arg, help="port (default: the server's own, e.g. 30000 for sglang)")
    add("--weights", type=Path, required=True, metavar="DIR", help="directory of *.safetensors")
    add("--generate", type=_count_arg, metavar="N", help="create N shards in DIR if missing")
    add("--shard-size", type=_size_arg, default=256 * MiB, help="size of generated shards")
    add("--read-rate", type=_rate_arg, default=240e6, help="pace of page-cache misses (240MB/s)")
    add("--cached-read-rate", type=_rate_arg, help="pace of page-cache hits (default unthrottled)")
    add("--startup-seconds", type=_seconds_arg, default=0.0, help="imports, distributed init")
    add("--init-seconds", type=_seconds_arg, default=10.0, help="KV cache, compile, CUDA graphs")
    add("--port-style", choices=PORT_STYLES, help="closed until ready, or 503 while loading")
    add(
        "--log-format",
        choices=tuple(LOG_WRITERS),
        default=ServerKind.SGLANG,
        help="whose startup log to write",
    )
    add("--log-file", type=Path, metavar="PATH", help="append the log here (default stderr)")
    add("--pidfile", type=Path, metavar="PATH", help="written at start, removed at exit")
    add("--report", type=Path, metavar="PATH", help="JSON summary written when ready or failed")
    add("--stall-at", type=_fraction_arg, metavar="FRACTION", help="pause the weight load here")
    add("--stall-for", type=_duration_arg, default=30.0, metavar="DURATION", help="default 30s")
    add("--crash-at", type=_fraction_arg, metavar="FRACTION", help="exit 1 at this weight share")
    add("--crash-during-init", action="store_true", help="exit 1 halfway through initializing")
    add("--exit-after", type=_duration_arg, metavar="DURATION", help="exit 0 this long after ready")
    add("--model", help="served model name (default: the weights directory name)")


@dataclass(frozen=True)
class Settings:
    """The validated flags, with per-server defaults filled in."""

    host: str
    port: int
    weights: Path
    generate: int | None
    shard_size: int
    read_rate: float
    cached_read_rate: float | None
    startup_seconds: float
    init_seconds: float
    port_style: str
    kind: ServerKind
    log_file: Path | None
    pidfile: Path | None
    report: Path | None
    stall_at: float | None
    stall_for: float
    crash_at: float | None
    crash_during_init: bool
    exit_after: float | None
    model: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        kind = ServerKind(args.log_format)
        weights = Path(args.weights).absolute()
        return cls(
            host=args.host,
            port=DEFAULT_PORTS[kind] if args.port is None else args.port,
            weights=weights,
            generate=args.generate,
            shard_size=args.shard_size,
            read_rate=args.read_rate,
            cached_read_rate=args.cached_read_rate,
            startup_seconds=args.startup_seconds,
            init_seconds=args.init_seconds,
            # llama.cpp answers 503 while loading; the others keep the port closed.
            port_style=args.port_style or ("503" if kind == ServerKind.LLAMACPP else "closed"),
            kind=kind,
            log_file=args.log_file,
            pidfile=args.pidfile,
            report=args.report,
            stall_at=args.stall_at,
            stall_for=args.stall_for,
            crash_at=args.crash_at,
            crash_during_init=args.crash_during_init,
            exit_after=args.exit_after,
            model=args.model or weights.name,
        )


# --- signals ----------------------------------------------------------------------------------


class Stopper:
    """Turns SIGTERM/SIGINT into a flag plus a wake-up pipe.

    Every wait of the simulation is a `select` on that pipe, so a signal ends even a stall of days
    within moments, and the handler does nothing that could deadlock (no locks, no exceptions
    thrown into arbitrary code).
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.requested = False

    def request(self, signum: int = 0, frame: FrameType | None = None) -> None:
        self.requested = True
        with suppress(BlockingIOError):  # a full pipe already holds a wake-up
            os.write(self._write_fd, b"\0")

    def sleep(self, seconds: float) -> None:
        """Wait `seconds` (0 just checks); raise `_Stopped` as soon as a stop is requested."""
        deadline = time.monotonic() + seconds
        while not self.requested:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            select.select([self._read_fd], [], [], min(remaining, 3600.0))
        raise _Stopped

    @contextmanager
    def installed(self) -> Iterator[Stopper]:
        previous = {
            sig: signal.signal(sig, self.request) for sig in (signal.SIGTERM, signal.SIGINT)
        }
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._read_fd)
            os.close(self._write_fd)


# --- HTTP -------------------------------------------------------------------------------------


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    endpoint: Endpoint

    def server_bind(self) -> None:
        # HTTPServer.server_bind would resolve the host name (getfqdn); nothing here needs it.
        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name, self.server_port = str(host), int(port)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Clients hanging up mid-response are normal for probes; keep tracebacks out of the log."""


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._reply(self.server.endpoint.respond("GET", self.path, b""))

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MiB:
            self.close_connection = True
            body = b""
        else:
            body = self.rfile.read(length)
        self._reply(self.server.endpoint.respond("POST", self.path, body))

    def _reply(self, response: tuple[int, bytes]) -> None:
        status, body = response
        self.send_response(status)
        if body:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        """Probes arrive every second; the simulated server log stays about the startup."""


class Endpoint:
    """The server's HTTP face. States: loading (503 when listening), warmup (SGLang: /health 503,
    the rest served), ready.

    The socket is bound at start, so a busy port fails at once, and listens only when `open` is
    called: connecting to a bound but not listening socket is refused, like vLLM while loading.
    """

    def __init__(self, kind: ServerKind, model: str, host: str, port: int) -> None:
        self.kind = kind
        self.model = model
        self.state = "loading"
        self._httpd = _HTTPServer((host, port), _Handler, bind_and_activate=False)
        self._httpd.endpoint = self
        self._thread: threading.Thread | None = None
        try:
            self._httpd.server_bind()
        except OSError:
            self._httpd.server_close()
            raise

    @property
    def host(self) -> str:
        return str(self._httpd.server_address[0])

    @property
    def port(self) -> int:
        return int(self._httpd.server_address[1])

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def open(self, state: str) -> None:
        self.state = state
        if self._thread is None:
            self._httpd.server_activate()
            self._thread = threading.Thread(
                target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
            )
            self._thread.start()

    def close(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
        self._httpd.server_close()

    def respond(self, method: str, target: str, body: bytes) -> tuple[int, bytes]:
        """Status and JSON body for one request, given the current state."""
        path = target.split("?", 1)[0]
        health_paths = (
            ("/health", "/health_generate") if self.kind == ServerKind.SGLANG else ("/health",)
        )
        if self.state == "loading":
            return 503, LOADING_BODY
        if self.state == "warmup" and path in health_paths:
            return 503, b""
        if method == "GET" and path in health_paths:
            return 200, (b'{"status":"ok"}' if self.kind == ServerKind.LLAMACPP else b"")
        if method == "GET" and path == "/v1/models":
            return 200, self._models()
        if method == "POST" and path == "/v1/completions":
            return 200, self._completion(body)
        return 404, b'{"detail":"Not Found"}'

    def _models(self) -> bytes:
        model = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": self.kind,
        }
        return json.dumps({"object": "list", "data": [model]}).encode()

    def _completion(self, body: bytes) -> bytes:
        try:
            request = json.loads(body) if body else {}
        except ValueError:
            request = {}
        if not isinstance(request, dict):
            request = {}
        max_tokens = request.get("max_tokens")
        tokens = 16 if not isinstance(max_tokens, int) else min(max(max_tokens, 1), 256)
        prompt_tokens = max(len(str(request.get("prompt", "")).split()), 1)
        return json.dumps(
            {
                "id": f"cmpl-{uuid.uuid4().hex}",
                "object": "text_completion",
                "created": int(time.time()),
                "model": self.model,
                "choices": [
                    {
                        "index": 0,
                        "text": " ok" * tokens,
                        "logprobs": None,
                        "finish_reason": "length",
                    }
                ],
                "usage": {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": tokens,
                    "total_tokens": prompt_tokens + tokens,
                },
            }
        ).encode()


# --- the run ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Report:
    """What `--report` holds: the truth a test or drill compares the exporter's metrics against."""

    pid: int
    start_time: float
    weights_started_at: float | None
    weights_done_at: float | None
    ready_at: float | None
    load_seconds: float
    outcome: str
    cache: str
    weights_bytes: int
    cached_bytes: int
    read_bytes: int
    server: str
    model: str
    endpoint: str


class Simulation:
    """One startup: weights, then the init steps, then serving until stopped."""

    def __init__(self, settings: Settings, stopper: Stopper, out: TextIO) -> None:
        self.settings = settings
        self.stopper = stopper
        self._out = out
        self._process = psutil.Process()
        self._start_time = process_start_time(os.getpid()) or self._process.create_time()
        self._weights_started_at: float | None = None
        self._weights_done_at: float | None = None
        self._cached = 0
        self._known = True
        self._init_spent = 0.0

    def run(self) -> int:
        s = self.settings
        if s.report is not None:
            try:
                s.report.unlink(missing_ok=True)
            except OSError as exc:
                raise SimulationError(f"cannot replace report {s.report}: {exc.strerror}") from None
        shards = self._prepare_shards()
        try:
            endpoint = Endpoint(s.kind, s.model, s.host, s.port)
        except OSError as exc:
            raise SimulationError(f"cannot bind {s.host}:{s.port}: {exc.strerror}") from None
        try:
            return self._startup(endpoint, shards)
        finally:
            endpoint.close()

    def _prepare_shards(self) -> list[Shard]:
        s = self.settings
        if s.generate is not None:
            try:
                generate_shards(s.weights, s.generate, s.shard_size, lambda: self.stopper.sleep(0))
            except OSError as exc:
                raise SimulationError(f"cannot generate weights in {s.weights}: {exc}") from None
        if not s.weights.is_dir():
            raise SimulationError(
                f"weights directory {s.weights} does not exist (--generate N creates it)"
            )
        shards = find_shards(s.weights)
        if not shards:
            raise SimulationError(f"no {WEIGHTS_GLOB} files in {s.weights}")
        return shards

    def _startup(self, endpoint: Endpoint, shards: list[Shard]) -> int:
        s = self.settings
        total = sum(shard.size for shard in shards)
        ctx = LogContext(
            model=s.model,
            model_path=str(s.weights),
            pid=os.getpid(),
            url=endpoint.url,
            host=endpoint.host,
            port=endpoint.port,
            weights_bytes=total,
            shards=len(shards),
            fs_type=fs_type(s.weights),
        )
        log = LOG_WRITERS[s.kind](self._out, ctx)
        if s.port_style == "503":
            endpoint.open("loading")
        log.banner()
        self.stopper.sleep(s.startup_seconds)
        try:
            self._load_weights(log, shards, total)
            self._initialize(log, endpoint)
        except _Crash as crash:
            log.failure(crash.stage, crash.reason)
            self._write_report(endpoint, total, None, "failed")
            return 1
        endpoint.open("ready")
        ready_at = time.time()
        log.ready()
        self._write_report(endpoint, total, ready_at, "ready")
        self.stopper.sleep(math.inf if s.exit_after is None else s.exit_after)
        return 0

    def _marks(self, total: int) -> list[tuple[int, str]]:
        s = self.settings
        marks = []
        if s.stall_at is not None:
            marks.append((round(s.stall_at * total), "stall"))
        if s.crash_at is not None:
            marks.append((round(s.crash_at * total), "crash"))
        return sorted(marks, key=lambda mark: mark[0])  # stable: a stall at the crash point first

    def _pass_marks(self, marks: list[tuple[int, str]], loaded: int, total: int) -> int | None:
        """Act on the scripted marks reached at `loaded` bytes; return the next mark's byte."""
        while marks and marks[0][0] <= loaded:
            _, action = marks.pop(0)
            if action == "stall":
                self.stopper.sleep(self.settings.stall_for)
            else:
                share = 100 * loaded / total if total else 100
                raise _Crash("weights", f"simulated crash after loading {share:.0f}% of weights")
        return marks[0][0] if marks else None

    def _load_weights(self, log: ServerLog, shards: Sequence[Shard], total: int) -> None:
        s = self.settings
        throttle = Throttle(s.read_rate, s.cached_read_rate)
        marks = self._marks(total)
        view = memoryview(bytearray(CHUNK_SIZE))
        loaded = 0
        began = time.monotonic()
        self._weights_started_at = time.time()
        log.weights_begin()
        for index, shard in enumerate(shards, start=1):
            fd = os.open(shard.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
                offset = 0
                while offset < shard.size:
                    next_mark = self._pass_marks(marks, loaded, total)
                    length = min(CHUNK_SIZE, shard.size - offset)
                    if next_mark is not None:
                        length = min(length, next_mark - loaded)
                    started = time.monotonic()
                    chunk = read_chunk(fd, view[:length], offset)
                    if chunk.total == 0:
                        break  # the file shrank under us; load what is there, like a server would
                    offset += chunk.total
                    loaded += chunk.total
                    self._cached += chunk.cached
                    self._known = self._known and chunk.known
                    pause = throttle.pace(started, time.monotonic(), chunk.cold, chunk.cached)
                    self.stopper.sleep(pause)
                    log.weights_bytes(loaded, time.monotonic() - began)
            finally:
                os.close(fd)
            log.shard_done(index, time.monotonic() - began)
        self._pass_marks(marks, total, total)
        self._weights_done_at = time.time()
        log.weights_end(time.monotonic() - began)

    def _initialize(self, log: ServerLog, endpoint: Endpoint) -> None:
        s = self.settings
        scale = s.init_seconds / sum(STEP_SHARES[step] for step in log.steps)
        for step in log.steps:
            duration = STEP_SHARES[step] * scale
            if step == "warmup" and log.opens_port_for_warmup and s.port_style == "closed":
                endpoint.open("warmup")
            log.step_begin(step)
            ticks = log.ticks.get(step, 1)
            for tick in range(1, ticks + 1):
                self._init_wait(step, duration / ticks)
                log.step_tick(step, tick, ticks, duration * tick / ticks)
            log.step_end(step, duration)

    def _init_wait(self, step: str, seconds: float) -> None:
        s = self.settings
        halfway = s.init_seconds / 2
        if s.crash_during_init and self._init_spent + seconds >= halfway:
            self.stopper.sleep(halfway - self._init_spent)
            raise _Crash(step, f"simulated crash during initialization ({step})")
        self.stopper.sleep(seconds)
        self._init_spent += seconds

    def _write_report(
        self, endpoint: Endpoint, total: int, ready_at: float | None, outcome: str
    ) -> None:
        path = self.settings.report
        if path is None:
            return
        ended = time.time() if ready_at is None else ready_at
        report = Report(
            pid=os.getpid(),
            start_time=self._start_time,
            weights_started_at=self._weights_started_at,
            weights_done_at=self._weights_done_at,
            ready_at=ready_at,
            load_seconds=ended - self._start_time,
            outcome=outcome,
            cache=cache_temperature(self._cached, total, self._known),
            weights_bytes=total,
            cached_bytes=self._cached,
            read_bytes=self._process.io_counters().read_bytes,
            server=self.settings.kind,
            model=self.settings.model,
            endpoint=endpoint.url,
        )
        partial = path.with_name(f".{path.name}.partial")
        try:
            partial.write_text(json.dumps(asdict(report), indent=2) + "\n")
            os.replace(partial, path)
        except OSError as exc:
            raise SimulationError(f"cannot write report {path}: {exc.strerror}") from None


@contextmanager
def _pidfile(path: Path | None) -> Iterator[None]:
    if path is None:
        yield
        return
    pid = str(os.getpid())
    try:
        path.write_text(pid + "\n")
    except OSError as exc:
        raise SimulationError(f"cannot write pidfile {path}: {exc.strerror}") from None
    try:
        yield
    finally:
        try:
            if path.read_text().strip() == pid:
                path.unlink()
        except OSError:
            pass


@contextmanager
def _log_output(path: Path | None) -> Iterator[TextIO]:
    if path is None:
        yield sys.stderr
        return
    try:
        out = path.open("a", encoding="utf-8")
    except OSError as exc:
        raise SimulationError(f"cannot open log file {path}: {exc.strerror}") from None
    with out:
        yield out


def run(args: argparse.Namespace) -> int:
    """Run the simulated server until SIGTERM/SIGINT, a scripted exit or failure; the exit code."""
    settings = Settings.from_args(args)
    try:
        with (
            Stopper().installed() as stopper,
            _pidfile(settings.pidfile),
            _log_output(settings.log_file) as out,
        ):
            return Simulation(settings, stopper, out).run()
    except _Stopped:
        return 0
    except SimulationError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 1
