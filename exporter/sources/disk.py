"""Read throughput of the block devices that back the weight files.

A cold load is bounded by how fast these devices deliver bytes, so the exporter watches the whole
disk (or the dm/md device) that actually sees the reads, not a partition and not every disk, and
follows the layers between (exporter/storage/backing.py): btrfs's member devices, an overlay's
upper and lower filesystems, a loop device and the disk under its backing file.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from exporter.sources import HostSource, SourceKey
from exporter.sources.counters import CounterSource
from exporter.sources.sample import Sample
from exporter.storage.backing import Layer
from exporter.vocabulary import StorageKind

SECTOR_BYTES = 512  # /proc/diskstats counts 512-byte sectors whatever the device's block size
# Filesystems whose reads another source counts (exporter/sources/netfs.py, zfs.py).
_COUNTED_ELSEWHERE = {
    StorageKind.NFS: "NFS mountstats",
    StorageKind.LUSTRE: "Lustre llite stats",
    StorageKind.CEPHFS: "the CephFS client metrics",
    StorageKind.ZFS: "ZFS pool and ARC kstats",
}


@dataclass(frozen=True)
class DeviceReads:
    device: str
    read_bytes_total: int
    read_bytes_per_second: float | None


@dataclass(frozen=True)
class DiskSample(Sample):
    devices: tuple[DeviceReads, ...]
    # The devices the weights' filesystems read from directly (a loop device, not the disk under
    # its image: that one may read nothing where the image's page cache serves).
    devices_by_target: Mapping[str, tuple[str, ...]]
    unbacked_by_target: Mapping[str, tuple[str, ...]]
    # Devices further down (under a loop device's backing file): counted, not summed per target.
    lower_devices_by_target: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def read_bytes_of(self, target: str) -> int | None:
        """Bytes read so far by the devices behind one target's weights; None without any."""
        if not self.devices_by_target.get(target):
            return None
        return sum(self.counters_of(target).values())

    def counters_of(self, target: str) -> dict[tuple[str, str], int]:
        """Each device behind one target's weights, as ("disk", device), and its bytes read."""
        names = set(self.devices_by_target.get(target, ()))
        return {("disk", d.device): d.read_bytes_total for d in self.devices if d.device in names}


class DiskSource(CounterSource):
    """Maps weight paths to block devices once per filesystem and samples /proc/diskstats."""

    def sample(self) -> DiskSample:
        devices_by_target: dict[str, tuple[str, ...]] = {}
        lower_by_target: dict[str, tuple[str, ...]] = {}
        unbacked_by_target: dict[str, tuple[str, ...]] = {}
        for target, placed in self._watched.placed().items():
            top: list[str] = []
            lower: list[str] = []
            unbacked: list[str] = []
            for entry in placed:
                layer = entry.layer
                reads = layer.read_devices()
                if not reads:
                    unbacked.append(entry.path)
                    self._report_unbacked(entry.path, layer)
                _extend(top, reads)
                _extend(lower, (d for d in layer.all_devices() if d not in reads))
            devices_by_target[target] = tuple(top)
            lower_by_target[target] = tuple(d for d in lower if d not in top)
            unbacked_by_target[target] = tuple(unbacked)
        wanted = {d for names in devices_by_target.values() for d in names}
        wanted.update(d for names in lower_by_target.values() for d in names)
        return DiskSample(
            devices=self._reads(wanted),
            devices_by_target=devices_by_target,
            unbacked_by_target=unbacked_by_target,
            lower_devices_by_target=lower_by_target,
        )

    def _report_unbacked(self, path: str, layer: Layer) -> None:
        elsewhere = _COUNTED_ELSEWHERE.get(layer.kind)
        why = (
            f"its reads are counted from {elsewhere}"
            if elsewhere
            else "disk reads are not measured for it"
        )
        self._watched.report_once(
            path, logging.INFO, "%s is on %s, with no block device: %s", path, layer.summary(), why
        )

    def _reads(self, wanted: set[str]) -> tuple[DeviceReads, ...]:
        if not wanted:
            return ()
        totals = read_diskstats(self._proc_root)
        now = self._clock()
        result = []
        for device in sorted(wanted):
            total = totals.get(device)
            if total is None:
                self._watched.report_once(
                    device, logging.WARNING, "device %s is missing from diskstats", device
                )
                continue
            result.append(DeviceReads(device, total, self._rates.rate(device, total, now)))
        return tuple(result)


def _extend(names: list[str], more: Iterable[str]) -> None:
    for name in more:
        if name not in names:
            names.append(name)


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


DISK: SourceKey[DiskSample] = SourceKey("disk", per_target=False)
HOST_SOURCE = HostSource(DISK, lambda host: DiskSource.started(host).sample)
