"""What a server's process tree does with its weight files: which it holds, how far into each.

Why: a Python server reads hundreds of MB while importing itself (torch alone: 533 MB of `read()`
for vLLM on CPU) before it touches a weight, so the tree's read counters say nothing about when
the weights begin or how far they are. The files themselves do: the weights begin when a
process of the tree first opens or maps a weight file, and a file's progress is

* the file offset in `/proc/PID/fdinfo/N` for `read()` loaders (the furthest any process got:
  tensor-parallel ranks each read their part of every tensor, so their offsets move together),
* the pages of the file mapped into the process (pages of `/proc/PID/numa_maps`, `Rss` of
  `smaps` where the kernel has no NUMA) for mmap loaders (safetensors, llama.cpp), summed over
  processes (ranks touch their own slices) and, for a file mapped more than once, at most its
  bytes in the page cache (the pages several ranks map, such as the header, count once),
* the process's `read()` bytes (`rchar`) beyond what its offsets explain, for `pread` loaders
  (the offset never moves), credited to its open weight files whose offset stood still and that
  it does not map (a loader that maps a file and closes it at once, as safetensors' safe_open
  does for Triton's Python models, is followed by its pages alone: reads through a mapping are
  no `read()`),

capped at the file's size and never falling; a file that was open or mapped and is no longer is
consumed whole (its loader is done with it).

Cost, because a TP-8 tree may hold 2,000 mappings and 500 descriptors per process: each look
reads per process `statm` (one line), `io` and the descriptor count (`st_size` of /proc/PID/fd,
Linux >= 6.2). The descriptor table is looked at again only when that count changed, and then
for what changed (exporter/sources/descriptors.py, shared with the environment's learning: a
process holding 20,000 and churning one costs what changed), mappings only
when `statm`'s size or file-backed pages changed, and `numa_maps` only while a weight file is
mapped and pages arrive; descriptors known to be weight files are checked through their fdinfo
at every look where the process read or its mappings changed (its `ino:` says whether the
number now names another file: the next shard, mapped on it without a read). A number reused for a
weight file while the count stayed the same (or moved between listings) is found by re-checking
new descriptors for a few looks, every descriptor once read() bytes that no weight file explains
add up to RESCAN_BYTES (a read loader on a number we missed), and a slice of the old ones each
look, so that every descriptor is re-checked within ROTATE_LOOKS looks (descriptors.py).
"""

from __future__ import annotations

import errno
import os
import re
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from exporter.config.schema import WeightsConfig
from exporter.sources.descriptors import DescriptorTable
from exporter.sources.process import ProcessSample
from exporter.sources.sample import Health, Sample
from exporter.storage.pagecache import PassResult, measure
from exporter.storage.weighttree import WeightFile, WeightTree, walk_weights
from exporter.trust.asprocess import OnBehalf

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
WALK_TIMEOUT = 5.0  # seconds a walk of a discovered server's weights may take (a hung mount)
YOUNG_AT_FIRST = 256  # files held at the first look re-checked so, the latest opened first
RESCAN_BYTES = 64 << 20  # read() bytes no weight file explains before every descriptor is re-read
_O_DIRECT = os.O_DIRECT if hasattr(os, "O_DIRECT") else 0o40000
# Pages per NUMA node add up to the mapping's pages (`mapped=` is left out when all are dirty).
_NODE_PAGES_RE = re.compile(rb" N\d+=(\d+)")
_KPAGE_RE = re.compile(rb" kernelpagesize_kB=(\d+)")
_RCHAR_RE = re.compile(rb"^rchar: (\d+)", re.MULTILINE)
_READ_SIZE = 1 << 16

FileKey = tuple[int, int]  # (st_dev, st_ino)


@dataclass(frozen=True)
class FileUse:
    """One weight file the tree has opened or mapped in this process's life."""

    name: str  # relative to the weights root, as the residency source names it
    size_bytes: int
    consumed_bytes: int
    held: bool  # open or mapped by a process of the tree now
    how: str  # what showed its progress: "read", "mmap", "pread", or "closed" once let go
    holders: int  # processes of the tree holding it now
    direct: bool  # some process opened it with O_DIRECT (its reads bypass the page cache)


