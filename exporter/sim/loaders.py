"""How one rank consumes its part of the weight files, the three ways real servers do.

* `mmap`: the `safetensors` library's own default (vLLM, SGLang): the file is mapped and pages
  fault in as tensors are copied out, so the shard shows in /proc/PID/maps with its mapped pages
  growing, and no file descriptor stays open.
* `read`: `open` and sequential `read()`; the file offset in /proc/PID/fdinfo moves.
* `pread`: `pread` at offsets from two threads (Run:ai streamer, fastsafetensors); the file
  offset stays 0 while the read() byte counter (rchar) grows.

With `--direct`, `read` and `pread` open each shard with O_DIRECT (Run:ai's streamer with
RUNAI_STREAMER_DIRECTIO=1, GPUDirect Storage): aligned reads around each chunk into an aligned
buffer, every byte from the device, nothing left in the page cache.

Each shard is opened at its turn and closed (or unmapped) when done. With tensor parallelism each
rank reads only its slice of every tensor (the r-th of N equal row ranges), seeking to it with
`read`, touching only its pages with `mmap`. Whatever the loader, every chunk is paced to the
cold rate or the page-cache rate from what `cachestat` says of it before it is touched (with
`--direct`, to the cold rate: the page cache serves none of it).
"""

from __future__ import annotations

import ctypes
import errno
import json
import mmap
import os
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path

# Imported now, as a real server imported it long before its weights: `safe_open` would import
# it while holding the first shard's descriptor open, for a fifth of a second.
import numpy  # noqa: F401
from safetensors import SafetensorError, safe_open

from exporter.sim.events import Kind, RankEvent, Trace
from exporter.sim.shards import (
    PAGE_SIZE,
    ChunkRead,
    Layout,
    Piece,
    Shard,
    ShardError,
    Throttle,
    cached_share,
    read_chunk,
    read_direct,
    read_layout,
)
from exporter.sim.stopper import Crash, Stopper

PREAD_THREADS = 2

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]


@dataclass(frozen=True)
class RankSpec:
    """Everything one rank needs to load its part: JSON on a child rank's stdin."""

    rank: int
    world: int
    loader: str
    shards: tuple[Shard, ...]
    read_rate: float
    cached_read_rate: float | None
    stall_at: float | None
    stall_for: float
    crash_at: float | None
    trace: Path | None
    parent: int  # the server's pid: a rank never outlives it
    direct: bool = False  # the read and pread loaders open shards with O_DIRECT

    def to_json(self) -> str:
        return json.dumps(asdict(self), default=str)

    @classmethod
    def from_json(cls, text: str) -> RankSpec:
        fields = json.loads(text)
        shards = tuple(Shard(Path(s["path"]), int(s["size"])) for s in fields["shards"])
        trace = None if fields["trace"] is None else Path(fields["trace"])
        return cls(**{**fields, "shards": shards, "trace": trace})


