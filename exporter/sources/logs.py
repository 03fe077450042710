"""Follow a model server's log (a file or a systemd unit's journal) and turn it into step events.

Reading never blocks the sampler: a file is read with pread up to a byte budget per sample, and
journald is read from a `journalctl --follow` child through a non-blocking pipe. Per-sample
polling is enough for both: nothing is lost between samples (the file keeps its bytes; journalctl
blocks on a full pipe, which is enlarged to 1 MiB, and resumes where it stopped), and the tracker
acts once per interval anyway. `follow()` runs the same polling from a thread that wakes on new
journal output, for a log so busy that one interval's output outgrows the pipe.

Memory stays bounded whatever arrives: a line longer than `MAX_LINE` is cut there (the rest is
skipped up to its end), bytes that are not UTF-8 become U+FFFD, and only the last `MAX_EVENTS`
events are kept (each carries a sequence number, so a reader knows what it has seen).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import shutil
import stat
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from exporter.config import LogConfig
from exporter.logmarkers import LogEvent, MarkerParser, StepTimeline
from exporter.vocabulary import LogFormat, Step

log = logging.getLogger(__name__)

MAX_LINE = 64 * 1024  # bytes of one line kept; markers sit at a line's start
READ_BUDGET = 8 * 1024 * 1024  # bytes read per sample at most; the rest waits for the next one
MAX_EVENTS = 1024
JOURNAL_PIPE_SIZE = 1 << 20
JOURNAL_RESTART_SECONDS = 5.0
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, absent from the fcntl module before Python 3.10 on some
_TERMINATORS = (b"\n", b"\r")


@dataclass(frozen=True)
class LogSample:
    """What the server's log said, up to this sample."""

    up: bool  # the log can be read (a missing file or a dead journalctl is not up)
    reason: str | None  # why not up, in words
    source: str  # "file:/var/log/sglang.log" or "journald:sglang.service"
    format: LogFormat | None  # the format in use; None while `auto` has not decided
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


def _first_terminator(data: bytes) -> int:
    """Index of the first `\\n` or `\\r`, or -1."""
    found = [i for i in (data.find(t) for t in _TERMINATORS) if i >= 0]
    return min(found) if found else -1


class _FileReader:
    """Follows a path like `tail -F`: through rename rotation, truncation and absence.

    The first time the file is found it is read from its end (its history is an older load's),
    unless it did not exist when following began: then all of it is new.
    """

    def __init__(self, path: str, lines: _Lines) -> None:
        self.path = path
        self._lines = lines
        self._fd: int | None = None
        self._identity: tuple[int, int] | None = None
        self._offset = 0
        self._from_end = os.path.exists(path)

    def read(self, budget: int) -> tuple[str, int, str | None]:
        """(text of whole lines, bytes read, reason the file cannot be read or None)."""
        reason = None
        if self._fd is None:
            reason = self._open()
            if self._fd is None:
                return "", 0, reason
        texts, read = [], 0
        try:
            current = os.stat(self.path)
            identity: tuple[int, int] | None = (current.st_dev, current.st_ino)
        except OSError:
            identity = None  # renamed away and not recreated yet: finish the old one
        if identity is not None and identity != self._identity:
            text, read = self._drain(budget)  # rotated: the old file's last lines first
            texts += [text, self._lines.flush()]
            self._close()
            reason = self._open()
            budget -= read
        if self._fd is not None:
            if os.fstat(self._fd).st_size < self._offset:  # truncated (copytruncate)
                texts.append(self._lines.flush())
                self._offset = 0
            text, more = self._drain(budget)
            texts.append(text)
            read += more
        return "".join(texts), read, reason

    def _open(self) -> str | None:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
        except FileNotFoundError:
            self._from_end = False
            return f"{self.path} does not exist (yet)"
        except OSError as exc:
            return f"cannot open {self.path}: {exc.strerror}"
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return f"{self.path} is not a regular file"
        self._fd, self._identity = fd, (st.st_dev, st.st_ino)
        self._offset = st.st_size if self._from_end else 0
        self._from_end = False
        return None

    def _drain(self, budget: int) -> tuple[str, int]:
        assert self._fd is not None
        texts, read = [], 0
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
            texts.append(self._lines.push(data))
        return "".join(texts), read

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def close(self) -> None:
        self._close()

    def fileno(self) -> int | None:
        return None


@dataclass(frozen=True)
class JournalEntry:
    message: str  # MESSAGE, decoded from a byte array where journald stored one
    realtime: float | None  # __REALTIME_TIMESTAMP in unix seconds
    cursor: str | None


