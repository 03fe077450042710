"""A target's weight files: the configured paths walked, symlinks followed, each inode once.

The residency pass, the weight-files source and the storage description all start from this
walk; each directory's identity is kept so that a change under it is noticed without walking
again.
"""

from __future__ import annotations

import logging
import os
import re
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from fnmatch import fnmatchcase

from exporter.config.schema import WeightsConfig
from exporter.trust.safeio import PSEUDO_MAGIC, Refused, path_magic

log = logging.getLogger(__name__)

# A tree seen through another process's root: an absolute symlink in it would resolve against
# this exporter's root instead, outside the process's files, so it is not followed.
_CONTAINED = re.compile(r"/proc/\d+/root(?:/|\Z)")


@dataclass(frozen=True)
class WeightFile:
    path: str
    directory: str  # a pass opens each directory once and its files by openat: fewer lookups
    entry: str
    name: str  # relative to the weights root it was found under
    dev: int
    ino: int
    size: int  # when discovered (a pass measures the size it finds)


@dataclass(frozen=True)
class WeightTree:
    """Discovered weight files plus the identity of every directory walked, to notice changes."""

    files: tuple[WeightFile, ...]
    watched: tuple[tuple[str, tuple[int, int, int] | None], ...]

    def changed(self) -> bool:
        return any(_signature(path) != sig for path, sig in self.watched)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_dev, st.st_ino, st.st_mtime_ns if stat.S_ISDIR(st.st_mode) else 0)


def _pseudo(path: str) -> bool:
    """On /proc, /sys or the like: a walk there would go through the whole host."""
    try:
        return path_magic(path) in PSEUDO_MAGIC
    except OSError:
        return False  # gone, or not ours to see: the walk's own stat says so


def walk_weights(weights: WeightsConfig, max_entries: int | None = None) -> WeightTree:
    """Weight files under each configured path, symlinks followed, each inode once.

    Never into a pseudo file system (/proc, /sys); `max_entries` bounds the entries looked at
    (Refused "too_many_files" beyond it), so a tree named by someone else's command line cannot
    make a pass walk the host.
    """
    looked = 0

    def count() -> None:
        nonlocal looked
        looked += 1
        if max_entries is not None and looked > max_entries:
            raise Refused(
                "too_many_files",
                f"more than {max_entries} entries under {', '.join(weights.paths)}: not measured",
            )

    files: list[WeightFile] = []
    watched: list[tuple[str, tuple[int, int, int] | None]] = []
    seen_files: set[tuple[int, int]] = set()
    seen_dirs: set[tuple[int, int]] = set()
    names: set[str] = set()

    def add(directory: str, entry: str, name: str, st: os.stat_result) -> None:
        key = (st.st_dev, st.st_ino)
        if not stat.S_ISREG(st.st_mode) or key in seen_files:
            return
        seen_files.add(key)
        # Two roots may hold the same relative name; the later one keeps its absolute path.
        path = os.path.join(directory, entry)
        label = name if name not in names else path
        names.add(label)
        files.append(WeightFile(path, directory, entry, label, st.st_dev, st.st_ino, st.st_size))

    for root in weights.paths:
        watched.append((root, _signature(root)))
        contained = _CONTAINED.match(root) is not None
        try:
            st = os.stat(root)
        except OSError as exc:
            log.debug("weights path %s: %s", root, exc.strerror)
            continue
        if _pseudo(root):
            log.debug("weights path %s: on a pseudo file system, not walked", root)
            continue
        if not stat.S_ISDIR(st.st_mode):
            parent, base = os.path.split(root)
            add(parent, base, base, st)
            continue
        seen_dirs.add((st.st_dev, st.st_ino))
        stack = [(root, "")]  # (directory, its path relative to root with a trailing /)
        while stack:
            directory, prefix = stack.pop()
            if prefix:
                watched.append((directory, _signature(directory)))
                if _pseudo(directory):
                    continue
            try:
                with os.scandir(directory) as it:
                    entries = sorted(it, key=lambda e: e.name)
            except OSError as exc:
                log.debug("cannot list %s: %s", directory, exc.strerror)
                continue
            subdirs: list[tuple[str, str]] = []
            for entry in entries:
                count()
                try:
                    if entry.is_symlink() and (
                        (contained and os.readlink(entry.path).startswith("/"))
                        or _pseudo(entry.path)
                    ):
                        continue
                    if entry.is_dir():
                        dst = entry.stat()
                        if (dst.st_dev, dst.st_ino) not in seen_dirs:  # symlink loops
                            seen_dirs.add((dst.st_dev, dst.st_ino))
                            subdirs.append((entry.path, f"{prefix}{entry.name}/"))
                    elif _included(entry.name, weights.include):
                        add(directory, entry.name, prefix + entry.name, entry.stat())
                except OSError:
                    continue  # broken symlink, or vanished while walking
            stack.extend(reversed(subdirs))  # depth first, in name order
    return WeightTree(tuple(files), tuple(watched))


def _included(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)
