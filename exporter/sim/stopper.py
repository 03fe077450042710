"""How a simulated server (and each of its ranks) stops: signals turned into a flag and a wake-up
pipe, and the two ways a run ends early (stopped, or a scripted or real crash)."""

from __future__ import annotations

import os
import select
import signal
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from types import FrameType


class Stopped(Exception):
    """SIGTERM or SIGINT arrived: unwind and exit cleanly."""


class Crash(Exception):
    """The server fails: a scripted failure, a rank that died, a shard it cannot load."""

    def __init__(self, stage: str, reason: str) -> None:
        super().__init__(reason)
        self.stage = stage
        self.reason = reason


class Stopper:
    """Turns SIGTERM/SIGINT into a flag plus a wake-up pipe.

    Every wait of the simulation is a `select` on that pipe, so a signal ends even a stall of days
    within moments, and the handler does nothing that could deadlock (no locks, no exceptions
    thrown into arbitrary code).
    """

    def __init__(self) -> None:
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        self.requested = False

    def request(self, signum: int = 0, frame: FrameType | None = None) -> None:
        self.requested = True
        with suppress(BlockingIOError):  # a full pipe already holds a wake-up
            os.write(self._write_fd, b"\0")

    def wait(self, seconds: float, fds: Sequence[int] = ()) -> list[int]:
        """Wait up to `seconds` for one of `fds` to be readable; those that are (none: time ran
        out). Raise `Stopped` as soon as a stop is requested."""
        deadline = time.monotonic() + seconds
        while not self.requested:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return []
            readable, _, _ = select.select([self._read_fd, *fds], [], [], min(remaining, 3600.0))
            ready = [fd for fd in readable if fd != self._read_fd]
            if ready and not self.requested:
                return ready
        raise Stopped

    def sleep(self, seconds: float) -> None:
        """Wait `seconds` (0 just checks); raise `Stopped` as soon as a stop is requested."""
        self.wait(seconds)

    @contextmanager
    def installed(self, interrupt: bool = True) -> Iterator[Stopper]:
        """Handle SIGTERM (and SIGINT, or ignore it: a rank leaves Ctrl-C to its server)."""
        handlers = {signal.SIGTERM: self.request, signal.SIGINT: self.request}
        if not interrupt:
            handlers[signal.SIGINT] = signal.SIG_IGN  # type: ignore[assignment]
        previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
        try:
            yield self
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            os.close(self._read_fd)
            os.close(self._write_fd)
