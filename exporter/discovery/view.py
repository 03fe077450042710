"""A process's view of its files, turned into paths this exporter can open.

A server names its files as it sees them: relative paths against its working directory, `~`
in its owner's home (from the passwd file it sees), and everything through /proc/PID/root
when it lives in another mount namespace (a container). Its environment and its own --config
file are read here too, bounded; each is read with the process's rights (discovery/scan.py)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import yaml

from exporter.discovery.refusals import Refuser
from exporter.discovery.serverargs import Evidence
from exporter.trust.safeio import Refused, pseudo_path, read_regular, resolve_in_root

MAX_CONFIG_BYTES = 1 << 20
MAX_ENVIRON_BYTES = 1 << 20
MAX_PASSWD_BYTES = 4 << 20


@dataclass(frozen=True)
class ProcessView:
    """Paths as one process sees them, turned into paths this exporter can open."""

    prefix: str  # "" or /proc/PID/root when the process has another root or mount namespace
    cwd: str | None  # its working directory, as the process sees it
    home: str | None
    evidence: tuple[Evidence, ...]
    uid: int | None = None

    @classmethod
    def of(cls, proc_root: str, pid: int, environ: Mapping[str, str] | None) -> ProcessView:
        base = f"{proc_root}/{pid}"
        same_mounts = same_namespace(proc_root, pid, "mnt")
        evidence: list[Evidence] = []
        prefix = ""
        if same_mounts is False or not _same_root(proc_root, pid):
            prefix = f"{base}/root"
            evidence.append(
                Evidence("files", prefix, "another mount namespace or root: paths go through it")
            )
        elif same_mounts is None:
            evidence.append(Evidence("files", "as on this host", "mount namespace unreadable"))
        try:
            cwd: str | None = os.readlink(f"{base}/cwd")
            uid: int | None = os.stat(base).st_uid
        except OSError:
            cwd = uid = None
        return cls(prefix, cwd, None, tuple(evidence), uid)

    def host_path(self, path: str) -> str | None:
        """The path this exporter opens for one the process names; symlinks resolved inside the
        process's root, Refused for /proc, /sys and /dev, OSError when a step is refused."""
        if path == "~" or path.startswith("~/"):
            if self.home is None:
                return None
            path = self.home + path[1:]
        if not path.startswith("/"):
            if self.cwd is None:
                return None
            path = os.path.join(self.cwd, path)
        if pseudo_path(path):
            raise Refused("pseudo_filesystem", f"{path}: /proc, /sys and /dev are never read")
        resolved = resolve_in_root(self.prefix, path)
        if pseudo_path(resolved[len(self.prefix) :]):
            raise Refused("pseudo_filesystem", f"{path}: leads into /proc, /sys or /dev")
        return resolved


def same_namespace(proc_root: str, pid: int, kind: str) -> bool | None:
    try:
        theirs = os.readlink(f"{proc_root}/{pid}/ns/{kind}")
        ours = os.readlink(f"{proc_root}/self/ns/{kind}")
    except OSError:
        return None
    return theirs == ours


def _same_root(proc_root: str, pid: int) -> bool:
    try:
        theirs = os.stat(f"{proc_root}/{pid}/root")
        ours = os.stat(f"{proc_root}/self/root")
    except OSError:
        return True
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def passwd_home(view: ProcessView, refuse: Refuser) -> str | None:
    """The process owner's home from the passwd file the process itself sees."""
    if view.uid is None:
        return None
    try:
        text = read_regular(f"{view.prefix}/etc/passwd", MAX_PASSWD_BYTES)
    except OSError as exc:
        refuse.of(exc, "/etc/passwd")
        return None
    for line in text.decode("utf-8", "surrogateescape").splitlines():
        fields = line.split(":")
        if len(fields) >= 6 and fields[2] == str(view.uid):
            return fields[5] or None
    return None


def read_environ(base: str) -> dict[str, str] | None:
    """The process's initial environment; None when we may not read it (another user's)."""
    try:
        raw = read_regular(f"{base}/environ", MAX_ENVIRON_BYTES)
    except OSError:
        return None
    environ = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            environ[os.fsdecode(name)] = os.fsdecode(value)
    return environ


def read_server_config(
    view: ProcessView, path: str, refuse: Refuser
) -> Mapping[str, object] | None:
    """A server's own --config file (YAML), read through the process's view of the files."""
    try:
        host = view.host_path(path)
        if host is None:
            return None
        document = yaml.safe_load(read_regular(host, MAX_CONFIG_BYTES))
    except OSError as exc:
        refuse.of(exc, path)
        return None
    except (yaml.YAMLError, RecursionError):
        return None
    return document if isinstance(document, dict) else None
