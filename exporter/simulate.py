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
import errno
import json
import math
import os
import select
import signal
import socketserver
import struct
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType
from typing import Any, ClassVar, NoReturn, TextIO

import psutil

from exporter.config import ConfigError, parse_duration
from exporter.sources.pagecache import cachestat
from exporter.sources.process import process_start_time
from exporter.units import parse_rate, parse_size

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

MiB = 1 << 20
GiB = 1 << 30
CHUNK_SIZE = 4 * MiB
MIN_SHARD_SIZE = 4096
SERVER_KINDS: tuple[str, ...] = ("sglang", "vllm", "llamacpp", "tgi")
PORT_STYLES: tuple[str, ...] = ("closed", "503")
DEFAULT_PORTS: dict[str, int] = {"sglang": 30000, "vllm": 8000, "llamacpp": 8080, "tgi": 3000}
WEIGHTS_GLOB = "*.safetensors"
# How `--init-seconds` is shared between the fine steps a format goes through.
STEP_SHARES: dict[str, float] = {
    "kv_cache": 0.1,
    "compile": 0.35,
    "cuda_graph": 0.4,
    "warmup": 0.15,
}
LOADING_BODY = json.dumps(
    {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}
).encode()
# The GPU is imaginary; its numbers only need to be plausible for an 80 GB card.
GPU_AVAILABLE_GB = 79.11


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
    add("--log-format", choices=SERVER_KINDS, default="sglang", help="whose startup log to write")
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
    kind: str
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
        kind: str = args.log_format
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
            port_style=args.port_style or ("503" if kind == "llamacpp" else "closed"),
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


# --- weight files -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Shard:
    path: Path
    size: int


def find_shards(directory: Path) -> list[Shard]:
    """The weight files a server would load from `directory`, in load order."""
    paths = sorted(p for p in directory.glob(WEIGHTS_GLOB) if p.is_file())
    return [Shard(p, p.stat().st_size) for p in paths]


def _safetensors_header(file_size: int) -> bytes:
    """Length prefix and JSON header of a valid safetensors file of exactly `file_size` bytes.

    One U8 tensor fills the rest of the file, so tools that inspect the checkpoint accept it.
    """
    header_len = 0
    while True:
        data_len = file_size - 8 - header_len
        tensor = {"dtype": "U8", "shape": [data_len], "data_offsets": [0, data_len]}
        text = json.dumps({"__metadata__": {"format": "pt"}, "weight": tensor}).encode()
        padded = -(-len(text) // 8) * 8
        if padded <= header_len:
            return struct.pack("<Q", header_len) + text.ljust(header_len, b" ")
        header_len = padded


def generate_shards(
    directory: Path, count: int, size: int, check: Callable[[], None] = lambda: None
) -> None:
    """Create the `count` shards of `size` random bytes that are missing (or of another size).

    Random data, so compression or deduplication below the page cache cannot make reads cheaper
    than a real checkpoint's. Written under a temporary name and renamed, so an interrupted run
    never leaves a short shard that looks complete. `check` is called between blocks to abort.
    """
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(1, count + 1):
        path = directory / f"model-{index:05d}-of-{count:05d}.safetensors"
        if path.is_file() and path.stat().st_size == size:
            continue
        partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
        try:
            with partial.open("wb") as out:
                header = _safetensors_header(size)
                out.write(header)
                remaining = size - len(header)
                while remaining > 0:
                    check()
                    block = os.urandom(min(CHUNK_SIZE, remaining))
                    out.write(block)
                    remaining -= len(block)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)


@dataclass(frozen=True)
class ChunkRead:
    """One chunk of a weight file: how many bytes came from page cache and how many from storage."""

    cached: int
    cold: int
    known: bool  # False where the file system cannot say (no RWF_NOWAIT support, e.g. tmpfs)

    @property
    def total(self) -> int:
        return self.cached + self.cold


