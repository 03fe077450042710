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

Whose files (docs/trust.md). Every file is opened, learned and measured with the rights of the
tree's root process (`rights`, as every other read for it: trust/asprocess.py), a configured
target's as a discovered one's, and as that process sees its path: through /proc/PID/root
(symlinks resolved inside it) where its mount namespace or root is not this exporter's. A path is
learned only when what opens there is the very file the process holds: the inode its maps line
names, the device and inode of its descriptor. So a file its user may not read, a name planted
where a deleted file was (the kernel shows `f (deleted)`), a path that means another file on the
host than in the process's mount namespace, are never learned, and a missing and an unreadable
path look the same: neither is learned, nor counted, nor named. What was learned belongs to one
user and one view of the files (`_Owner`): it is carried to the next process of the target only
when that runs as the same user and sees the host's files (a restart, measured before it begins
and then with the new process's rights); a process of another user, or one in a mount namespace
or root of its own, starts afresh (a container's files were reachable through the old process's
root alone), and `before` says nothing of one owner's files for another's load.

What it costs. Learning keeps per process of the tree only its size when its maps were last read
and its descriptor numbers (exporter/sources/descriptors.py: a table of 20,000 churning one costs
what changed), both forgotten when it leaves the tree; maps are read again only when the size
changed, each descriptor is identified once, and a (path, inode) pair looked at once is not
opened again (a hash of it kept, at most MAX_CHECKED). Learning takes at most LEARN_SLICE of CPU
in one sample and LEARN_SHARE of a core on average (what is left waits for the next); the
learned files are at most MAX_FILES and MAX_PATH_CHARS of path. So a tree forking a child every
0.2 s that maps hundreds of long paths grows nothing (issue 37 row 2), and one holding tens of
thousands of descriptors costs its share of a core, not a core (row 5; bench/tree_churn.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from fnmatch import fnmatchcase

from exporter.config.schema import DEFAULT_RESIDENCY_CPU_BUDGET, WeightsConfig
from exporter.sources.descriptors import DescriptorTable
from exporter.sources.process import ProcessSample
from exporter.sources.sample import Health, Sample
from exporter.storage.pagecache import PassResult, measure
from exporter.storage.weighttree import WeightFile
from exporter.trust.asprocess import OnBehalf, RightsError
from exporter.trust.safeio import fs_magic, open_checked, pseudo_path, resolve_in_root

REFRESH_SECONDS = 5.0  # a pass this often while the target is not serving: before a restart
MAX_FILES = 20_000  # files learned per target at most (SGLang on CPU maps about 260)
MAX_PATH_CHARS = 4 << 20  # of the learned files' paths, per target: long names bound it too
MAX_CHECKED = 65_536  # (path, inode) pairs remembered as looked at, per target (a hash each)
MAX_QUEUED = MAX_FILES  # found and not yet opened (learning ran out of its slice), per target
LEARN_SHARE = 0.02  # of one core that learning may take on average, per target
LEARN_SLICE = 0.05  # CPU seconds one sample's learning may take: the rest waits for the next
DEPARTED_SHARE_FOR_PASS = 0.05  # of the environment left the host's page cache: measure again
# ... and at least this much: a start that found at most 64 MiB of its environment out of the page
# cache found it cached (exporter/history/forecast.py's ENVIRONMENT_BYTES), so less than that
# leaving the whole host cannot turn a cached environment into an uncached one in a forecast. A
# host's page cache loses megabytes every few seconds (this VM's DAMON: 100 MB a minute): at a
# 1 MiB floor a serving target's environment was measured at every look at host memory.
MIN_DEPARTED_BYTES = 64 << 20
PASSES_KEPT = 8  # passes kept for `before`: those made while the server was down, newest last
PASS_TIMEOUT = 60.0  # a pass run with a process's rights (exporter/trust/asprocess.py)
LEARN_TIMEOUT = 10.0  # opening what was found, with the process's rights
# A load starting this close to the first process of a new owner is that process's: its start
# and the owner's were read from clocks at different moments (boot time is wall - boottime).
EPOCH_SLACK = 1.0
# Memory file systems: always resident, never read from storage.
MEMORY_MAGIC = frozenset({0x01021994, 0x858458F6})  # tmpfs, ramfs
NOT_LEARNED = "not learned yet: the files are read from the server's own mappings while it runs"

FileKey = tuple[int, int]  # (st_dev, st_ino)


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


@dataclass(frozen=True)
class _Found:
    """A file a process of the tree holds, as it names it: to be opened with its rights."""

    path: str
    ino: int
    # Its descriptor's device; None for a mapping, whose maps line may give the device of the
    # file system below (a btrfs subvolume's, an overlay's layer), not the one its path is on.
    dev: int | None


@dataclass(frozen=True)
class _Owner:
    """Whose the learned files are: a user, and how its processes' paths are opened."""

    uid: int
    prefix: str  # "": as they are on this host; else its /proc/PID/root (that process's alone)


@dataclass
class _Proc:
    """What learning keeps of one live process of the tree; forgotten when it leaves."""

    size: str | None = None  # its statm size when its maps were last read
    numbers: set[int] = field(default_factory=set)  # descriptors appeared (looked at or pending)
    table: DescriptorTable = field(default_factory=DescriptorTable)
    pending: list[int] = field(default_factory=list)  # appeared, not identified yet (budget)


class EnvironmentSource:
    """One target's environment: learned from its tree, measured between its starts."""

    def __init__(
        self,
        weights: WeightsConfig | None,
        tree: Callable[[], ProcessSample | None],
        rights: Callable[[int], OnBehalf],
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.thread_time,
        cpu_budget: float = DEFAULT_RESIDENCY_CPU_BUDGET,
        refresh_after: Callable[[], float] = lambda: REFRESH_SECONDS,
        learn_share: float = LEARN_SHARE,
    ) -> None:
        """`tree`: the target's process tree now; `rights(pid)`: how to act for its root process
        (ProcessLookupError when gone, RightsError when its rights are not its own);
        `refresh_after`: how old a pass may get; `cpu_clock`: the calling thread's CPU time."""
        self._tree_of = tree
        self._rights = rights
        self._proc_root = proc_root
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._budget = cpu_budget
        self._learn_share = learn_share
        self._refresh_after = refresh_after
        self._lock = threading.Lock()
        self._files: dict[FileKey, _Learned] = {}
        self._path_chars = 0
        # The learned files as a pass measures them, made again only when they change: a
        # serving target is measured at every departure, and its files stay the same.
        self._listed: list[WeightFile] | None = None
        self._procs: dict[int, _Proc] = {}
        self._checked: dict[int, None] = {}  # hashes of (path, inode) looked at, oldest first
        self._queued: dict[int, _Found] = {}  # found, not opened yet
        self._looks = 0
        self._learn_due = 0.0
        self._acting: OnBehalf | None = None  # the root process's rights (its last, once gone)
        self._owner: _Owner | None = None
        self._refused: str | None = None  # why its rights could not be taken
        self._epoch: float | None = None  # start of the first process of the present owner
        self._root: tuple[int | None, float | None] | None = None
        self._last: EnvironmentSample | None = None
        self._warm: int | None = None  # the most a pass found cached (EnvironmentSample)
        self._next_due = 0.0
        self._passes: deque[EnvironmentSample] = deque(maxlen=PASSES_KEPT)
        self._departed_at_pass: int | None = None
        self._news = threading.Event()
        self.follow(weights)

    def follow(self, weights: WeightsConfig | None) -> None:
        """The target's weights changed (a restart found by discovery): what was learned stays,
        the next start maps the same files (if it is the same user's: `sample`)."""
        self._weights = weights
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
        """The last pass made at or before `at` (a load's start): what that start found. None
        for a load of a process whose files were not those learned before (another owner's)."""
        with self._lock:
            kept = [*self._passes, *([self._last] if self._last is not None else [])]
            epoch = self._epoch
        if epoch is not None and at >= epoch - EPOCH_SLACK:
            kept = [p for p in kept if p.measured_at is not None and p.measured_at >= epoch]
        made = [p for p in kept if p.measured_at is not None and p.measured_at <= at]
        return max(made, key=lambda p: p.measured_at or 0.0) if made else None

    def sample(self) -> EnvironmentSample:
        """Learn from the tree when it runs; measure when a pass is due."""
        tree = self._tree_of()
        running = tree is not None and tree.found
        root = (tree.root_pid, tree.start_time) if tree is not None and running else None
        with self._lock:
            now = self._clock()
            if root != self._root:
                self._root = root
                if self._last is not None:  # the last pass before this process (or its exit)
                    self._passes.append(self._last)
                self._enter(tree if running else None)
            if running and tree is not None and self._acting is not None and now >= self._learn_due:
                self._learn(tree.pids, now)
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

    # -- whose files -------------------------------------------------------------------------

    def _enter(self, tree: ProcessSample | None) -> None:
        """A new root process (or none): take its rights, and keep what was learned only for
        the same owner in the host's view."""
        self._procs.clear()
        self._checked.clear()
        self._queued.clear()
        if self._owner is not None and self._owner.prefix:
            self._forget(None)  # reachable through that process's root alone
        if tree is None or tree.root_pid is None:
            return  # between runs: the last process's rights measure what it left
        pid = tree.root_pid
        try:
            acting = self._rights(pid)
            owner = _Owner(acting.current().uid, _prefix(self._proc_root, pid))
        except (ProcessLookupError, RightsError) as exc:
            self._forget(tree.start_time)
            self._refused = None if isinstance(exc, ProcessLookupError) else str(exc)
            return
        if owner != self._owner:
            self._forget(tree.start_time)
        self._acting, self._owner, self._refused = acting, owner, None

    def _forget(self, epoch: float | None) -> None:
        """Learned files, and what passes found of them, are no longer this target's."""
        self._files.clear()
        self._listed = None
        self._path_chars = 0
        self._warm = None
        self._acting = self._owner = None
        if epoch is not None:
            self._epoch = epoch
            self._last = None

    # -- learning ----------------------------------------------------------------------------

    def _learn(self, pids: Iterable[int], now: float) -> None:
        """Find what the tree's processes newly map or hold, within LEARN_SLICE of CPU; open it
        with the root process's rights; wait LEARN_SHARE's worth of time after."""
        started = self._cpu_clock()
        deadline = started + LEARN_SLICE
        self._looks += 1
        live = set(pids)
        for pid in [p for p in self._procs if p not in live]:
            del self._procs[pid]  # left the tree: what was kept of it goes with it
        for pid in sorted(live):
            if self._cpu_clock() >= deadline or len(self._queued) >= MAX_QUEUED:
                break
            proc = self._procs.setdefault(pid, _Proc())
            try:
                self._look(f"{self._proc_root}/{pid}", proc, deadline)
            except OSError:  # gone meanwhile (or its /proc entries are not ours to read)
                del self._procs[pid]
        spent = self._cpu_clock() - started
        spent += self._open_found(max(0.0, LEARN_SLICE - spent))
        self._learn_due = now + spent / self._learn_share

    def _look(self, base: str, proc: _Proc, deadline: float) -> None:
        statm = _read(f"{base}/statm")
        size = statm.split(maxsplit=1)[0] if statm else None
        if size is not None and size != proc.size:  # a mapping came or went
            for found in _mapped(base):
                self._queue(found)
            proc.size = size
        first = not proc.numbers
        changes = proc.table.look(f"{base}/fd", proc.numbers, self._looks)
        if changes is not None:
            proc.numbers -= changes.gone
            proc.numbers.update(changes.appeared)
            proc.pending.extend(changes.appeared)
            if not first:  # new since a look: its number may soon be another file's
                for number in changes.appeared:
                    proc.table.born(number, self._looks)
        if not proc.pending:  # caught up: what may have been reused since
            proc.pending.extend(proc.table.rechecks(proc.numbers, self._looks))
        while proc.pending and self._cpu_clock() < deadline:
            held = self._descriptor(base, proc.pending.pop())
            if held is not None:
                self._queue(held)

    def _descriptor(self, base: str, number: int) -> _Found | None:
        """A descriptor of a regular file opened read-only (a log it writes is no part of what
        it reads), not learned already."""
        link = f"{base}/fd/{number}"
        try:
            st = os.stat(link)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) in self._files:
                return None
            path = os.readlink(link)
        except OSError:
            return None  # closed since it appeared
        key = _key(path, st.st_ino)
        if not path.startswith("/") or pseudo_path(path) or key in self._checked:
            return None
        if key in self._queued:  # another descriptor of a file found already
            return None
        flags = _read(f"{base}/fdinfo/{number}").partition("flags:")[2].split("\n", 1)[0]
        try:
            if int(flags.strip() or "1", 8) & os.O_ACCMODE != os.O_RDONLY:
                return None
        except ValueError:
            return None
        return _Found(path, st.st_ino, st.st_dev)

    def _queue(self, found: _Found) -> None:
        key = _key(found.path, found.ino)
        if key not in self._checked and len(self._queued) < MAX_QUEUED:
            self._queued[key] = found

    def _open_found(self, slice_left: float) -> float:
        """Open what was found with the process's rights, within `slice_left` of CPU on the
        thread that does; learn what is what the process holds. The CPU that took."""
        acting, owner = self._acting, self._owner
        if not self._queued or acting is None or owner is None:
            return 0.0
        queued = list(self._queued.items())
        weights = self._weights
        roots = self._weight_roots

        def opened() -> tuple[list[tuple[int, _Learned | None]], float]:
            started = time.thread_time()
            done: list[tuple[int, _Learned | None]] = []
            for key, found in queued:
                if done and time.thread_time() - started >= slice_left:
                    break
                done.append((key, _held(owner.prefix, found, weights, roots)))
            return done, time.thread_time() - started

        try:
            done, cost = acting.run(opened, LEARN_TIMEOUT)
        except RightsError as exc:  # its rights are not its own now, or not ours to take
            self._refused = str(exc)
            return 0.0
        except (TimeoutError, OSError):
            return 0.0  # tried again at the next learning
        self._refused = None
        for key, learned in done:
            del self._queued[key]
            self._checked[key] = None
            if learned is not None:
                self._add(learned)
        while len(self._checked) > MAX_CHECKED:
            del self._checked[next(iter(self._checked))]
        return cost

    def _add(self, learned: _Learned) -> None:
        key = (learned.dev, learned.ino)
        chars = len(learned.path)
        if key in self._files or len(self._files) >= MAX_FILES:
            return
        if self._path_chars + chars > MAX_PATH_CHARS:
            return
        self._files[key] = learned
        self._listed = None
        self._path_chars += chars

    # -- measuring ---------------------------------------------------------------------------

    def _pass(self, now: float) -> EnvironmentSample:
        acting = self._acting
        if not self._files or acting is None:
            self._next_due = now
            return EnvironmentSample(0, 0, None, None, None, self._refused or NOT_LEARNED)
        learned = dict(self._files)
        if self._listed is None:
            self._listed = _listed(learned.values())
        files = self._listed
        cpu = self._cpu_clock()

        def run() -> tuple[PassResult, set[FileKey] | None, float]:
            started = time.thread_time()
            result = measure(files, count_unreadable=False, exact=True)
            # Replaced or gone (a package upgraded): learned afresh from the next start.
            kept = {k for k, f in learned.items() if _same(f)} if result.stale else None
            return result, kept, time.thread_time() - started

        try:
            result, kept, worker = acting.run(run, PASS_TIMEOUT)
        except (RightsError, TimeoutError) as exc:
            self._next_due = now
            return EnvironmentSample(0, 0, None, self._warm, now, f"cannot measure: {exc}")
        count, total, resident, reason = (
            result.files,
            result.total_bytes,
            result.resident_bytes,
            result.reason,
        )
        cost = max(0.0, self._cpu_clock() - cpu) + worker
        self._next_due = now + cost / self._budget
        if kept is not None:
            self._files = {k: f for k, f in self._files.items() if k in kept}
            self._listed = None
            self._path_chars = sum(len(f.path) for f in self._files.values())
            self._warm = None  # what was cached of the old files says nothing of the new
        if count == 0 and reason is None:
            reason = "none of the server's files could be opened"
            resident = None
        if resident is not None and kept is None:  # a stale pass measured files no longer learned
            self._warm = max(self._warm or 0, resident)
        return EnvironmentSample(count, total, resident, self._warm, now, reason)


