"""A stand-in model server that loads weights and starts up like SGLang, vLLM, llama.cpp or TGI.

The exporter has to be demonstrated, tested and drilled without GPUs or 500 GB checkpoints. This
process does the parts of a real startup that the exporter can observe, for real: it imports
(reads and maps libraries, no weight file touched), then loads weight files the way real loaders
do (mmap through `safetensors`, `read()` or threaded `pread`, by one process or by one child per
tensor-parallel rank), so page-cache residency, `/proc` file offsets and mappings, read counters
and disk throughput move, paced to a cold-disk or page-cache rate decided per chunk by asking the
kernel what was cached; it writes the server's own startup log lines; and it keeps its port
closed (or answering 503) until ready. `--trace` and `--report` tell the truth of it, for tests
to compare with. Stalls, crashes and timed exits can be scripted for alert drills.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socketserver
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, TextIO

import psutil

from exporter.config.values import ConfigError, parse_duration
from exporter.servers import SERVERS
from exporter.sim import ranks
from exporter.sim.events import Kind
from exporter.sim.imports import Imports, imported, imports_dir, prepare_imports
from exporter.sim.loaders import LOADERS, RankSpec, load_rank
from exporter.sim.progress import WeightsProgress
from exporter.sim.serverlog import LOG_WRITERS, STEP_SHARES, LogContext, ServerLog, fs_type
from exporter.sim.shards import (
    MIN_SHARD_SIZE,
    WEIGHTS_GLOB,
    Shard,
    cache_temperature,
    find_shards,
    generate_shards,
)
from exporter.sim.stopper import Crash, Stopped, Stopper
from exporter.sources.process import process_start_time
from exporter.units import MiB, parse_rate, parse_size
from exporter.vocabulary import ServerKind

PORT_STYLES: tuple[str, ...] = ("closed", "503")
LOADING_BODY = json.dumps(
    {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
).encode()


DEFAULT_IMPORT_BYTES = 8 * MiB


class SimulationError(Exception):
    """A setup problem (weights, port, files) to report as one line; the exit code is 1."""


# --- flags ------------------------------------------------------------------------------------


def _bytes_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size_arg(text: str) -> int:
    size = _bytes_arg(text)
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
    add(
        "--import-bytes",
        type=_bytes_arg,
        default=DEFAULT_IMPORT_BYTES,
        metavar="SIZE",
        help=f"read() during start-up, from {imports_dir(Path('DIR'))}/ (8MiB)",
    )
    add("--loader", choices=tuple(LOADERS), default="mmap", help="how weights are read (mmap)")
    add(
        "--direct",
        action="store_true",
        help="the read and pread loaders open shards with O_DIRECT: reads bypass the page cache",
    )
    add("--tensor-parallel", type=_count_arg, default=1, metavar="N", help="N rank processes")
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
    add("--trace", type=Path, metavar="PATH", help="JSON lines: what every rank consumed, when")
    add("--stall-at", type=_fraction_arg, metavar="FRACTION", help="pause the weight load here")
    add("--stall-for", type=_duration_arg, default=30.0, metavar="DURATION", help="default 30s")
    add("--crash-at", type=_fraction_arg, metavar="FRACTION", help="exit 1 at this weight share")
    add("--crash-during-init", action="store_true", help="exit 1 halfway through initializing")
    add("--exit-after", type=_duration_arg, metavar="DURATION", help="exit 0 this long after ready")
    add("--model", help="served model name (default: the weights directory name)")
    add(
        "--follower",
        action="store_true",
        help="a node of a model over several hosts that serves nothing (sglang, vllm): no port, "
        "its log ends with a follower's last start-up line",
    )


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
    import_bytes: int
    loader: str
    direct: bool
    tensor_parallel: int
    init_seconds: float
    port_style: str
    kind: ServerKind
    log_file: Path | None
    pidfile: Path | None
    report: Path | None
    trace: Path | None
    stall_at: float | None
    stall_for: float
    crash_at: float | None
    crash_during_init: bool
    exit_after: float | None
    model: str
    follower: bool

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Settings:
        kind = ServerKind(args.log_format)
        weights = Path(args.weights).absolute()
        return cls(
            host=args.host,
            port=SERVERS[kind].default_port if args.port is None else args.port,
            weights=weights,
            generate=args.generate,
            shard_size=args.shard_size,
            read_rate=args.read_rate,
            cached_read_rate=args.cached_read_rate,
            startup_seconds=args.startup_seconds,
            import_bytes=args.import_bytes,
            loader=args.loader,
            direct=args.direct,
            tensor_parallel=args.tensor_parallel,
            init_seconds=args.init_seconds,
            # llama.cpp answers 503 while loading; the others keep the port closed.
            port_style=args.port_style or ("503" if kind == ServerKind.LLAMACPP else "closed"),
            kind=kind,
            log_file=args.log_file,
            pidfile=args.pidfile,
            report=args.report,
            trace=args.trace,
            stall_at=args.stall_at,
            stall_for=args.stall_for,
            crash_at=args.crash_at,
            crash_during_init=args.crash_during_init,
            exit_after=args.exit_after,
            model=args.model or weights.name,
            follower=args.follower,
        )


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


# SGLang's paths that say 503 until its own warm-up request has been answered (they read
# tokenizer_manager.server_status), while its generation paths already serve.
_SGLANG_STATUS_PATHS = ("/health", "/health_generate", "/ready", "/ping")


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
        health_paths = _SGLANG_STATUS_PATHS if self.kind == ServerKind.SGLANG else ("/health",)
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
    """One startup: imports, weights, then the init steps, then serving until stopped."""

    def __init__(self, settings: Settings, stopper: Stopper, out: TextIO) -> None:
        self.settings = settings
        self.stopper = stopper
        self._out = out
        self._process = psutil.Process()
        self._start_time = process_start_time(os.getpid()) or self._process.create_time()
        self._progress: WeightsProgress | None = None
        self._ranks: ranks.RankGroup | None = None  # with tensor parallelism
        self._init_spent = 0.0

    def run(self) -> int:
        s = self.settings
        for path, what in ((s.report, "report"), (s.trace, "trace")):
            if path is not None:
                try:
                    path.unlink(missing_ok=True)
                except OSError as exc:
                    raise SimulationError(f"cannot replace {what} {path}: {exc.strerror}") from None
        shards = self._prepare_shards()
        imports = self._prepare_imports()
        if s.follower:  # it binds no port: nothing listens, as on a headless vLLM node
            return self._startup(None, shards, imports)
        try:
            endpoint = Endpoint(s.kind, s.model, s.host, s.port)
        except OSError as exc:
            raise SimulationError(f"cannot bind {s.host}:{s.port}: {exc.strerror}") from None
        try:
            return self._startup(endpoint, shards, imports)
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

    def _prepare_imports(self) -> Imports:
        directory = imports_dir(self.settings.weights)
        try:
            return prepare_imports(
                directory, self.settings.import_bytes, lambda: self.stopper.sleep(0)
            )
        except OSError as exc:
            raise SimulationError(
                f"cannot generate imports in {directory}: {exc} (--import-bytes 0 skips them)"
            ) from None

    def _startup(self, endpoint: Endpoint | None, shards: list[Shard], imports: Imports) -> int:
        """`endpoint` None: a follower node's start, which serves nothing."""
        s = self.settings
        total = sum(shard.size for shard in shards)
        url = endpoint.url if endpoint is not None else f"http://{s.host}:{s.port}"
        ctx = LogContext(
            model=s.model,
            model_path=str(s.weights),
            pid=os.getpid(),
            url=url,
            host=s.host if endpoint is None else endpoint.host,
            port=s.port if endpoint is None else endpoint.port,
            weights_bytes=total,
            shards=len(shards),
            fs_type=fs_type(s.weights),
            tensor_parallel=s.tensor_parallel,
        )
        log = LOG_WRITERS[s.kind](self._out, ctx)
        if s.port_style == "503" and endpoint is not None:
            endpoint.open("loading")
        log.banner()
        specs = [self._rank_spec(rank, shards) for rank in range(s.tensor_parallel)]
        self._progress = WeightsProgress(log, len(shards), len(specs))
        ready_at: float | None = None
        try:
            with imported(imports, s.startup_seconds, self.stopper), self._tensor_parallel(specs):
                self._load_weights(specs)
                self._initialize(log, endpoint)
                if endpoint is not None:
                    endpoint.open("ready")
                ready_at = time.time()
                if endpoint is not None:
                    log.ready()
                else:
                    log.node_up()
                self._write_report(url, total, ready_at, "ready")
                self._wait(math.inf if s.exit_after is None else s.exit_after, "serve")
        except Crash as crash:
            log.failure(crash.stage, crash.reason)
            if ready_at is None:
                self._write_report(url, total, None, "failed")
            return 1
        return 0

    def _rank_spec(self, rank: int, shards: Sequence[Shard]) -> RankSpec:
        s = self.settings
        return RankSpec(
            rank=rank,
            world=s.tensor_parallel,
            loader=s.loader,
            shards=tuple(shards),
            read_rate=s.read_rate,
            cached_read_rate=s.cached_read_rate,
            stall_at=s.stall_at,
            stall_for=s.stall_for,
            crash_at=s.crash_at,
            trace=s.trace,
            parent=os.getpid(),
            direct=s.direct,
        )

    @contextmanager
    def _tensor_parallel(self, specs: Sequence[RankSpec]) -> Iterator[None]:
        """With more than one rank, each is a child process (started after the imports, as
        vLLM's workers are); a single rank is the server process itself."""
        if len(specs) == 1:
            yield
            return
        with ranks.started(specs, self.stopper) as group:
            self._ranks = group
            try:
                yield
            finally:
                self._ranks = None

    def _load_weights(self, specs: Sequence[RankSpec]) -> None:
        progress = self._progress
        assert progress is not None
        if self._ranks is None:
            load_rank(specs[0], progress.handle, self.stopper)
            return
        while progress.done_at is None:
            self._hear(self.stopper.wait(math.inf, self._ranks.fds), "weights")

    def _hear(self, fds: Sequence[int], stage: str) -> None:
        """Take what the ranks behind `fds` said; a rank's crash is the server's, in `stage`."""
        assert self._ranks is not None and self._progress is not None
        for event in self._ranks.read(fds):
            if event.kind is Kind.CRASH:
                raise Crash(stage, event.reason)
            self._progress.handle(event)

    def _wait(self, seconds: float, stage: str) -> None:
        """Sleep `seconds`, hearing the ranks meanwhile (one dying ends the wait in a crash)."""
        deadline = time.monotonic() + seconds
        fds = self._ranks.fds if self._ranks is not None else []
        while readable := self.stopper.wait(max(0.0, deadline - time.monotonic()), fds):
            self._hear(readable, stage)
            fds = self._ranks.fds if self._ranks is not None else []

    def _initialize(self, log: ServerLog, endpoint: Endpoint | None) -> None:
        s = self.settings
        steps = [step for step in log.steps if endpoint is not None or step not in log.head_steps]
        scale = s.init_seconds / sum(STEP_SHARES[step] for step in steps)
        for step in steps:
            duration = STEP_SHARES[step] * scale
            if step == "warmup" and log.opens_port_for_warmup and s.port_style == "closed":
                assert endpoint is not None  # a follower runs no warm-up of its own
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
            self._wait(halfway - self._init_spent, step)
            raise Crash(step, f"simulated crash during initialization ({step})")
        self._wait(seconds, step)
        self._init_spent += seconds

    def _tree_read_bytes(self) -> int:
        """Storage bytes read by the server and its ranks (reaped ones count in the server's)."""
        total = 0
        for process in (self._process, *self._process.children(recursive=True)):
            try:
                total += process.io_counters().read_bytes
            except psutil.NoSuchProcess:
                continue
        return total

    def _write_report(self, url: str, total: int, ready_at: float | None, outcome: str) -> None:
        path = self.settings.report
        if path is None:
            return
        progress = self._progress
        assert progress is not None
        ended = time.time() if ready_at is None else ready_at
        report = Report(
            pid=os.getpid(),
            start_time=self._start_time,
            weights_started_at=progress.started_at,
            weights_done_at=progress.done_at,
            ready_at=ready_at,
            load_seconds=ended - self._start_time,
            outcome=outcome,
            cache=cache_temperature(progress.cached, total, progress.known),
            weights_bytes=total,
            cached_bytes=progress.cached,
            read_bytes=self._tree_read_bytes(),
            server=self.settings.kind,
            model=self.settings.model,
            endpoint=url,
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
    if args.direct and args.loader == "mmap":
        print("simulate: error: --direct needs --loader read or pread (a mapping is cached)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.follower and not LOG_WRITERS[ServerKind(args.log_format)].has_followers:
        print(f"simulate: error: --follower: {args.log_format} runs no follower nodes "
              "(sglang and vllm do)", file=sys.stderr)  # fmt: skip
        return 2
    settings = Settings.from_args(args)
    try:
        with (
            Stopper().installed() as stopper,
            _pidfile(settings.pidfile),
            _log_output(settings.log_file) as out,
        ):
            return Simulation(settings, stopper, out).run()
    except Stopped:
        return 0
    except SimulationError as exc:
        print(f"simulate: {exc}", file=sys.stderr)
        return 1
