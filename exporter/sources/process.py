"""Find a model server's process tree and count the bytes it reads.

The tree's own start time is the start of a load (so an exporter started mid-load still sees the
whole load), and its read counters show weights moving even when the disk is shared with others.
Everything is read straight from /proc under an injectable root: a pass over /proc/*/stat gives
both the process table and the parent links (re-reading only new pids and the tree itself), without
touching psutil's global PROCFS_PATH that other sources share.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

from exporter.config.schema import ProcessConfig
from exporter.sources.sample import Health, Sample

_UNIT_SUFFIXES = (".service", ".scope")
CMDLINE_SETTLE_SECONDS = 5.0
# Where a unit's cgroup lives: cgroup v2, then the v2 and the named v1 hierarchy of hybrid mode.
_CGROUP_LAYOUTS = ("", "unified", "systemd")


@dataclass(frozen=True)
class ProcessSample(Sample):
    found: bool
    pids: tuple[int, ...]
    root_pid: int | None
    start_time: float | None
    read_bytes: int | None  # None, never 0, when /proc/PID/io cannot be read (see read_problem)
    read_chars: int | None
    cmdline: str | None
    read_problem: str | None = None  # why the read counters are unknown
    # CPU seconds the tree has used (user + system, with its reaped children's); readable for
    # any user's process (/proc/PID/stat is 0444), so a stall can tell spinning from waiting.
    cpu_seconds: float | None = None
    # The most telling scheduler state in the tree (STATE_ORDER): a stopped or disk-waiting
    # member explains a stall better than the sleeping rest.
    state: str | None = None

    def health(self) -> Health:
        """The process found, but its read counters perhaps not: the status says why."""
        return Health(note=self.read_problem)


NOT_FOUND = ProcessSample(False, (), None, None, None, None, None)


# /proc/PID/stat states, most telling first: stopped (SIGSTOP, a debugger), waiting on storage
# that does not answer (D), running, then the rest.
STATE_ORDER = "TtDRSI"


@dataclass(frozen=True)
class _Proc:
    pid: int
    ppid: int
    start_ticks: int
    zombie: bool
    state: str = "?"
    cpu_ticks: int = 0  # utime + stime + cutime + cstime

    @property
    def key(self) -> tuple[int, int]:
        """Identity that survives pid reuse."""
        return (self.pid, self.start_ticks)


@dataclass(frozen=True)
class _Seen:
    """Last counters of one tree member, and who would inherit them when it is reaped."""

    read_bytes: int
    read_chars: int
    parent: tuple[int, int] | None


class ProcessFinder:
    """Locates the server's root process each sample and keeps the tree's counters monotonic."""

    def __init__(
        self,
        config: ProcessConfig,
        proc_root: str = "/proc",
        cgroup_root: str = "/sys/fs/cgroup",
    ) -> None:
        self._config = config
        self._proc_root = proc_root
        self._cgroup_root = cgroup_root
        self._pattern = re.compile(config.cmdline) if config.cmdline else None
        self._clock_ticks = os.sysconf("SC_CLK_TCK")
        self._boot_time: float | None = None
        self._table: dict[int, _Proc] = {}
        self._members: frozenset[int] = frozenset()
        self._cmdlines: dict[tuple[int, int], str | None] = {}
        self._reset(None)

    def _reset(self, root_key: tuple[int, int] | None) -> None:
        self._root_key = root_key
        self._seen: dict[tuple[int, int], _Seen] = {}
        self._departed_bytes = 0
        self._departed_chars = 0
        self._high_bytes = 0
        self._high_chars = 0

    def sample(self) -> ProcessSample:
        table = self._scan()
        found = self._find_root(table)
        if found is None:
            self._reset(None)
            self._members = frozenset()
            return NOT_FOUND
        root, extra_members, root_cmdline = found
        if root.key != self._root_key:
            self._reset(root.key)
        members = _descendants(root, table)
        members.update(pid for pid in extra_members if pid in table)
        tree = [table[pid] for pid in sorted(members)]
        self._members = frozenset(members)
        read_bytes, read_chars, read_problem = self._count(tree, table)
        if root_cmdline is None:
            root_cmdline = self._cmdline(root.pid)
        return ProcessSample(
            found=True,
            pids=tuple(p.pid for p in tree),
            root_pid=root.pid,
            start_time=self._start_time(root),
            read_bytes=read_bytes,
            read_chars=read_chars,
            cmdline=root_cmdline,
            read_problem=read_problem,
            cpu_seconds=sum(p.cpu_ticks for p in tree) / self._clock_ticks,
            state=telling_state(p.state for p in tree),
        )

    def _count(
        self, tree: list[_Proc], table: dict[int, _Proc]
    ) -> tuple[int | None, int | None, str | None]:
        """Sum the tree's counters so that they never go backwards while the root lives.

        When a child is reaped by a parent inside the tree, Linux adds the child's counters to
        the parent's own, so its last values must be dropped, not kept. Members that left the
        tree alive (orphans re-parented to init) or were reaped outside it take their bytes
        with them, so their last values are remembered.
        """
        tree_keys = {p.key for p in tree}
        alive_keys = {p.key for p in table.values()}
        gone = {key: seen for key, seen in self._seen.items() if key not in tree_keys}
        for key, seen in gone.items():
            del self._seen[key]
            if key in alive_keys or not _inherited(seen, gone, tree_keys, alive_keys):
                self._departed_bytes += seen.read_bytes
                self._departed_chars += seen.read_chars
        unreadable = None
        for proc in tree:
            try:
                counters = self._read_io(proc.pid)
            except OSError as err:  # EACCES: another user's process and we are not root
                # Keep the last values if we ever had them; a tree we cannot read is unknown.
                if proc.key not in self._seen and unreadable is None:
                    unreadable = f"{err.strerror or err} for pid {proc.pid}"
                continue
            if counters is None:
                continue  # exited since the scan; accounted for as gone next time
            parent = table.get(proc.ppid)
            self._seen[proc.key] = _Seen(*counters, parent.key if parent is not None else None)
        if unreadable is not None:
            problem = (
                f"read counters unknown: /proc/PID/io not readable as uid {os.geteuid()}"
                f" ({unreadable}); run as root or as the server's user"
            )
            return None, None, problem
        live_bytes = sum(s.read_bytes for s in self._seen.values())
        live_chars = sum(s.read_chars for s in self._seen.values())
        self._high_bytes = max(self._high_bytes, self._departed_bytes + live_bytes)
        self._high_chars = max(self._high_chars, self._departed_chars + live_chars)
        return self._high_bytes, self._high_chars, None

    def _read_io(self, pid: int) -> tuple[int, int] | None:
        """(read_bytes, rchar), or None if the process is gone; OSError if we may not read it."""
        try:
            with open(os.path.join(self._proc_root, str(pid), "io"), encoding="ascii") as f:
                text = f.read()
        except (FileNotFoundError, ProcessLookupError):
            return None
        values = {}
        for line in text.splitlines():
            name, _, value = line.partition(":")
            values[name] = value.strip()
        try:
            return int(values["read_bytes"]), int(values["rchar"])
        except (KeyError, ValueError):
            return None

    def _scan(self) -> dict[int, _Proc]:
        """The process table, re-reading /proc/PID/stat only where it can have changed.

        A process outside the tree cannot join it (children get new pids; an orphan is
        re-parented to an ancestor subreaper, which is outside the tree too), so its stat from
        an earlier scan still serves. New pids and tree members are read afresh. On a GPU host
        with thousands of processes this turns a thousand reads a second into a handful.
        """
        try:
            names = os.listdir(self._proc_root)
        except OSError:
            return {}
        cached, members = self._table, self._members
        table = {}
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            proc = cached.get(pid)
            if proc is None or pid in members:
                proc = read_stat(self._proc_root, pid)
            if proc is not None:
                table[pid] = proc
        self._table = table
        return table

    def _cmdline(self, pid: int) -> str | None:
        try:
            with open(os.path.join(self._proc_root, str(pid), "cmdline"), "rb") as f:
                raw = f.read()
        except OSError:
            return None
        return raw.rstrip(b"\0").replace(b"\0", b" ").decode("utf-8", "replace")

    def _boot(self) -> float | None:
        if self._boot_time is None:
            self._boot_time = boot_time(self._proc_root)
        return self._boot_time

    def _settled_ticks(self) -> int:
        """Start ticks before which a process is CMDLINE_SETTLE_SECONDS old (0 if unknown)."""
        boot = self._boot()
        if boot is None:
            return 0
        return int((time.time() - boot - CMDLINE_SETTLE_SECONDS) * self._clock_ticks)

    def _start_time(self, proc: _Proc) -> float | None:
        boot = self._boot()
        return None if boot is None else boot + proc.start_ticks / self._clock_ticks

    def _find_root(self, table: dict[int, _Proc]) -> tuple[_Proc, Iterable[int], str | None] | None:
        """The root process, extra members that belong to the tree, and the root's cmdline."""
        config = self._config
        if config.pid is not None:
            proc = table.get(config.pid)
            exact = proc is not None and proc.start_ticks == config.start_ticks
            return (proc, (), None) if exact and proc is not None and not proc.zombie else None
        if config.pidfile is not None:
            root = self._from_pidfile(config.pidfile, table)
            return (root, (), None) if root is not None else None
        if self._pattern is not None:
            return self._from_cmdline(self._pattern, table)
        if config.systemd_unit is not None:
            return self._from_unit(config.systemd_unit, table)
        return None

    def _from_pidfile(self, path: str, table: dict[int, _Proc]) -> _Proc | None:
        try:
            with open(path, encoding="ascii") as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            return None
        proc = table.get(pid)
        return proc if proc is not None and not proc.zombie else None

    def _from_cmdline(
        self, pattern: re.Pattern[str], table: dict[int, _Proc]
    ) -> tuple[_Proc, Iterable[int], str | None] | None:
        own_pid = os.getpid()
        matches: dict[int, str] = {}
        settled = self._settled_ticks()
        cmdlines: dict[tuple[int, int], str | None] = {}
        for proc in table.values():
            if proc.zombie or proc.pid == own_pid:
                continue
            # A command line changes at exec, right after fork: trust a cached one only for
            # processes old enough to have exec'd; read young ones afresh every time.
            if proc.key in self._cmdlines and proc.start_ticks < settled:
                cmdline = self._cmdlines[proc.key]
            else:
                cmdline = self._cmdline(proc.pid)
            cmdlines[proc.key] = cmdline
            if cmdline and pattern.search(cmdline):
                matches[proc.pid] = cmdline
        self._cmdlines = cmdlines
        # The oldest match has no matching ancestor unless both started in the same clock tick,
        # which is exactly when the ancestor test is needed (worker processes fork instantly).
        tops = [table[pid] for pid in matches if not _has_ancestor_in(pid, matches, table)]
        if not tops:
            return None
        root = min(tops, key=lambda p: (p.start_ticks, p.pid))
        return root, (), matches[root.pid]

    def _from_unit(
        self, unit: str, table: dict[int, _Proc]
    ) -> tuple[_Proc, Iterable[int], str | None] | None:
        if not unit.endswith(_UNIT_SUFFIXES):
            unit += ".service"
        for layout in _CGROUP_LAYOUTS:
            unit_dir = os.path.join(self._cgroup_root, layout, "system.slice", unit)
            if os.path.isdir(unit_dir):
                break
        else:
            return None
        members = [table[pid] for pid in _cgroup_pids(unit_dir) if pid in table]
        live = [p for p in members if not p.zombie]
        if not live:
            return None
        root = min(live, key=lambda p: (p.start_ticks, p.pid))
        return root, [p.pid for p in members], None


