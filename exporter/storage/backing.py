"""What a mount stands on: the block devices that see its reads, and the filesystems below it.

Reads of weights reach hardware through layers the mount's own device number hides: an XFS image
on `loop1` reads the disk under the image file (and, with the loop device's buffered I/O, may be
served by the image file's own page cache without the disk reading anything); btrfs spreads over
the members in `/sys/fs/btrfs/FSID/devices`; an overlay reads its upper and lower directories'
filesystems; an erofs image may be mounted straight from a file. `describe` follows all of them,
so the disk source can count every device that reads and each message names the real filesystem.
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.storage.mounts import Mount, Mounts, Placed, relative_to
from exporter.vocabulary import StorageKind

log = logging.getLogger(__name__)

MAX_DEPTH = 8  # layers below layers: a loop over an image on an overlay is 3; more is a loop

KINDS: dict[str, StorageKind] = {
    "tmpfs": StorageKind.MEMORY,
    "ramfs": StorageKind.MEMORY,
    "hugetlbfs": StorageKind.MEMORY,
    "overlay": StorageKind.OVERLAY,
    "btrfs": StorageKind.BTRFS,
    "squashfs": StorageKind.IMAGE,
    "erofs": StorageKind.IMAGE,
    "fuse": StorageKind.FUSE,
    "fuseblk": StorageKind.FUSE,
    "nfs": StorageKind.NFS,
    "nfs4": StorageKind.NFS,
    "lustre": StorageKind.LUSTRE,
    "ceph": StorageKind.CEPHFS,
    "zfs": StorageKind.ZFS,
}


@dataclass(frozen=True)
class Loop:
    """A loop device under a filesystem: its reads become reads of its backing file."""

    device: str
    backing_file: str
    direct_io: bool  # dio=1: the backing file's page cache is bypassed


@dataclass(frozen=True)
class Layer:
    """One filesystem under the weights and everything it stands on."""

    kind: StorageKind
    fstype: str
    mount: Mount
    devices: tuple[str, ...]  # block devices that see this filesystem's reads, top first
    loops: tuple[Loop, ...]  # loop devices among them
    below: tuple[Layer, ...]  # overlay layers (upper first), a loop's or an image's backing fs,
    # a FUSE passthrough's source
    problem: str | None = None  # why something below could not be followed
    passthrough: str | None = None  # the directory a FUSE mount passes through (checked)

    def all_devices(self) -> tuple[str, ...]:
        """Every device that reads for this layer, itself and below, each once, top first."""
        seen: list[str] = []
        for device in (*self.devices, *(d for layer in self.below for d in layer.all_devices())):
            if device not in seen:
                seen.append(device)
        return tuple(seen)

    def read_devices(self) -> tuple[str, ...]:
        """The first devices down each branch: they count the bytes the weights' filesystems
        asked for. Devices under a loop device's backing file count them again, or not at all
        where the backing file's page cache served them, so they are not added to these."""
        if self.devices:
            return self.devices
        seen: list[str] = []
        for device in (d for layer in self.below for d in layer.read_devices()):
            if device not in seen:
                seen.append(device)
        return tuple(seen)

    def all_loops(self) -> tuple[Loop, ...]:
        return (*self.loops, *(loop for layer in self.below for loop in layer.all_loops()))

    def summary(self) -> str:
        """`xfs on loop1 (buffered, backing /img/x.img) over ext4 on vda`: read as it is built."""
        text = self.fstype
        if self.devices:
            text += " on " + ", ".join(self._device_words(d) for d in self.devices)
        elif self.passthrough is not None:
            text += f" passing {self.passthrough} through"
        elif self.kind in (StorageKind.NFS, StorageKind.CEPHFS, StorageKind.LUSTRE):
            text += f" from {self.mount.source}"
        elif self.kind is StorageKind.FUSE:
            text += f" ({self.mount.source})"
        if self.below:
            joined = " and ".join(layer.summary() for layer in self.below)
            text += f" over {joined}"
        return text

    def _device_words(self, device: str) -> str:
        for loop in self.loops:
            if loop.device == device:
                io = "direct I/O" if loop.direct_io else "buffered"
                return f"{device} ({io}, backing {loop.backing_file})"
        return device


def kind_of(mount: Mount) -> StorageKind:
    kind = KINDS.get(mount.fstype) or KINDS.get(mount.base_type)
    if kind is not None:
        return kind
    major = mount.dev.partition(":")[0]
    return StorageKind.BLOCK if major not in ("", "0") else StorageKind.OTHER