def _pread_fully(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            break
        done += count
    return done


def read_chunk(fd: int, view: memoryview, offset: int) -> ChunkRead:
    """Read `len(view)` bytes at `offset`, asking the kernel first how many of them were cached.

    `cachestat` over the chunk's range counts its cached pages exactly. Where it is refused
    (old kernel, seccomp, a file we may not write), `RWF_NOWAIT` stands in: it returns the leading
    bytes already in page cache, but also stops early at pages marked for readahead, so it can
    call cached data cold. Open the file with `POSIX_FADV_RANDOM` so kernel readahead does not
    pull the next chunk in behind our back and make cold data look cached.
    """
    try:
        pages = cachestat(fd, offset, len(view)).nr_cache
    except OSError:
        return _read_chunk_nowait(fd, view, offset)
    done = _pread_fully(fd, view, offset)
    cached = min(done, pages * PAGE_SIZE)
    return ChunkRead(cached=cached, cold=done - cached, known=True)


def _read_chunk_nowait(fd: int, view: memoryview, offset: int) -> ChunkRead:
    try:
        cached = os.preadv(fd, [view], offset, os.RWF_NOWAIT)
    except BlockingIOError:
        cached = 0
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            raise
        return ChunkRead(cached=0, cold=_pread_fully(fd, view, offset), known=False)
    if cached == len(view):
        return ChunkRead(cached=cached, cold=0, known=True)
    # A short read ends at the first page not in cache (or at end of file: then this reads 0).
    cold = _pread_fully(fd, view[cached:], offset + cached)
    return ChunkRead(cached=cached, cold=cold, known=True)


class Throttle:
    """Paces reads to a cold-disk rate and a page-cache rate by sleeping to a schedule.

    Each chunk costs bytes/rate of wall time, counted from when its read began; reads slower than
    the schedule are not made up later (no bursts after a stall or a slow disk).
    """

    def __init__(self, cold_rate: float, cached_rate: float | None) -> None:
        self._cold_rate = cold_rate
        self._cached_rate = cached_rate
        self._due = -math.inf

    def pace(self, started: float, now: float, cold: int, cached: int) -> float:
        """Seconds to sleep after a chunk read that began at `started` and ended at `now`."""
        cost = cold / self._cold_rate
        if self._cached_rate is not None:
            cost += cached / self._cached_rate
        self._due = max(self._due, started) + cost
        return max(0.0, self._due - now)


def cache_temperature(cached: int, total: int, known: bool) -> str:
    """The DESIGN.md rule: warm >= 90 % served from page cache, cold <= 10 %, mixed otherwise."""
    if not known:
        return "unknown"
    share = cached / total if total else 1.0
    return "warm" if share >= 0.9 else "cold" if share <= 0.1 else "mixed"


# --- log formats ------------------------------------------------------------------------------


@dataclass(frozen=True)
class LogContext:
    model: str
    model_path: str
    pid: int
    url: str
    host: str
    port: int
    weights_bytes: int
    shards: int
    fs_type: str


def _interval(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def tqdm_meter(desc: str, done: int, total: int, elapsed: float, *, bar: bool = False) -> str:
    """A tqdm status line as the servers print it (SGLang and vLLM use the `Completed |` form)."""
    percent = 100.0 * done / total if total else 100.0
    rate = done / elapsed if done and elapsed > 0 else None
    if rate is None:
        remaining, rate_text = "?", "?it/s"
    else:
        remaining = _interval((total - done) / rate)
        rate_text = f"{1 / rate:5.2f}s/it" if rate < 1 else f"{rate:5.2f}it/s"
    if bar:
        filled = int(10 * done / total) if total else 10
        middle = f"{percent:3.0f}%|{'█' * filled}{' ' * (10 - filled)}|"
    else:
        middle = f"{percent:3.0f}% Completed |"
    return f"{desc}: {middle} {done}/{total} [{_interval(elapsed)}<{remaining}, {rate_text}]"


class ServerLog:
    """Writes one server's startup log; subclasses supply the wording of each event.

    Lines that tqdm would redraw in place are written with a leading `\\r` and no newline, as the
    real progress bars are; the next regular line first ends such an open line.
    """

    kind: ClassVar[str] = ""
    steps: ClassVar[tuple[str, ...]] = ()
    ticks: ClassVar[dict[str, int]] = {}
    # SGLang opens its port before its warmup request; /health answers 503 until that succeeds.
    opens_port_for_warmup: ClassVar[bool] = False

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        self._out = out
        self.ctx = ctx
        self._clock = clock
        self._open_line = False
        self.timings: dict[str, float] = {}

    @property
    def weights_gb(self) -> float:
        return self.ctx.weights_bytes / GiB

    @property
    def avail_after_weights(self) -> float:
        return max(GPU_AVAILABLE_GB - self.weights_gb, 1.0)

    def prefix(self, **fields: str) -> str:
        return ""

    def line(self, message: str, **fields: str) -> None:
        text = self.prefix(**fields) + message + "\n"
        self._write(("\n" if self._open_line else "") + text)
        self._open_line = False

    def raw(self, text: str) -> None:
        """Unprefixed output (tqdm bars, tracebacks); an unterminated one stays open."""
        self._write(text)
        self._open_line = not text.endswith("\n")

    def _write(self, text: str) -> None:
        self._out.write(text)
        self._out.flush()

    def banner(self) -> None:
        """Lines before the weights begin to move."""

    def weights_begin(self) -> None:
        """The weight load starts."""

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        """Called after every chunk."""

    def shard_done(self, done: int, elapsed: float) -> None:
        """Called after every weight file."""

    def weights_end(self, seconds: float) -> None:
        """All weights are in."""

    def step_begin(self, step: str) -> None:
        """A fine step of initialization starts (kv_cache, compile, cuda_graph, warmup)."""

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        """Progress within a step, `ticks[step]` times."""

    def step_end(self, step: str, seconds: float) -> None:
        """A fine step ended after `seconds`."""

    def ready(self) -> None:
        """The endpoint is ready."""

    def failure(self, stage: str, reason: str) -> None:
        """The scripted crash in `stage` (weights or an init step); the process exits 1 next."""


class SGLangLog(ServerLog):
    kind = "sglang"
    steps = ("kv_cache", "compile", "cuda_graph", "warmup")
    ticks: ClassVar[dict[str, int]] = {"compile": 4, "cuda_graph": 9}
    opens_port_for_warmup = True
    _BATCH_SIZES = (256, 128, 64, 32, 16, 8, 4, 2, 1)
    _COMPILE_TOKENS = (8192, 4096, 2048, 1024)

    def prefix(self, **fields: str) -> str:
        return time.strftime("[%Y-%m-%d %H:%M:%S] ", time.localtime(self._clock()))

    def _kv_tokens(self) -> int:
        return int(self.avail_after_weights * 0.85 * 8192)

    def banner(self) -> None:
        c = self.ctx
        self.line(
            f"server_args=ServerArgs(model_path='{c.model_path}', tokenizer_path='{c.model_path}', "
            f"host='{c.host}', port={c.port}, served_model_name='{c.model}', tp_size=1, "
            "dtype='auto', mem_fraction_static=0.85, random_seed=0)"
        )
        self.line("Init torch distributed begin.")
        self.line("Init torch distributed ends. mem usage=0.00 GB")

    def weights_begin(self) -> None:
        self.line(f"Load weight begin. avail mem={GPU_AVAILABLE_GB:.2f} GB")
        self.raw("\r" + tqdm_meter("Loading safetensors checkpoint shards", 0, self.ctx.shards, 0))

    def shard_done(self, done: int, elapsed: float) -> None:
        meter = tqdm_meter("Loading safetensors checkpoint shards", done, self.ctx.shards, elapsed)
        self.raw("\r" + meter + ("\n" if done == self.ctx.shards else ""))

    def weights_end(self, seconds: float) -> None:
        self.timings["load_weight"] = seconds
        self.line(
            f"Load weight end. elapsed={seconds:.2f} s, type=LlamaForCausalLM, "
            f"dtype=torch.bfloat16, avail mem={self.avail_after_weights:.2f} GB, "
            f"mem usage={self.weights_gb:.2f} GB."
        )

    def step_begin(self, step: str) -> None:
        avail = self.avail_after_weights
        if step == "kv_cache":
            size = avail * 0.85 / 2
            self.line(
                f"KV Cache is allocated. dtype: torch.bfloat16, #tokens: {self._kv_tokens()}, "
                f"K size: {size:.2f} GB, V size: {size:.2f} GB"
            )
        elif step == "compile":
            self.line("Entering DeepGEMM JIT Pre-Compile session. It may take a long time.")
        elif step == "cuda_graph":
            self.line(
                "Capture normal decode CUDA graph begin. This can take up to several minutes. "
                f"avail mem={avail * 0.15:.2f} GB"
            )
            self.raw("\r" + self._capture_meter(0, 0.0))
        elif step == "warmup":
            graphs = f"decode={self.timings.get('cuda_graph', 0):.2f}"
            self.line(
                f"Engine startup timings (s): load_weight={self.timings.get('load_weight', 0):.2f}"
                f", kv_cache_allocation={self.timings.get('kv_cache', 0):.2f}, "
                f"deep_gemm_compile={self.timings.get('compile', 0):.2f}, cuda_graph={{{graphs}}}"
            )
            self.line(
                f"max_total_num_tokens={self._kv_tokens()}, chunked_prefill_size=8192, "
                "max_prefill_tokens=16384, max_running_requests=4096, context_len=131072, "
                f"available_gpu_mem={avail * 0.14:.2f} GB"
            )
            self.line(f"INFO:     Started server process [{self.ctx.pid}]")
            self.line("INFO:     Waiting for application startup.")
            self.line("INFO:     Application startup complete.")
            self.line(f"INFO:     Uvicorn running on {self.ctx.url} (Press CTRL+C to quit)")

    def _capture_meter(self, done: int, elapsed: float) -> str:
        index = min(done, len(self._BATCH_SIZES) - 1)
        desc = f"Capturing batches (bs={self._BATCH_SIZES[index]} avail_mem="
        desc += f"{self.avail_after_weights * 0.15:.2f} GB)"
        return tqdm_meter(desc, done, len(self._BATCH_SIZES), elapsed, bar=True)

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        if step == "compile":
            self.line(f"Compiling num tokens (num_tokens={self._COMPILE_TOKENS[done - 1]})")
        elif step == "cuda_graph":
            end = "\n" if done == count else ""
            self.raw("\r" + self._capture_meter(done, elapsed) + end)

    def step_end(self, step: str, seconds: float) -> None:
        self.timings[step] = seconds
        if step == "kv_cache":
            self.line(f"Memory pool end. avail mem={self.avail_after_weights * 0.15:.2f} GB")
        elif step == "cuda_graph":
            self.line(
                f"Capture normal decode CUDA graph end. elapsed={seconds:.2f} s, "
                f"mem usage=0.52 GB, avail mem={self.avail_after_weights * 0.14:.2f} GB."
            )
        elif step == "warmup":
            self.line('INFO:     127.0.0.1:50412 - "GET /get_model_info HTTP/1.1" 200 OK')
            self.line(
                "Prefill batch, #new-seq: 1, #new-token: 7, #cached-token: 0, token usage: 0.00, "
                "#running-req: 0, #queue-req: 0, "
            )
            self.line('INFO:     127.0.0.1:50414 - "POST /generate HTTP/1.1" 200 OK')

    def ready(self) -> None:
        self.line("The server is fired up and ready to roll!")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "warmup":
            self.line(f"Initialization failed. warmup error: RuntimeError: {reason}")
            return
        self.line("Scheduler hit an exception: Traceback (most recent call last):")
        self.raw(
            '  File "/sgl-workspace/sglang/python/sglang/srt/managers/scheduler.py", '
            "line 2981, in run_scheduler_process\n"
            f"RuntimeError: {reason}\n"
        )
        self.line("Rank 0 scheduler died during initialization (exit code: 1)")


class VLLMLog(ServerLog):
    kind = "vllm"
    steps = ("compile", "kv_cache", "cuda_graph", "warmup")
    ticks: ClassVar[dict[str, int]] = {"compile": 2, "cuda_graph": 4}
    _VERSION = "0.33.0"
    _GRAPH_BATCHES = 67

    def prefix(self, **fields: str) -> str:
        proc = fields.get("proc", "EngineCore")
        head = f"({proc} pid={self.ctx.pid}) "
        if "source" not in fields:
            return head
        stamp = time.strftime("%m-%d %H:%M:%S", time.localtime(self._clock()))
        return f"{head}{fields.get('level', 'INFO')} {stamp} [{fields['source']}] "

    def _api(self, message: str, source: str) -> None:
        self.line(message, proc="APIServer", source=source)

    def banner(self) -> None:
        c = self.ctx
        self._api(
            f"vLLM server version {self._VERSION}, serving model {c.model_path}",
            "api_server.py:1932",
        )
        self._api(
            f"non-default args: {{'model': '{c.model_path}', 'host': '{c.host}', "
            f"'port': {c.port}, 'served_model_name': ['{c.model}']}}",
            "utils.py:328",
        )
        self.line(
            f"Initializing a V1 LLM engine (v{self._VERSION}) with config: model='{c.model_path}', "
            f"tokenizer='{c.model_path}', dtype=torch.bfloat16, max_seq_len=32768, "
            f"served_model_name={c.model}",
            source="core.py:77",
        )

    def weights_begin(self) -> None:
        c = self.ctx
        self.line("Loading model from scratch...", source="gpu_model_runner.py:2626")
        available = psutil.virtual_memory().available / GiB
        self.line(
            f"Filesystem type for checkpoints: {c.fs_type}. Checkpoint size: "
            f"{self.weights_gb:.2f} GiB. Available RAM: {available:.2f} GiB.",
            source="default_loader.py:268",
        )
        self.line(tqdm_meter("Loading safetensors checkpoint shards", 0, c.shards, 0))

    def shard_done(self, done: int, elapsed: float) -> None:
        self.line(
            tqdm_meter("Loading safetensors checkpoint shards", done, self.ctx.shards, elapsed)
        )

    def weights_end(self, seconds: float) -> None:
        self.line(f"Loading weights took {seconds:.2f} seconds", source="default_loader.py:312")
        self.line(
            f"Model loading took {self.weights_gb:.4f} GiB memory and {seconds + 0.21:.6f} seconds",
            source="gpu_model_runner.py:2658",
        )

    def step_begin(self, step: str) -> None:
        if step == "compile":
            self.line("Starting torch.compile of the model backbone", source="backends.py:548")
        elif step == "kv_cache":
            kv = self.avail_after_weights * 0.85
            self.line(f"Available KV cache memory: {kv:.2f} GiB", source="gpu_worker.py:298")
        elif step == "cuda_graph":
            self.line(self._capture_meter(0, 0.0))

    def _capture_meter(self, done: int, elapsed: float) -> str:
        desc = "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)"
        return tqdm_meter(desc, done, self._GRAPH_BATCHES, elapsed, bar=True)

    def step_tick(self, step: str, done: int, count: int, elapsed: float) -> None:
        if step == "compile" and done == 1:
            self.line(f"Dynamo bytecode transform time: {elapsed:.2f} s", source="backends.py:559")
        elif step == "compile":
            self.line(
                f"Compiling a graph for dynamic shape takes {elapsed / 2:.2f} s",
                source="backends.py:218",
            )
        elif step == "cuda_graph":
            self.line(self._capture_meter(self._GRAPH_BATCHES * done // count, elapsed))

    def step_end(self, step: str, seconds: float) -> None:
        self.timings[step] = seconds
        if step == "compile":
            self.line(f"torch.compile took {seconds:.2f} s in total", source="monitor.py:34")
        elif step == "kv_cache":
            tokens = int(self.avail_after_weights * 0.85 * 8192)
            self.line(f"GPU KV cache size: {tokens:,} tokens", source="kv_cache_utils.py:1087")
            self.line(
                f"Maximum concurrency for 32,768 tokens per request: {tokens / 32768:.2f}x",
                source="kv_cache_utils.py:1091",
            )
        elif step == "cuda_graph":
            self.line(
                f"Graph capturing finished in {round(seconds)} secs, took 0.52 GiB",
                source="gpu_model_runner.py:3480",
            )
        elif step == "warmup":
            total = sum(self.timings.values())
            self.line(
                f"init engine (profile, create kv cache, warmup model) took {total:.2f} seconds",
                source="core.py:210",
            )

    def ready(self) -> None:
        self._api(f"Starting vLLM server on {self.ctx.url}", "api_server.py:1971")
        self.line(f"INFO:     Started server process [{self.ctx.pid}]", proc="APIServer")
        self.line("INFO:     Waiting for application startup.", proc="APIServer")
        self.line("INFO:     Application startup complete.", proc="APIServer")

    def failure(self, stage: str, reason: str) -> None:
        for message in (
            "EngineCore failed to start.",
            "Traceback (most recent call last):",
            f"RuntimeError: {reason}",
        ):
            self.line(message, level="ERROR", source="core.py:708")
        self.line(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            "Failed core proc(s): {}",
            proc="APIServer",
        )


class LlamaCppLog(ServerLog):
    kind = "llamacpp"
    steps = ("kv_cache", "warmup")

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        super().__init__(out, ctx, clock)
        self._dots = 0

    def banner(self) -> None:
        c = self.ctx
        self.line("build: 6000 (0a1b2c3d) with cc (Debian 12.2.0-14) 12.2.0 for x86_64-linux-gnu")
        self.line("system info: n_threads = 16, n_threads_batch = 16, total_threads = 16")
        self.line("main: binding port with default address family")
        self.line(
            f"main: HTTP server is listening, hostname: {c.host}, port: {c.port}, http threads: 15"
        )
        self.line("main: loading model")
        self.line(f"srv    load_model: loading model '{c.model_path}'")

    def weights_begin(self) -> None:
        c = self.ctx
        self.line(
            "llama_model_loader: loaded meta data with 33 key-value pairs and 292 tensors from "
            f"{c.model_path} (version GGUF V3 (latest))"
        )
        self.line(f"print_info: file size   = {self.weights_gb:.2f} GiB (4.89 BPW)")
        self.line("load_tensors: loading model tensors, this can take a while... (mmap = true)")
        mib = c.weights_bytes / MiB
        self.line(f"load_tensors:        CUDA0 model buffer size = {mib:8.2f} MiB")

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        total = self.ctx.weights_bytes
        dots = 100 * loaded // total if total else 100
        if dots > self._dots:
            self.raw("." * (dots - self._dots) + ("\n" if dots == 100 else ""))
            self._dots = dots

    def step_begin(self, step: str) -> None:
        if step == "kv_cache":
            self.line("llama_context: constructing llama_context")
            self.line("llama_context: n_ctx         = 4096")
            self.line("llama_kv_cache:      CUDA0 KV buffer size =   512.00 MiB")
            self.line(
                "llama_kv_cache: size =  512.00 MiB (  4096 cells,  32 layers,  1/1 seqs), "
                "K (f16):  256.00 MiB, V (f16):  256.00 MiB"
            )
        elif step == "warmup":
            self.line(
                "common_init_from_params: warming up the model with an empty run - please wait "
                "... (--no-warmup to disable)"
            )

    def step_end(self, step: str, seconds: float) -> None:
        if step == "kv_cache":
            self.line("llama_context:      CUDA0 compute buffer size =   296.00 MiB")
            self.line("llama_context: graph nodes  = 1126")
        elif step == "warmup":
            self.line("srv          init: initializing slots, n_slots = 4")
            self.line("slot         init: id  0 | task -1 | new slot, n_ctx = 4096")

    def ready(self) -> None:
        self.line("srv          main: model loaded")
        self.line(f"main: server is listening on {self.ctx.url} - starting the main loop")
        self.line("srv  update_slots: all slots are idle")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "weights":
            self.line(f"llama_model_load: error loading model: {reason}")
            self.line("llama_model_load_from_file_impl: failed to load model")
        else:
            self.line(f"llama_init_from_model: failed to initialize the context: {reason}")
        self.line(f"srv    load_model: failed to load model, '{self.ctx.model_path}'")
        self.line("srv    operator(): operator(): cleaning up before exit...")
        self.line("main: exiting due to model loading error")


class TGILog(ServerLog):
    kind = "tgi"
    steps = ("warmup", "kv_cache", "cuda_graph")
    _WAIT_EVERY = 10.0
    _SHARD = "shard-manager: text_generation_launcher"
    _ROUTER = "text_generation_router_v3: backends/v3/src/lib.rs"

    def __init__(self, out: TextIO, ctx: LogContext, clock: Callable[[], float] = time.time):
        super().__init__(out, ctx, clock)
        self._waits = 0

    def prefix(self, **fields: str) -> str:
        now = self._clock()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now))
        micros = int((now % 1) * 1e6)
        level = fields.get("level", "INFO")
        return (
            f"{stamp}.{micros:06d}Z {level:>5} {fields.get('target', 'text_generation_launcher')}: "
        )

    def banner(self) -> None:
        c = self.ctx
        self.line(
            f'Args {{ model_id: "{c.model_path}", revision: None, sharded: None, num_shard: None, '
            f'hostname: "{c.host}", port: {c.port}, served_model_name: "{c.model}" }}'
        )
        download = "download: text_generation_launcher"
        self.line(f"Starting check and download process for {c.model_path}", target=download)
        self.line("Files are already present on the host. Skipping download.", target=download)
        self.line(f"Successfully downloaded weights for {c.model_path}", target=download)

    def weights_begin(self) -> None:
        self.line("Starting shard rank=0", target=self._SHARD)

    def weights_bytes(self, loaded: int, elapsed: float) -> None:
        while elapsed >= (self._waits + 1) * self._WAIT_EVERY:
            self._waits += 1
            self.line("Waiting for shard to be ready... rank=0", target=self._SHARD)

    def weights_end(self, seconds: float) -> None:
        self.line(
            "Server started at unix:///tmp/text-generation-server-0 rank=0", target=self._SHARD
        )
        self.line(f"Shard ready in {seconds:.1f}s rank=0", target=self._SHARD)
        self.line("Starting Webserver")

    def step_begin(self, step: str) -> None:
        if step == "warmup":
            self.line("125: Warming up model", target=self._ROUTER)
        elif step == "kv_cache":
            blocks = int(self.avail_after_weights * 0.85 * 8192 / 16)
            self.line(f"KV-cache blocks: {blocks}, size: 16")
        elif step == "cuda_graph":
            self.line("Cuda Graphs are enabled for sizes [32, 16, 8, 4, 2, 1]")

    def step_end(self, step: str, seconds: float) -> None:
        if step == "cuda_graph":
            tokens = int(self.avail_after_weights * 0.85 * 8192)
            self.line(f"137: Setting max batch total tokens to {tokens}", target=self._ROUTER)

    def ready(self) -> None:
        self.line("router/src/server.rs:2400: Connected", target="text_generation_router::server")

    def failure(self, stage: str, reason: str) -> None:
        if stage == "weights":
            self.line("Shard complete standard error output:\n", level="ERROR", target=self._SHARD)
            self.raw(f"RuntimeError: {reason}\n")
            self.line("Shard 0 failed to start", level="ERROR")
            self.line("Shutting down shards")
            self.raw("Error: ShardCannotStart\n")
        else:
            self.line(
                f"backends/v3/src/client/mod.rs:45: Server error: {reason}",
                level="ERROR",
                target="warmup:warmup: text_generation_router_v3::client",
            )
            self.raw(f'Error: Backend(Warmup(Generation("{reason}")))\n')


LOG_FORMATS: dict[str, type[ServerLog]] = {
    cls.kind: cls for cls in (SGLangLog, VLLMLog, LlamaCppLog, TGILog)
}


def _fs_type(path: Path) -> str:
    """File system type of `path` (vLLM logs it), from the longest matching mount point."""
    target = os.path.realpath(path) + "/"
    best, fs_type = "", "unknown"
    for part in psutil.disk_partitions(all=True):
        mount = part.mountpoint.rstrip("/") + "/"
        if target.startswith(mount) and len(mount) > len(best):
            best, fs_type = mount, part.fstype
    return fs_type


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

    def __init__(self, kind: str, model: str, host: str, port: int) -> None:
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
        health_paths = ("/health", "/health_generate") if self.kind == "sglang" else ("/health",)
        if self.state == "loading":
            return 503, LOADING_BODY
        if self.state == "warmup" and path in health_paths:
            return 503, b""
        if method == "GET" and path in health_paths:
            return 200, (b'{"status":"ok"}' if self.kind == "llamacpp" else b"")
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
            fs_type=_fs_type(s.weights),
        )
        log = LOG_FORMATS[s.kind](self._out, ctx)
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


class _OneLineParser(argparse.ArgumentParser):
    """Usage mistakes get one line and exit 2, not the whole usage text."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _OneLineParser(prog="simulate", description="A stand-in model server.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
