"""Real page-cache and block-device helpers shared by the source tests."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exporter.storage.cachectl import evict
from exporter.storage.pagecache import METHODS, measure
from exporter.storage.weighttree import WeightFile

MIB = 1024 * 1024
_CHUNK = 4 * MIB


def write_cold_file(path: Path, size: int) -> Path:
    """Write `size` random bytes, sync them to disk and drop them from the page cache.

    Random data so that no filesystem or device can shortcut the reads (zero pages, dedup).
    """
    with open(path, "wb") as f:
        remaining = size
        while remaining:
            n = min(_CHUNK, remaining)
            f.write(os.urandom(n))
            remaining -= n
        f.flush()
        os.fsync(f.fileno())
    evict(str(path))
    return path


def read_all(path: Path) -> int:
    """Read a file through the page cache; returns the number of bytes read."""
    total = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(_CHUNK):
            total += len(chunk)
    return total


def diskstats_read_bytes(device: str, proc_root: str = "/proc") -> int:
    """Bytes read from `device` per /proc/diskstats, parsed independently of the code under test."""
    with open(os.path.join(proc_root, "diskstats")) as f:
        for line in f:
            fields = line.split()
            if fields[2] == device:
                return int(fields[5]) * 512
    raise LookupError(device)


@dataclass(frozen=True)
class FileMeasurement:
    """One file's size and residency; resident_bytes None means not measurable truthfully."""

    size_bytes: int
    resident_bytes: int | None
    method: str | None
    reason: str | None


def file_residency(path: str, methods: Sequence[str] = METHODS) -> FileMeasurement:
    """Residency of one file by path (symlinks followed), measured as the exporter's residency
    pass measures a weight file, by the methods given."""
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISREG(st.st_mode):
        raise OSError(errno.EINVAL, f"{path}: not a regular file")
    directory, entry = os.path.split(real)
    found = WeightFile(real, directory, entry, entry, st.st_dev, st.st_ino, st.st_size)
    result = measure([found], methods=methods)
    return FileMeasurement(result.total_bytes, result.resident_bytes, result.method, result.reason)
