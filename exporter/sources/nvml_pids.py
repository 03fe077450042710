"""Whether the process IDs NVML lists name processes in this exporter's PID namespace.

Per-process GPU memory is matched to a server by PID, so a PID from another namespace would
give a server another process's memory, or none. What NVML returns depends on the driver:
older ones report every GPU client by its host PID, whatever the caller's namespace (an exporter
in a container without `--pid=host` then sees PIDs that are missing here, or that name an
unrelated local process); newer ones translate PIDs into the caller's namespace and leave out
the clients it cannot see. Which one runs cannot be asked of NVML, so it is checked:

1. In the initial PID namespace (the host's: `/proc/self/ns/pid` has the kernel's fixed inode
   PROC_PID_INIT_INO) both kinds of driver report our PIDs: trusted, nothing to check.
2. Elsewhere a listed PID is trusted only as a process here that holds an NVIDIA device open
   (a `/proc/PID/fd` link to `/dev/nvidia*`; every CUDA client does, that is how it talks to the
   driver). A listed PID that names a process here without one, or that is missing here in two
   samples in a row (one miss can be a process that exited between NVML's list and our look),
   means the PIDs are the host's: attribution is refused, with that reason.
3. Where `/proc/PID/fd` cannot be read (an unprivileged exporter, a server of another user) or
   no GPU process is listed yet, nothing can be checked, and attribution is refused until it can.
   A verdict reached stays until evidence contradicts it, so an idle GPU keeps the last one.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from enum import Enum

# PROC_PID_INIT_INO in include/linux/proc_ns.h: the inode of the initial PID namespace.
INIT_PID_NAMESPACE_INODE = 0xEFFFFFFC
NVIDIA_DEVICES = "/dev/nvidia"
HOST_PID_ADVICE = (
    "run the exporter in the host PID namespace (docker --pid=host, Kubernetes hostPID: true)"
)


class _Seen(Enum):
    GPU_CLIENT = "holds an NVIDIA device open here"
    OTHER = "is a process here that holds no NVIDIA device open"
    MISSING = "is not a process in this PID namespace"
    UNREADABLE = "cannot be checked (its /proc/PID/fd is not readable)"


def in_initial_pid_namespace(proc_root: str = "/proc") -> bool:
    """Whether this process lives in the host's PID namespace (False when it cannot be told)."""
    try:
        return os.stat(os.path.join(proc_root, "self", "ns", "pid")).st_ino == (
            INIT_PID_NAMESPACE_INODE
        )
    except OSError:
        return False


class NvmlPidCheck:
    """Judges each sample's listed PIDs; `problem()` is None when they can be attributed.

    Not thread-safe: the NVML source's thread owns it.
    """

    def __init__(
        self,
        proc_root: str = "/proc",
        *,
        host_namespace: bool | None = None,
        device_prefix: str = NVIDIA_DEVICES,
    ) -> None:
        self._proc_root = proc_root
        self._device_prefix = device_prefix
        self.host_namespace = (
            in_initial_pid_namespace(proc_root) if host_namespace is None else host_namespace
        )
        self._clients: set[int] = set()  # listed PIDs already seen holding a device here
        self._listed_before: frozenset[int] = frozenset()
        self._verdict: str | None = (
            None
            if self.host_namespace
            else "NVML's process IDs not checked yet: no GPU process listed to check them against"
            " (this exporter is not in the host PID namespace)"
        )

    def problem(self, listed: Collection[int]) -> str | None:
        """Why per-process GPU memory cannot be attributed by these PIDs, or None when it can."""
        if self.host_namespace:
            return None
        pids = frozenset(listed)
        self._clients &= pids
        seen = {pid: self._look(pid) for pid in sorted(pids)}
        self._clients.update(pid for pid, what in seen.items() if what is _Seen.GPU_CLIENT)
        wrong = [
            (pid, what)
            for pid, what in seen.items()
            if what is _Seen.OTHER or (what is _Seen.MISSING and pid in self._listed_before)
        ]
        self._listed_before = pids
        if wrong:
            pid, what = wrong[0]
            self._verdict = (
                f"NVML reports host process IDs, not this PID namespace's (pid {pid} {what.value}):"
                f" {HOST_PID_ADVICE}"
            )
        elif _Seen.GPU_CLIENT in seen.values():
            self._verdict = None
        elif _Seen.UNREADABLE in seen.values() and self._verdict is not None:
            pid = min(p for p, what in seen.items() if what is _Seen.UNREADABLE)
            self._verdict = (
                f"cannot check NVML's process IDs against this PID namespace: pid {pid}"
                f" {_Seen.UNREADABLE.value} as uid {os.geteuid()}; run as root or the server's"
                f" user, or {HOST_PID_ADVICE}"
            )
        return self._verdict

    def _look(self, pid: int) -> _Seen:
        if pid in self._clients:
            return _Seen.GPU_CLIENT
        fd_dir = os.path.join(self._proc_root, str(pid), "fd")
        try:
            fds = os.listdir(fd_dir)
        except FileNotFoundError:
            return _Seen.MISSING
        except OSError:
            return _Seen.UNREADABLE
        for fd in fds:
            try:
                if os.readlink(os.path.join(fd_dir, fd)).startswith(self._device_prefix):
                    return _Seen.GPU_CLIENT
            except OSError:
                continue  # closed since the listing
        return _Seen.OTHER
