"""Host memory from /proc/meminfo: how much room the page cache has to keep weights warm."""

from __future__ import annotations

import os
from dataclasses import dataclass

from exporter.sources import Sample

_FIELDS = {
    "MemTotal": "total_bytes",
    "MemAvailable": "available_bytes",
    "Cached": "page_cache_bytes",
}


@dataclass(frozen=True)
class MemorySample(Sample):
    total_bytes: int
    available_bytes: int
    page_cache_bytes: int


def read_meminfo(proc_root: str = "/proc") -> MemorySample:
    """Read MemTotal, MemAvailable and Cached in bytes.

    Raises OSError when the file cannot be read and ValueError when a needed line is missing or
    malformed, so the sampler can report the source as down instead of exporting zeros.
    """
    path = os.path.join(proc_root, "meminfo")
    with open(path, encoding="ascii") as f:
        text = f.read()
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, sep, rest = line.partition(":")
        if not sep or key not in _FIELDS:
            continue
        parts = rest.split()
        if len(parts) != 2 or parts[1] != "kB" or not parts[0].isdigit():
            raise ValueError(f"{path}: malformed line {line.strip()!r}")
        values[_FIELDS[key]] = int(parts[0]) * 1024
    missing = [key for key, name in _FIELDS.items() if name not in values]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)}")
    return MemorySample(**values)


class MemorySource:
    """/proc/meminfo sampled like every other source, under an injectable proc root."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root

    def sample(self) -> MemorySample:
        return read_meminfo(self._proc_root)