@dataclass(frozen=True)
class WeightFilesSample(Sample):
    """The tree's use of its weight files, since its root process started."""

    visible: bool  # every process's descriptors and mappings could be read
    reason: str | None  # why not visible, or why there is nothing to see
    root_pid: int | None
    files_total: int
    total_bytes: int
    first_open_at: float | None  # unix time a weight file was first seen open or mapped
    first_open_seen: bool  # an earlier sample saw none held: the open happened since it
    idle_since: float | None  # after the first open: no weight file held since then
    consumed_bytes: int
    seen_bytes: int  # sizes of the files ever held: the most the tree can have consumed
    held_files: int
    files: tuple[FileUse, ...]  # in the order they were first seen
    measured_at: float

    def health(self) -> Health:
        return Health(self.visible, self.reason, self.reason)


@dataclass
class _Fd:
    key: FileKey | None  # the weight file it names; None: anything else
    ino: int | None = None  # st_ino of what it names, to notice reuse through fdinfo
    pos: int = 0
    counted_pos: int | None = None  # the offset when the process's rchar was last read


# Shared: a descriptor of anything but a weight file carries no state.
_NOT_A_FILE = _Fd(None)  # a socket, pipe, device, anonymous inode: long-lived
_OTHER_FILE = _Fd(None)  # a regular file that is no weight file, or one closed as we looked


@dataclass(frozen=True)
class _Vma:
    key: FileKey
    suffix: bytes  # b"/" + the file's name: what its line in numa_maps or smaps ends with
    end: int  # its end address (the start is its key)


@dataclass
class _Proc:
    """What one process of the tree was last seen holding."""

    fds: dict[int, _Fd] = field(default_factory=dict)
    table: DescriptorTable = field(default_factory=DescriptorTable)
    weights: set[int] = field(default_factory=set)  # numbers naming weight files
    statm: tuple[bytes, bytes] | None = None  # (size, shared) when mappings were last read
    vmas: dict[int, _Vma] = field(default_factory=dict)  # start address -> weight file
    mapped: dict[FileKey, int] = field(default_factory=dict)  # bytes mapped, per weight file
    rchar: int | None = None
    unexplained: int = 0  # rchar since the last full look that no weight file's offset explains

    def name(self, number: int, fd: _Fd) -> None:
        self.fds[number] = fd
        if fd.key is None:
            self.weights.discard(number)
        else:
            self.weights.add(number)

    def forget(self, number: int) -> None:
        self.fds.pop(number, None)
        self.weights.discard(number)


@dataclass
class _File:
    wf: WeightFile
    first_seen: int  # order of first sight
    consumed: int = 0
    read_pos: int = 0  # furthest offset any process reached
    pread: int = 0  # read() bytes credited to it beyond its offsets
    held: bool = False
    how: str = "read"
    holders: int = 0
    direct: bool = False


class _Blind(Exception):
    """A process's descriptors or mappings may not be read (another user's, not root)."""


