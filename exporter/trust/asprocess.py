"""Act with a discovered process's own rights: its file-system uid, gid, groups and capabilities.

Discovery reads what any local user's command line names, and the exporter usually runs as root
or with CAP_DAC_READ_SEARCH and CAP_FOWNER; so every file it opens, stats or measures on behalf
of a process is accessed on a thread that has taken that process's credentials, and the kernel,
not a guess from mode bits, decides what may be read.

The credentials of a Linux thread are its own at the syscall level: `setfsuid`, `setfsgid`,
`setgroups` and `capset` change the calling thread only. glibc's `setgroups` (like `setuid`)
broadcasts the change to every thread of the process, and Python's `os.setgroups` calls it, so
the raw syscalls are used here. The switch happens on dedicated worker threads (`Actor`) that run
nothing else, so no sampler, HTTP worker or the main thread ever holds another user's rights.

Capabilities: a fsuid changed from 0 to non-zero clears the file-system capabilities from the
effective set (capabilities(7), "Effect of user ID changes on capabilities"), but an exporter that
is not root and holds CAP_DAC_READ_SEARCH through ambient capabilities keeps them across the
change; so the worker also sets its effective set with `capset` to the process's own effective
capabilities (those of them the exporter holds: none for an ordinary user's process), and
restores its own after. The process's capabilities matter beyond its files: the kernel lets a
thread into /proc/PID/root only when the process's permitted capabilities are a subset of the
thread's effective ones (cap_ptrace_access_check), so a container's root process is looked at
with the container's capabilities. Without CAP_SETUID and CAP_SETGID a worker cannot take
another user's ids: it then acts only for processes whose ids are the exporter's own and refuses
the others.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import stat
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from exporter.trust.libc import LIBC
from exporter.trust.safeio import read_regular

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = 5.0  # a hung file system (NFS, FUSE) must not hold discovery longer
MAX_STUCK = 4  # worker threads left in a hung syscall before calls are refused outright
_STATUS_BYTES = 64 * 1024

# (setgroups, setfsuid, setfsgid, capget, capset) per architecture.
_SYSCALLS = {
    "x86_64": (116, 122, 123, 125, 126),
    "amd64": (116, 122, 123, 125, 126),
    "aarch64": (159, 151, 152, 90, 91),
    "arm64": (159, 151, 152, 90, 91),
    "riscv64": (159, 151, 152, 90, 91),
    "loongarch64": (159, 151, 152, 90, 91),
}
_NR = _SYSCALLS.get(platform.machine().lower())
_CAP_V3 = 0x20080522
_libc = LIBC
_libc.syscall.restype = ctypes.c_long


class _CapHeader(ctypes.Structure):
    _fields_ = (("version", ctypes.c_uint32), ("pid", ctypes.c_int))


class _CapData(ctypes.Structure):
    _fields_ = (
        ("effective", ctypes.c_uint32),
        ("permitted", ctypes.c_uint32),
        ("inheritable", ctypes.c_uint32),
    )


class RightsError(PermissionError):
    """This thread cannot take a process's rights: nothing is done on its behalf."""


class Borrowed(RightsError):
    """A process whose rights are not its user's own (a setuid program, one that is not
    dumpable): the exporter reads nothing for it. `why` says which."""

    def __init__(self, pid: int, why: str) -> None:
        super().__init__(f"pid {pid}: {why}")
        self.why = why


@dataclass(frozen=True)
class Rights:
    """The credentials a process accesses files with: fsuid, fsgid, supplementary groups and
    effective capabilities (a bit mask, capability(7) numbers)."""

    uid: int
    gid: int
    groups: tuple[int, ...]
    capabilities: int = 0

    @property
    def ids(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.uid, self.gid, self.groups)


@dataclass(frozen=True)
class _Status:
    """The credential lines of /proc/PID/status: (real, effective, saved, file-system) ids."""

    uids: tuple[int, ...]
    gids: tuple[int, ...]
    groups: tuple[int, ...]
    capabilities: int

    @classmethod
    def read(cls, path: str) -> _Status | None:
        try:
            text = read_regular(path, _STATUS_BYTES).decode("ascii", "replace")
        except OSError:
            return None
        fields: dict[str, list[str]] = {}
        for line in text.splitlines():
            name, _, value = line.partition(":")
            fields[name] = value.split()
        try:
            uids = tuple(int(u) for u in fields["Uid"][:4])
            gids = tuple(int(g) for g in fields["Gid"][:4])
            groups = tuple(sorted(int(g) for g in fields.get("Groups", [])))
            capabilities = int(fields["CapEff"][0], 16)
        except (KeyError, IndexError, ValueError):
            return None
        if len(uids) != 4 or len(gids) != 4:
            return None
        return cls(uids, gids, groups, capabilities)

    def rights(self, capabilities: int) -> Rights:
        return Rights(self.uids[3], self.gids[3], self.groups, capabilities)


