"""Run each data source on its own thread at a fixed interval and keep its latest reading.

One thread per source is the simplest arrangement that meets the hard rule: a probe that hangs for
its whole timeout, or a residency pass over half a terabyte, must never delay another source or a
scrape. Scrapes only ever read the latest immutable `Reading`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

from exporter.sources import SourceKey
from exporter.sources.sample import FINE, Health, Sample

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Reading(Generic[T]):
    """The outcome of one sample of one source."""

    source: str
    target: str  # "" for host-wide sources
    value: T | None  # the source's dataclass; None when the sample raised
    ok: bool
    error: str | None
    duration_seconds: float
    finished_at: float  # unix seconds

    @property
    def good(self) -> T | None:
        """The value when the sample succeeded, else None."""
        return self.value if self.ok else None


def health(value: object) -> Health:
    """What a sample says of itself (a loop's return value that is no sample says nothing)."""
    return value.health() if isinstance(value, Sample) else FINE


class Periodic:
    """Calls `fn` on a daemon thread until stopped, `every()` seconds apart.

    `every` is asked after each call, so a source may change its own pace (the endpoint probe
    slows down while a server is ready and speeds up while it initializes); `wake()` makes the
    loop ask again at once, for when the pace should change before the current wait is over.
    Calls are spaced from when each was due, not from when the previous one ended, so a fixed
    interval does not drift.
    """

    def __init__(
        self, name: str, every: float | Callable[[], float], fn: Callable[[], object]
    ) -> None:
        self.name = name
        self._every = every if callable(every) else (lambda: every)
        self._fn = fn
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by wake(), run_soon() and stop()
        self._soon = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def run_soon(self) -> None:
        """Call `fn` now rather than when it is next due (the schedule goes on from there)."""
        self._soon = True
        self._wake.set()

    def join(self, timeout: float) -> None:
        if self._thread.ident is not None:  # never started: nothing to wait for
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        due = time.monotonic()
        while not self._stop.is_set():
            try:
                self._fn()
            except Exception:  # a bug in one loop must not kill the thread silently
                log.exception("%s: unexpected error", self.name)
            while not self._stop.is_set():
                now = time.monotonic()
                next_due = due + self._delay()
                if next_due <= now:  # overran (a slow probe): again now, no burst to catch up
                    due = now
                    break
                if not self._wake.wait(next_due - now):
                    due = next_due
                    break
                self._wake.clear()  # woken: ask for the delay again, or run now
                if self._soon:
                    self._soon = False
                    due = time.monotonic()
                    break

    def _delay(self) -> float:
        try:
            return max(0.0, float(self._every()))
        except Exception:
            log.exception("%s: cannot tell the next delay", self.name)
            return 1.0


LoopFactory = Callable[[str, float | Callable[[], float], Callable[[], object]], Periodic]


def _loop_name(source: SourceKey[Any], target: str) -> str:
    return f"{source.name}:{target}" if target else source.name


class Sampler:
    """Owns the periodic source threads and their latest readings.

    Sources may come and go while it runs (discovered targets): `add` starts a loop at once when
    the sampler is running and replaces one already registered under the same key, `remove`
    stops a target's loops and forgets its readings.
    """

    def __init__(
        self,
        interval: float,
        clock: Callable[[], float] = time.time,
        periodic: LoopFactory = Periodic,
    ) -> None:
        """`periodic` makes each loop: a timer thread, or a loop a test steps by hand."""
        self.interval = interval
        self._clock = clock
        self._periodic = periodic
        self._lock = threading.Lock()
        self._latest: dict[tuple[str, str], Reading[Any]] = {}
        self._loops: dict[tuple[str, str], Periodic] = {}
        self._failing: set[tuple[str, str]] = set()
        self._running = False

    def add(
        self,
        source: SourceKey[T],
        target: str,
        fn: Callable[[], T],
        every: Callable[[], float] | None = None,
        after: Callable[[Reading[T]], None] | None = None,
    ) -> None:
        """Register a source; `fn` returns its dataclass or raises. `every` paces it when the
        sample interval does not (asked after each sample); `after` sees each stored reading."""

        def sample() -> None:
            reading = self.run_once(source, target, fn, loop)
            if after is not None:
                after(reading)

        loop = self._periodic(_loop_name(source, target), every or self.interval, sample)
        self._register((source.name, target), loop)

    def add_loop(
        self, name: str, fn: Callable[[], None], every: Callable[[], float] | None = None
    ) -> None:
        """Register a periodic task that is not a source (the tracker tick, discovery)."""
        self._register((name, ""), self._periodic(name, every or self.interval, fn))

    def run_soon(self, name: str) -> None:
        """Run a loop added with add_loop (the tracker tick) now rather than when due."""
        self._loop_at((name, ""), Periodic.run_soon)

    def sample_soon(self, source: SourceKey[Any], target: str = "") -> None:
        """Take a source's next sample now rather than when due."""
        self._loop_at((source.name, target), Periodic.run_soon)

    def wake_all(self) -> None:
        """Have every loop re-ask its pace now (the exporter stops being quiet)."""
        with self._lock:
            loops = list(self._loops.values())
        for loop in loops:
            loop.wake()

    def _loop_at(self, key: tuple[str, str], action: Callable[[Periodic], None]) -> None:
        with self._lock:
            loop = self._loops.get(key)
        if loop is not None:
            action(loop)

    def _register(self, key: tuple[str, str], loop: Periodic) -> None:
        with self._lock:
            old, self._loops[key] = self._loops.get(key), loop
            running = self._running
        if old is not None:
            old.stop()
        if running:
            loop.start()

    def discard(self, source: SourceKey[Any], target: str) -> None:
        """Stop one source of one target, if it runs, and drop its reading."""
        key = (source.name, target)
        with self._lock:
            loop = self._loops.pop(key, None)
            self._latest.pop(key, None)
        if loop is not None:
            loop.stop()

    def remove(self, target: str) -> None:
        """Stop every source of one target and drop its readings."""
        with self._lock:
            keys = [key for key in self._loops if key[1] == target]
            loops = [self._loops.pop(key) for key in keys]
            for key in [key for key in self._latest if key[1] == target]:
                del self._latest[key]
        for loop in loops:
            loop.stop()

    def run_once(
        self,
        source: SourceKey[T],
        target: str,
        fn: Callable[[], T],
        loop: Periodic | None = None,
    ) -> Reading[T]:
        """Take one sample now and store it; public so tests can step sources by hand.

        A sample of `loop` that ends after its loop was discarded or replaced is not stored: the
        reading of a source the runtime let go (an older process's log) must not come back.
        """
        key = (source.name, target)
        started = time.monotonic()
        try:
            value, error = fn(), None
        except Exception as exc:
            value, error = None, f"{type(exc).__name__}: {exc}"
        said = health(value)
        ok = error is None and said.up
        if not ok:
            error = error or said.reason or "source reported down"
        reading = Reading(
            source=source.name,
            target=target,
            value=value,
            ok=ok,
            error=error,
            duration_seconds=time.monotonic() - started,
            finished_at=self._clock(),
        )
        with self._lock:
            current = loop is None or self._loops.get(key) is loop
            if current:
                self._latest[key] = reading
        if current:
            self._note_transition(key, reading)
        return reading

    def _note_transition(self, key: tuple[str, str], reading: Reading[Any]) -> None:
        """Log when a source starts or stops failing, not on every sample."""
        name = f"{key[0]}:{key[1]}" if key[1] else key[0]
        if not reading.ok and key not in self._failing:
            self._failing.add(key)
            log.warning("source %s is down: %s", name, reading.error)
        elif reading.ok and key in self._failing:
            self._failing.discard(key)
            log.info("source %s is up again", name)

    def latest(self, source: SourceKey[T], target: str = "") -> Reading[T] | None:
        with self._lock:
            return cast("Reading[T] | None", self._latest.get((source.name, target)))

    def value(self, source: SourceKey[T], target: str = "") -> T | None:
        """The latest successful sample of a source, or None."""
        reading = self.latest(source, target)
        return reading.good if reading is not None else None

    def readings(self) -> list[Reading[Any]]:
        with self._lock:
            return list(self._latest.values())

    def start(self) -> None:
        with self._lock:
            self._running = True
            loops = list(self._loops.values())
        for loop in loops:
            loop.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop every loop; a source stuck in a syscall is a daemon thread and is left behind."""
        with self._lock:
            self._running = False
            loops = list(self._loops.values())
        for loop in loops:
            loop.stop()
        deadline = time.monotonic() + timeout
        for loop in loops:
            loop.join(max(0.0, deadline - time.monotonic()))
        stuck = [loop.name for loop in loops if loop.alive]
        if stuck:
            log.warning("still running after stop: %s", ", ".join(stuck))
