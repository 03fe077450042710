"""A server that floods its log: LINE written to PATH at RATE bytes a second for SECONDS, in
blocks every 10 ms, for the tests and the benchmark of what a noisy log costs the exporter.

    python noisylog.py PATH RATE SECONDS [LINE]
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

BLOCKS_PER_SECOND = 100


def command(path: Path, rate: int, seconds: float, line: str = "ok") -> list[str]:
    """The command line of a writer of `path`, as a child process."""
    return [sys.executable, __file__, str(path), str(rate), str(seconds), line]


def write(path: str, rate: int, seconds: float, line: str) -> None:
    data = line.encode() + b"\n"
    block = data * max(1, rate // BLOCKS_PER_SECOND // len(data))
    end = time.monotonic() + seconds
    with open(path, "ab", buffering=0) as f:
        due = time.monotonic()
        while due < end:
            f.write(block)
            due += 1 / BLOCKS_PER_SECOND
            time.sleep(max(0.0, due - time.monotonic()))


if __name__ == "__main__":
    write(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] if sys.argv[4:] else "ok")
