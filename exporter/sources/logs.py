"""Follow a model server's log (files or a systemd unit's journal) and turn it into step events.

Reading never blocks the sampler: a file is read with pread up to a byte budget per sample, and
journald is read from a `journalctl --follow` child through a non-blocking pipe. Per-sample
polling is enough for both: nothing is lost between samples (the file keeps its bytes; journalctl
blocks on a full pipe, which is enlarged to 1 MiB, and resumes where it stopped), and the tracker
acts once per interval anyway. `follow()` runs the same polling from a thread that wakes on new
journal output, for a log so busy that one interval's output outgrows the pipe.

A file is plain text, or a container runtime's records (`LogEncoding`): Docker's json-file
(`{"log":"...\\n","stream":"stderr","time":"<RFC 3339>"}`, a long line split over several
records without the `\\n`) or the CRI format of /var/log/pods (`<RFC 3339> <stream> <F|P> <text>`,
`P` a partial line). Each record's own time is its lines' reference time (as journald's
`__REALTIME_TIMESTAMP` is), records older than `since` are skipped (so an older process's lines in
the same file are not this load's), and stdout and stderr are joined into lines apart.

CPU stays bounded whatever arrives: text is read and parsed PARSE_CHUNK at a time, and once a
sample has spent its share of the CPU (CPU_SHARE of a core, saved up to CPU_BURST) or read
READ_BUDGET, what else is there now is skipped unread and counted (`skipped_bytes`): a server that
writes 10 MB/s of lines no rule knows costs its share and no more, and the reader never falls
behind (markers in a skipped stretch are lost; the log says how many bytes). When the process
whose log it is has gone, `finish()` has the next sample read its last lines and close it.

Memory stays bounded whatever arrives: a line longer than `MAX_LINE` is cut there (the rest is
skipped up to its end), a record longer than `MAX_RECORD` is skipped, bytes that are not UTF-8
become U+FFFD, and only the last `MAX_EVENTS` events are kept (each carries a sequence number, so
a reader knows what it has seen).
"""

from __future__ import annotations

import calendar
import contextlib
import fcntl
import json
import logging
import os
import re
import select
import shutil
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from exporter.config import LogConfig
from exporter.logmarkers import LogEvent, MarkerParser, StepTimeline
from exporter.sources.sample import Health, Sample
from exporter.vocabulary import LogEncoding, Step

if TYPE_CHECKING:
    from exporter.asprocess import Rights

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024  # bytes of one line kept; markers sit at a line's start
MAX_RECORD = 8 * MAX_LINE  # a journal entry or container record longer than this is skipped
READ_BUDGET = 8 * 1024 * 1024  # bytes parsed per sample at most; more than that is skipped
CPU_SHARE = 0.05  # of one core, on average, that parsing one target's log may take
CPU_BURST = 0.25  # seconds of CPU one sample may take at most, saved up while the log was quiet
PARSE_CHUNK = 64 * 1024  # bytes read and parsed between two looks at the CPU spent
MAX_EVENTS = 1024
JOURNAL_PIPE_SIZE = 1 << 20
JOURNAL_SKIP_LIMIT = 8 * READ_BUDGET  # bytes of journal output dropped unparsed per sample at most
JOURNAL_RESTART_SECONDS = 5.0
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, absent from the fcntl module before Python 3.10 on some
_TERMINATORS = (b"\n", b"\r")


@dataclass(frozen=True)
class LogSample(Sample):
    """What the server's log said, up to this sample."""

    up: bool  # the log can be read (a missing file or a dead journalctl is not up)
    reason: str | None  # why not up, in words
    source: str  # "file:/var/log/sglang.log", "journald:sglang.service", "cri:/var/log/pods/..."
    format: str | None  # the server kind whose format is in use; None while `auto` has not decided
    format_reason: str  # "configured", or which line decided, or that none did
    events: tuple[LogEvent, ...]  # the last MAX_EVENTS events, oldest first, seq increasing
    last_seq: int  # seq of the newest event (0: none yet)
    step: Step
    step_since: float | None  # unix time the current step began
    steps: tuple[tuple[Step, float], ...]  # seconds spent in each finished step of this load
    weights: tuple[int, int] | None  # (done, total) shards (or percent for llama.cpp)
    cuda_graphs: tuple[int, int] | None  # (done, total) batch sizes captured
    ready_at: float | None  # when the log said ready, for the current load
    fatal: str | None  # the server's own fatal message for the current load
    lines_total: int  # line terminators read (`\n`, `\r`, `\r\n`); a change is movement
    bytes_total: int
    last_line_at: float | None  # unix time a line was last read
    skipped_bytes: int = 0  # bytes not parsed: over a sample's CPU or byte budget
    closed: bool = False  # its process is gone: the last lines were read, then it was closed

    @property
    def activity(self) -> int:
        """Grows whenever the server writes: lines read, and bytes skipped unread."""
        return self.lines_total + self.skipped_bytes

    def health(self) -> Health:
        return Health(self.up, self.reason)


