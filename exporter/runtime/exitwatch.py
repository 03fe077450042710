"""Know the moment a watched process exits, at no CPU cost until it does.

A ready server's process is the one thing that can end its readiness without a probe noticing
first, and re-scanning /proc every second to see it still there costs more than everything else
an idle exporter does. A pidfd (Linux >= 5.3) becomes readable when its process exits; one thread
blocks in poll() on all of them and runs a callback per exit. Where pidfds are not available
(older kernels, seccomp) `watch` says so and the caller keeps polling /proc.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ExitWatch:
    """Calls `on_exit` once when a watched process exits; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._poll = select.poll()
        self._wake_read, self._wake_write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._poll.register(self._wake_read, select.POLLIN)
        self._watched: dict[int, tuple[int, Callable[[], None]]] = {}  # pidfd -> (pid, on_exit)
        self._closed = False
        self._thread: threading.Thread | None = None

    def watch(self, pid: int, on_exit: Callable[[], None]) -> bool:
        """Start watching `pid`; False when it cannot be watched (gone already, no pidfd)."""
        try:
            pidfd = os.pidfd_open(pid)
        except (OSError, AttributeError):
            return False
        with self._lock:
            if self._closed:
                os.close(pidfd)
                return False
            self._watched[pidfd] = (pid, on_exit)
            self._poll.register(pidfd, select.POLLIN)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="exit-watch", daemon=True)
                self._thread.start()
        self._nudge()
        return True

    def forget(self, pid: int) -> None:
        """Stop watching `pid` (its target went away, or another process took its place)."""
        with self._lock:
            for pidfd, (watched, _) in list(self._watched.items()):
                if watched == pid:
                    self._drop(pidfd)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for pidfd in list(self._watched):
                self._drop(pidfd)
        self._nudge()
        if self._thread is not None:
            self._thread.join(2.0)
        os.close(self._wake_read)
        os.close(self._wake_write)

    def _drop(self, pidfd: int) -> None:
        """With the lock held."""
        del self._watched[pidfd]
        self._poll.unregister(pidfd)
        os.close(pidfd)

    def _nudge(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.write(self._wake_write, b"\0")

    def _run(self) -> None:
        while True:
            events = self._poll.poll()
            exited: list[Callable[[], None]] = []
            with self._lock:
                if self._closed:
                    return
                for fd, _ in events:
                    if fd == self._wake_read:
                        with contextlib.suppress(BlockingIOError):
                            os.read(self._wake_read, 4096)
                    elif fd in self._watched:
                        exited.append(self._watched[fd][1])
                        self._drop(fd)
            for on_exit in exited:
                try:
                    on_exit()
                except Exception:  # one callback's bug must not stop the watch of the others
                    log.exception("exit callback failed")
