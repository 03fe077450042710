"""Put weight files into, or take them out of, the page cache.

`prewarm` (the command), the demo and the tests use these to make a restart warm or cold on
purpose. Pages are pulled in by `sendfile` to /dev/null: the kernel reads the file into the page
cache and discards the data without copying it to user space, so one core keeps up with a fast
NVMe array where `cat` or vmtouch's page touching spend a core per GB/s (`bench/prewarm.py`).
POSIX_FADV_WILLNEED ahead of the reads measured no gain over sequential readahead, so none is used.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

CHUNK_BYTES = 16 << 20  # one sendfile call: progress and cancellation granularity
SEGMENT_BYTES = 256 << 20  # unit of parallel work; sequential within it, so readahead works
_NO_SENDFILE = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})

Progress = Callable[[int], None]
Opener = Callable[[str], int]  # a path -> an fd to read (`prewarm`: exporter/storage/ownedfiles.py)


def open_plain(path: str) -> int:
    """Files this program wrote itself (the demo, tests): opened as named."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


class Cancelled(Exception):
    """`stop` was set while reading."""


def evict(path: str, opener: Opener = open_plain) -> int:
    """Drop a file's pages from the page cache; returns its size.

    Dirty pages cannot be dropped, so flush first: a freshly written shard would otherwise stay
    cached and the "cold" load would read from memory. A read-only filesystem (squashfs, erofs)
    has nothing to flush and refuses fsync with EINVAL or EROFS.
    """
    fd = opener(path)
    try:
        try:
            os.fsync(fd)
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.EROFS):
                raise
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def read_through(
    fd: int,
    offset: int,
    length: int,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Pull `length` bytes from `offset` into the page cache; returns the bytes read.

    Stops early at the end of the file (it may shrink meanwhile); raises Cancelled when `stop` is
    set between chunks.
    """
    done = 0
    with open(os.devnull, "wb", buffering=0) as sink:
        use_sendfile = True
        buffer = memoryview(bytearray(0))
        while done < length:
            if stop is not None and stop.is_set():
                raise Cancelled
            want = min(CHUNK_BYTES, length - done)
            n = 0
            if use_sendfile:
                try:
                    n = os.sendfile(sink.fileno(), fd, offset + done, want)
                except OSError as exc:
                    if exc.errno not in _NO_SENDFILE:
                        raise
                    use_sendfile = False  # e.g. a filesystem without splice: plain reads
            if not use_sendfile:
                if len(buffer) < want:
                    buffer = memoryview(bytearray(want))
                n = os.preadv(fd, [buffer[:want]], offset + done)
            if n == 0:
                break
            done += n
            if progress is not None:
                progress(n)
    return done


def prewarm(path: str, progress: Progress | None = None) -> int:
    """Read a file through the page cache so the next load of it is warm; returns its size."""
    fd = open_plain(path)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return read_through(fd, 0, os.fstat(fd).st_size, progress)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Segment:
    path: str
    offset: int
    length: int


def segments(files: Sequence[tuple[str, int]], size: int = SEGMENT_BYTES) -> list[Segment]:
    """Split (path, size) pairs into work units, in file order."""
    return [
        Segment(path, offset, min(size, file_size - offset))
        for path, file_size in files
        for offset in range(0, file_size, size)
    ]


def prewarm_files(
    files: Sequence[tuple[str, int]],
    jobs: int,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    opener: Opener = open_plain,
) -> int:
    """Read (path, size) files into the page cache with `jobs` parallel readers; bytes read.

    Files are cut into segments so that one huge file (a single GGUF) is read in parallel too;
    queues of several outstanding reads are what NVMe and network block devices need to reach
    their throughput. The first error (unreadable file) stops the others and is raised.
    """
    stop = stop or threading.Event()

    def read(segment: Segment) -> int:
        fd = opener(segment.path)
        try:
            os.posix_fadvise(fd, segment.offset, segment.length, os.POSIX_FADV_SEQUENTIAL)
            return read_through(fd, segment.offset, segment.length, progress, stop)
        finally:
            os.close(fd)

    with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="prewarm") as pool:
        futures = [pool.submit(read, s) for s in segments(files)]
        try:
            return sum(f.result() for f in futures)
        except BaseException:
            stop.set()  # also on KeyboardInterrupt: the readers stop within one chunk
            for f in futures:
                f.cancel()
            raise