def describe(placed: Placed, mounts: Mounts, sys_root: str = "/sys") -> Layer:
    """The layer a placed path is on, with what it stands on."""
    return _Walker(mounts, sys_root).layer(placed.mount, placed, 0)


class _Walker:
    def __init__(self, mounts: Mounts, sys_root: str) -> None:
        self._mounts = mounts
        self._sys_root = sys_root

    def layer(self, mount: Mount, placed: Placed, depth: int) -> Layer:
        kind = kind_of(mount)
        devices: list[str] = []
        loops: list[Loop] = []
        below: list[Layer] = []
        problems: list[str] = []
        passthrough = None
        if depth >= MAX_DEPTH:
            problems.append(f"more than {MAX_DEPTH} layers below {mount.mount_point}")
        elif kind is StorageKind.OVERLAY:
            for directory in overlay_dirs(mount):
                self._below(_candidates(directory, placed), below, problems, depth)
        elif kind is StorageKind.BTRFS:
            members = btrfs_members(mount.source, self._sys_root)
            if not members:
                problems.append(f"no /sys/fs/btrfs/*/devices entry names {mount.source}")
            for member in members:
                self._device(member, devices, loops, below, problems, depth)
        elif kind is not StorageKind.MEMORY and mount.dev.split(":")[0] not in ("0", ""):
            name = block_device_of(mount.dev, self._sys_root)
            if name is None:
                problems.append(f"no /sys/dev/block entry for {mount.dev}")
            else:
                self._device(name, devices, loops, below, problems, depth)
        elif kind is StorageKind.FUSE and mount.dev.startswith("0:"):
            passthrough = passthrough_source(placed)
            if passthrough is not None:
                self._below((passthrough,), below, problems, depth)
        elif kind is StorageKind.IMAGE and mount.source.startswith("/"):
            files = [p for p in _candidates(mount.source, placed) if os.path.isfile(p)]
            if files:  # erofs mounted straight from an image file (Linux >= 6.12)
                self._below(files, below, problems, depth)
        return Layer(
            kind=kind,
            fstype=mount.fstype,
            mount=mount,
            devices=tuple(devices),
            loops=tuple(loops),
            below=tuple(below),
            problem="; ".join(problems) or None,
            passthrough=passthrough,
        )

    def _device(
        self,
        name: str,
        devices: list[str],
        loops: list[Loop],
        below: list[Layer],
        problems: list[str],
        depth: int,
    ) -> None:
        """A block device, and for a loop device the filesystem under its backing file."""
        if name not in devices:
            devices.append(name)
        loop = loop_of(name, self._sys_root)
        if loop is not None:
            loops.append(loop)
            self._below((loop.backing_file,), below, problems, depth)

    def _below(
        self, paths: Sequence[str], below: list[Layer], problems: list[str], depth: int
    ) -> None:
        """The layer under the first of `paths` that can be reached (each names one directory
        or file, as this exporter or the mounting process's namespace sees it)."""
        failure = f"cannot follow {paths[0] if paths else '?'}"
        for path in paths:
            try:
                placed = self._mounts.place(path)
            except OSError as exc:
                failure = f"cannot follow {path}: {exc.strerror}"
                continue
            if placed is not None:
                below.append(self.layer(placed.mount, placed, depth + 1))
                return
            failure = f"no mount holds {path}"
        problems.append(failure)


def _candidates(path: str, placed: Placed) -> tuple[str, ...]:
    """Where a path named in a mount's options lives: a container runtime mounts overlays from
    the host's namespace, so its options name host paths even in a container's mount table;
    the path is tried as this exporter sees it first, then inside that process's root."""
    inside = placed.table.outside(path)
    return (path,) if inside == path else (path, inside)


def passthrough_source(placed: Placed) -> str | None:
    """The directory a FUSE mount passes through, when its mount source names one (bindfs
    does) and the placed path looks the same there: inode number, size, modification time and
    type (a daemon that made its own files up would not match all four)."""
    source = placed.mount.source
    if not source.startswith("/"):
        return None
    candidate = source_path(placed, source)
    try:
        if candidate is not None and same_file(
            os.stat(placed.table.outside(placed.path)), os.stat(candidate)
        ):
            return source
    except OSError:
        return None
    return None


def source_path(placed: Placed, source: str) -> str | None:
    """Where a path of a passthrough mount lies in its source directory."""
    rel = relative_to(placed.path, placed.mount.mount_point)
    if rel is None:
        return None
    return os.path.normpath(os.path.join(source, placed.mount.root.lstrip("/"), rel))