class _Lines:
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
    found = [i for i in (data.find(t) for t in _TERMINATORS) if i >= 0]
    return min(found) if found else -1


# A chunk of whole lines of text and the time they were logged (None: when they were read).
Piece = tuple[float | None, str]


class _Records:
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


class _PlainText:
    """A plain log: its bytes are the server's text, timed when read."""

    def __init__(self) -> None:
        self._lines = _Lines()
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


def _json_object(line: bytes) -> dict[str, Any] | None:
    """A line of JSON that is an object, else None (a journal's or Docker's record)."""
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def parse_docker_json(record: bytes) -> ContainerEntry | None:
    """One line of Docker's json-file log; None for anything that is not an entry."""
    entry = _json_object(record)
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


_PARSERS: dict[LogEncoding, Callable[[bytes], ContainerEntry | None]] = {
    LogEncoding.DOCKER: parse_docker_json,
    LogEncoding.CRI: parse_cri,
}


class _ContainerText:
    """A container runtime's records: lines joined per stream, each timed by its last record.

    A line may be split over several records (Docker and CRI split at 16 KiB, and a tqdm bar
    redrawn with `\\r` has no `\\n` until it is done), and stdout's and stderr's records interleave,
    so each stream keeps its own unterminated tail. Records before `since` are skipped.
    """

    def __init__(self, parse: Callable[[bytes], ContainerEntry | None], since: float | None):
        self._parse = parse
        self._since = since
        self._records = _Records()
        self._streams = {stream: _Lines() for stream in STREAMS}
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


def _next_restart(path: str) -> str:
    """CRI: the kubelet writes a restarted container's log beside the last, `<N+1>.log`."""
    head, name = os.path.split(path)
    stem, dot, ext = name.partition(".")
    if not (stem.isdigit() and dot and ext == "log"):
        return path
    successor = os.path.join(head, f"{int(stem) + 1}.log")
    return successor if os.path.exists(successor) else path


class _Decoder(Protocol):
    """What a file's bytes mean: plain text or a container runtime's records."""

    @property
    def lines(self) -> int: ...
    def push(self, data: bytes) -> None: ...
    def cut(self) -> None: ...
    def skip(self, within_line: bool) -> None: ...
    def take(self) -> list[Piece]: ...
    def tails(self) -> list[Piece]: ...