def parse_journal_json(line: bytes) -> JournalEntry | None:
    """One line of `journalctl -o json`; None for anything that is not an entry."""
    try:
        entry = json.loads(line)
    except ValueError:
        return None
    if not isinstance(entry, dict):
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
    unit: str, since: float, cursor: str | None, journalctl: str = "journalctl"
) -> list[str]:
    """The follower's command: this boot, from `since` (or just after `cursor`), as JSON.

    `--unit` matches as journalctl always does: the unit's own processes (`_SYSTEMD_UNIT`, from
    their cgroup), plus systemd's and coredumps' messages about the unit.
    """
    start = [f"--after-cursor={cursor}"] if cursor else [f"--since=@{since:.6f}"]
    return [
        journalctl,
        f"--unit={unit}",
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
    ) -> None:
        self.unit = unit
        self._since = since
        self._restart_after = restart_after
        self._journalctl = journalctl
        self._child: subprocess.Popen[bytes] | None = None
        self._cursor: str | None = None
        self._partial = b""
        self._skipping = False
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

    def _split(self, data: bytes, entries: list[JournalEntry]) -> None:
        if self._skipping:
            end = data.find(b"\n")
            if end < 0:
                return
            data, self._skipping = data[end + 1 :], False
        buf = self._partial + data if self._partial else data
        cut = buf.rfind(b"\n") + 1
        self._partial = buf[cut:]
        if len(self._partial) > 8 * MAX_LINE:  # an entry too big to be a log line: skip it
            self._partial, self._skipping = b"", True
        for raw in buf[:cut].splitlines():
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
        command = journalctl_command(self.unit, self._since, self._cursor, path)
        try:
            child = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                close_fds=True,
            )
        except OSError as exc:
            self._reason = f"cannot start journalctl: {exc.strerror}"
            self._next_start = time.monotonic() + self._restart_after
            return None
        assert child.stdout is not None and child.stderr is not None
        for stream in (child.stdout, child.stderr):
            os.set_blocking(stream.fileno(), False)
        with contextlib.suppress(OSError):  # unprivileged limits may refuse; 64 KiB still works
            fcntl.fcntl(child.stdout.fileno(), _F_SETPIPE_SZ, JOURNAL_PIPE_SIZE)
        self._child, self._reason, self._partial, self._skipping = child, None, b"", False
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


class LogSource:
    """Follows one target's log and keeps what its markers said, for `sample()` to report.

    `since` (unix seconds) is where a journal is read from: the server process's start time when
    known, else now; never the journal's whole history. A file is read from its end.
    """

    def __init__(
        self,
        config: LogConfig,
        *,
        since: float | None = None,
        clock: Callable[[], float] = time.time,
        journalctl: str = "journalctl",
        read_budget: int = READ_BUDGET,
        restart_after: float = JOURNAL_RESTART_SECONDS,
    ) -> None:
        self._clock = clock
        self._budget = read_budget
        self._parser = MarkerParser(config.format)
        self._timeline = StepTimeline()
        self._events: deque[LogEvent] = deque(maxlen=MAX_EVENTS)
        self._lines = _Lines()
        self._lock = threading.Lock()
        self._bytes = 0
        self._last_line_at: float | None = None
        self._announced_unknown = False
        self._file: _FileReader | None = None
        self._journal: _JournalReader | None = None
        if config.journald_unit:
            self.source = f"journald:{config.journald_unit}"
            start = clock() if since is None else since
            self._journal = _JournalReader(config.journald_unit, start, journalctl, restart_after)
        elif config.file:
            self.source = f"file:{config.file}"
            self._file = _FileReader(config.file, self._lines)
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
            if self._journal is not None:
                self._journal.close()
            if self._file is not None:
                self._file.close()

    def _poll(self) -> None:
        now = self._clock()
        try:
            if self._file is not None:
                self._poll_file(now)
            elif self._journal is not None:
                self._poll_journal(now)
        except Exception as exc:  # a bad byte must never take the exporter down
            self._reason = f"log reader error: {exc!r}"
            log.exception("log source %s", self.source)
        self._announce()

    def _poll_file(self, now: float) -> None:
        assert self._file is not None
        lines_before = self._lines.lines
        text, read, self._reason = self._file.read(self._budget)
        self._bytes += read
        if text:
            self._take(self._parser.feed(text, now))
        tail = self._lines.peek()
        if tail:
            self._take(self._parser.peek(tail, now))
        if self._lines.lines != lines_before:
            self._last_line_at = now

    def _poll_journal(self, now: float) -> None:
        assert self._journal is not None
        entries, read, self._reason = self._journal.read(self._budget)
        self._bytes += read
        for entry in entries:
            text = entry.message
            self._lines.lines += 1 + text.count("\r") + text.count("\n") - text.count("\r\n")
            if len(text) > MAX_LINE:
                text = text[:MAX_LINE]
            ref = entry.realtime if entry.realtime is not None else now
            self._take(self._parser.feed(text, min(ref, now)))
        if entries:
            self._last_line_at = now

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
            lines_total=self._lines.lines,
            bytes_total=self._bytes,
            last_line_at=self._last_line_at,
        )


def new_events(sample: LogSample, after_seq: int) -> tuple[LogEvent, ...]:
    """The events of `sample` a reader that last saw `after_seq` has not seen yet."""
    return tuple(e for e in sample.events if e.seq > after_seq)