def same_file(seen: os.stat_result, real: os.stat_result) -> bool:
    return (
        seen.st_ino == real.st_ino
        and seen.st_size == real.st_size
        and seen.st_mtime_ns == real.st_mtime_ns
        and stat.S_IFMT(seen.st_mode) == stat.S_IFMT(real.st_mode)
    )


def overlay_dirs(mount: Mount) -> tuple[str, ...]:
    """An overlay's upper directory, then its lower ones in order (`lowerdir=a:b`, or the
    repeated `lowerdir+=` and `datadir+=` of the new mount API), as its options name them."""
    dirs: list[str] = []
    upper = mount.option("upperdir")
    if upper:
        dirs.append(upper)
    lower = mount.option("lowerdir")
    if lower:
        dirs.extend(split_lowerdir(lower))
    dirs.extend(mount.options_named("lowerdir+"))
    dirs.extend(mount.options_named("datadir+"))
    return tuple(d for d in dirs if d)


def split_lowerdir(value: str) -> list[str]:
    r"""`a:b` -> [a, b]; `\:` is a colon inside a name, `::` marks data-only layers."""
    parts, current, i = [], "", 0
    while i < len(value):
        char = value[i]
        if char == "\\" and i + 1 < len(value):
            current += value[i + 1]
            i += 2
            continue
        if char == ":":
            parts.append(current)
            current = ""
        else:
            current += char
        i += 1
    parts.append(current)
    return [p for p in parts if p]


def block_device_of(dev: str, sys_root: str = "/sys") -> str | None:
    """Kernel name of the device that sees reads for MAJ:MIN: a partition resolves to its whole
    disk; dm-N and mdN stay themselves (their slaves count the same bytes)."""
    link = os.path.join(sys_root, "dev", "block", dev)
    if not os.path.exists(link):
        found = _class_block_link(dev, sys_root)
        if found is None:
            return None
        link = found
    device_dir = os.path.realpath(link)
    if os.path.exists(os.path.join(device_dir, "partition")):
        device_dir = os.path.dirname(device_dir)
    return os.path.basename(device_dir)


def _class_block_link(number: str, sys_root: str) -> str | None:
    """The /sys/class/block entry whose `dev` is MAJ:MIN.

    Podman masks /sys/dev/block with an empty tmpfs in containers; /sys/class/block stays.
    """
    class_dir = os.path.join(sys_root, "class", "block")
    try:
        names = os.listdir(class_dir)
    except OSError:
        return None
    for name in names:
        try:
            with open(os.path.join(class_dir, name, "dev"), encoding="ascii") as f:
                if f.read().strip() == number:
                    return os.path.join(class_dir, name)
        except OSError:
            continue
    return None


def _whole_disk(name: str, sys_root: str) -> str:
    """A partition's whole disk by kernel name (sda2 -> sda), the name itself otherwise."""
    entry = os.path.join(sys_root, "class", "block", name)
    device_dir = os.path.realpath(entry)
    if os.path.exists(os.path.join(device_dir, "partition")):
        return os.path.basename(os.path.dirname(device_dir))
    return name


def btrfs_members(source: str, sys_root: str = "/sys") -> tuple[str, ...]:
    """The devices of the btrfs whose mount source is `source` (`/dev/loop0`, `/dev/mapper/x`),
    from the filesystem's own list under /sys/fs/btrfs/FSID/devices: every member reads."""
    name = os.path.basename(os.path.realpath(source)) if source.startswith("/") else source
    root = os.path.join(sys_root, "fs", "btrfs")
    try:
        fsids = sorted(os.listdir(root))
    except OSError:
        return ()
    for fsid in fsids:
        devices = os.path.join(root, fsid, "devices")
        try:
            members = sorted(os.listdir(devices))
        except OSError:
            continue
        if name in members:
            disks: list[str] = []
            for member in members:
                disk = _whole_disk(member, sys_root)
                if disk not in disks:
                    disks.append(disk)
            return tuple(disks)
    return ()


def loop_of(name: str, sys_root: str = "/sys") -> Loop | None:
    """The loop device `name`'s backing file and I/O mode, None for any other device."""
    loop_dir = os.path.join(sys_root, "block", name, "loop")
    try:
        with open(os.path.join(loop_dir, "backing_file"), encoding="utf-8") as f:
            backing = f.read().strip()
    except OSError:
        return None
    try:
        with open(os.path.join(loop_dir, "dio"), encoding="ascii") as f:
            direct = f.read().strip() == "1"
    except OSError:
        direct = False
    # The kernel appends " (deleted)" when the image was unlinked after attaching.
    return Loop(name, backing.removesuffix(" (deleted)"), direct)
