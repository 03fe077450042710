"""What a rank tells its server while it loads (over a pipe, or by a call when it is the server
itself), and `--trace`: the truth of what every rank consumed, for tests to compare against."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path


class Kind(StrEnum):
    READY = "ready"  # a rank started and waits for the others (distributed init's barrier)
    OPEN = "open"  # a weight file opened (or mapped) at its turn
    CHUNK = "chunk"  # a chunk consumed
    CLOSE = "close"  # the file closed (or unmapped)
    DONE = "done"  # the rank's part of every file is in
    CRASH = "crash"  # the rank fails; its process exits 1 next


TRACED = (Kind.OPEN, Kind.CHUNK, Kind.CLOSE)


@dataclass(frozen=True)
class RankEvent:
    kind: Kind
    rank: int
    time: float  # unix seconds
    shard: int = -1  # index in the load order
    consumed: int = 0  # bytes of weight files this rank has consumed so far, in total
    cached: int = 0  # of those, the bytes that came from the page cache
    known: bool = True  # False once the page cache could not say for some chunk
    reason: str = ""  # why it crashed

    def line(self) -> bytes:
        """One JSON line: shorter than PIPE_BUF, so a write of it is never interleaved."""
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def parse(cls, line: bytes) -> RankEvent:
        fields = json.loads(line)
        return cls(**{**fields, "kind": Kind(fields["kind"])})


class Trace:
    """Appends `{"time", "rank", "event", "file", "consumed"}` lines as events happen.

    Every rank appends to the same file with O_APPEND, one write per line, so lines of different
    processes never mix. The weights' truly consumed bytes at time t are the sum over ranks of
    their last `consumed` at or before t.
    """

    def __init__(self, path: Path, files: Sequence[str]) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)
        self._files = files

    def record(self, event: RankEvent) -> None:
        if event.kind not in TRACED:
            return
        entry = {
            "time": event.time,
            "rank": event.rank,
            "event": str(event.kind),
            "file": self._files[event.shard],
            "consumed": event.consumed,
        }
        os.write(self._fd, json.dumps(entry).encode() + b"\n")

    def close(self) -> None:
        os.close(self._fd)