class Meter:
    """One rank's account of what it consumed: pacing, the scripted marks, its events.

    The marks (`--stall-at`, `--crash-at`) are shares of the rank's part of the weights, so all
    ranks reach them together and the server's consumption is that share of the whole.
    """

    def __init__(self, spec: RankSpec, emit: Callable[[RankEvent], None], stopper: Stopper):
        world = spec.world
        self._spec = spec
        self._emit = emit
        self._stopper = stopper
        cached_rate = None if spec.cached_read_rate is None else spec.cached_read_rate / world
        self._throttle = Throttle(spec.read_rate / world, cached_rate)
        self._part = sum(shard.size for shard in spec.shards) / world
        marks = []
        if spec.stall_at is not None:
            marks.append((round(spec.stall_at * self._part), "stall"))
        if spec.crash_at is not None:
            marks.append((round(spec.crash_at * self._part), "crash"))
        # Stable: a stall at the crash point comes first.
        self._marks = sorted(marks, key=lambda mark: mark[0])
        self.consumed = 0
        self._cached = 0
        self._known = True
        self._last = 0.0

    @property
    def direct(self) -> bool:
        return self._spec.direct

    def pieces(self, layout: Layout) -> list[Piece]:
        """This rank's slice of every tensor of a shard."""
        return layout.pieces(self._spec.rank, self._spec.world)

    def event(self, kind: Kind, shard: int = -1, at: float | None = None) -> None:
        """Tell what happened `at` (unix time, default now), never before the previous event."""
        self._last = max(self._last, time.time() if at is None else at)
        self._emit(
            RankEvent(
                kind, self._spec.rank, self._last, shard, self.consumed, self._cached, self._known
            )
        )

    def header(self, chunk: ChunkRead, started: float, shard: int) -> None:
        """Every rank reads a shard's header; rank 0 counts it, so the ranks sum to the file."""
        if self._spec.rank == 0:
            self._account(chunk, started, shard)

    def consume(
        self, pieces: Sequence[Piece], read: Callable[[Piece], ChunkRead], shard: int, threads: int
    ) -> None:
        """Read `pieces` in order, stopping at each mark, on `threads` threads that take turns
        (piece k on thread k mod `threads`, as loaders that split a file between threads do)."""
        flight: deque[tuple[float, Future[tuple[ChunkRead, float]]]] = deque()
        planned = self.consumed
        with ExitStack() as stack:
            pools = [stack.enter_context(ThreadPoolExecutor(1)) for _ in range(threads)]
            turn = 0
            for piece in pieces:
                rest: Piece | None = piece
                while rest is not None:
                    if self._marks and self._marks[0][0] <= planned:
                        while flight:
                            self._settle(flight.popleft(), shard)
                        self._pass_marks()
                    room = self._marks[0][0] - planned if self._marks else None
                    head, rest = rest.split(room)
                    submitted = pools[turn % threads].submit(_timed, read, head)
                    flight.append((time.monotonic(), submitted))
                    turn += 1
                    planned += head.length
                    if len(flight) == threads:
                        self._settle(flight.popleft(), shard)
            while flight:
                self._settle(flight.popleft(), shard)

    def finish(self) -> None:
        """The rank's part is in: marks not reached yet (a shard shorter than said) act now."""
        self._pass_marks(force=True)
        self.event(Kind.DONE)

    def _settle(self, read: tuple[float, Future[tuple[ChunkRead, float]]], shard: int) -> None:
        started, future = read
        chunk, finished = future.result()
        self._account(chunk, started, shard, finished)

    def _account(
        self, chunk: ChunkRead, started: float, shard: int, finished: float | None = None
    ) -> None:
        """Count a chunk read from `started` (monotonic) to `finished` (unix), then pace."""
        self.consumed += chunk.total
        self._cached += chunk.cached
        self._known = self._known and chunk.known
        self.event(Kind.CHUNK, shard, finished)
        self._stopper.sleep(
            self._throttle.pace(started, time.monotonic(), chunk.cold, chunk.cached)
        )

    def _pass_marks(self, force: bool = False) -> None:
        while self._marks and (force or self._marks[0][0] <= self.consumed):
            _, action = self._marks.pop(0)
            if action == "stall":
                self._stopper.sleep(self._spec.stall_for)
            else:
                share = 100 * self.consumed / self._part if self._part else 100
                raise Crash("weights", f"simulated crash after loading {share:.0f}% of weights")


def _timed(read: Callable[[Piece], ChunkRead], piece: Piece) -> tuple[ChunkRead, float]:
    """A read and when it finished: with two in flight, it is accounted a little later."""
    return read(piece), time.time()


