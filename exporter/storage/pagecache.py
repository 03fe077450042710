"""Page-cache residency of a target's weight files, measured file by file.

Residency decides whether the next restart is warm or cold, so it must be true or absent:
`cachestat` (Linux >= 6.5) answers exactly, `mincore` only where the caller owns or may write
the file (otherwise Linux >= 5.2 claims every page resident, as vmtouch happily repeats), and
anything else yields `resident_bytes=None` with a reason instead of a guess.

cachestat walks the cached folios: a few ms of CPU per cached GB held in 4 KiB pages (far less
in large folios), so a host with hundreds of GB cached would burn a core polling it;
`ResidencySource` spaces full passes so that its CPU stays under a budget and hands out the last
measurement in between.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import os
import platform
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

from exporter.storage.weighttree import WeightFile
from exporter.trust.libc import LIBC

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
METHODS: tuple[str, ...] = ("cachestat", "mincore")
MINCORE_WINDOW = 1 << 30
ADVICE = (
    "run as the files' owner or root; cachestat needs Linux >= 6.5 and must be allowed by seccomp"
)

# cachestat is 451 in the unified syscall table; the arches below all use that table as is
# (alpha and mips add offsets, so they get ENOSYS semantics instead of a wrong syscall).
_CACHESTAT_ARCHES = frozenset(
    {"x86_64", "amd64", "aarch64", "arm64", "riscv64", "ppc64le", "ppc64", "s390x", "loongarch64"}
)
SYS_CACHESTAT: int | None = 451 if platform.machine().lower() in _CACHESTAT_ARCHES else None

_CAP_FOWNER = 3  # linux/capability.h
_PROT_READ = 0x1
_MAP_SHARED = 0x01
_MAP_FAILED = ctypes.c_void_p(-1).value
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY  # no hang on a FIFO
_LOW_BIT = bytes(i & 1 for i in range(256))

_libc = LIBC
_libc.syscall.restype = ctypes.c_long  # no argtypes: converting them doubles the call's cost
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int64,
]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


class _CachestatRange(ctypes.Structure):
    _fields_ = (("off", ctypes.c_uint64), ("len", ctypes.c_uint64))


class _CachestatOut(ctypes.Structure):
    _fields_ = (
        ("nr_cache", ctypes.c_uint64),
        ("nr_dirty", ctypes.c_uint64),
        ("nr_writeback", ctypes.c_uint64),
        ("nr_evicted", ctypes.c_uint64),
        ("nr_recently_evicted", ctypes.c_uint64),
    )


@dataclass(frozen=True)
class CacheStat:
    """The kernel's `struct cachestat`, in pages."""

    nr_cache: int
    nr_dirty: int
    nr_writeback: int
    nr_evicted: int
    nr_recently_evicted: int


@dataclass(frozen=True)
class FileResidency:
    path: str
    size_bytes: int
    resident_bytes: int


@dataclass(frozen=True)
class PassResult:
    files: int
    total_bytes: int
    resident_bytes: int | None
    per_file: tuple[FileResidency, ...]
    method: str | None
    reason: str | None
    stale: bool  # a file vanished or was replaced since discovery
    where: str | None = None  # measured below the files' own mount (overlay layer, FUSE source)


