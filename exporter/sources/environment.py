"""The model server's own environment in the page cache: the files its processes map or hold
open (the interpreter, extension modules, shared libraries, CUDA's: gigabytes), weights left out.

A restart's start-up opens no weight file, yet SGLang's imports took 25 s longer the first time
after its environment left the page cache: what a start costs depends on this residency as much
as the weights' phase depends on theirs. The files are learned from the tree's /proc/PID/maps
and /proc/PID/fd while it runs, and kept across its restarts (the next start maps the same
ones), so a restart's environment is measured before it begins, with the weights' measurement
(cachestat, or mincore where truthful: exporter/storage/pagecache.py). Files the tree read and
closed (Python's sources and bytecode) are not seen: the libraries it maps are most of the
bytes, and their residency goes with the rest (evicted or kept together).

A start reads only the parts of those files it touches (SGLang maps 4 GB of libraries, and a
run keeps 1.5 GB of them cached), so what it needs is what a run keeps in the page cache: the
most of them any pass found cached (`warm_bytes`), and what it must read is that less what is
cached now (`uncached_bytes`).

A file is the environment when the tree maps it or holds it open for reading, lies on storage
(not /proc, /sys, /dev, tmpfs: /dev/shm is memory) and is no weight file (under a weights path,
or named like one). Passes are spaced as the weights' are (`refresh_after`, a CPU budget, and
a pass as soon as the host's page cache lost a share of the environment's size). Each pass made
while no process of the tree ran, and the last one before a new process appeared, is kept a
while, so a finished load can say what its start found (`before`).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from exporter.config.schema import DEFAULT_RESIDENCY_CPU_BUDGET, WeightsConfig
from exporter.sources.process import ProcessSample
from exporter.sources.sample import Health, Sample
from exporter.storage.pagecache import measure
from exporter.storage.weighttree import WeightFile
from exporter.trust.asprocess import OnBehalf
from exporter.trust.safeio import PSEUDO_MAGIC, PSEUDO_PATHS, path_magic

REFRESH_SECONDS = 5.0  # a pass this often while the target is not serving: before a restart
MAX_FILES = 20_000  # files learned per target at most (SGLang on CPU maps about 260)
DEPARTED_SHARE_FOR_PASS = 0.05  # of the environment left the host's page cache: measure again
MIN_DEPARTED_BYTES = 1 << 20
PASSES_KEPT = 8  # passes kept for `before`: those made while the server was down, newest last
PASS_TIMEOUT = 60.0  # a pass run with a process's rights (exporter/asprocess.py)
# Memory file systems: always resident, never read from storage.
MEMORY_MAGIC = frozenset({0x01021994, 0x858458F6})  # tmpfs, ramfs
NOT_LEARNED = "not learned yet: the files are read from the server's own mappings while it runs"


@dataclass(frozen=True)
class EnvironmentSample(Sample):
    """The learned environment and its residency at the last pass."""

    files: int  # measured at the last pass
    total_bytes: int  # of the files: a start reads only the parts of them it touches
    resident_bytes: int | None  # None: not measured (nothing learned yet, or not measurable)
    # What a run of the server keeps of them in the page cache, so what a start needs there:
    # the most any pass found cached since a learned file was last replaced or removed.
    warm_bytes: int | None
    measured_at: float | None  # when that pass ran; None before any
    reason: str | None  # why resident_bytes is None

    def health(self) -> Health:
        """Not learned yet is no failure: the first load teaches it."""
        if self.resident_bytes is None and self.reason not in (None, NOT_LEARNED):
            return Health(up=False, reason=self.reason)
        return Health(note=self.reason)

    @property
    def uncached_bytes(self) -> int | None:
        """Of what a start needs, the bytes out of the page cache now."""
        if self.resident_bytes is None or self.warm_bytes is None:
            return None
        return max(0, self.warm_bytes - self.resident_bytes)


@dataclass(frozen=True)
class _Learned:
    """One file of the environment: how to open it, and what it was when learned."""

    path: str  # as this exporter opens it
    dev: int
    ino: int
    size: int


class EnvironmentSource:
    """One target's environment: learned from its tree, measured between its starts."""

    def __init__(
        self,
        weights: WeightsConfig | None,
        tree: Callable[[], ProcessSample | None],
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.thread_time,
        cpu_budget: float = DEFAULT_RESIDENCY_CPU_BUDGET,
        refresh_after: Callable[[], float] = lambda: REFRESH_SECONDS,
        on_behalf: OnBehalf | None = None,
    ) -> None:
        """`tree`: the target's process tree now; `refresh_after`: how old a pass may get."""
        self._tree_of = tree
        self._proc_root = proc_root
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._budget = cpu_budget
        self._refresh_after = refresh_after
        self._lock = threading.Lock()
        self._files: dict[tuple[int, int], _Learned] = {}
        # Paths each process was seen with: no stat, and no fdinfo read, again.
        self._seen_paths: dict[int, set[str]] = {}
        self._root: tuple[int | None, float | None] | None = None
        self._last: EnvironmentSample | None = None
        self._warm: int | None = None  # the most a pass found cached (EnvironmentSample)
        self._next_due = 0.0
        self._passes: deque[EnvironmentSample] = deque(maxlen=PASSES_KEPT)
        self._departed_at_pass: int | None = None
        self._news = threading.Event()
        self.follow(weights, on_behalf)

    def follow(self, weights: WeightsConfig | None, on_behalf: OnBehalf | None) -> None:
        """The target's weights or process changed (a restart found by discovery): what was
        learned stays, the next start maps the same files."""
        self._weights = weights
        self._on_behalf = on_behalf
        roots = weights.paths if weights is not None else ()
        self._weight_roots = tuple(os.path.realpath(p).rstrip("/") + "/" for p in roots)

    def note_departures(self, departed_bytes_total: int) -> bool:
        """Ask for a pass once more than DEPARTED_SHARE_FOR_PASS of the environment's size left
        the host's page cache (the memory source's count); True when one was asked."""
        base, last = self._departed_at_pass, self._last
        if last is None or not last.resident_bytes or base is None or departed_bytes_total < base:
            self._departed_at_pass = departed_bytes_total
            return False
        threshold = max(MIN_DEPARTED_BYTES, (last.warm_bytes or 0) * DEPARTED_SHARE_FOR_PASS)
        if departed_bytes_total - base < threshold:
            return False
        self._departed_at_pass = departed_bytes_total
        self._news.set()
        return True

    def before(self, at: float) -> EnvironmentSample | None:
        """The last pass made at or before `at` (a load's start): what that start found."""
        with self._lock:
            kept = [*self._passes, *([self._last] if self._last is not None else [])]
        made = [p for p in kept if p.measured_at is not None and p.measured_at <= at]
        return max(made, key=lambda p: p.measured_at or 0.0) if made else None

    def sample(self) -> EnvironmentSample:
        """Learn from the tree when it runs; measure when a pass is due."""
        tree = self._tree_of()
        running = tree is not None and tree.found
        root = (tree.root_pid, tree.start_time) if tree is not None and running else None
        with self._lock:
            if root != self._root:
                self._root = root
                self._seen_paths.clear()
                if self._last is not None:  # the last pass before this process (or its exit)
                    self._passes.append(self._last)
            if tree is not None and running:
                self._learn(tree.pids)
            now = self._clock()
            last = self._last
            if last is not None and last.measured_at is not None:
                if now < self._next_due:  # the CPU budget
                    return last
                due = now >= last.measured_at + self._refresh_after()
                if not due and not self._news.is_set():
                    return last
            self._news.clear()
            self._last = self._pass(now)
            if not running:
                self._passes.append(self._last)
            return self._last

    # -- learning ----------------------------------------------------------------------------

    def _learn(self, pids: Iterable[int]) -> None:
        for pid in pids:
            base = f"{self._proc_root}/{pid}"
            prefix = self._prefix(base)
            seen = self._seen_paths.setdefault(pid, set())
            for path in (*_mapped(base), *_open_for_reading(base, seen)):
                if len(self._files) >= MAX_FILES:
                    return
                if path in seen:
                    continue
                seen.add(path)
                self._add(prefix + path if prefix is not None else None, path)

    def _prefix(self, base: str) -> str | None:
        """How this exporter opens the paths a process names: as they are where its root is
        ours, else through its root (a container's files: open only while it runs)."""
        try:
            theirs, ours = os.stat(f"{base}/root"), os.stat("/")
        except OSError:
            return None
        return (
            "" if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino) else f"{base}/root"
        )

    def _add(self, host: str | None, path: str) -> None:
        if host is None or path.startswith(PSEUDO_PATHS) or self._is_weights(host, path):
            return
        try:
            st = os.stat(host)
            magic = path_magic(host)
        except OSError:
            return
        if not stat.S_ISREG(st.st_mode) or not st.st_size:
            return
        if magic in PSEUDO_MAGIC or magic in MEMORY_MAGIC:
            return
        self._files.setdefault(
            (st.st_dev, st.st_ino), _Learned(host, st.st_dev, st.st_ino, st.st_size)
        )

    def _is_weights(self, host: str, path: str) -> bool:
        weights = self._weights
        if weights is None:
            return False
        name = os.path.basename(path)
        if any(fnmatchcase(name, pattern) for pattern in weights.include):
            return True
        real = os.path.realpath(host)
        return any(real.startswith(root) for root in self._weight_roots)

    # -- measuring ---------------------------------------------------------------------------

    def _pass(self, now: float) -> EnvironmentSample:
        if not self._files:
            self._next_due = now
            return EnvironmentSample(0, 0, None, None, None, NOT_LEARNED)
        files = sorted(
            (WeightFile(f.path, os.path.dirname(f.path), os.path.basename(f.path), f.path, f.dev,
                        f.ino, f.size)
             for f in self._files.values()),
            key=lambda wf: (wf.directory, wf.entry),
        )  # fmt: skip
        cpu = self._cpu_clock()

        def run() -> tuple[int, int, int | None, str | None, bool]:
            r = measure(files, count_unreadable=False)
            return r.files, r.total_bytes, r.resident_bytes, r.reason, r.stale

        behalf = self._on_behalf
        count, total, resident, reason, stale = (
            behalf.run(run, PASS_TIMEOUT) if behalf is not None else run()
        )
        cost = max(0.0, self._cpu_clock() - cpu)
        self._next_due = now + cost / self._budget
        if stale:  # replaced or gone (a package upgraded): learned afresh from the next start
            self._files = {k: f for k, f in self._files.items() if _same(f)}
            self._warm = None  # what was cached of the old files says nothing of the new
        if count == 0 and reason is None:
            reason = "none of the server's files could be opened"
            resident = None
        if resident is not None and not stale:  # a stale pass measured files no longer learned
            self._warm = max(self._warm or 0, resident)
        return EnvironmentSample(count, total, resident, self._warm, now, reason)