def _open(shard: Shard, direct: bool = False) -> int:
    """Open a weight file with readahead off, so a chunk's cached share is what it was before
    this rank touched it (read ahead, the next chunk would look cached); with `direct`, with
    O_DIRECT, as Run:ai's streamer (RUNAI_STREAMER_DIRECTIO=1) and GPUDirect Storage do."""
    if not direct:
        fd = os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        return fd
    try:
        return os.open(shard.path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # the filesystem has no direct I/O
            raise ShardError(f"its filesystem does not take O_DIRECT ({exc.strerror})") from None
        raise


def _load_fd(shard: Shard, index: int, meter: Meter, sequential: bool, threads: int) -> None:
    """The `read` (sequential, one thread) and `pread` (at offsets, two threads) loaders."""
    direct = meter.direct
    chunk_reader = read_direct if direct else read_chunk
    fd = _open(shard, direct)
    meter.event(Kind.OPEN, index)
    try:
        started = time.monotonic()
        layout, header = read_layout(fd, shard.size, sequential, chunk_reader)
        meter.header(header, started, index)

        def read(piece: Piece) -> ChunkRead:
            if sequential and not direct:
                os.lseek(fd, piece.offset, os.SEEK_SET)  # to this rank's slice
            view = memoryview(bytearray(piece.length))
            return chunk_reader(fd, view, piece.offset, sequential)

        meter.consume(meter.pieces(layout), read, index, threads)
    finally:
        os.close(fd)
    meter.event(Kind.CLOSE, index)


def _mapping_of(path: Path) -> tuple[int, int]:
    """Address and length of the mapping the `safetensors` library made of `path`."""
    target = os.path.realpath(path)
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            fields = line.rstrip("\n").split(maxsplit=5)
            if len(fields) == 6 and fields[5] == target and int(fields[2], 16) == 0:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                return start, end - start
    raise ShardError("the safetensors library did not map it")


def _advise(address: int, length: int, advice: int) -> None:
    if _libc.madvise(address, length, advice) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {os.strerror(err)}")


def _load_mmap(shard: Shard, index: int, meter: Meter) -> None:
    """The `safetensors` loader: `safe_open` maps the file; tensors are copied out of it.

    The header is read first through a descriptor of our own, so the library's first fault finds
    it cached and reads nothing around it; then the mapping is advised random and each chunk
    asked for (WILLNEED) right after `cachestat` measured it. Without that, the kernel's
    read-around (8 MiB on some disks) would cache chunks before they are measured.
    """
    fd = _open(shard)
    meter.event(Kind.OPEN, index)
    try:
        started = time.monotonic()
        layout, header = read_layout(fd, shard.size, sequential=False)
    finally:
        os.close(fd)
    with safe_open(str(shard.path), framework="numpy") as tensors:
        address, length = _mapping_of(shard.path)
        _advise(address, length, mmap.MADV_RANDOM)
        meter.header(header, started, index)

        def copy(piece: Piece) -> ChunkRead:
            probe = _open(shard)
            try:
                share = cached_share(probe, piece.offset, piece.length)
            finally:
                os.close(probe)
            first_page = piece.offset - piece.offset % PAGE_SIZE
            end = piece.offset + piece.length
            _advise(address + first_page, end - first_page, mmap.MADV_WILLNEED)
            if piece.whole:
                copied = tensors.get_tensor(piece.tensor).nbytes
            else:
                rows = slice(piece.first_row, piece.first_row + piece.rows)
                copied = tensors.get_slice(piece.tensor)[rows].nbytes
            cached = min(share.cached, copied)
            return replace(share, cached=cached, cold=copied - cached)

        meter.consume(meter.pieces(layout), copy, index, threads=1)
    meter.event(Kind.CLOSE, index)


LOADERS: dict[str, Callable[[Shard, int, Meter], None]] = {
    "mmap": _load_mmap,
    "read": partial(_load_fd, sequential=True, threads=1),
    "pread": partial(_load_fd, sequential=False, threads=PREAD_THREADS),
}


@contextmanager
def _traced(
    spec: RankSpec, upstream: Callable[[RankEvent], None]
) -> Iterator[Callable[[RankEvent], None]]:
    if spec.trace is None:
        yield upstream
        return
    trace = Trace(spec.trace, [shard.path.name for shard in spec.shards])

    def emit(event: RankEvent) -> None:
        trace.record(event)
        upstream(event)

    try:
        yield emit
    finally:
        trace.close()


def load_rank(spec: RankSpec, upstream: Callable[[RankEvent], None], stopper: Stopper) -> None:
    """Consume rank `spec.rank`'s part of every shard in turn, telling `upstream` as it goes.

    A shard that cannot be loaded is the server's crash, as in a real server.
    """
    with _traced(spec, upstream) as emit:
        meter = Meter(spec, emit, stopper)
        load = LOADERS[spec.loader]
        for index, shard in enumerate(spec.shards):
            try:
                load(shard, index, meter)
            except (OSError, ShardError, SafetensorError) as exc:
                raise Crash("weights", f"cannot load {shard.path.name}: {exc}") from None
        meter.finish()
