"""Put weight files into, or take them out of, the page cache.

The demo uses `evict` to make a restart cold on purpose; the same calls serve `prewarm`.
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