class CachestatCall:
    """cachestat with its buffers built once: per-call ctypes setup dominated a 10,000-file pass."""

    def __init__(self) -> None:
        self._whole = ctypes.byref(_CachestatRange(0, 0))  # len 0: to the end of the file
        self._range = _CachestatRange(0, 0)
        self._range_ref = ctypes.byref(self._range)
        self._out = _CachestatOut()
        self._out_ref = ctypes.byref(self._out)
        # -1 is no syscall at all: the kernel answers ENOSYS, as it would without cachestat.
        self._nr = -1 if SYS_CACHESTAT is None else SYS_CACHESTAT

    def __call__(self, fd: int, offset: int = 0, length: int = 0) -> CacheStat:
        """Counters of a range of the file (length 0: to its end); OSError on failure."""
        self._range.off = offset
        self._range.len = length
        if _libc.syscall(self._nr, fd, self._range_ref, self._out_ref, 0) != 0:
            _raise_errno()
        out = self._out
        return CacheStat(
            out.nr_cache, out.nr_dirty, out.nr_writeback, out.nr_evicted, out.nr_recently_evicted
        )

    def resident_bytes(self, fd: int, size: int) -> int:
        """Cached bytes; a cached partial last page counts only the bytes of the file it holds."""
        if _libc.syscall(self._nr, fd, self._whole, self._out_ref, 0) != 0:
            _raise_errno()
        pages: int = self._out.nr_cache
        tail = size % PAGE_SIZE
        if tail and pages and self(fd, size - tail).nr_cache:
            return min(size, (pages - 1) * PAGE_SIZE + tail)
        return min(size, pages * PAGE_SIZE)


def _raise_errno() -> NoReturn:
    err = ctypes.get_errno()
    raise OSError(err, os.strerror(err))


def cachestat(fd: int, offset: int = 0, length: int = 0) -> CacheStat:
    """Page-cache counters of a range of the file (length 0: to its end); OSError on failure."""
    return CachestatCall()(fd, offset, length)


