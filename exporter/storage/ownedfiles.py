"""Open files listed in a tree another user may own, with that user's rights, for `prewarm`.

Root runs `prewarm` on a model directory; the directory may be a user's, and then so is every
name in it: a symlink to a root-only file, a subdirectory that is a symlink into /root, a file
swapped for a FIFO after the listing. Read as root, the first two would pull root's files into
the page cache (or drop them from it with `--evict`) and the third would hang the command. So each
file is opened with the rights of the user who owns the names leading to it (a root-owned path
alone is read with root's rights), through its real path with O_NOFOLLOW | O_NONBLOCK, and fstat
must show the regular file that was listed (same device and inode) before a byte is read.
"""

from __future__ import annotations

import os
import pwd
import stat
from collections.abc import Sequence

from exporter.storage.weighttree import WeightFile
from exporter.trust.asprocess import Actor, Rights
from exporter.trust.safeio import Refused

OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


class OwnedFiles:
    """An opener for a listed set of files: `open(path)` is an fd of the file listed at `path`,
    opened with its owner's rights; Refused (or OSError, EACCES) otherwise. The caller owns the
    fd."""

    def __init__(self, files: Sequence[WeightFile], actor: Actor | None = None) -> None:
        self._listed = {wf.path: (wf.dev, wf.ino) for wf in files}
        self._actor = actor
        self._root = os.geteuid() == 0

    def open(self, path: str) -> int:
        real = os.path.realpath(path)
        rights = owner_rights(path, real) if self._root else None
        if rights is None:
            return self._checked(path, real)
        if self._actor is None:
            self._actor = Actor()
        try:
            return self._actor.call(rights, lambda: self._checked(path, real))
        except PermissionError:  # EACCES, or rights this process cannot take
            raise Refused(
                "unreadable", f"{path}: not readable by uid {rights.uid}, whose path it is"
            ) from None

    def check(self) -> None:
        """Open and close every listed file: Refused or OSError for the first that fails."""
        for path in self._listed:
            os.close(self.open(path))

    def close(self) -> None:
        if self._actor is not None:
            self._actor.close()

    def _checked(self, path: str, real: str) -> int:
        fd = os.open(real, OPEN_FLAGS)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise Refused("not_regular", f"{path}: not a regular file now")
            if (st.st_dev, st.st_ino) != self._listed.get(path):
                raise Refused("not_regular", f"{path}: another file than the one listed")
            return fd
        except BaseException:
            os.close(fd)
            raise


def owner_rights(path: str, real: str) -> Rights | None:
    """The rights to read `path` (resolved: `real`) with: None where root owns every name on
    both ways to it, the one other user's where some are theirs; Refused when two users' are."""
    owners = {_owner(step) for way in (path, real) for step in _steps(os.path.abspath(way))}
    users = owners - {0}
    if not users:
        return None
    if len(users) > 1:
        shown = ", ".join(str(u) for u in sorted(users))
        raise Refused("unreadable", f"{path}: its path is owned by several users ({shown})")
    (uid,) = users
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Rights(uid, os.lstat(real).st_gid, ())
    groups = tuple(sorted(set(os.getgrouplist(entry.pw_name, entry.pw_gid))))
    return Rights(uid, entry.pw_gid, groups)


def _steps(path: str) -> list[str]:
    """`/a/b/c` -> `/a`, `/a/b`, `/a/b/c`: every name a user could have swapped."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def _owner(path: str) -> int:
    try:
        return os.lstat(path).st_uid
    except FileNotFoundError:
        return 0  # gone since the listing: the open then fails on its own
