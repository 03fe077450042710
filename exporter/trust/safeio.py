"""Opening files that an untrusted command line named: regular files only, bounded, never /proc.

A path from another user's argv, config or environment may be a FIFO (an open would block
forever), a symlink to /dev/zero (a read would never end), or /proc (a walk of the whole host
through /proc/1/root). Every open here is non-blocking, checked with fstat before a byte is read,
bounded in size, and refused on a pseudo file system (proc, sysfs, devtmpfs and the like).
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat

from exporter.trust.libc import LIBC

_libc = LIBC
_libc.fstatfs.argtypes = [ctypes.c_int, ctypes.c_void_p]
_libc.statfs.argtypes = [ctypes.c_char_p, ctypes.c_void_p]

OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
# Where no model's weights or config live, whatever a command line says (paths as the process
# sees them, and file systems by their magic number in statfs).
PSEUDO_PATHS = ("/proc", "/sys", "/dev")
PSEUDO_MAGIC = frozenset(
    {
        0x9FA0,  # proc
        0x62656572,  # sysfs
        0x1CD1,  # devpts
        0x27E0EB,  # cgroup
        0x63677270,  # cgroup2
        0x64626720,  # debugfs
        0x74726163,  # tracefs
        0x73636673,  # securityfs
        0xCAFE4A11,  # bpf
        0x6E736673,  # nsfs
        0x50495045,  # pipefs
        0x534F434B,  # sockfs
        0x42494E4D,  # binfmt_misc
        0xF97CFF8C,  # selinuxfs
        0x454D444D,  # devtmpfs has tmpfs's magic: PSEUDO_PATHS catch /dev by name
    }
)
_STATFS_BYTES = 256  # struct statfs is 120 bytes on 64-bit Linux; f_type comes first
MAX_SYMLINKS = 40  # as the kernel's own limit


class Refused(OSError):
    """A file discovery will not read: `reason` is the refusal's label (not_regular, ...)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(errno.EPERM, message)
        self.reason = reason


def fs_magic(fd: int) -> int:
    """The file system type (statfs f_type) of an open file."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ctypes.c_long.from_buffer(buf).value) & 0xFFFFFFFF


def path_magic(path: str) -> int:
    """The file system type of a path (symlinks followed)."""
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.statfs(os.fsencode(path), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return int(ctypes.c_long.from_buffer(buf).value) & 0xFFFFFFFF


def pseudo_path(path: str) -> bool:
    """`/proc/...`, `/sys/...`, `/dev/...` as the process names it (after normalising)."""
    normal = posixpath.normpath("/" + path.lstrip("/")) if path.startswith("/") else ""
    return any(normal == p or normal.startswith(p + "/") for p in PSEUDO_PATHS)


def open_checked(path: str) -> tuple[int, os.stat_result]:
    """An fd of a regular file or a directory that lies on no pseudo file system.

    The path is stat'ed before it is opened, so that a device is never opened at all (opening
    some has effects: a watchdog starts, a tape rewinds), and the fd checked again after.
    """
    before = os.stat(path)
    _check_kind(path, before)
    fd = os.open(path, OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        _check_kind(path, st)
        if fs_magic(fd) in PSEUDO_MAGIC:
            raise Refused("pseudo_filesystem", f"{path}: on a pseudo file system")
        return fd, st
    except BaseException:
        os.close(fd)
        raise


def _check_kind(path: str, st: os.stat_result, directories: bool = True) -> None:
    if not (stat.S_ISREG(st.st_mode) or (directories and stat.S_ISDIR(st.st_mode))):
        raise Refused("not_regular", f"{path}: not a regular file")


def read_regular(path: str, limit: int) -> bytes:
    """The content of a regular file of at most `limit` bytes; Refused or OSError otherwise.

    /proc's own files (status, environ) are regular files of size 0 whose content is made on
    read: they are read up to the limit too, which is why the limit is checked on what was read.
    """
    _check_kind(path, os.stat(path), directories=False)
    fd = os.open(path, OPEN_FLAGS)
    try:
        st = os.fstat(fd)
        _check_kind(path, st, directories=False)
        if st.st_size > limit:
            raise Refused("too_large", f"{path}: {st.st_size} bytes, more than {limit}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 16, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise Refused("too_large", f"{path}: more than {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def resolve_in_root(root: str, path: str) -> str:
    """`path` as a process whose root is `root` sees it, its symlinks resolved inside that root.

    `root + path` handed to the kernel would resolve an absolute symlink against this exporter's
    root instead (a container's `/models -> /mnt/models` would land on the host); this walks the
    components itself, so that every absolute target starts again at `root`. A missing step
    leaves the rest as written (opening it then says ENOENT); OSError (ELOOP, EACCES) when the
    kernel refuses a step.
    """
    parts = [p for p in path.split("/") if p and p != "."]
    done: list[str] = []
    links = 0
    while parts:
        part = parts.pop(0)
        if part == "..":
            if done:
                done.pop()
            continue
        candidate = root + "/" + "/".join([*done, part])
        try:
            target = os.readlink(candidate)
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink
                done.append(part)
                continue
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # missing: the rest as written
                done.extend(p for p in [part, *parts] if p != "..")
                break
            raise
        links += 1
        if links > MAX_SYMLINKS:
            raise OSError(errno.ELOOP, f"{path}: too many symbolic links")
        if target.startswith("/"):
            done = []
        parts[:0] = [p for p in target.split("/") if p and p != "."]
    return root + "/" + "/".join(done) if done else (root or "/")