def _same(learned: _Learned) -> bool:
    try:
        st = os.stat(learned.path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (learned.dev, learned.ino)


def _mapped(base: str) -> list[str]:
    """The files a process maps (its /proc/PID/maps), each once; none when it is gone or may
    not be read. Shared writable mappings are memory the process writes, not what it reads."""
    text = _read(f"{base}/maps")
    paths: dict[str, None] = {}
    for line in text.splitlines():
        parts = line.split(None, 5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].endswith(" (deleted)"):
            continue
        if parts[1][1:2] == "w" and parts[1][3:4] == "s":
            continue
        paths[parts[5]] = None
    return list(paths)


def _open_for_reading(base: str, seen: Collection[str]) -> list[str]:
    """The files a process holds open read-only (a log it writes is no part of what it reads),
    but for those `seen` already: their fdinfo is not read again each sample."""
    try:
        numbers = os.listdir(f"{base}/fd")
    except OSError:
        return []
    paths = []
    for number in numbers:
        try:
            path = os.readlink(f"{base}/fd/{number}")
        except OSError:
            continue
        if not path.startswith("/") or path.startswith(PSEUDO_PATHS) or path in seen:
            continue
        flags = _read(f"{base}/fdinfo/{number}").partition("flags:")[2].split("\n", 1)[0]
        try:
            if int(flags.strip() or "1", 8) & os.O_ACCMODE != os.O_RDONLY:
                continue
        except ValueError:
            continue
        paths.append(path)
    return paths


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return ""
