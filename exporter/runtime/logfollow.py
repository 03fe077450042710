"""Which log a target follows, from when and with whose rights, and when that changes.

A configured `log:` is opened once it is known where to start reading a journal: from the server
process's start (so an exporter started mid-load still reads the whole load's markers), or from
now when no process is configured or it is not running. Without `log:`, each new server process
(a restart too) has its log found afresh (find.py) and read with that process's own rights,
whoever configured the target: the older process's log is closed and a new one found; a model
server a router started, writing into a pipe to it, has its lines in the router's log. Once the
process a found log belongs to is gone, its last lines are read and it is closed
(exporter/sources/logs.py `finish`). A target watching one model of a server serving several
reads only the lines of that model.

`TargetLog` is one target's: the runtime hands it each tick's latest process reading and time,
and samples the `LogSource` it opens. `wanted` and `outlived` decide, touching nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from exporter.config.schema import LogConfig
from exporter.discovery.found import DiscoveredServer
from exporter.logs.find import LogFinding, find_log, find_routed_log
from exporter.runtime.sampler import Reading
from exporter.servers import SERVERS
from exporter.sources.logs import LogSample, LogSource
from exporter.sources.process import ProcessSample
from exporter.trust.asprocess import Borrowed, OnBehalf
from exporter.trust.safeio import open_checked

log = logging.getLogger(__name__)

LOG_OPEN_TIMEOUT = 5.0  # seconds opening a found log with its process's rights may take

# With whose rights the log of server process `pid` is read: the process's own (an OnBehalf), or
# None for the exporter's. Raises Borrowed (its rights are lent to it: its log is not read) or
# ProcessLookupError (its credentials cannot be read: the exporter's own rights then).
RightsOf = Callable[[int], OnBehalf | None]


@dataclass(frozen=True)
class Configured:
    """Open the configured log; a journal is read from `since` (unix s)."""

    since: float


@dataclass(frozen=True)
class FindFor:
    """Find afresh the log of the server process `pid` that started at `start` (unix s)."""

    pid: int
    start: float


@dataclass(frozen=True)
class Switch:
    """What the target's log loop does after an update: stop sampling the older log (its last
    reading goes too: its events' numbers are another log's), then sample `opened`, if any."""

    stopped: bool
    opened: LogSource | None


def wanted(
    configured: bool,
    following: bool,
    found_for: tuple[int, float] | None,
    process: Reading[ProcessSample] | None,
    *,
    watched: bool,
    now: float,
) -> Configured | FindFor | None:
    """What to open now, if anything. `watched`: the target has a process configured, and
    `process` is its latest reading (None: the first is not in yet); `found_for`: the process
    (root pid, start) the log followed now was found for."""
    if watched and process is None:
        return None  # where a journal starts reading waits for the process's start
    sample = process.good if process is not None else None
    start = sample.start_time if sample is not None and sample.found else None
    if configured:
        return None if following else Configured(now if start is None else start)
    if sample is None or start is None or sample.root_pid is None:
        return None
    if (sample.root_pid, start) == found_for:
        return None
    return FindFor(sample.root_pid, start)


def outlived(found_for: tuple[int, float] | None, process: ProcessSample | None) -> bool:
    """A process reading says the process a found log belongs to is no longer the server's
    root: gone, or replaced by a restart. Nothing read (None) says nothing."""
    if process is None or found_for is None:
        return False
    root = process.root_pid if process.found else None
    return root != found_for[0]


def read_every_interval(reading: Reading[LogSample] | None) -> bool:
    """A server that loads models in place (Triton): only its log says at once that a load began
    inside it, so it is read every interval even when quiet (a pread of nothing new, some
    microseconds)."""
    kind = reading.good.format if reading is not None and reading.good is not None else None
    return kind is not None and SERVERS[kind].loads_in_place


class TargetLog:
    """One target's log: the source following it, the last of its events handed to the
    tracker, and where an unconfigured one was found for which process (or why none was)."""

    def __init__(
        self,
        name: str,
        configured: LogConfig | None,
        rights: RightsOf,
        *,
        clock: Callable[[], float] = time.time,
        proc_root: str = "/proc",
        host_root: str = "/",
    ) -> None:
        """`host_root`: where the container runtimes' logs are (find.py)."""
        self.name = name
        self.configured = configured
        self.source: LogSource | None = None
        self.seq = 0  # the last log event handed to the tracker
        # Where the followed log was found, or why none was; replaced whole (a snapshot reads it).
        self.finding: LogFinding | None = None
        self.found_for: tuple[int, float] | None = None  # the process (pid, start) it was found for
        self._rights = rights
        self._clock = clock
        self._proc_root = proc_root
        self._host_root = host_root

    def update(
        self,
        now: float,
        process: Reading[ProcessSample] | None,
        *,
        watched: bool,
        found: DiscoveredServer | None = None,
        model: str | None = None,
    ) -> Switch | None:
        """Open the log `wanted` says, closing an older process's; None: nothing changed.
        `found`: the server as discovery last found it (None: configured); `model`: the one
        model of a server serving several this target watches (exporter/runtime/admission.py)."""
        move = wanted(
            self.configured is not None,
            self.source is not None,
            self.found_for,
            process,
            watched=watched,
            now=now,
        )
        if move is None:
            return None
        if isinstance(move, Configured):
            assert self.configured is not None
            self.source = self._open(self.configured, move.since, model=model)
            return Switch(stopped=False, opened=self.source)
        stopped = self.source is not None
        self.close()
        self.source, self.seq, self.found_for = None, 0, (move.pid, move.start)
        finding, behalf = self._find(move, found)
        self.finding = finding
        if finding.config is None:
            log.info("target %s: no log found: %s", self.name, finding.why)
            return Switch(stopped, opened=None)
        log.info("target %s: following its log: %s", self.name, finding.why)
        self.source = self._open(
            finding.config,
            move.start,
            finding.whole_files,
            behalf,
            origin=move.start,
            model=model,
            lines_of=finding.lines_of,
        )
        return Switch(stopped, opened=self.source)

    def process_seen(self, process: ProcessSample | None) -> None:
        """A process reading came in: once a found log's process is gone, read its last lines."""
        if self.source is not None and outlived(self.found_for, process):
            self.source.finish()

    def close(self) -> None:
        if self.source is not None:
            self.source.close()

    def _find(
        self, move: FindFor, server: DiscoveredServer | None
    ) -> tuple[LogFinding, OnBehalf | None]:
        """A found log is its process's: read with its rights, whoever configured the target."""
        behalf = None
        try:
            behalf = self._rights(move.pid)
        except Borrowed as exc:
            return LogFinding(None, f"its log is not read: {exc}"), None
        except ProcessLookupError:
            pass  # a configured target's process whose credentials cannot be read (gone, or a
            # /proc tree without them): its log, if any is found, with the exporter's rights
        roots = {"proc_root": self._proc_root, "host_root": self._host_root}
        found = find_log(move.pid, move.start, **roots)
        if found.config is None and server is not None and server.router_pid is not None:
            # A router's model server writes into a pipe to its router, whose log has its lines.
            port = int(server.url.rsplit(":", 1)[-1])
            found = find_routed_log(server.router_pid, server.router_start, port, **roots)
        return found, behalf

    def _open(
        self,
        config: LogConfig,
        since: float,
        whole_files: tuple[str, ...] = (),
        behalf: OnBehalf | None = None,
        origin: float | None = None,
        model: str | None = None,
        lines_of: str | None = None,
    ) -> LogSource:
        """Follow `config`: `behalf` of the process whose log it is, else (a configured `log:`)
        with the exporter's own rights; `origin`: the start of the one process the log belongs
        to (a found log), else None; `model`: the one model whose lines are wanted; `lines_of`:
        the mark of its lines in a log it shares."""
        return LogSource(
            config,
            since=since,
            whole_files=whole_files,
            clock=self._clock,
            opener=log_opener(behalf) if behalf is not None else None,
            rights=behalf.current if behalf is not None else None,
            origin=origin,
            model=model,
            lines_of=lines_of,
        )


def log_opener(behalf: OnBehalf) -> Callable[[str], int]:
    """Opens a found log as its process would read it: with its rights (a file it may not read
    is PermissionError), a regular file only (Refused), within LOG_OPEN_TIMEOUT (a hung mount)."""

    def opener(path: str) -> int:
        return behalf.run(lambda: open_checked(path)[0], LOG_OPEN_TIMEOUT)

    return opener
