"""Follow a systemd unit's journal from a `journalctl --follow` child.

The child is read through a non-blocking pipe, so reading never blocks the sampler; nothing is
lost between samples (journalctl blocks on a full pipe, which is enlarged to 1 MiB, and resumes
where it stopped). A child that dies is restarted after its cursor.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from exporter.logs.decode import Records, json_object

if TYPE_CHECKING:
    from exporter.trust.asprocess import Rights

log = logging.getLogger(__name__)

JOURNAL_PIPE_SIZE = 1 << 20
JOURNAL_RESTART_SECONDS = 5.0
_F_SETPIPE_SZ = 1031  # fcntl.F_SETPIPE_SZ, absent from the fcntl module before Python 3.10 on some


@dataclass(frozen=True)
class JournalEntry:
    message: str  # MESSAGE, decoded from a byte array where journald stored one
    realtime: float | None  # __REALTIME_TIMESTAMP in unix seconds
    cursor: str | None


def parse_journal_json(line: bytes) -> JournalEntry | None:
    """One line of `journalctl -o json`; None for anything that is not an entry."""
    entry = json_object(line)
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


class JournalReader:
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
        self._records = Records()
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