def _inherited(
    seen: _Seen,
    gone: dict[tuple[int, int], _Seen],
    tree_keys: set[tuple[int, int]],
    alive_keys: set[tuple[int, int]],
) -> bool:
    """Whether a reaped member's counters now sit inside a live tree member's own counters.

    A parent that reaps a child absorbs its counters; if that parent was reaped too, they moved
    on with it, up to the first ancestor that is still in the tree (absorbed) or is not.
    """
    parent = seen.parent
    visited: set[tuple[int, int]] = set()
    while parent in gone and parent not in alive_keys and parent not in visited:
        visited.add(parent)
        parent = gone[parent].parent
    return parent in tree_keys


def _cgroup_pids(unit_dir: str) -> set[int]:
    """Every pid in a unit's cgroup and its child cgroups."""
    pids: set[int] = set()
    for directory, _, files in os.walk(unit_dir):
        if "cgroup.procs" not in files:
            continue
        try:
            with open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as f:
                pids.update(int(line) for line in f if line.strip().isdigit())
        except OSError:
            continue
    return pids


def _descendants(root: _Proc, table: dict[int, _Proc]) -> set[int]:
    children: dict[int, list[int]] = {}
    for proc in table.values():
        children.setdefault(proc.ppid, []).append(proc.pid)
    found = {root.pid}
    stack = [root.pid]
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def _has_ancestor_in(pid: int, candidates: dict[int, str], table: dict[int, _Proc]) -> bool:
    seen = {pid}
    proc = table.get(pid)
    while proc is not None and proc.ppid not in seen:
        if proc.ppid in candidates:
            return True
        seen.add(proc.ppid)
        proc = table.get(proc.ppid)
    return False


