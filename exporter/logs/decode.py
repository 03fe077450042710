"""A log file's bytes as timed lines of text: plain text, or a container runtime's records.

A file is plain text, or a container runtime's records (`LogEncoding`): Docker's json-file
(`{"log":"...\\n","stream":"stderr","time":"<RFC 3339>"}`, a long line split over several
records without the `\\n`) or the CRI format of /var/log/pods (`<RFC 3339> <stream> <F|P> <text>`,
`P` a partial line). Each record's own time is its lines' reference time (as journald's
`__REALTIME_TIMESTAMP` is), records older than `since` are skipped (so an older process's lines in
the same file are not this load's), and stdout and stderr are joined into lines apart.

Memory stays bounded whatever arrives: a line longer than `MAX_LINE` is cut there (the rest is
skipped up to its end), a record longer than `MAX_RECORD` is skipped, and bytes that are not
UTF-8 become U+FFFD.
"""

from __future__ import annotations

import calendar
import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from exporter.vocabulary import LogEncoding

MAX_LINE = 64 * 1024  # bytes of one line kept; markers sit at a line's start
MAX_RECORD = 8 * MAX_LINE  # a journal entry or container record longer than this is skipped
TERMINATORS = (b"\n", b"\r")


class Lines:
    """Bytes -> whole lines of text, keeping an unterminated tail bounded by MAX_LINE."""

    def __init__(self) -> None:
        self.tail = b""
        self._skipping = False  # inside a line already cut at MAX_LINE
        self.lines = 0

    def push(self, data: bytes) -> str:
        """The text of the lines `data` completes (cut lines included); the rest is kept."""
        if self._skipping:
            end = _first_terminator(data)
            if end < 0:
                return ""
            data, self._skipping = data[end + 1 :], False
        buf = self.tail + data if self.tail else data
        cut = max(buf.rfind(b"\n"), buf.rfind(b"\r")) + 1
        done, self.tail = buf[:cut], buf[cut:]
        self.lines += done.count(b"\n") + done.count(b"\r") - done.count(b"\r\n")
        text = done.decode("utf-8", "replace")
        if len(self.tail) > MAX_LINE:
            text += self.tail[:MAX_LINE].decode("utf-8", "replace") + "\n"
            self.tail, self._skipping = b"", True
            self.lines += 1
        return text

    def flush(self) -> str:
        """The tail as a last line (the file was replaced or cut under us)."""
        text = self.tail.decode("utf-8", "replace")
        if self.tail:
            self.lines += 1
        self.tail, self._skipping = b"", False
        return text + "\n" if text else ""

    def peek(self) -> str:
        return self.tail.decode("utf-8", "replace") if self.tail else ""

    def skip(self, within_line: bool) -> None:
        """Bytes were skipped unread: the line they cut (if they end inside one) is dropped up
        to its end."""
        self.tail, self._skipping = b"", within_line


def _first_terminator(data: bytes) -> int:
    """Index of the first `\\n` or `\\r`, or -1."""
    found = [i for i in (data.find(t) for t in TERMINATORS) if i >= 0]
    return min(found) if found else -1


# A chunk of whole lines of text and the time they were logged (None: when they were read).
Piece = tuple[float | None, str]


class Records:
    """Bytes -> whole `\\n`-terminated records (journal JSON, container records); a record longer
    than MAX_RECORD is skipped to its end. Only `\\n` ends a record: CRI text keeps tqdm's `\\r`."""

    def __init__(self) -> None:
        self._tail = b""
        self._skipping = False

    def push(self, data: bytes) -> list[bytes]:
        if self._skipping:
            end = data.find(b"\n")
            if end < 0:
                return []
            data, self._skipping = data[end + 1 :], False
        buf = self._tail + data if self._tail else data
        cut = buf.rfind(b"\n") + 1
        self._tail = buf[cut:]
        if len(self._tail) > MAX_RECORD:
            self._tail, self._skipping = b"", True
        return buf[:cut].split(b"\n")[:-1]

    def reset(self) -> None:
        """The file ended under us: a record cut off there is lost."""
        self._tail, self._skipping = b"", False

    def skip(self, within_record: bool = True) -> None:
        """Bytes were skipped unread: the record they cut (if they end inside one) is dropped
        up to its end."""
        self._tail, self._skipping = b"", within_record


class PlainText:
    """A plain log: its bytes are the server's text, timed when read."""

    def __init__(self) -> None:
        self._lines = Lines()
        self._pieces: list[Piece] = []

    @property
    def lines(self) -> int:
        return self._lines.lines

    def push(self, data: bytes) -> None:
        self._keep(self._lines.push(data))

    def cut(self) -> None:
        """The file was replaced or cut under us: its unterminated tail is a last line."""
        self._keep(self._lines.flush())

    def skip(self, within_line: bool) -> None:
        self._lines.skip(within_line)

    def take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces

    def tails(self) -> list[Piece]:
        return [(None, self._lines.peek())]

    def _keep(self, text: str) -> None:
        if text:
            self._pieces.append((None, text))


@dataclass(frozen=True)
class ContainerEntry:
    """One record of a container runtime's log file."""

    time: float  # when the runtime read it from the container, unix seconds
    stream: str  # stdout or stderr
    text: bytes  # this record's part of a line; ends with `\n` where the line ends


STREAMS = ("stdout", "stderr")
_RFC3339 = re.compile(
    rb"(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(\.\d{1,9})?(Z|[+-]\d\d:\d\d)", re.ASCII
)


