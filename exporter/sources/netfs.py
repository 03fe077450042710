"""Bytes read from network and parallel filesystems under the weights: NFS, Lustre, CephFS.

None of them reads a local block device, so /proc/diskstats says nothing of a cold load from them;
each client counts its reads itself, per mount:

* NFS, in `/proc/self/mountstats` (or the server process's `/proc/PID/mountstats` for weights
  seen through its root): the `bytes:` line of the mount's block gives the bytes read from the
  server (`serverreadbytes`, what a cold load waits for) and what applications read buffered
  (`normalreadbytes`, page-cache hits included) and with O_DIRECT (`directreadbytes`);
* Lustre, in `llite.<fsname>-<instance>.stats` (/proc/fs/lustre/llite, or
  /sys/kernel/debug/lustre/llite from Lustre 2.12 on): the sum of `read_bytes`, bytes
  applications read through this client (cache hits included: Lustre has no per-mount count of
  bytes from the OSTs);
* CephFS, in the kernel client's debugfs (`/sys/kernel/debug/ceph/<fsid>.client<id>/metrics/
  size`, Linux >= 5.16): the `read` row's `total_sz(bytes)`, bytes the client read from the
  OSDs. A mount names its fsid in its source only with the `name@fsid.fs=/path` syntax; with one
  client on the host that one is it, with several and no fsid the mount is not counted.

Each mount is labelled by its source as mountinfo shows it (server and export) and its mount
point, and its rate comes in the disk pair's shape (exporter/sources/counters.py).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

from exporter.sources import HostSource, SourceKey
from exporter.sources.counters import CounterSource
from exporter.sources.sample import Health, Sample
from exporter.storage.mounts import Mount, namespace_of, unescape
from exporter.vocabulary import StorageKind

LUSTRE_DIRS = ("fs/lustre/llite", "kernel/debug/lustre/llite")  # under /proc, under /sys
CEPH_DIR = "kernel/debug/ceph"  # under /sys
_CEPH_FSID = re.compile(r"^[^@]*@([0-9a-f-]{36})\.")
KINDS = (StorageKind.NFS, StorageKind.LUSTRE, StorageKind.CEPHFS)


@dataclass(frozen=True)
class MountReads:
    """What one network mount under some target's weights has read."""

    kind: StorageKind
    mount: str  # the mount's source: server:/export, mgs@tcp:/fsname, mon:6789:/path
    mountpoint: str
    read_bytes_total: int  # bytes from the server (NFS, CephFS) or read through the client
    read_bytes_per_second: float | None
    buffered_read_bytes_total: int | None = None  # NFS: read through the page cache
    direct_read_bytes_total: int | None = None  # NFS: read with O_DIRECT

    @property
    def key(self) -> tuple[str, str]:
        return (self.mount, self.mountpoint)


@dataclass(frozen=True)
class NetFsSample(Sample):
    mounts: tuple[MountReads, ...]
    mounts_by_target: Mapping[str, tuple[tuple[str, str], ...]]  # (mount, mountpoint) keys
    unmeasured: tuple[str, ...]  # "MOUNTPOINT (fstype): why its reads are not counted"

    def health(self) -> Health:
        return Health(note="; ".join(self.unmeasured) or None)

    def read_bytes_of(self, target: str) -> int | None:
        """Bytes read so far from the network mounts under one target's weights; None without
        any, or while one of them is not counted (a part would read as the whole)."""
        keys = set(self.mounts_by_target.get(target, ()))
        counted = [m.read_bytes_total for m in self.mounts if m.key in keys]
        return sum(counted) if keys and len(counted) == len(keys) else None

    def counters_of(self, target: str) -> dict[tuple[str, str], int]:
        """Each counted mount under one target's weights, as (kind, mount point), and its
        bytes read."""
        keys = set(self.mounts_by_target.get(target, ()))
        return {(m.kind, m.mountpoint): m.read_bytes_total for m in self.mounts if m.key in keys}


@dataclass(frozen=True)
class NfsBytes:
    """The `bytes:` counters of one NFS mount (nfs(5) mountstats, statvers 1.0 and 1.1)."""

    normal_read: int
    direct_read: int
    server_read: int


def parse_mountstats(text: str) -> dict[str, NfsBytes]:
    """NFS mounts by mount point; other filesystems' lines carry no counters and are skipped."""
    found: dict[str, NfsBytes] = {}
    point: str | None = None
    for line in text.splitlines():
        if line.startswith("device "):
            words = line.split()
            nfs = "fstype" in words and words[words.index("fstype") + 1].startswith("nfs")
            point = words[words.index("on") + 1] if nfs and "on" in words else None
        elif point is not None and line.strip().startswith("bytes:"):
            fields = line.split()[1:]
            if len(fields) >= 6 and all(f.isdigit() for f in fields[:6]):
                found[unescape(point)] = NfsBytes(
                    normal_read=int(fields[0]), direct_read=int(fields[2]),
                    server_read=int(fields[4]),
                )  # fmt: skip
    return found


def parse_llite_stats(text: str) -> int | None:
    """The sum of `read_bytes` (`read_bytes N samples [bytes] MIN MAX SUM [SUMSQ]`)."""
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "read_bytes" and "[bytes]" in fields:
            numbers = fields[fields.index("[bytes]") + 1 :]
            if len(numbers) >= 3 and numbers[2].isdigit():
                return int(numbers[2])
    return None