class _FileReader:
    """Follows a path like `tail -F`: through rename rotation, truncation and absence.

    The first time the file is found it is read from `first_offset(fd, size)` (its end for a plain
    file whose history is an older load's), unless it did not exist when following began: then
    all of it is new. `successor` names the file that replaces this one when a new one is started
    beside it rather than renamed over it (CRI's next restart).
    """

    def __init__(
        self,
        path: str,
        decoder: _Decoder,
        first_offset: Callable[[int, int], int],
        successor: Callable[[str], str] | None = None,
        opener: Callable[[str], int] | None = None,
    ) -> None:
        self.path = path
        self._opener = opener or _open_plain
        self.decoder = decoder
        self._first_offset = first_offset if os.path.exists(path) else None
        self._successor = successor
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self._offset = 0

    def read(self, budget: int) -> tuple[int, str | None]:
        """(bytes read into the decoder, reason the file cannot be read or None)."""
        reason = None
        if self._fd is None:
            reason = self._open()
            if self._fd is None:
                return 0, reason
        read = 0
        if self._successor is not None:
            self.path = self._successor(self.path)
        try:
            current = os.stat(self.path)
            identity: tuple[int, int] | None = (current.st_dev, current.st_ino)
        except OSError:
            identity = None  # renamed away and not recreated yet: finish the old one
        if identity is not None and identity != self._identity:
            read = self._drain(budget)  # rotated: the old file's last lines first
            self.decoder.cut()
            self._close()
            reason = self._open()
            budget -= read
        if self._fd is not None:
            if os.fstat(self._fd).st_size < self._offset:  # truncated (copytruncate)
                self.decoder.cut()
                self._offset = 0
            read += self._drain(budget)
        return read, reason

    def _open(self) -> str | None:
        try:
            fd = self._opener(self.path)
        except FileNotFoundError:
            self._first_offset = None
            return f"{self.path} does not exist (yet)"
        except (OSError, TimeoutError) as exc:
            return f"cannot open {self.path}: {getattr(exc, 'strerror', None) or exc}"
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return f"{self.path} is not a regular file"
        self._fd, self._identity = fd, (st.st_dev, st.st_ino)
        first, self._first_offset = self._first_offset, None
        self._offset = first(fd, st.st_size) if first is not None else 0
        return None

    def _drain(self, budget: int) -> int:
        assert self._fd is not None
        read = 0
        while read < budget:
            try:
                data = os.pread(self._fd, min(1 << 20, budget - read), self._offset)
            except OSError as exc:
                log.debug("reading %s: %s", self.path, exc)
                break
            if not data:
                break
            self._offset += len(data)
            read += len(data)
            self.decoder.push(data)
        return read

    def skip(self) -> int:
        """Jump to the file's end unread (the decoder drops the line cut); the bytes jumped."""
        if self._fd is None:
            return 0
        size = os.fstat(self._fd).st_size
        skipped, self._offset = max(0, size - self._offset), max(size, self._offset)
        if skipped:
            try:
                last = os.pread(self._fd, 1, size - 1)
            except OSError:
                last = b""
            self.decoder.skip(within_line=last not in _TERMINATORS)
        return skipped

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def close(self) -> None:
        self._close()


@dataclass(frozen=True)
class JournalEntry:
    message: str  # MESSAGE, decoded from a byte array where journald stored one
    realtime: float | None  # __REALTIME_TIMESTAMP in unix seconds
    cursor: str | None


def parse_journal_json(line: bytes) -> JournalEntry | None:
    """One line of `journalctl -o json`; None for anything that is not an entry."""
    entry = _json_object(line)
    if entry is None:
        return None
    message = entry.get("MESSAGE")
    if isinstance(message, list):
        try:
            message = bytes(message).decode("utf-8", "replace")
        except (TypeError, ValueError):
            return None
    if not isinstance(message, str):
        return None
    realtime = entry.get("__REALTIME_TIMESTAMP")
    try:
        when = int(realtime) / 1e6 if realtime is not None else None
    except (TypeError, ValueError):
        when = None
    cursor = entry.get("__CURSOR")
    return JournalEntry(message, when, cursor if isinstance(cursor, str) else None)


def journalctl_command(
    unit: str,
    since: float,
    cursor: str | None,
    journalctl: str = "journalctl",
    literal: bool = False,
) -> list[str]:
    """The follower's command: this boot, from `since` (or just after `cursor`), as JSON.

    A configured unit is the operator's word: `--unit` matches as journalctl always does (a
    glob, `.service` added), the unit's own processes (`_SYSTEMD_UNIT`, from their cgroup) plus
    systemd's and coredumps' messages about it. A unit read from a process's cgroup is
    `literal`: the `_SYSTEMD_UNIT=` match, which takes the name as it is, no glob.
    """
    start = [f"--after-cursor={cursor}"] if cursor else [f"--since=@{since:.6f}"]
    return [
        journalctl,
        f"_SYSTEMD_UNIT={unit}" if literal else f"--unit={unit}",
        "--boot",
        *start,
        "--follow",
        "--output=json",
        "--output-fields=MESSAGE",
        "--all",
        "--no-pager",
        "--quiet",
    ]


