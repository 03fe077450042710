"""Follow a log file like `tail -F`, through rename rotation, truncation and absence.

Reading never blocks the sampler: a file is read with pread up to a byte budget per sample, and
nothing is lost between samples (the file keeps its bytes). A container runtime's file is read
from its first record stamped at or after the process's start, found by bisection.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable

from exporter.logs.decode import (
    PARSERS,
    TERMINATORS,
    ContainerText,
    Decoder,
    PlainText,
    offset_since,
)
from exporter.vocabulary import LogEncoding

log = logging.getLogger(__name__)

# Seconds before `since` a container record may be stamped and still be read: the runtime stamps
# a record after the process wrote it, and the process start is exact to a clock tick, so only
# the two clocks' granularity matters (a restart in the same container follows the last exit).
ENTRY_SKEW = 0.1


def _next_restart(path: str) -> str:
    """CRI: the kubelet writes a restarted container's log beside the last, `<N+1>.log`."""
    head, name = os.path.split(path)
    stem, dot, ext = name.partition(".")
    if not (stem.isdigit() and dot and ext == "log"):
        return path
    successor = os.path.join(head, f"{int(stem) + 1}.log")
    return successor if os.path.exists(successor) else path


class FileReader:
    """Follows a path like `tail -F`: through rename rotation, truncation and absence.

    The first time the file is found it is read from `first_offset(fd, size)` (its end for a plain
    file whose history is an older load's), unless it did not exist when following began: then
    all of it is new. `successor` names the file that replaces this one when a new one is started
    beside it rather than renamed over it (CRI's next restart).
    """

    def __init__(
        self,
        path: str,
        decoder: Decoder,
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
            self.decoder.skip(within_line=last not in TERMINATORS)
        return skipped

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
        self._fd = None

    def close(self) -> None:
        self._close()


def file_reader(
    path: str,
    encoding: LogEncoding,
    since: float | None,
    from_start: bool,
    opener: Callable[[str], int] | None,
) -> FileReader:
    """A reader of one log file in its encoding, starting where `LogSource` says."""
    if encoding is LogEncoding.PLAIN:
        return FileReader(
            path, PlainText(), lambda fd, size: 0 if from_start else size, opener=opener
        )
    parse = PARSERS[encoding]
    oldest = None if since is None else since - ENTRY_SKEW
    successor = _next_restart if encoding is LogEncoding.CRI else None

    def first_offset(fd: int, size: int) -> int:
        return 0 if oldest is None else offset_since(fd, size, oldest, parse)

    return FileReader(path, ContainerText(parse, oldest), first_offset, successor, opener)


def _open_plain(path: str) -> int:
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