def rights_of(pid: int, proc_root: str = "/proc") -> Rights:
    """A process's rights as they count from this exporter's user namespace; raises
    ProcessLookupError when it is gone, Borrowed when they are not its user's own.

    A setuid or setgid program run by a user holds another user's rights it was lent for one
    task (`su` at its password prompt: effective uid 0, real uid the user's); a process that is
    not dumpable holds something its owner may not see (the kernel makes its /proc entries
    root's then). Neither is a server the exporter reads for. Capabilities count only in the
    exporter's own user namespace: `unshare -Ur` gives any user a full set that is worth nothing
    over the host's files, so a process of another namespace has none here.
    """
    base = f"{proc_root}/{pid}"
    status = _Status.read(f"{base}/status")
    if status is None:
        raise ProcessLookupError(f"pid {pid} is gone")
    why = _borrowed(base, status)
    if why is not None:
        raise Borrowed(pid, why)
    theirs = _user_namespace(base)
    own_namespace = theirs is not None and theirs == _user_namespace(f"{proc_root}/self")
    return status.rights(status.capabilities if own_namespace else 0)


def _borrowed(base: str, status: _Status) -> str | None:
    """Why a process's credentials are not its user's own, or None."""
    if len(set(status.uids)) > 1 or len(set(status.gids)) > 1:
        return (
            f"its real, effective, saved and file-system ids differ (uids {_ids(status.uids)}, "
            f"gids {_ids(status.gids)}): a setuid or setgid program"
        )
    try:
        # The kernel's word on dumpable: root owns the process's entries otherwise (the
        # directory itself keeps its owner on Linux 6).
        owner = os.stat(f"{base}/status").st_uid
    except OSError:
        return None  # gone meanwhile: nothing is read for it anyway
    if owner != status.uids[1]:
        return "it is not dumpable (what it holds is hidden from its own user)"
    try:
        exe = os.stat(f"{base}/exe").st_mode
    except OSError:
        return None  # a kernel thread, or another user's read without privilege: ids tell all
    if exe & stat.S_ISUID or (exe & stat.S_ISGID and exe & stat.S_IXGRP):
        return "it runs a setuid or setgid program"
    return None


def _ids(ids: tuple[int, ...]) -> str:
    return "/".join(str(i) for i in ids)


def _user_namespace(base: str) -> str | None:
    try:
        return os.readlink(f"{base}/ns/user")
    except OSError:
        return None


def own_rights() -> Rights:
    """This thread's own credentials (for tests and the no-CAP_SETUID rule)."""
    mine = _Status.read(f"/proc/self/task/{threading.get_native_id()}/status")
    if mine is None:
        raise RightsError("cannot read this thread's own credentials")
    return mine.rights(mine.capabilities)


def _syscall(number: int, *args: Any) -> int:
    result = int(_libc.syscall(number, *args))
    if result == -1:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return result


def _capabilities() -> tuple[_CapHeader, Any]:
    assert _NR is not None
    header = _CapHeader(_CAP_V3, 0)
    data = (_CapData * 2)()
    _syscall(_NR[3], ctypes.byref(header), data)
    return header, data


def _set_effective(header: _CapHeader, data: Any, effective: tuple[int, int]) -> None:
    assert _NR is not None
    data[0].effective, data[1].effective = effective
    _syscall(_NR[4], ctypes.byref(header), data)


def _set_ids(rights: Rights) -> bool:
    """Set this thread's groups, fsgid and fsuid; whether the kernel took all three."""
    assert _NR is not None
    groups = (ctypes.c_uint32 * max(1, len(rights.groups)))(*rights.groups)
    try:
        _syscall(_NR[0], len(rights.groups), groups)
    except OSError:
        return False
    # setfsuid/setfsgid never fail loudly: they return the previous id; -1 asks without setting.
    _libc.syscall(_NR[2], rights.gid)
    _libc.syscall(_NR[1], rights.uid)
    return bool(_libc.syscall(_NR[1], -1) == rights.uid and _libc.syscall(_NR[2], -1) == rights.gid)


@contextlib.contextmanager
def _assumed(rights: Rights, mine: Rights) -> Iterator[None]:
    """This thread with `rights` and no effective capabilities, then `mine` again."""
    header, data = _capabilities()
    effective = (data[0].effective, data[1].effective)
    permitted = data[0].permitted | data[1].permitted << 32
    theirs = rights.capabilities & permitted
    switched = rights.ids != mine.ids
    try:
        if switched and not _set_ids(rights):
            raise RightsError(
                f"cannot take uid {rights.uid}'s rights (needs CAP_SETUID and CAP_SETGID)"
            )
        _set_effective(header, data, (theirs & 0xFFFFFFFF, theirs >> 32))
        yield
    finally:
        _set_effective(header, data, effective)
        if switched and not _set_ids(mine):
            raise _Broken("cannot restore the exporter's own credentials")
        # Back to fsuid 0 raised the file-system capabilities again: set exactly the old ones.
        _set_effective(header, data, effective)


