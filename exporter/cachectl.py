"""Put weight files into, or take them out of, the page cache.

The demo and the tests use these to make a restart cold or warm on purpose.
"""

from __future__ import annotations

import os


def evict(path: str) -> int:
    """Drop a file's pages from the page cache; returns its size.

    Dirty pages cannot be dropped, so flush first: a freshly written shard would otherwise stay
    cached and the "cold" load would read from memory.
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return os.fstat(fd).st_size
    finally:
        os.close(fd)


def prewarm(path: str, chunk: int = 8 << 20) -> int:
    """Read a file through the page cache so the next load of it is warm; returns its size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        buffer = bytearray(chunk)
        total = 0
        while n := os.readv(fd, [buffer]):
            total += n
        return total
    finally:
        os.close(fd)