class _JournalReader:
    """A `journalctl --follow` child read through a non-blocking pipe, restarted if it dies."""

    def __init__(
        self,
        unit: str,
        since: float,
        journalctl: str = "journalctl",
        restart_after: float = JOURNAL_RESTART_SECONDS,
        rights: Callable[[], Rights] | None = None,
    ) -> None:
        """`rights`: the process's own, which journalctl runs with (its unit matched literally);
        None for a configured unit, read with the exporter's."""
        self.unit = unit
        self._rights = rights
        self._since = since
        self._restart_after = restart_after
        self._journalctl = journalctl
        self._child: subprocess.Popen[bytes] | None = None
        self._cursor: str | None = None
        self._records = _Records()
        self._next_start = 0.0
        self._reason: str | None = None

    def read(self, budget: int) -> tuple[list[JournalEntry], int, str | None]:
        child = self._child
        if child is None:
            if time.monotonic() < self._next_start:
                return [], 0, self._reason
            child = self._start()
            if child is None:
                return [], 0, self._reason
        entries: list[JournalEntry] = []
        read = 0
        assert child.stdout is not None
        fd = child.stdout.fileno()
        while read < budget:
            try:
                data = os.read(fd, min(1 << 20, budget - read))
            except BlockingIOError:
                break
            except OSError as exc:
                data = b""
                log.debug("reading journalctl: %s", exc)
            if not data:
                self._died(child)
                break
            read += len(data)
            self._split(data, entries)
        return entries, read, self._reason

    def skip(self, limit: int) -> int:
        """Read what journalctl has written by now, up to `limit` bytes, without parsing it."""
        child = self._child
        if child is None or child.stdout is None:
            return 0
        skipped = 0
        while skipped < limit:
            try:
                data = os.read(child.stdout.fileno(), min(1 << 20, limit - skipped))
            except (BlockingIOError, OSError):
                break
            if not data:
                break
            skipped += len(data)
        if skipped:
            self._records.skip()
        return skipped

    def _split(self, data: bytes, entries: list[JournalEntry]) -> None:
        for raw in self._records.push(data):
            entry = parse_journal_json(raw)
            if entry is not None:
                self._cursor = entry.cursor or self._cursor
                entries.append(entry)

    def _start(self) -> subprocess.Popen[bytes] | None:
        path = shutil.which(self._journalctl)
        if path is None:
            self._reason = f"{self._journalctl} not found; cannot read the journal"
            self._next_start = time.monotonic() + self._restart_after
            return None
        literal = self._rights is not None
        command = journalctl_command(self.unit, self._since, self._cursor, path, literal)
        ids: dict[str, Any] = {}
        try:
            if self._rights is not None:
                rights = self._rights()
                ids = {"user": rights.uid, "group": rights.gid, "extra_groups": rights.groups}
                if rights.ids == (os.geteuid(), os.getegid(), tuple(sorted(os.getgroups()))):
                    ids = {}  # the exporter's own already (and it may not call setgroups)
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
                **ids,
            )
        except OSError as exc:  # a PermissionError when the rights are not the exporter's to take
            self._reason = f"cannot start journalctl: {exc.strerror or exc}"
            self._next_start = time.monotonic() + self._restart_after
            return None
        assert child.stdout is not None and child.stderr is not None
        for stream in (child.stdout, child.stderr):
            os.set_blocking(stream.fileno(), False)
        with contextlib.suppress(OSError):  # unprivileged limits may refuse; 64 KiB still works
            fcntl.fcntl(child.stdout.fileno(), _F_SETPIPE_SZ, JOURNAL_PIPE_SIZE)
        self._child, self._reason = child, None
        self._records.reset()
        return child

    def _died(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stderr is not None
        try:
            said = child.stderr.read(4096) or b""
        except OSError:
            said = b""
        code = child.wait()
        words = said.decode("utf-8", "replace").strip().splitlines()
        self._reason = f"journalctl exited with {code}" + (f": {words[-1]}" if words else "")
        self._child = None
        self._next_start = time.monotonic() + self._restart_after
        log.warning("journal of %s: %s", self.unit, self._reason)

    def fileno(self) -> int | None:
        child = self._child
        return child.stdout.fileno() if child is not None and child.stdout is not None else None

    def close(self) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        child.terminate()
        try:
            child.wait(timeout=2)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        for stream in (child.stdout, child.stderr):
            if stream is not None:
                stream.close()


# Seconds before `since` a container record may be stamped and still be read: the runtime stamps
# a record after the process wrote it, and the process start is exact to a clock tick, so only
# the two clocks' granularity matters (a restart in the same container follows the last exit).
ENTRY_SKEW = 0.1


class LogSource:
    """Follows one target's log and keeps what its markers said, for `sample()` to report.

    `since` (unix seconds) is where a journal is read from, and the oldest container record read:
    the server process's start time when known, else now; never the whole history. A plain file
    is read from its end, or from its start when listed in `whole_files` (it is known to be this
    process's own, exporter/logfind.py). Several files (stdout's and stderr's) feed one parser.
    """

    def __init__(
        self,
        config: LogConfig,
        *,
        since: float | None = None,
        whole_files: Collection[str] = (),
        clock: Callable[[], float] = time.time,
        journalctl: str = "journalctl",
        read_budget: int = READ_BUDGET,
        restart_after: float = JOURNAL_RESTART_SECONDS,
        opener: Callable[[str], int] | None = None,
        rights: Callable[[], Rights] | None = None,
        origin: float | None = None,
        cpu_clock: Callable[[], float] = time.thread_time,
        cpu_share: float = CPU_SHARE,
        model: str | None = None,
    ) -> None:
        """`opener` opens a log file for reading, `rights` are those journalctl runs with (a
        found log: its process's own); `origin` is the start of the one process whose log this
        is (a found log), which dates the lines stamped with the time since it
        (exporter/logmarkers.py); `cpu_clock` is the CPU time of the thread that samples (a
        test counts work with it); `model`: the one model, of a server serving several, whose
        events are wanted (the lines naming others are none of its)."""
        self._clock = clock
        self._budget = read_budget
        self._cpu_clock = cpu_clock
        self._cpu_share = cpu_share
        self._cpu_left = CPU_BURST
        self._cpu_checked_at: float | None = None
        self._skipped = 0
        self._finishing = False
        self._closed = False
        self._parser = MarkerParser(config.format, origin, model)
        self._timeline = StepTimeline()
        self._events: deque[LogEvent] = deque(maxlen=MAX_EVENTS)
        self._journal_lines = 0
        self._lock = threading.Lock()
        self._bytes = 0
        self._last_line_at: float | None = None
        self._announced_unknown = False
        self._files: list[_FileReader] = []
        self._journal: _JournalReader | None = None
        if config.journald_unit:
            self.source = f"journald:{config.journald_unit}"
            start = clock() if since is None else since
            self._journal = _JournalReader(
                config.journald_unit, start, journalctl, restart_after, rights
            )
        elif config.file:
            kind = "file" if config.encoding is LogEncoding.PLAIN else config.encoding.value
            self.source = ", ".join(f"{kind}:{path}" for path in config.files)
            self._files = [_file_reader(path, config.encoding, since, path in whole_files, opener)
                           for path in config.files]  # fmt: skip
        else:
            raise ValueError("log config names neither journald_unit nor file")
        self._reason: str | None = None

    def sample(self) -> LogSample:
        """Read what arrived since the last call (bounded), then report. Never raises for data."""
        with self._lock:
            self._poll()
            return self._snapshot()

    def report(self) -> LogSample:
        """What has been read so far, without reading: for a sampler while `follow` runs."""
        with self._lock:
            return self._snapshot()

    def poll(self) -> None:
        """Read without reporting: the body of `follow`."""
        with self._lock:
            self._poll()

    def follow(self, stop: threading.Event, interval: float = 1.0) -> None:
        """Poll until `stop` is set, waking on journal output or every `interval` for a file."""
        while not stop.is_set():
            fd = self._journal.fileno() if self._journal is not None else None
            if fd is None:
                stop.wait(interval)
            else:
                with contextlib.suppress(OSError, ValueError):
                    select.select([fd], [], [], interval)
            self.poll()

    def close(self) -> None:
        with self._lock:
            self._close()

    def finish(self) -> None:
        """Its process is gone: the next sample reads what it wrote last (within the budgets)
        and closes the file or the journal; later samples only report."""
        self._finishing = True

    def _close(self) -> None:
        if self._journal is not None:
            self._journal.close()
        for reader in self._files:
            reader.close()

    def _poll(self) -> None:
        if self._closed:
            return
        now = self._clock()
        try:
            if self._files:
                self._poll_files(now)
            elif self._journal is not None:
                self._poll_journal(now)
        except Exception as exc:  # a bad byte must never take the exporter down
            self._reason = f"log reader error: {exc!r}"
            log.exception("log source %s", self.source)
        self._announce()
        if self._finishing:
            self._close()
            self._closed = True

    def _allowance(self, now: float) -> float:
        """CPU seconds this sample may spend: CPU_SHARE of the time since the last, saved up
        to CPU_BURST, less what earlier samples overspent (one chunk's worth at most)."""
        if self._cpu_checked_at is not None:
            earned = max(0.0, now - self._cpu_checked_at) * self._cpu_share
            self._cpu_left = min(CPU_BURST, self._cpu_left + earned)
        self._cpu_checked_at = now
        return self._cpu_left

    def _spend(self, started: float, allowance: float) -> bool:
        """Charge the CPU spent since `started`; whether the sample may go on parsing."""
        spent = self._cpu_clock() - started
        self._cpu_left = allowance - spent
        return spent < allowance

    def _poll_files(self, now: float) -> None:
        lines_before = self._lines_total
        reasons = []
        allowance, started = self._allowance(now), self._cpu_clock()
        if allowance <= 0:  # overspent: what arrived waits, and is skipped if it is too much
            return
        budget = self._budget // len(self._files)
        within = True
        for reader in self._files:
            left = budget
            reason = None
            while within and left > 0:
                read, reason = reader.read(min(PARSE_CHUNK, left))
                self._bytes += read
                left -= read
                self._parse(reader, now)
                within = self._spend(started, allowance)
                if read == 0:
                    break
            if not within or left <= 0:
                self._skipped += reader.skip()
            reasons.append(reason)
        self._reason = next((r for r in reasons if r is not None), None)
        if self._lines_total != lines_before:
            self._last_line_at = now

    def _parse(self, reader: _FileReader, now: float) -> None:
        for ref, text in reader.decoder.take():
            self._take(self._parser.feed(text, now if ref is None else min(ref, now)))
        for ref, tail in reader.decoder.tails():
            if tail:
                self._take(self._parser.peek(tail, now if ref is None else min(ref, now)))

    def _poll_journal(self, now: float) -> None:
        assert self._journal is not None
        allowance, started = self._allowance(now), self._cpu_clock()
        if allowance <= 0:
            return
        left = self._budget
        while left > 0:
            entries, read, self._reason = self._journal.read(min(PARSE_CHUNK, left))
            self._bytes += read
            left -= read
            self._feed_journal(entries, now)
            if not self._spend(started, allowance):
                break
            if read == 0:
                return
        self._skipped += self._journal.skip(JOURNAL_SKIP_LIMIT)

    def _feed_journal(self, entries: list[JournalEntry], now: float) -> None:
        for entry in entries:
            text = entry.message
            self._journal_lines += 1 + text.count("\r") + text.count("\n") - text.count("\r\n")
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE]
            ref = entry.realtime if entry.realtime is not None else now
            self._take(self._parser.feed(text, min(ref, now)))
        if entries:
            self._last_line_at = now

    @property
    def _lines_total(self) -> int:
        return self._journal_lines + sum(reader.decoder.lines for reader in self._files)

    def _take(self, events: Sequence[LogEvent]) -> None:
        for event in events:
            self._events.append(event)
            self._timeline.apply(event)

    def _announce(self) -> None:
        if self._parser.unknown_announced and not self._announced_unknown:
            self._announced_unknown = True
            log.warning(
                "log %s: %s; phases come from the other signals", self.source,
                self._parser.format_reason,
            )  # fmt: skip

    def _snapshot(self) -> LogSample:
        timeline = self._timeline
        return LogSample(
            up=self._reason is None,
            reason=self._reason,
            source=self.source,
            format=self._parser.format,
            format_reason=self._parser.format_reason,
            events=tuple(self._events),
            last_seq=self._parser.seq,
            step=timeline.step,
            step_since=timeline.since,
            steps=tuple(timeline.durations.items()),
            weights=timeline.weights,
            cuda_graphs=timeline.cuda_graphs,
            ready_at=timeline.ready_at,
            fatal=timeline.fatal,
            lines_total=self._lines_total,
            bytes_total=self._bytes,
            last_line_at=self._last_line_at,
            skipped_bytes=self._skipped,
            closed=self._closed,
        )


def _file_reader(
    path: str,
    encoding: LogEncoding,
    since: float | None,
    from_start: bool,
    opener: Callable[[str], int] | None,
) -> _FileReader:
    """A reader of one log file in its encoding, starting where `LogSource` says."""
    if encoding is LogEncoding.PLAIN:
        return _FileReader(
            path, _PlainText(), lambda fd, size: 0 if from_start else size, opener=opener
        )
    parse = _PARSERS[encoding]
    oldest = None if since is None else since - ENTRY_SKEW
    successor = _next_restart if encoding is LogEncoding.CRI else None

    def first_offset(fd: int, size: int) -> int:
        return 0 if oldest is None else offset_since(fd, size, oldest, parse)

    return _FileReader(path, _ContainerText(parse, oldest), first_offset, successor, opener)


def _open_plain(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


def new_events(sample: LogSample, after_seq: int) -> tuple[LogEvent, ...]:
    """The events of `sample` a reader that last saw `after_seq` has not seen yet."""
    return tuple(e for e in sample.events if e.seq > after_seq)