class _Broken(Exception):
    """A worker that could not get its own rights back: it must run nothing else."""


@dataclass
class _Job:
    rights: Rights
    fn: Callable[[], Any]
    future: Future[Any]
    abandoned: bool = False  # the caller gave up waiting: its worker counts as stuck


class Actor:
    """Dedicated threads that run callables with a process's rights, one call at a time each.

    `call` waits at most `timeout`; a worker stuck in a hung file system is left behind and
    replaced, up to MAX_STUCK of them, after which calls are refused until one comes back.

    Every caller of one actor waits behind what its workers wait on, and a hung mount under a
    server's weights holds them for as long as it hangs: so each watched target has an actor of
    its own, and discovery another (exporter/runtime/wiring.py), and one user's hung FUSE daemon
    holds that target's file reads only. A worker starts when a call finds none idle (up to
    `workers`): a quiet target costs one thread.
    """

    def __init__(self, workers: int = 2, timeout: float = DEFAULT_TIMEOUT) -> None:
        self._wanted = workers
        self._timeout = timeout
        self._lock = threading.Lock()
        self._queued = threading.Condition(self._lock)
        self._jobs: deque[_Job | None] = deque()
        self._workers = 0  # started, and neither stuck nor broken
        self._idle = 0  # of those, waiting for a job
        self._stuck = 0
        self._closed = False

    def call(self, rights: Rights, fn: Callable[[], T], timeout: float | None = None) -> T:
        """fn() on a worker holding `rights`; RightsError, TimeoutError or what fn raised."""
        if _NR is None:
            raise RightsError(f"cannot switch credentials on {platform.machine()}")
        job = _Job(rights, fn, Future())
        with self._lock:
            if self._closed:
                raise RightsError("shutting down")
            if self._stuck >= MAX_STUCK:
                raise TimeoutError(f"{self._stuck} file accesses hung: refusing more for now")
            self._jobs.append(job)
            if self._workers < self._wanted and self._idle < len(self._jobs):
                self._workers += 1
                threading.Thread(target=self._work, name="as-process", daemon=True).start()
            self._queued.notify()
        try:
            return job.future.result(self._timeout if timeout is None else timeout)  # type: ignore[no-any-return]
        except TimeoutError:
            if job.future.cancel():
                raise  # still queued behind others: no worker is stuck on it
            with self._lock:
                if not job.future.done():
                    job.abandoned = True
                    self._stuck += 1
                    self._workers -= 1  # the next call starts a replacement
            if job.abandoned:
                raise TimeoutError("file access as the process did not finish in time") from None
            return job.future.result()  # type: ignore[no-any-return]

    def close(self) -> None:
        """End the idle workers now, the busy ones after their call, the stuck ones when their
        file system answers."""
        with self._lock:
            self._closed = True
            self._jobs.extend([None] * self._workers)
            self._queued.notify_all()

    def _work(self) -> None:
        mine = own_rights()
        while True:
            with self._lock:
                self._idle += 1
                while not self._jobs:
                    self._queued.wait()
                self._idle -= 1
                job = self._jobs.popleft()
            if job is None:
                return
            if not job.future.set_running_or_notify_cancel():
                continue
            try:
                with _assumed(job.rights, mine):
                    result = job.fn()
            except _Broken as exc:
                log.critical("%s: this worker thread stops", exc)
                job.future.set_exception(RightsError(str(exc)))
                with self._lock:
                    if job.abandoned:
                        self._stuck -= 1  # counted as stuck, and gone for good now
                    else:
                        self._workers -= 1
                return
            except BaseException as exc:  # handed to the caller, whatever it is
                job.future.set_exception(exc)
            else:
                job.future.set_result(result)
            with self._lock:
                if job.abandoned:
                    self._stuck -= 1
                    if self._closed or self._workers >= self._wanted:
                        return  # replaced meanwhile, or its target is no longer watched
                    self._workers += 1


@dataclass(frozen=True)
class OnBehalf:
    """An actor bound to one process's rights: how a source touches that process's files.

    Each call takes the process's rights afresh while it runs (a server that drops root after
    its start is read for with its user's rights), and refuses once it holds borrowed ones (a
    setuid program exec'd in its place): Borrowed. Once it is gone, the rights it last had,
    which passed the same rule, read its files while its target is kept.
    """

    actor: Actor
    rights: Rights
    pid: int | None = None
    same: Callable[[], bool] = lambda: True  # whether `pid` is still that process (not reused)
    proc_root: str = "/proc"

    def current(self) -> Rights:
        """The process's rights now (Borrowed when they are not its own), or its last ones."""
        if self.pid is None:
            return self.rights
        try:
            rights = rights_of(self.pid, self.proc_root)
        except ProcessLookupError:
            return self.rights
        return rights if self.same() else self.rights  # a reused pid is another process's

    def run(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        return self.actor.call(self.current(), fn, timeout)
