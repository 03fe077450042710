"""Where a weight file's data really lies, and what a FUSE mount does with the page cache.

Residency must be measured on the file whose page cache serves the reads, and without an open
that disturbs it:

* overlayfs: `cachestat` through the overlay's descriptor reports 0 pages while the real file
  below is fully cached. The real file is the same relative path in the upper directory, else in
  the lower ones in order (from the mount options), accepted only when its size and modification
  time match and, for a lower file, its inode number is the overlay's (identical, or identical
  below the top 16 bits, where overlayfs's `xino` puts the layer's number; checked on Linux 6.18
  with xino on, off and auto, one filesystem or two). A copied-up file keeps the inode number of
  the lower file it came from, so in the upper layer the number is no evidence;
* a FUSE passthrough (bindfs: its mount source names the directory it serves): the same relative
  path there, accepted when inode number, size, modification time and type match;
* other FUSE mounts: every `open()` without `keep_cache` (bindfs's default) drops the file's page
  cache, and a daemon in direct-I/O mode (mountpoint-s3) never fills it; neither shows in
  fdinfo's flags or anywhere in /proc or /sys (both are the daemon's per-open reply), so
  `probe_fuse` tries the mount on one *other* file of the model: reads a page, asks cachestat,
  opens it again and asks again. Only that file's cache is touched.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from fnmatch import fnmatchcase
from functools import partial

from exporter.storage.backing import overlay_dirs, same_file, source_path
from exporter.storage.mounts import Placed, relative_to
from exporter.storage.pagecache import CachestatCall
from exporter.storage.weighttree import WeightFile

PROBE_ENTRIES = 200  # entries looked at to find a probe file on a FUSE mount
_XINO_BITS = 16  # overlayfs xino keeps the layer number in the top bits of st_ino
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY


@dataclass(frozen=True)
class Below:
    """Where a weight file's data really lies, and the check that keeps it so."""

    path: str
    how: str  # "on the real files below the overlay", for status
    matches: Callable[[os.stat_result, os.stat_result], bool]  # (the file seen, the real one)


@dataclass(frozen=True)
class FuseProbe:
    """What reading one other file of the model through a FUSE mount showed."""

    file: str | None  # the probe file; None when there was none to try
    direct: bool | None  # a read left nothing in the page cache: the daemon opens with direct I/O
    keeps_cache: bool | None  # a second open kept the cached page (keep_cache, kernel_cache)
    reason: str


def passthrough_below(
    wf: WeightFile, seen: os.stat_result, placed: Placed, source: str
) -> tuple[Below, os.stat_result] | str:
    """The source file a FUSE passthrough shows as `wf`, checked, or why there is none."""
    candidate = source_path(placed, source)
    if candidate is None:
        return f"{wf.path} is outside its FUSE mount {placed.mount.mount_point}"
    try:
        real = os.stat(candidate)
    except OSError as exc:
        return f"the passthrough's source {candidate} of {wf.path}: {exc.strerror}"
    if not same_file(seen, real):
        return (
            f"{candidate} is not the file {wf.path} shows (inode, size or modification time "
            "differ): the FUSE mount is not a plain passthrough there"
        )
    return Below(candidate, f"on the passthrough's source files in {source}", same_file), real


def probe_fuse(roots: Iterable[str], include: Sequence[str]) -> FuseProbe:
    """Read one page of a file of the model that is no weight file through the mount, and ask
    the page cache what that left: nothing means direct I/O; a page that a second open took
    away means opens drop the cache. Only that file's cache is touched."""
    probe = _probe_file(roots, include)
    if probe is None:
        return FuseProbe(None, None, None, "no file other than the weights to try the mount on")
    call = CachestatCall()
    try:
        first = os.open(probe, _OPEN_FLAGS)
    except OSError as exc:
        return FuseProbe(probe, None, None, f"cannot open {probe}: {exc.strerror}")
    try:
        os.pread(first, 4096, 0)
        cached = call(first).nr_cache
        if cached == 0:
            return FuseProbe(
                probe, True, None, f"reading {probe} left nothing in the page cache: direct I/O"
            )
        second = os.open(probe, _OPEN_FLAGS)
        try:
            kept = call(first).nr_cache > 0
        finally:
            os.close(second)
    except OSError as exc:
        return FuseProbe(probe, None, None, f"cannot probe {probe}: {exc.strerror}")
    finally:
        os.close(first)
    what = "kept" if kept else "dropped"
    return FuseProbe(probe, False, kept, f"a second open of {probe} {what} its cached page")