def read_stat(proc_root: str, pid: int) -> _Proc | None:
    """Parent, start ticks and zombie state of one process from /proc/PID/stat."""
    try:
        with open(os.path.join(proc_root, str(pid), "stat"), "rb") as f:
            text = f.read()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces and parentheses.
    fields = text.rpartition(b")")[2].split()
    try:
        state = fields[0].decode("ascii", "replace")
        cpu = sum(int(fields[i]) for i in range(11, 15))  # utime, stime, cutime, cstime
        return _Proc(pid, int(fields[1]), int(fields[19]), state in ("Z", "X"), state, cpu)
    except (IndexError, ValueError):
        return None


def telling_state(states: Iterable[str]) -> str | None:
    """The state of the tree that says most about a stall (STATE_ORDER), None for no members."""
    seen = set(states)
    for state in STATE_ORDER:
        if state in seen:
            return state
    return min(seen) if seen else None


def boot_time(proc_root: str = "/proc") -> float | None:
    """Unix time of boot, to sub-second precision on the live system.

    /proc/stat's btime is whole seconds (psutil uses it), which makes every start time up to a
    second early; that is a second of error in every measured load duration. Process start
    ticks count from CLOCK_BOOTTIME, so wall time minus that clock is the exact same origin.
    """
    if proc_root == "/proc":
        return time.time() - time.clock_gettime(time.CLOCK_BOOTTIME)
    try:
        with open(os.path.join(proc_root, "stat"), encoding="ascii") as f:
            for line in f:
                if line.startswith("btime "):
                    return float(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


def process_start_time(pid: int) -> float | None:
    """Unix time a live process started, as precise as the kernel's clock ticks."""
    proc, boot = read_stat("/proc", pid), boot_time()
    if proc is None or boot is None:
        return None
    return boot + proc.start_ticks / os.sysconf("SC_CLK_TCK")