def _listed(learned: Iterable[_Learned]) -> list[WeightFile]:
    """Learned files as the page-cache measurement takes them, by directory."""
    return sorted(
        (WeightFile(f.path, os.path.dirname(f.path), os.path.basename(f.path), f.path, f.dev,
                    f.ino, f.size)
         for f in learned),
        key=lambda wf: (wf.directory, wf.entry),
    )  # fmt: skip


def _prefix(proc_root: str, pid: int) -> str:
    """How this exporter opens the paths a process names: as they are where its mount namespace
    and root are this exporter's, else through its root (resolved inside it, as
    exporter/discovery/view.py does); through its root too where that cannot be told."""
    base = f"{proc_root}/{pid}"
    try:
        same_mounts = os.readlink(f"{base}/ns/mnt") == os.readlink(f"{proc_root}/self/ns/mnt")
        theirs, ours = os.stat(f"{base}/root"), os.stat(f"{proc_root}/self/root")
    except OSError:
        return f"{base}/root"
    same_root = (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)
    return "" if same_mounts and same_root else f"{base}/root"


def _held(
    prefix: str, found: _Found, weights: WeightsConfig | None, roots: tuple[str, ...]
) -> _Learned | None:
    """What `found` names, opened with the calling thread's rights as its process sees it,
    when that is the file the process holds, a file of storage and no weight file; else None,
    whatever the reason (missing, unreadable, another file, memory): all look alike."""
    try:
        host = resolve_in_root(prefix, found.path) if prefix else found.path
        fd, st = open_checked(host)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(st.st_mode) or not st.st_size or st.st_ino != found.ino:
            return None
        if found.dev is not None and st.st_dev != found.dev:
            return None
        if fs_magic(fd) in MEMORY_MAGIC:
            return None
        name = os.path.basename(found.path)
        if weights is not None and any(fnmatchcase(name, p) for p in weights.include):
            return None
        real = os.readlink(f"/proc/self/fd/{fd}")
        if any(real.startswith(root) or host.startswith(root) for root in roots):
            return None
    except OSError:
        return None
    finally:
        os.close(fd)
    return _Learned(host, st.st_dev, st.st_ino, st.st_size)


def _same(learned: _Learned) -> bool:
    try:
        st = os.stat(learned.path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (learned.dev, learned.ino)


def _key(path: str, ino: int) -> int:
    return hash((path, ino))


def _mapped(base: str) -> Iterator[_Found]:
    """The files a process maps (its /proc/PID/maps); none when it is gone or may not be read.
    Shared writable mappings are memory the process writes, not what it reads. Read a line at a
    time: a tree's maps can be megabytes, and one string that large per process leaves the
    allocator's arenas grown for good (the RSS steps that row 2's soak showed)."""
    try:
        with open(f"{base}/maps", encoding="utf-8", errors="surrogateescape") as lines:
            for line in lines:
                parts = line.rstrip("\n").split(None, 5)
                if len(parts) < 6 or not parts[5].startswith("/") or pseudo_path(parts[5]):
                    continue
                if parts[1][1:2] == "w" and parts[1][3:4] == "s":
                    continue
                with contextlib.suppress(ValueError):
                    yield _Found(parts[5], int(parts[4]), None)
    except OSError:
        return


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except OSError:
        return ""