def mincore_resident_bytes(fd: int, size: int) -> int:
    """Resident bytes by mmap + mincore in windows; only truthful where mincore_truthful says so."""
    resident = 0
    vec = (ctypes.c_ubyte * -(-min(size, MINCORE_WINDOW) // PAGE_SIZE))()
    for offset in range(0, size, MINCORE_WINDOW):
        length = min(MINCORE_WINDOW, size - offset)
        addr = _libc.mmap(None, length, _PROT_READ, _MAP_SHARED, fd, offset)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"mmap: {os.strerror(err)}")
        try:
            if _libc.mincore(addr, length, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"mincore: {os.strerror(err)}")
        finally:
            _libc.munmap(addr, length)
        flags = bytes(vec)[: -(-length // PAGE_SIZE)].translate(_LOW_BIT)
        resident += flags.count(1) * PAGE_SIZE
        if length % PAGE_SIZE and flags[-1]:  # the file's partial last page
            resident -= PAGE_SIZE - length % PAGE_SIZE
    return resident


def mincore_truthful(path: str, st: os.stat_result) -> bool:
    """Linux >= 5.2 makes mincore claim every page resident unless the caller owns the file, may
    write it, or holds CAP_FOWNER (the kernel's can_do_mincore).

    Being root is not enough: a container's root with its capabilities dropped gets the lie.
    """
    return (
        st.st_uid == os.geteuid()
        or _holds_cap_fowner()
        or os.access(path, os.W_OK, effective_ids=True)
    )


@functools.cache
def _holds_cap_fowner() -> bool:
    """CAP_FOWNER in the effective set; read once, a process's capabilities do not grow."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, ValueError):
        pass
    return False


def _measure_fd(
    fd: int, path: str, st: os.stat_result, methods: Sequence[str], call: CachestatCall
) -> tuple[int | None, str | None, str | None]:
    size = st.st_size
    failures: list[str] = []
    if "cachestat" in methods:
        try:
            return call.resident_bytes(fd, size), "cachestat", None
        except OSError as exc:
            failures.append(f"cachestat: {exc.strerror}")
    if "mincore" in methods:
        if not mincore_truthful(path, st):
            failures.append(
                "mincore would claim every page resident (not owner, not writable, no CAP_FOWNER)"
            )
        else:
            try:
                return mincore_resident_bytes(fd, size), "mincore", None
            except OSError as exc:
                failures.append(f"mincore: {exc.strerror}")
    return None, None, f"cannot measure page cache of {path}: {'; '.join(failures)}; {ADVICE}"


def measure(
    files: Sequence[WeightFile],
    per_file: bool = False,
    methods: Sequence[str] = METHODS,
    count_unreadable: bool = True,
    exact: bool = False,
) -> PassResult:
    """One pass over discovered files; vanished, replaced and shrunk files are handled, not fatal.

    Sizes come from fstat of the open fd, so a file replaced or truncated since discovery is
    measured as it is now, and an inode reached twice (e.g. replaced by a hard link) counts once.
    A file that cannot be opened still counts its size, unless `count_unreadable` is False (a
    pass with a discovered process's rights: what it cannot read is not its weights). `exact`:
    a path that now names another file than the one listed (dev, ino) is not counted at all (a
    server's environment: a name planted where its file was is not its file).
    """
    call = CachestatCall()
    fast = "cachestat" in methods  # the common case, kept free of per-file function layers
    seen: set[tuple[int, int]] = set()
    total = resident = 0
    rows: list[FileResidency] = []
    used: set[str | None] = set()
    cached: int | None
    method: str | None
    reason: str | None = None
    stale = False
    directory, dir_fd = None, -1
    try:
        for wf in files:
            if wf.directory != directory:
                if dir_fd >= 0:
                    os.close(dir_fd)
                directory, dir_fd = wf.directory, -1
                with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                    dir_fd = os.open(directory, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            if dir_fd < 0:
                stale = True  # its directory vanished
                continue
            try:
                fd = os.open(wf.entry, _OPEN_FLAGS, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ENOENT, errno.ENOTDIR):
                    stale = True  # vanished: skip it and rediscover
                    continue
                if not count_unreadable:
                    continue
                reason = reason or f"cannot open {wf.path}: {exc.strerror}; {ADVICE}"
                # Still a weight file: its size counts even though its residency cannot.
                with contextlib.suppress(OSError):
                    st = os.stat(wf.entry, dir_fd=dir_fd)
                    if (st.st_dev, st.st_ino) not in seen and stat.S_ISREG(st.st_mode):
                        seen.add((st.st_dev, st.st_ino))
                        total += st.st_size
                continue
            try:
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                if key != (wf.dev, wf.ino):
                    stale = True
                    if exact:
                        continue
                if key in seen or not stat.S_ISREG(st.st_mode):
                    continue
                seen.add(key)
                total += st.st_size
                if reason is not None:
                    continue  # the total is already unknown: spend no more CPU measuring
                if fast:
                    try:
                        cached, method = call.resident_bytes(fd, st.st_size), "cachestat"
                    except OSError:
                        fast = False  # e.g. EPERM: the slow path says why, or falls back
                if not fast:
                    cached, method, reason = _measure_fd(fd, wf.path, st, methods, call)
            finally:
                os.close(fd)
            if cached is None:
                continue
            used.add(method)
            resident += cached
            if per_file:
                rows.append(FileResidency(wf.name, st.st_size, cached))
    finally:
        if dir_fd >= 0:
            os.close(dir_fd)
    if reason is not None:
        return PassResult(len(seen), total, None, (), None, reason, stale)
    method = "mincore" if "mincore" in used else "cachestat" if used else None
    return PassResult(len(seen), total, resident, tuple(rows), method, None, stale)


def sizes_only(files: Sequence[WeightFile], reason: str) -> PassResult:
    """Count and size without opening a file (stat only): where an open would disturb the page
    cache (FUSE without keep_cache) or residency would not be the truth (ZFS)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    stale = False
    for wf in files:
        try:
            st = os.stat(wf.path)
        except OSError as exc:
            stale = stale or exc.errno in (errno.ENOENT, errno.ENOTDIR)  # vanished: rediscover
            continue
        if (st.st_dev, st.st_ino) != (wf.dev, wf.ino):
            stale = True
        if (st.st_dev, st.st_ino) in seen or not stat.S_ISREG(st.st_mode):
            continue
        seen.add((st.st_dev, st.st_ino))
        total += st.st_size
    return PassResult(len(seen), total, None, (), None, reason, stale)
