"""Follow a model server's log (files or a systemd unit's journal) and turn it into step events.

A file is followed by exporter/logs/files.py and a journal by exporter/logs/journal.py, each read
without blocking up to a byte budget per sample; exporter/logs/markers.py turns the lines into
events. Per-sample polling is enough for both: nothing is lost between samples, and the tracker
acts once per interval anyway. `follow()` runs the same polling from a thread that wakes on new
journal output, for a log so busy that one interval's output outgrows the journal's pipe.

CPU stays bounded whatever arrives: text is read and parsed PARSE_CHUNK at a time, and once a
sample has spent its share of the CPU (CPU_SHARE of a core, saved up to CPU_BURST) or read
READ_BUDGET, what else is there now is skipped unread and counted (`skipped_bytes`): a server that
writes 10 MB/s of lines no rule knows costs its share and no more, and the reader never falls
behind (markers in a skipped stretch are lost; the log says how many bytes). When the process
whose log it is has gone, `finish()` has the next sample read its last lines and close it.

Memory stays bounded whatever arrives: lines and records are cut or skipped past their bounds
(exporter/logs/decode.py), and only the last `MAX_EVENTS` events are kept (each carries a
sequence number, so a reader knows what it has seen).
"""

from __future__ import annotations

import contextlib
import logging
import select
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from exporter.config.schema import LogConfig
from exporter.load.events import LogEvent
from exporter.load.steps import StepTimeline
from exporter.logs.decode import MAX_LINE
from exporter.logs.files import FileReader, file_reader
from exporter.logs.journal import JOURNAL_RESTART_SECONDS, JournalEntry, JournalReader
from exporter.logs.markers import MarkerParser
from exporter.sources.sample import Health, Sample
from exporter.vocabulary import LogEncoding, Step

if TYPE_CHECKING:
    from exporter.trust.asprocess import Rights

log = logging.getLogger(__name__)

READ_BUDGET = 8 * 1024 * 1024  # bytes parsed per sample at most; more than that is skipped
CPU_SHARE = 0.05  # of one core, on average, that parsing one target's log may take
CPU_BURST = 0.25  # seconds of CPU one sample may take at most, saved up while the log was quiet
PARSE_CHUNK = 64 * 1024  # bytes read and parsed between two looks at the CPU spent
MAX_EVENTS = 1024
JOURNAL_SKIP_LIMIT = 8 * READ_BUDGET  # bytes of journal output dropped unparsed per sample at most


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


class LogSource:
    """Follows one target's log and keeps what its markers said, for `sample()` to report.

    `since` (unix seconds) is where a journal is read from, and the oldest container record read:
    the server process's start time when known, else now; never the whole history. A plain file
    is read from its end, or from its start when listed in `whole_files` (it is known to be this
    process's own, exporter/logs/find.py). Several files (stdout's and stderr's) feed one parser.
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
        lines_of: str | None = None,
    ) -> None:
        """`opener` opens a log file for reading, `rights` are those journalctl runs with (a
        found log: its process's own); `origin` is the start of the one process whose log this
        is (a found log), which dates the lines stamped with the time since it
        (exporter/logs/markers.py); `cpu_clock` is the CPU time of the thread that samples (a
        test counts work with it); `model`: the one model, of a server serving several, whose
        events are wanted (the lines naming others are none of its); `lines_of`: the mark of
        the process's lines in a log it shares (a router's `[PORT] `)."""
        self._clock = clock
        self._budget = read_budget
        self._cpu_clock = cpu_clock
        self._cpu_share = cpu_share
        self._cpu_left = CPU_BURST
        self._cpu_checked_at: float | None = None
        self._skipped = 0
        self._finishing = False
        self._closed = False
        self._parser = MarkerParser(config.format, origin, model, lines_of)
        self._timeline = StepTimeline()
        self._events: deque[LogEvent] = deque(maxlen=MAX_EVENTS)
        self._journal_lines = 0
        self._lock = threading.Lock()
        self._bytes = 0
        self._last_line_at: float | None = None
        self._announced_unknown = False
        self._files: list[FileReader] = []
        self._journal: JournalReader | None = None
        if config.journald_unit:
            self.source = f"journald:{config.journald_unit}"
            start = clock() if since is None else since
            self._journal = JournalReader(
                config.journald_unit, start, journalctl, restart_after, rights
            )
        elif config.file:
            kind = "file" if config.encoding is LogEncoding.PLAIN else config.encoding.value
            self.source = ", ".join(f"{kind}:{path}" for path in config.files)
            self._files = [file_reader(path, config.encoding, since, path in whole_files, opener)
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

    def _parse(self, reader: FileReader, now: float) -> None:
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


def new_events(sample: LogSample, after_seq: int) -> tuple[LogEvent, ...]:
    """The events of `sample` a reader that last saw `after_seq` has not seen yet."""
    return tuple(e for e in sample.events if e.seq > after_seq)