class WeightFilesSource:
    """Follows one target's process tree through its weight files; one instance per target."""

    def __init__(
        self,
        weights: WeightsConfig,
        tree: Callable[[], ProcessSample | None],
        proc_root: str = "/proc",
        clock: Callable[[], float] = time.time,
        on_behalf: OnBehalf | None = None,
        max_entries: int | None = None,
    ) -> None:
        """A discovered server's weights are walked `on_behalf` of its process (with its
        rights), at most `max_entries` entries; its /proc entries are the exporter's to read."""
        self._weights = weights
        self._on_behalf = on_behalf
        self._max_entries = max_entries
        self._tree_of = tree
        self._proc_root = proc_root
        self._clock = clock
        self._weight_tree: WeightTree | None = None
        self._by_key: dict[FileKey, WeightFile] = {}
        self._by_ino: dict[bytes, list[WeightFile]] = {}
        self._root: tuple[int | None, float | None] | None = None
        self._restart = False
        self._reset()

    def restart(self) -> None:
        """Account afresh from the next look, the same process running on: a model loaded into
        a running server reads its files again, and what the files were to the load before
        (consumed, let go) is no part of its progress. Safe from another thread."""
        self._restart = True

    def _reset(self) -> None:
        self._procs: dict[int, _Proc] = {}
        self._files: dict[FileKey, _File] = {}
        self._samples = 0
        self._first_open_at: float | None = None
        self._first_open_seen = False
        self._seen_none_held = False  # a sample of this process saw no weight file held yet
        self._idle_since: float | None = None

    def sample(self) -> WeightFilesSample:
        if self._restart:
            self._restart = False
            self._reset()
        now = self._clock()
        self._samples += 1
        self._refresh_weights()
        tree = self._tree_of()
        if tree is None or not tree.found:
            self._root = None
            self._reset()
            return self._report(now, True, "no server process")
        root = (tree.root_pid, tree.start_time)
        if root != self._root:
            self._root = root
            self._reset()
        try:
            self._scan_tree(tree.pids, now)
        except _Blind as exc:
            return self._report(now, False, str(exc))
        return self._report(now, True, None)

    # -- the weight files --------------------------------------------------------------------

    def _refresh_weights(self) -> None:
        behalf = self._on_behalf
        tree = behalf.run(self._walk, WALK_TIMEOUT) if behalf is not None else self._walk()
        if tree is self._weight_tree:
            return
        self._weight_tree = tree
        self._by_key = {(wf.dev, wf.ino): wf for wf in tree.files}
        by_ino: dict[bytes, list[WeightFile]] = {}
        for wf in tree.files:
            by_ino.setdefault(str(wf.ino).encode(), []).append(wf)
        self._by_ino = by_ino

    def _walk(self) -> WeightTree:
        """The weight files, walked again only when a directory of theirs changed."""
        tree = self._weight_tree
        if tree is not None and not tree.changed():
            return tree
        return walk_weights(self._weights, self._max_entries)

    # -- following the tree ------------------------------------------------------------------

    def _scan_tree(self, pids: Iterable[int], now: float) -> None:
        live = set(pids)
        for pid in list(self._procs):
            if pid not in live:
                del self._procs[pid]  # exited: what it held is let go
        held: dict[FileKey, int] = {}  # processes holding each file
        offsets: dict[FileKey, int] = {}
        mapped: dict[FileKey, int] = {}
        mappings: dict[FileKey, int] = {}  # mappings of each file, all processes together
        for pid in sorted(live):
            proc = self._procs.get(pid)
            if proc is None:
                proc = self._procs[pid] = _Proc()
            try:
                self._look(pid, proc)
            except (FileNotFoundError, ProcessLookupError):
                self._procs.pop(pid, None)  # exited since the process sample
                continue
            keys = {vma.key for vma in proc.vmas.values()}
            for number in proc.weights:
                fd = proc.fds[number]
                assert fd.key is not None
                keys.add(fd.key)
                offsets[fd.key] = max(offsets.get(fd.key, 0), fd.pos)
            for key in keys:
                held[key] = held.get(key, 0) + 1
            for key, size in proc.mapped.items():
                mapped[key] = mapped.get(key, 0) + size
            for vma in proc.vmas.values():
                mappings[vma.key] = mappings.get(vma.key, 0) + 1
        self._account(held, offsets, mapped, mappings, now)

    def _look(self, pid: int, proc: _Proc) -> None:
        """Bring one process's view up to date, reading only what can have changed."""
        base = f"{self._proc_root}/{pid}"
        statm = _read(f"{base}/statm")
        size_shared = tuple(statm.split()[:3:2]) if statm else None
        io = _read(f"{base}/io", blind=True)
        found = _RCHAR_RE.search(io) if io else None
        rchar = int(found.group(1)) if found else None
        # Offsets move only by reads, and a weight file's number names the next shard only
        # once that is read or mapped (safetensors maps it on the number the last one had, and
        # reads nothing): without either, the weight files' fdinfo can wait.
        moved = rchar is None or rchar != proc.rchar or size_shared != proc.statm
        self._descriptors(base, proc, moved=moved)
        before, proc.statm = proc.statm, size_shared  # type: ignore[assignment]
        if size_shared != before:
            # A new mapping changes the size; pages arriving grow the file-backed pages. Pages
            # leaving (reclaim, DAMON) take nothing from what was consumed: no look for them.
            resized = before is None or size_shared is None or size_shared[0] != before[0]
            arrived = resized or int(size_shared[1]) > int(before[1])  # type: ignore[index]
            if arrived or not self._still_mapped(base, proc):
                self._mappings(base, proc, remap=resized)
        self._reads(base, proc, rchar)

    def _descriptors(self, base: str, proc: _Proc, moved: bool) -> None:
        """Looked for again when the count changed (exporter/sources/descriptors.py: work
        follows what changed, not what is held); weight files' and new ones' checked each
        look, the rest a slice at a time (a number can be reused without the count changing).
        """
        fd_dir = f"{base}/fd"
        now = self._samples
        first = proc.table.count is None and not proc.fds
        try:
            changes = proc.table.look(fd_dir, proc.fds, now)
        except PermissionError as exc:
            raise _Blind(_blind(fd_dir, exc)) from None
        if changes is not None:
            for number in changes.gone:
                proc.forget(number)
            for rank, number in enumerate(changes.appeared):
                fd = self._identify(fd_dir, number)
                proc.name(number, fd)
                # At the first look, files of the latest opens (the highest numbers: an
                # import's .pyc?) are young too; sockets and pipes there from the start are
                # long-lived.
                if not first or (fd is _OTHER_FILE and rank < YOUNG_AT_FIRST):
                    proc.table.born(number, now)
        for number in proc.table.rechecks(proc.fds, now):
            if proc.fds[number].key is None:
                proc.name(number, self._identify(fd_dir, number))
        for number in list(proc.weights):
            fd = proc.fds[number]
            if moved or fd.counted_pos is None:
                self._weight_fd(base, number, fd, proc)

    def _identify(self, fd_dir: str, number: int) -> _Fd:
        try:
            st = os.stat(f"{fd_dir}/{number}")
        except OSError:
            return _OTHER_FILE  # closed since the listing: its number is free for any file
        if not stat.S_ISREG(st.st_mode):
            return _NOT_A_FILE
        key = (st.st_dev, st.st_ino)
        return _Fd(key, st.st_ino) if key in self._by_key else _OTHER_FILE

    def _weight_fd(self, base: str, number: int, fd: _Fd, proc: _Proc) -> None:
        """Offset and flags of a weight file's descriptor; a reused number is named anew."""
        info = _read(f"{base}/fdinfo/{number}")
        if info is None:
            proc.forget(number)
            return
        fields = _fields(info)
        ino = fields.get(b"ino")
        if ino is None or int(ino) != fd.ino:  # no ino in fdinfo before Linux 5.14: stat it
            fresh = self._identify(f"{base}/fd", number)
            if fresh.key != fd.key:
                proc.name(number, fresh)
                fd = fresh
                if fd.key is None:
                    return
        fd.pos = int(fields.get(b"pos", b"0"))
        flags = int(fields.get(b"flags", b"0"), 8)
        if flags & _O_DIRECT and fd.key is not None:
            file = self._file(fd.key)
            file.direct = True

    def _mappings(self, base: str, proc: _Proc, remap: bool) -> None:
        """Which weight files are mapped (maps), and how many of their pages are (numa_maps).

        Mappings are listed again only when the process's size changed; a shard unmapped and
        one as large mapped in its place keeps the size, so a mapping whose address now names
        another file (or is gone) makes them listed again at once.
        """
        for attempt in (remap, True):
            if attempt:
                proc.vmas = self._weight_vmas(_read(f"{base}/maps", blind=True) or b"")
            if not proc.vmas:
                proc.mapped = {}
                return
            proc.mapped, complete = self._mapped_bytes(base, proc.vmas)
            if complete or attempt:
                return

    @staticmethod
    def _still_mapped(base: str, proc: _Proc) -> bool:
        """Whether each weight mapping still maps its file (/proc/PID/map_files, one readlink
        each): pages left, but no shard was unmapped and another as large mapped in its place.
        False where map_files may not be read (it needs CAP_SYS_ADMIN): then look properly."""
        for start, vma in proc.vmas.items():
            try:
                target = os.readlink(f"{base}/map_files/{start:x}-{vma.end:x}")
            except OSError:
                return False
            if not os.fsencode(target).endswith(vma.suffix):
                return False
        return True

    def _weight_vmas(self, text: bytes) -> dict[int, _Vma]:
        vmas: dict[int, _Vma] = {}
        by_ino = self._by_ino
        for line in text.splitlines():
            parts = line.split(None, 5)
            if len(parts) < 6 or parts[4] not in by_ino:
                continue
            wf = _match(by_ino[parts[4]], parts[3], parts[5])
            if wf is not None:
                start, _, end = parts[0].partition(b"-")
                entry = b"/" + os.fsencode(wf.entry)
                vmas[int(start, 16)] = _Vma((wf.dev, wf.ino), entry, int(end, 16))
        return vmas

    def _mapped_bytes(self, base: str, vmas: Mapping[int, _Vma]) -> tuple[dict[FileKey, int], bool]:
        """Bytes mapped per weight file, and whether every known mapping still names its file."""
        out: dict[FileKey, int] = {}
        found = 0
        text = _read(f"{base}/numa_maps", blind=True)
        if text is not None:
            for line in text.splitlines():
                start, _, rest = line.partition(b" ")
                vma = vmas.get(int(start, 16)) if start else None
                if vma is None:
                    continue
                if vma.suffix + b" " not in rest and not rest.endswith(vma.suffix):
                    return out, False  # the address names another file now
                found += 1
                pages = sum(int(n) for n in _NODE_PAGES_RE.findall(rest))
                kpage = _KPAGE_RE.search(rest)
                unit = int(kpage.group(1)) * 1024 if kpage else PAGE_SIZE
                out[vma.key] = out.get(vma.key, 0) + pages * unit
            return out, found == len(vmas)
        text = _read(f"{base}/smaps", blind=True) or b""  # a kernel without NUMA
        current: _Vma | None = None
        for line in text.splitlines():
            head = line.split(None, 1)[0] if line else b""
            if not head.endswith(b":"):  # a mapping's own line: start-end perms ... path
                current = vmas.get(int(head.partition(b"-")[0], 16)) if head else None
                if current is not None and not line.rstrip().endswith(current.suffix):
                    return out, False
                found += current is not None
            elif current is not None and head == b"Rss:":
                out[current.key] = out.get(current.key, 0) + int(line.split()[1]) * 1024
        return out, found == len(vmas)

    def _reads(self, base: str, proc: _Proc, rchar: int | None) -> None:
        """read() bytes (rchar) beyond what the weight files' offsets explain.

        With a weight file open whose offset stood still, and that the process does not map,
        they are its preads. Without one,
        enough of them (RESCAN_BYTES) may be a weight file opened on a reused descriptor number
        while the count stayed the same: every descriptor is looked at again.
        """
        moved = 0
        still: list[_Fd] = []  # offset unmoved since the last look (or since 0): pread suspects
        for number in proc.weights:
            fd = proc.fds[number]
            counted = fd.counted_pos or 0  # a new one was opened since the last look, at 0
            # A file this process maps is read through its pages, which rchar never counts:
            # its read() bytes are another file's (safe_open keeps the descriptor a moment).
            if fd.pos == counted and fd.key not in proc.mapped:
                still.append(fd)
            moved += max(0, fd.pos - counted)
            fd.counted_pos = fd.pos
        before, proc.rchar = proc.rchar, rchar
        if before is None or rchar is None:
            return
        extra = rchar - before - moved
        if extra <= 0:
            return
        if still:
            share = extra // len(still)
            for fd in still:
                assert fd.key is not None
                file = self._file(fd.key)
                file.pread = min(file.wf.size, file.pread + share)
            return
        proc.unexplained += extra
        if proc.unexplained >= RESCAN_BYTES:
            proc.unexplained = 0
            fd_dir = f"{base}/fd"
            for number in [n for n, fd in proc.fds.items() if fd.key is None]:
                proc.name(number, self._identify(fd_dir, number))

    # -- per-file accounting -----------------------------------------------------------------

    def _file(self, key: FileKey) -> _File:
        file = self._files.get(key)
        if file is None:
            file = self._files[key] = _File(self._by_key[key], len(self._files))
        return file

    def _account(
        self,
        held: Mapping[FileKey, int],
        offsets: Mapping[FileKey, int],
        mapped: Mapping[FileKey, int],
        mappings: Mapping[FileKey, int],
        now: float,
    ) -> None:
        for key in held:
            if key in self._by_key:
                self._file(key)
        for key, file in self._files.items():
            holders = held.get(key, 0)
            file.read_pos = max(file.read_pos, offsets.get(key, 0))
            if holders:
                by_map = min(file.wf.size, mapped.get(key, 0))
                if mappings.get(key, 0) > 1 and by_map > file.consumed:
                    by_map = self._cached(file.wf, by_map)
                estimate = max(file.read_pos, by_map, file.pread)
                file.how = (
                    "mmap"
                    if by_map >= max(file.read_pos, file.pread) and by_map
                    else "pread"
                    if file.pread > file.read_pos
                    else "read"
                )
            elif file.held:
                estimate, file.how = file.wf.size, "closed"  # let go: its loader is done with it
            else:
                estimate = file.consumed
            file.consumed = max(file.consumed, min(file.wf.size, estimate))
            file.held, file.holders = bool(holders), holders
        if held and self._first_open_at is None:
            self._first_open_at, self._first_open_seen = now, self._seen_none_held
        elif not held and self._first_open_at is None:
            self._seen_none_held = True
        if held:
            self._idle_since = None
        elif self._first_open_at is not None and self._idle_since is None:
            self._idle_since = now

    def _cached(self, wf: WeightFile, mapped: int) -> int:
        """A file mapped more than once counts each mapping's pages, and the pages several map
        count twice: the header every tensor-parallel rank parses, the fault-around at each
        one's slice edge, every page of a row-parallel tensor whose rows each rank slices (seen
        on vLLM 0.32 at TP 2: 64-128 KiB of a shard ahead of the page cache). Every mapped page
        is in the page cache, so the file's cached bytes bound them where they are measured
        truthfully (one cachestat, while such a file's pages arrive); else the sum stands."""
        behalf = self._on_behalf

        def one_pass() -> PassResult:
            return measure((wf,), count_unreadable=False)

        measured = behalf.run(one_pass, WALK_TIMEOUT) if behalf is not None else one_pass()
        if measured.resident_bytes is None or measured.stale:
            return mapped
        return min(mapped, measured.resident_bytes)

    def _report(self, now: float, visible: bool, reason: str | None) -> WeightFilesSample:
        files = sorted(self._files.values(), key=lambda f: f.first_seen)
        tree = self._weight_tree
        return WeightFilesSample(
            visible=visible,
            reason=reason,
            root_pid=self._root[0] if self._root else None,
            files_total=len(tree.files) if tree else 0,
            total_bytes=sum(wf.size for wf in tree.files) if tree else 0,
            first_open_at=self._first_open_at,
            first_open_seen=self._first_open_seen,
            idle_since=self._idle_since,
            consumed_bytes=sum(f.consumed for f in files),
            seen_bytes=sum(f.wf.size for f in files),
            held_files=sum(1 for f in files if f.held),
            files=tuple(
                FileUse(f.wf.name, f.wf.size, f.consumed, f.held, f.how, f.holders, f.direct)
                for f in files
            ),
            measured_at=now,
        )