def _probe_file(roots: Iterable[str], include: Sequence[str]) -> str | None:
    """A non-empty regular file near the weights that no include pattern matches."""
    looked = 0
    for root in roots:
        directory = root if os.path.isdir(root) else os.path.dirname(root)
        stack = [directory]
        while stack and looked < PROBE_ENTRIES:
            current = stack.pop(0)
            try:
                with os.scandir(current) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError:
                continue
            for entry in entries:
                looked += 1
                if looked > PROBE_ENTRIES:
                    break
                try:
                    if entry.is_dir():
                        stack.append(entry.path)
                    elif (
                        entry.is_file()
                        and entry.stat().st_size > 0
                        and not any(fnmatchcase(entry.name, p) for p in include)
                    ):
                        return entry.path
                except OSError:
                    continue
    return None


# -- overlayfs -----------------------------------------------------------------------------


def overlay_below(
    wf: WeightFile, seen: os.stat_result, placed: Placed
) -> tuple[Below, os.stat_result] | str:
    """The upper or lower file the overlay shows as `wf`, checked, or why there is none."""
    mount = placed.mount
    rel = relative_to(placed.path, mount.mount_point)
    if rel is None:
        return f"{wf.path} is outside its overlay {mount.mount_point}"
    inside = os.path.join(mount.root.lstrip("/"), rel)
    upper = mount.option("upperdir")
    for directory in overlay_dirs(mount):
        for base in dict.fromkeys((directory, placed.table.outside(directory))):
            candidate = os.path.join(base, inside)
            real = stat_if(candidate)
            if real is None:
                continue
            matches = partial(_overlay_shows, copied_up=directory == upper)
            if not matches(seen, real):
                return (
                    f"{candidate} is not the file {wf.path} shows (size, modification time or "
                    "inode differ: a redirected or opaque directory?)"
                )
            if mount.option("metacopy") == "on" and _metacopy(candidate):
                return (
                    f"{candidate} holds only the metadata of {wf.path} (metacopy): its data "
                    "lies in a lower layer the overlay redirects to"
                )
            return Below(candidate, "on the real files below the overlay", matches), real
    return f"no layer of the overlay at {mount.mount_point} holds {inside}"


def stat_if(path: str) -> os.stat_result | None:
    """stat(), or None where there is nothing (a layer without the file)."""
    try:
        return os.stat(path)
    except OSError:
        return None


def _overlay_shows(seen: os.stat_result, real: os.stat_result, copied_up: bool) -> bool:
    """An overlay file shows its real file's size and mtime, and a lower file's inode number
    whole (one filesystem, or xino off) or with the layer's number in the top bits (xino). A
    file in the upper layer keeps the inode number of the lower file it was copied up from, so
    there the number is no evidence (the upper layer always wins where it holds the name)."""
    differ = seen.st_ino ^ real.st_ino
    return (
        seen.st_size == real.st_size
        and seen.st_mtime_ns == real.st_mtime_ns
        and stat.S_ISREG(real.st_mode)
        and (copied_up or differ & ((1 << (64 - _XINO_BITS)) - 1) == 0)
    )


def _metacopy(path: str) -> bool:
    for name in ("trusted.overlay.metacopy", "user.overlay.metacopy"):
        try:
            os.getxattr(path, name)
            return True
        except OSError:
            continue
    return False


def moved(wf: WeightFile, path: str, st: os.stat_result) -> WeightFile:
    """The weight file as its real file: its name kept (residency reports it so), the real
    path, device and inode (a pass checks it has not been replaced)."""
    directory, entry = os.path.split(path)
    return replace(wf, path=path, directory=directory, entry=entry, dev=st.st_dev, ino=st.st_ino)
