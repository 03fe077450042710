"""Weight shards for the simulator: real safetensors files, read chunk by chunk with the kernel
asked how much of each chunk came from the page cache (which decides the cold or cached pace)."""

from __future__ import annotations

import errno
import json
import math
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from exporter.sources.pagecache import cachestat
from exporter.tracker import temperature
from exporter.units import MiB
from exporter.vocabulary import Cache

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
CHUNK_SIZE = 4 * MiB
MIN_SHARD_SIZE = 4096
WEIGHTS_GLOB = "*.safetensors"


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


def cache_temperature(cached: int, total: int, known: bool) -> Cache:
    """The exporter's rule, applied to what this process really read from the page cache."""
    if not known:
        return Cache.UNKNOWN
    return temperature(cached / total if total else 1.0)