def parse_ceph_size(text: str) -> int | None:
    """`read` row's total_sz(bytes) of a ceph client's metrics/size."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) >= 6 and fields[0] == "read" and fields[-1].isdigit():
            return int(fields[-1])
    return None


def lustre_fsname(source: str) -> str | None:
    """`10.0.0.1@o2ib:/lustre/sub` -> `lustre`."""
    _, sep, path = source.partition(":/")
    return path.split("/", 1)[0] or None if sep else None


class NetFsSource(CounterSource):
    """Counts the reads of every NFS, Lustre and CephFS mount under some target's weights."""

    def sample(self) -> NetFsSample:
        """Reads nothing at all while no target's weights are on such a mount."""
        wanted: dict[tuple[str, str], tuple[StorageKind, Mount, str]] = {}
        by_target: dict[str, tuple[tuple[str, str], ...]] = {}
        for target, placed in self._watched.placed().items():
            keys: list[tuple[str, str]] = []
            for entry in placed:
                layer = entry.layer
                if layer.kind not in KINDS:
                    continue
                key = (layer.mount.source, layer.mount.mount_point)
                # Weights seen through /proc/PID/root: that process's mountstats count them.
                wanted.setdefault(key, (layer.kind, layer.mount, namespace_of(entry.path)[0]))
                if key not in keys:
                    keys.append(key)
            by_target[target] = tuple(keys)
        now = self._clock()
        mounts: list[MountReads] = []
        unmeasured: list[str] = []
        mountstats: dict[str, dict[str, NfsBytes]] = {}
        for _, (kind, mount, pid) in sorted(wanted.items(), key=lambda item: item[0]):
            try:
                if kind is StorageKind.NFS:
                    if pid not in mountstats:
                        mountstats[pid] = self._mountstats(pid)
                    reads = self._nfs(mount, mountstats[pid], now)
                elif kind is StorageKind.LUSTRE:
                    reads = self._counted(kind, mount, self._lustre_total(mount), now)
                else:
                    reads = self._counted(kind, mount, self._ceph_total(mount), now)
            except _Unmeasured as why:
                unmeasured.append(f"{mount.mount_point} ({mount.fstype}): {why}")
                continue
            mounts.append(reads)
        return NetFsSample(tuple(mounts), by_target, tuple(unmeasured))

    def _mountstats(self, pid: str) -> dict[str, NfsBytes]:
        path = os.path.join(self._proc_root, pid, "mountstats")
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                return parse_mountstats(f.read())
        except OSError as exc:
            raise _Unmeasured(f"cannot read {path}: {exc.strerror}") from None

    def _nfs(self, mount: Mount, stats: Mapping[str, NfsBytes], now: float) -> MountReads:
        counters = stats.get(mount.mount_point)
        if counters is None:
            raise _Unmeasured("not in mountstats")
        reads = self._counted(StorageKind.NFS, mount, counters.server_read, now)
        return replace(
            reads,
            buffered_read_bytes_total=counters.normal_read,
            direct_read_bytes_total=counters.direct_read,
        )

    def _counted(self, kind: StorageKind, mount: Mount, total: int, now: float) -> MountReads:
        rate = self._rates.rate((mount.source, mount.mount_point), total, now)
        return MountReads(kind, mount.source, mount.mount_point, total, rate)

    def _lustre_total(self, mount: Mount) -> int:
        fsname = lustre_fsname(mount.source)
        if fsname is None:
            raise _Unmeasured(f"no filesystem name in its source {mount.source}")
        roots = [os.path.join(self._proc_root, LUSTRE_DIRS[0])]
        roots.append(os.path.join(self._sys_root, LUSTRE_DIRS[1]))
        for root in roots:
            # One instance per mount of the filesystem: fsname-<superblock address>.
            instances = sorted(glob.glob(os.path.join(glob.escape(root), f"{fsname}-*", "stats")))
            if len(instances) > 1:
                raise _Unmeasured(
                    f"{len(instances)} llite instances of {fsname}: which one is this mount's "
                    "cannot be told from /proc"
                )
            if instances:
                return _read_total(instances[0], parse_llite_stats, "read_bytes")
        raise _Unmeasured(f"no llite stats for {fsname} under {' or '.join(roots)}")

    def _ceph_total(self, mount: Mount) -> int:
        root = os.path.join(self._sys_root, CEPH_DIR)
        match = _CEPH_FSID.match(mount.source)
        pattern = f"{match.group(1)}.client*" if match else "*.client*"
        clients = sorted(glob.glob(os.path.join(glob.escape(root), pattern, "metrics", "size")))
        if not clients:
            raise _Unmeasured(f"no ceph client metrics under {root} (debugfs, Linux >= 5.16)")
        if len(clients) > 1:
            raise _Unmeasured(
                f"{len(clients)} ceph clients and no fsid in the mount source: which one is "
                "this mount's cannot be told"
            )
        return _read_total(clients[0], parse_ceph_size, "a read row")


class _Unmeasured(Exception):
    """Why one mount's reads are not counted (its sample is left out, with this reason)."""


def _read_total(path: str, parse: Callable[[str], int | None], what: str) -> int:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            total = parse(f.read())
    except OSError as exc:
        raise _Unmeasured(f"cannot read {path}: {exc.strerror}") from None
    if total is None:
        raise _Unmeasured(f"{path} has no {what}")
    return total


NETFS: SourceKey[NetFsSample] = SourceKey("netfs", per_target=False)
HOST_SOURCE = HostSource(NETFS, lambda host: NetFsSource.started(host).sample)
