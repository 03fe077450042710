"""Which mount a path lives on, from the kernel's own answer rather than from device numbers.

A file's `st_dev` does not name its mount on every filesystem: btrfs gives each subvolume an
anonymous device number that differs from the one mountinfo shows for its superblock, and
overlayfs gives each layer another. The mount id does not lie: an `O_PATH` descriptor of the path
(which runs no filesystem `open`, so a FUSE daemon sees nothing and drops no cache) carries it in
its fdinfo (`mnt_id:`), and mountinfo lists that id with the filesystem type, its source and its
options. Paths seen through `/proc/PID/root` live in that process's mount namespace, so they are
looked up in `/proc/PID/mountinfo`.
"""

from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

_OCTAL = re.compile(r"\\([0-7]{3})")
_IN_PROCESS_ROOT = re.compile(r"(/proc/(\d+)/root)(?=/|\Z)")


def unescape(text: str) -> str:
    r"""mountinfo's octal escapes (`\040` for a space, `\054` for a comma) back to characters."""
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), text)


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo (proc(5)), fields unescaped."""

    mount_id: int
    parent_id: int
    dev: str  # MAJ:MIN of the superblock
    root: str  # the directory of the filesystem that is mounted here
    mount_point: str
    fstype: str  # "fuse.sshfs" is kept whole: its subtype names the daemon
    source: str
    options: str  # per mount (ro, nosuid, ...)
    super_options: str  # per superblock (overlay's lowerdir, NFS's addr, ...)

    @functools.cached_property
    def _options(self) -> dict[str, list[str]]:
        """Superblock options by name, in the kernel's order ("" for a flag), parsed once."""
        parsed: dict[str, list[str]] = {}
        for item in split_options(self.super_options):
            key, _, value = item.partition("=")
            parsed.setdefault(key, []).append(value)
        return parsed

    def option(self, name: str) -> str | None:
        """The value of a superblock option (`lowerdir`), "" for a flag, None when absent."""
        values = self._options.get(name)
        return values[0] if values else None

    def options_named(self, name: str) -> tuple[str, ...]:
        """Every value of an option that may repeat (overlay's `lowerdir+`)."""
        return tuple(v for v in self._options.get(name, ()) if v)

    @property
    def base_type(self) -> str:
        """`fuse` for `fuse.sshfs`: the kernel's filesystem, without the daemon's subtype."""
        return self.fstype.split(".", 1)[0]


def split_options(text: str) -> list[str]:
    """Comma-separated options; commas inside values are escaped (\\054) by the kernel."""
    return [unescape(item) for item in text.split(",") if item]


# Mount tables kept parsed, by their text: this exporter's and a few containers'. A table changes
# with a mount, not a sample, yet the storage and residency sources read it at each description
# and pass; reading it is a copy, parsing it was most of their cost (0.3 ms for 20 mounts).
TABLES_KEPT = 16


@functools.lru_cache(maxsize=TABLES_KEPT)
def parse_mountinfo(text: str) -> tuple[Mount, ...]:
    """Every well-formed line; a line the kernel would never write is skipped, not fatal."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 6 or len(rest) < 2:
            continue
        try:
            mount_id, parent_id = int(fields[0]), int(fields[1])
        except ValueError:
            continue
        mounts.append(
            Mount(
                mount_id=mount_id,
                parent_id=parent_id,
                dev=fields[2],
                root=unescape(fields[3]),
                mount_point=unescape(fields[4]),
                fstype=rest[0],
                source=unescape(rest[1]),
                options=fields[5],
                super_options=rest[2] if len(rest) > 2 else "",
            )
        )
    return tuple(mounts)


@dataclass(frozen=True)
class MountTable:
    """The mounts of one mount namespace, as read at one moment."""

    mounts: tuple[Mount, ...]
    prefix: str  # "" or /proc/PID/root: how this exporter reaches that namespace's paths

    def by_id(self, mount_id: int) -> Mount | None:
        for mount in self.mounts:
            if mount.mount_id == mount_id:
                return mount
        return None

    def containing(self, path: str) -> Mount | None:
        """The last-mounted mount whose mount point is the longest prefix of `path` (a path in
        this namespace, without the prefix)."""
        best: Mount | None = None
        for mount in self.mounts:
            point = mount.mount_point.rstrip("/") + "/"
            if (path.rstrip("/") + "/").startswith(point) and (
                best is None or len(point) >= len(best.mount_point.rstrip("/") + "/")
            ):
                best = mount
        return best

    def outside(self, path: str) -> str:
        """A path of this namespace as this exporter reaches it."""
        return self.prefix + path if self.prefix else path


def read_mount_table(proc_root: str = "/proc", pid: str = "self") -> MountTable:
    """The mount table of a process (OSError when it cannot be read)."""
    with open(os.path.join(proc_root, pid, "mountinfo"), encoding="utf-8", errors="replace") as f:
        mounts = parse_mountinfo(f.read())
    prefix = "" if pid == "self" else os.path.join(proc_root, pid, "root")
    return MountTable(mounts, prefix)


@dataclass(frozen=True)
class Placed:
    """A path on its mount: the mount, and the path within that mount's namespace."""

    mount: Mount
    path: str  # inside the namespace, symlinks resolved where the kernel could say so
    table: MountTable


def mount_id_of(path: str) -> tuple[int | None, str | None]:
    """The mount id of `path` and its resolved path, from an O_PATH descriptor (no fs open)."""
    fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    try:
        mount_id = None
        with open(f"/proc/self/fdinfo/{fd}", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("mnt_id:"):
                    mount_id = int(line.split()[1])
        try:
            resolved: str | None = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            resolved = None
        return mount_id, resolved
    finally:
        os.close(fd)


class Mounts:
    """Places paths on mounts; mount tables are read once per `refresh()`, per namespace."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self._proc_root = proc_root
        self._tables: dict[str, MountTable] = {}

    def refresh(self) -> None:
        """Forget the tables read so far: mounts may have changed since."""
        self._tables = {}

    def table(self, pid: str = "self") -> MountTable:
        if pid not in self._tables:
            self._tables[pid] = read_mount_table(self._proc_root, pid)
        return self._tables[pid]

    def place(self, path: str) -> Placed | None:
        """The mount `path` is on, or None when no mount of its table holds it; OSError when
        the path or its namespace's mount table cannot be read."""
        pid, inner = namespace_of(path)
        mount_id, resolved = mount_id_of(path)
        table = self.table(pid)
        mount = table.by_id(mount_id) if mount_id is not None else None
        if mount is not None and resolved is not None and pid == "self":
            inner = resolved
        if mount is None:
            # A fake or foreign table (tests, a namespace read from elsewhere): the longest
            # mount point over the path as written.
            mount = table.containing(os.path.normpath(inner))
        if mount is None:
            return None
        return Placed(mount, os.path.normpath(inner), table)


def namespace_of(path: str) -> tuple[str, str]:
    """("self", path), or (PID, the path inside) for a path seen through /proc/PID/root: that
    process's mount namespace holds it, and its /proc/PID files (mountinfo, mountstats) say."""
    match = _IN_PROCESS_ROOT.match(path)
    if match is None:
        return "self", path
    return match.group(2), path[match.end(1) :] or "/"


def relative_to(path: str, mount_point: str) -> str | None:
    """`path` relative to `mount_point`, or None when it is not below it."""
    point = mount_point.rstrip("/")
    if path == point or not point:
        return path[len(point) :].lstrip("/")
    if path.startswith(point + "/"):
        return path[len(point) + 1 :]
    return None
