"""Read throughput of the block devices that back the weight files.

A cold load is bounded by how fast these devices deliver bytes, so the exporter watches the whole
disk (or the dm/md device) that actually sees the reads, not a partition and not every disk.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from exporter.asprocess import OnBehalf

log = logging.getLogger(__name__)

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size


@dataclass(frozen=True)
class DeviceReads:
    device: str
    read_bytes_total: int
    read_bytes_per_second: float | None


@dataclass(frozen=True)
class DiskSample:
    devices: tuple[DeviceReads, ...]
    devices_by_target: Mapping[str, tuple[str, ...]]
    unbacked_by_target: Mapping[str, tuple[str, ...]]

    def read_bytes_of(self, target: str) -> int | None:
        """Bytes read so far by the devices behind one target's weights; None without any."""
        names = set(self.devices_by_target.get(target, ()))
        if not names:
            return None
        return sum(d.read_bytes_total for d in self.devices if d.device in names)


class DiskSource:
    """Maps weight paths to block devices once per filesystem and samples /proc/diskstats."""

    def __init__(
        self,
        paths_by_target: Mapping[str, Sequence[str]],
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._paths_by_target = {t: tuple(p) for t, p in paths_by_target.items()}
        self._on_behalf: Mapping[str, OnBehalf] = {}
        self._proc_root = proc_root
        self._sys_root = sys_root
        self._clock = clock
        self._device_by_dev: dict[int, str | None] = {}
        self._reported: set[str] = set()
        self._previous: dict[str, tuple[float, int]] = {}

    def watch(
        self, target: str, paths: Sequence[str] | None, on_behalf: OnBehalf | None = None
    ) -> None:
        """Watch another target's weight paths, or none (thread-safe: the mappings are swapped).

        A discovered target's paths are stat'ed `on_behalf` of its process, with its rights.
        """
        watched = {t: p for t, p in self._paths_by_target.items() if t != target}
        behalf = {t: b for t, b in self._on_behalf.items() if t != target}
        if paths:
            watched[target] = tuple(paths)
            if on_behalf is not None:
                behalf[target] = on_behalf
        self._on_behalf = behalf
        self._paths_by_target = watched

    def sample(self) -> DiskSample:
        devices_by_target: dict[str, tuple[str, ...]] = {}
        unbacked_by_target: dict[str, tuple[str, ...]] = {}
        on_behalf = self._on_behalf
        for target, paths in self._paths_by_target.items():
            devices: list[str] = []
            unbacked: list[str] = []
            behalf = on_behalf.get(target)
            stats: list[tuple[str, int | OSError]]
            try:
                stats = behalf.run(partial(_devices_of, paths)) if behalf else _devices_of(paths)
            except (PermissionError, TimeoutError) as exc:
                stats = [(path, OSError(str(exc))) for path in paths]
            for path, st_dev in stats:
                if isinstance(st_dev, OSError):
                    self._report_once(path, logging.WARNING, "cannot stat %s: %s", path, st_dev)
                    continue
                device = self._device(st_dev, path)
                if device is None:
                    unbacked.append(path)
                elif device not in devices:
                    devices.append(device)
            devices_by_target[target] = tuple(devices)
            unbacked_by_target[target] = tuple(unbacked)
        wanted = {d for names in devices_by_target.values() for d in names}
        return DiskSample(
            devices=self._reads(wanted),
            devices_by_target=devices_by_target,
            unbacked_by_target=unbacked_by_target,
        )

    def _device(self, st_dev: int, path: str) -> str | None:
        if st_dev not in self._device_by_dev:
            device = resolve_block_device(st_dev, self._sys_root)
            if device is None:
                fstype = _filesystem_type(st_dev, self._proc_root) or "unknown"
                self._report_once(
                    path,
                    logging.INFO,
                    "%s is on a %s filesystem with no block device; disk reads are not measured"
                    " for it",
                    path,
                    fstype,
                )
            self._device_by_dev[st_dev] = device
        return self._device_by_dev[st_dev]

    def _reads(self, wanted: set[str]) -> tuple[DeviceReads, ...]:
        if not wanted:
            return ()
        totals = read_diskstats(self._proc_root)
        now = self._clock()
        result = []
        for device in sorted(wanted):
            total = totals.get(device)
            if total is None:
                self._report_once(
                    device, logging.WARNING, "device %s is missing from diskstats", device
                )
                continue
            rate = None
            previous = self._previous.get(device)
            if previous is not None:
                then, before = previous
                if now > then and total >= before:
                    rate = (total - before) / (now - then)
            self._previous[device] = (now, total)
            result.append(DeviceReads(device, total, rate))
        return tuple(result)

    def _report_once(self, key: str, level: int, message: str, *args: object) -> None:
        if key not in self._reported:
            self._reported.add(key)
            log.log(level, message, *args)


def _devices_of(paths: Sequence[str]) -> list[tuple[str, int | OSError]]:
    """Each path's st_dev, or why it could not be stat'ed."""
    result: list[tuple[str, int | OSError]] = []
    for path in paths:
        try:
            result.append((path, os.stat(path).st_dev))
        except OSError as exc:
            result.append((path, exc))
    return result


def resolve_block_device(st_dev: int, sys_root: str = "/sys") -> str | None:
    """Kernel name of the device that sees reads for files on `st_dev`, or None if there is none.

    A partition resolves to its whole disk; dm-N and mdN stay themselves because their slaves
    also count the same bytes and only the top device is unambiguous.
    """
    number = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    link = os.path.join(sys_root, "dev", "block", number)
    if not os.path.exists(link):
        found = _class_block_link(number, sys_root)
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


def read_diskstats(proc_root: str = "/proc") -> dict[str, int]:
    """Bytes read per device name, from one read of /proc/diskstats."""
    with open(os.path.join(proc_root, "diskstats"), encoding="ascii") as f:
        lines = f.read().splitlines()
    totals = {}
    for line in lines:
        fields = line.split()
        if len(fields) >= 6:
            totals[fields[2]] = int(fields[5]) * SECTOR_BYTES
    return totals


def _filesystem_type(st_dev: int, proc_root: str) -> str | None:
    """Filesystem type of a mount with this device number, from /proc/self/mountinfo."""
    wanted = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    try:
        with open(os.path.join(proc_root, "self", "mountinfo")) as f:
            for line in f:
                fields = line.split()
                if len(fields) > 2 and fields[2] == wanted and " - " in line:
                    return line.split(" - ", 1)[1].split()[0]
    except OSError:
        return None
    return None