def _match(candidates: list[WeightFile], dev: bytes, path: bytes) -> WeightFile | None:
    """The weight file a maps line names: same inode, and same device or same file name.

    btrfs shows a subvolume's files with another device number in maps than stat gives, so a
    device mismatch still matches when the mapped path ends in the file's own name.
    """
    major, _, minor = dev.partition(b":")
    try:
        device = os.makedev(int(major, 16), int(minor, 16))
    except ValueError:
        device = -1
    name = path.rstrip().removesuffix(b" (deleted)")
    for wf in candidates:
        if wf.dev == device or name.endswith(b"/" + os.fsencode(wf.entry)):
            return wf
    return None


def _fields(text: bytes) -> dict[bytes, bytes]:
    out = {}
    for line in text.splitlines():
        name, sep, value = line.partition(b":")
        if sep:
            out[name] = value.strip()
    return out


def _read(path: str, blind: bool = False) -> bytes | None:
    """A /proc file, None when the process is gone; _Blind when we may not read it.

    Unbuffered: a look reads a handful of these per process, and Python's file objects cost
    more than the reads themselves.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        return None
    except PermissionError as exc:
        if blind:
            raise _Blind(_blind(path, exc)) from None
        return None
    try:
        chunks = []
        while chunk := os.read(fd, _READ_SIZE):
            chunks.append(chunk)
            if len(chunk) < _READ_SIZE:
                break  # a short read of a seq_file is its end: spare the empty read
        return b"".join(chunks)
    except OSError as exc:
        if exc.errno in (errno.ESRCH, errno.ENOENT):
            return None
        raise
    finally:
        os.close(fd)


def _blind(path: str, exc: OSError) -> str:
    return (
        f"cannot see the server's weight files: {path}: {exc.strerror} as uid {os.geteuid()}; "
        "run as root (or with CAP_SYS_PTRACE) or as the server's user"
    )
