"""Weight shards for the simulator: real safetensors files of many tensors, their layout, and
reads chunk by chunk with the kernel asked how much of each chunk came from the page cache (which
decides the cold or cached pace)."""

from __future__ import annotations

import errno
import json
import math
import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exporter.load.progress import temperature
from exporter.storage.pagecache import cachestat
from exporter.units import MiB
from exporter.vocabulary import Cache

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CHUNK_SIZE = 4 * MiB
# Generated shards hold tensors of this size, so a loader consumes a shard tensor by tensor.
TENSOR_SIZE = 4 * MiB
MIN_SHARD_SIZE = 4096
WEIGHTS_GLOB = "*.safetensors"
_PREFIX = 8  # the little-endian u64 length of the JSON header
_MAX_HEADER = 100_000_000  # safetensors' own limit


class ShardError(Exception):
    """A weight file that is not a safetensors file the simulator can load."""


@dataclass(frozen=True)
class Shard:
    path: Path
    size: int


def find_shards(directory: Path) -> list[Shard]:
    """The weight files a server would load from `directory`, in load order (stat, no open)."""
    paths = sorted(p for p in directory.glob(WEIGHTS_GLOB) if p.is_file())
    return [Shard(p, p.stat().st_size) for p in paths]


def _tensor_table(data_len: int) -> dict[str, object]:
    table: dict[str, object] = {"__metadata__": {"format": "pt"}}
    for index, start in enumerate(range(0, data_len, TENSOR_SIZE)):
        end = min(start + TENSOR_SIZE, data_len)
        table[f"model.layers.{index}.weight"] = {
            "dtype": "U8",
            "shape": [end - start],
            "data_offsets": [start, end],
        }
    return table