def parse_rfc3339(text: bytes) -> float | None:
    """Unix seconds of an RFC 3339 time with up to nanoseconds, as Docker and CRI write it."""
    m = _RFC3339.fullmatch(text)
    if m is None:
        return None
    year, month, day, hour, minute, second = (int(g) for g in m.groups()[:6])
    try:
        stamp = calendar.timegm((year, month, day, hour, minute, second, 0, 0, 0))
    except (ValueError, OverflowError):
        return None
    zone = m[8]
    if zone != b"Z":
        sign = -1 if zone[:1] == b"+" else 1
        stamp += sign * (int(zone[1:3]) * 3600 + int(zone[4:6]) * 60)
    return stamp + (float(m[7]) if m[7] else 0.0)


def json_object(line: bytes) -> dict[str, Any] | None:
    """A line of JSON that is an object, else None (a journal's or Docker's record)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_docker_json(record: bytes) -> ContainerEntry | None:
    """One line of Docker's json-file log; None for anything that is not an entry."""
    entry = json_object(record)
    if entry is None:
        return None
    text, stream, stamp = entry.get("log"), entry.get("stream"), entry.get("time")
    if not isinstance(text, str) or stream not in STREAMS or not isinstance(stamp, str):
        return None
    when = parse_rfc3339(stamp.encode("ascii", "replace"))
    if when is None:
        return None
    return ContainerEntry(when, stream, text.encode("utf-8", "replace"))


def parse_cri(record: bytes) -> ContainerEntry | None:
    """One line of the CRI log format: `<time> <stream> <tags> <text>`, tag `P` a partial line."""
    parts = record.split(b" ", 3)
    if len(parts) < 3:
        return None
    stamp, stream, tags = parts[0], parts[1].decode("ascii", "replace"), parts[2]
    when = parse_rfc3339(stamp)
    if when is None or stream not in STREAMS:
        return None
    partial = tags.split(b":", 1)[0]
    if partial not in (b"F", b"P"):
        return None
    text = parts[3] if len(parts) == 4 else b""
    return ContainerEntry(when, stream, text if partial == b"P" else text + b"\n")


PARSERS: dict[LogEncoding, Callable[[bytes], ContainerEntry | None]] = {
    LogEncoding.DOCKER: parse_docker_json,
    LogEncoding.CRI: parse_cri,
}


class ContainerText:
    """A container runtime's records: lines joined per stream, each timed by its last record.

    A line may be split over several records (Docker and CRI split at 16 KiB, and a tqdm bar
    redrawn with `\\r` has no `\\n` until it is done), and stdout's and stderr's records interleave,
    so each stream keeps its own unterminated tail. Records before `since` are skipped.
    """

    def __init__(self, parse: Callable[[bytes], ContainerEntry | None], since: float | None):
        self._parse = parse
        self._since = since
        self._records = Records()
        self._streams = {stream: Lines() for stream in STREAMS}
        self._last: dict[str, float] = {}
        self._pieces: list[Piece] = []

    @property
    def lines(self) -> int:
        return sum(lines.lines for lines in self._streams.values())

    def push(self, data: bytes) -> None:
        for record in self._records.push(data):
            entry = self._parse(record)
            if entry is None or (self._since is not None and entry.time < self._since):
                continue
            self._last[entry.stream] = entry.time
            text = self._streams[entry.stream].push(entry.text)
            if text:
                self._pieces.append((entry.time, text))

    def cut(self) -> None:
        """Rotated or truncated: a line split over records goes on in the next file."""
        self._records.reset()

    def skip(self, within_line: bool) -> None:
        """Records were skipped unread: every stream's line in progress is dropped."""
        self._records.skip(within_line)
        for lines in self._streams.values():
            lines.tail = b""

    def take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces

    def tails(self) -> list[Piece]:
        return [(self._last.get(s), lines.peek()) for s, lines in self._streams.items()]


BISECT_WINDOW = 64 * 1024


def offset_since(
    fd: int, size: int, since: float, parse: Callable[[bytes], ContainerEntry | None]
) -> int:
    """Where to start reading time-ordered records so that none stamped at or after `since` is
    missed: a bisection over record starts, so a log of gigabytes (Docker's default has no size
    limit, and a restarted container appends to it) is not parsed from its start. Records before
    the offset are all older; the few older ones after it are skipped as they are read."""
    lo, hi = 0, size
    while hi - lo > BISECT_WINDOW:
        mid = (lo + hi) // 2
        found = _record_after(fd, mid)
        if found is None or found[0] >= hi:
            hi = mid
            continue
        start, record = found
        entry = parse(record)
        if entry is not None and entry.time >= since:
            hi = start
        else:
            lo = start + len(record) + 1
    return lo


def _record_after(fd: int, pos: int) -> tuple[int, bytes] | None:
    """The first whole record that starts at or after `pos`: its offset and bytes."""
    at = max(pos - 1, 0)
    try:
        data = os.pread(fd, 2 * BISECT_WINDOW, at)
    except OSError:
        return None
    begin = data.find(b"\n") + 1 if pos > 0 else 0
    if pos > 0 and begin == 0:
        return None
    end = data.find(b"\n", begin)
    return (at + begin, data[begin:end]) if end >= 0 else None


class Decoder(Protocol):
    """What a file's bytes mean: plain text or a container runtime's records."""

    @property
    def lines(self) -> int: ...
    def push(self, data: bytes) -> None: ...
    def cut(self) -> None: ...
    def skip(self, within_line: bool) -> None: ...
    def take(self) -> list[Piece]: ...
    def tails(self) -> list[Piece]: ...