def _safetensors_header(file_size: int) -> bytes:
    """Length prefix and JSON header of a valid safetensors file of exactly `file_size` bytes.

    U8 tensors of TENSOR_SIZE bytes (the last one shorter) fill the rest of the file, so the
    `safetensors` library and tools that inspect the checkpoint accept it.
    """
    header_len = 0
    while True:
        text = json.dumps(_tensor_table(file_size - _PREFIX - header_len)).encode()
        padded = -(-len(text) // 8) * 8
        if padded <= header_len:
            return struct.pack("<Q", header_len) + text.ljust(header_len, b" ")
        header_len = padded


def write_random_file(
    path: Path, size: int, head: bytes = b"", check: Callable[[], None] = lambda: None
) -> None:
    """Write `head` then random bytes up to `size` under a temporary name, then rename.

    Random data, so compression or deduplication below the page cache cannot make reads cheaper
    than a real file's; the rename means an interrupted run never leaves a short file that looks
    complete. `check` is called between blocks to abort.
    """
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        with partial.open("wb") as out:
            out.write(head)
            remaining = size - len(head)
            while remaining > 0:
                check()
                block = os.urandom(min(CHUNK_SIZE, remaining))
                out.write(block)
                remaining -= len(block)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def generate_shards(
    directory: Path, count: int, size: int, check: Callable[[], None] = lambda: None
) -> None:
    """Create the `count` safetensors shards of `size` bytes that are missing or of another size."""
    directory.mkdir(parents=True, exist_ok=True)
    for index in range(1, count + 1):
        path = directory / f"model-{index:05d}-of-{count:05d}.safetensors"
        if not (path.is_file() and path.stat().st_size == size):
            write_random_file(path, size, _safetensors_header(size), check)


@dataclass(frozen=True)
class Piece:
    """Rows `first_row`.. of one tensor: the bytes `offset`..+`length` of the file."""

    tensor: str
    offset: int
    length: int
    first_row: int
    rows: int
    whole: bool  # the piece is the whole tensor

    def split(self, limit: int | None) -> tuple[Piece, Piece | None]:
        """At most `limit` bytes (whole rows, at least one) and the rest, if any."""
        row_bytes = self.length // self.rows
        rows = self.rows if limit is None else min(self.rows, max(1, limit // row_bytes))
        if rows == self.rows:
            return self, None
        head = rows * row_bytes
        return (
            Piece(self.tensor, self.offset, head, self.first_row, rows, False),
            Piece(
                self.tensor,
                self.offset + head,
                self.length - head,
                self.first_row + rows,
                self.rows - rows,
                False,
            ),
        )


@dataclass(frozen=True)
class Tensor:
    name: str
    offset: int  # in the file
    length: int
    rows: int  # along the first dimension, which tensor parallelism splits

    def part(self, rank: int, world: int) -> list[Piece]:
        """Rank `rank`'s share of `world` equal parts (whole rows), in chunks of CHUNK_SIZE."""
        row_bytes = self.length // self.rows
        first, end = self.rows * rank // world, self.rows * (rank + 1) // world
        step = max(1, CHUNK_SIZE // row_bytes)
        return [
            Piece(
                self.name,
                self.offset + row * row_bytes,
                min(step, end - row) * row_bytes,
                row,
                min(step, end - row),
                first == 0 and end == self.rows and step >= self.rows,
            )
            for row in range(first, end, step)
        ]


@dataclass(frozen=True)
class Layout:
    """Where a safetensors file's header ends and each tensor lies, in file order."""

    header_end: int
    tensors: tuple[Tensor, ...]

    def pieces(self, rank: int, world: int) -> list[Piece]:
        """What rank `rank` of `world` reads: its part of every tensor, through the file."""
        return [piece for tensor in self.tensors for piece in tensor.part(rank, world)]


def parse_layout(header: bytes, size: int) -> Layout:
    """The layout a safetensors JSON header describes; ShardError when it is not one."""
    header_end = _PREFIX + len(header)
    try:
        table = json.loads(header)
        tensors = []
        for name, entry in table.items():
            if name == "__metadata__":
                continue
            start, end = (int(x) for x in entry["data_offsets"])
            shape = [int(x) for x in entry["shape"]]
            length = end - start
            rows = shape[0] if shape and shape[0] > 0 and length % shape[0] == 0 else 1
            if length > 0:
                tensors.append(Tensor(str(name), header_end + start, length, rows))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ShardError(f"not a safetensors header ({exc})") from None
    tensors.sort(key=lambda t: t.offset)
    if tensors and tensors[-1].offset + tensors[-1].length > size:
        raise ShardError("a tensor ends past the end of the file")
    return Layout(header_end, tuple(tensors))


@dataclass(frozen=True)
class ChunkRead:
    """One chunk of a weight file: how many bytes came from page cache and how many from storage."""

    cached: int
    cold: int
    known: bool  # False where the file system cannot say (no RWF_NOWAIT support, e.g. tmpfs)

    @property
    def total(self) -> int:
        return self.cached + self.cold

    def __add__(self, other: ChunkRead) -> ChunkRead:
        return ChunkRead(
            self.cached + other.cached, self.cold + other.cold, self.known and other.known
        )


def _read_fully(fd: int, view: memoryview, at: int) -> int:
    """Read into all of `view` from offset `at`, or from the file position (moving it) if -1."""
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], at if at < 0 else at + done)
        if count == 0:
            break
        done += count
    return done


def read_chunk(fd: int, view: memoryview, offset: int, sequential: bool = False) -> ChunkRead:
    """Read `len(view)` bytes at `offset`, asking the kernel first how many of them were cached.

    `sequential` reads at the file position (which must be `offset`) and moves it, as `read()`
    does; otherwise the position stays where it is, as with `pread()`. `cachestat` over the
    chunk's range counts its cached pages exactly. Where it is refused (old kernel, seccomp, a
    file we may not write), `RWF_NOWAIT` stands in: it returns the leading bytes already in page
    cache, but also stops early at pages marked for readahead, so it can call cached data cold.
    Open the file with `POSIX_FADV_RANDOM` so kernel readahead does not pull the next chunk in
    behind our back and make cold data look cached.
    """
    at = -1 if sequential else offset
    try:
        pages = cachestat(fd, offset, len(view)).nr_cache
    except OSError:
        return _read_chunk_nowait(fd, view, at)
    done = _read_fully(fd, view, at)
    cached = min(done, pages * PAGE_SIZE)
    return ChunkRead(cached=cached, cold=done - cached, known=True)


def _read_chunk_nowait(fd: int, view: memoryview, at: int) -> ChunkRead:
    try:
        cached = os.preadv(fd, [view], at, os.RWF_NOWAIT)
    except BlockingIOError:
        cached = 0
    except OSError as exc:
        if exc.errno != errno.EOPNOTSUPP:
            raise
        return ChunkRead(cached=0, cold=_read_fully(fd, view, at), known=False)
    if cached == len(view):
        return ChunkRead(cached=cached, cold=0, known=True)
    # A short read ends at the first page not in cache (or at end of file: then this reads 0).
    cold = _read_fully(fd, view[cached:], at if at < 0 else at + cached)
    return ChunkRead(cached=cached, cold=cold, known=True)


DIRECT_ALIGN = 4096  # O_DIRECT wants offsets, lengths and buffers aligned to the block size
ChunkReader = Callable[[int, memoryview, int, bool], "ChunkRead"]


def read_direct(fd: int, view: memoryview, offset: int, sequential: bool = False) -> ChunkRead:
    """Read `len(view)` bytes at `offset` from a descriptor opened with O_DIRECT.

    O_DIRECT transfers whole blocks into an aligned buffer, so the aligned range around the
    chunk is read into a page-aligned anonymous mapping and the chunk copied out of it; with
    `sequential` the file position ends past that range, as a direct `read()` loader's does.
    Every byte comes from the device, whatever the page cache holds: all of it is cold.
    """
    start = offset - offset % DIRECT_ALIGN
    end = -(-(offset + len(view)) // DIRECT_ALIGN) * DIRECT_ALIGN
    with mmap.mmap(-1, end - start) as buffer:
        aligned = memoryview(buffer)
        try:
            if sequential:
                os.lseek(fd, start, os.SEEK_SET)
            got = 0
            while got < len(aligned):  # whole blocks until the end; a short block is the last
                count = os.preadv(fd, [aligned[got:]], -1 if sequential else start + got)
                got += count
                if count == 0 or got % DIRECT_ALIGN:
                    break
            done = max(0, min(len(view), got - (offset - start)))
            view[:done] = aligned[offset - start : offset - start + done]
        finally:
            aligned.release()
    return ChunkRead(cached=0, cold=done, known=True)


def cached_share(fd: int, offset: int, length: int) -> ChunkRead:
    """How `length` bytes at `offset` would read now, without reading them (mmap loaders).

    Unknown (and paced as cold) where `cachestat` is refused: the `RWF_NOWAIT` stand-in reads.
    """
    try:
        pages = cachestat(fd, offset, length).nr_cache
    except OSError:
        return ChunkRead(cached=0, cold=length, known=False)
    cached = min(length, pages * PAGE_SIZE)
    return ChunkRead(cached=cached, cold=length - cached, known=True)


def read_layout(
    fd: int, size: int, sequential: bool, read: ChunkReader | None = None
) -> tuple[Layout, ChunkRead]:
    """Read a shard's header like a loader does (`sequential`: with `read()`; `read`:
    read_direct for a descriptor opened with O_DIRECT), and parse it."""
    read = read or read_chunk
    prefix = bytearray(_PREFIX)
    first = read(fd, memoryview(prefix), 0, sequential)
    if first.total < _PREFIX:
        raise ShardError("too short for a safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > min(_MAX_HEADER, size - _PREFIX):
        raise ShardError(f"header length {length} does not fit the file")
    header = bytearray(length)
    rest = read(fd, memoryview(header), _PREFIX, sequential)
    return parse_layout(bytes(header[: rest.total]), size), first + rest


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


def cache_temperature(cached: int, total: int, known: bool) -> Cache:
    """The exporter's rule, applied to what this process really read from the page cache."""
    if not known:
        return Cache.UNKNOWN
    return temperature(cached / total if total else 1.0)
