"""NFS, Lustre and CephFS reads under the weights, from fixtures of the files their clients write.

This kernel has none of these clients, so each test lays out a /proc (and /sys) the way a client
host has it: a mount table naming a network mount over a real directory, and the client's
counters (tests/fixtures/storage/README.md says where each file comes from). The sources run as
the exporter runs them: weight paths placed on mounts, counters parsed, rates from an injected
clock, labels from the mount, and the storage description's verdicts.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_exposition import exposition, host_snapshot

from exporter.config.schema import WeightsConfig
from exporter.sources.netfs import (
    NETFS,
    MountReads,
    NetFsSource,
    lustre_fsname,
    parse_ceph_size,
    parse_llite_stats,
    parse_mountstats,
)
from exporter.sources.residency import ResidencySource
from exporter.sources.storage import WeightStorage
from exporter.vocabulary import StorageKind

FIXTURES = Path(__file__).with_name("fixtures") / "storage"
NFS_POINT = "/mnt/nfs/test"  # where the mountstats fixture says its export is mounted
SERVER_READ = 1210214218  # its `bytes:` serverreadbytes
FSID = "6f0d2d5e-1b7c-4b0e-9c51-3f1f0e3a1b2c"


class FakeHost:
    """A /proc and /sys of a client host whose network mounts sit over real directories."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.proc = root / "proc"
        self.sys = root / "sys"
        (self.proc / "self").mkdir(parents=True)
        self.sys.mkdir()
        self.lines: list[str] = []
        self.now = 1000.0

    def mount(self, fstype: str, source: str, name: str, options: str = "rw") -> Path:
        """A directory with model files, listed in mountinfo as a `fstype` mount of `source`."""
        point = self.root / name
        point.mkdir(parents=True)
        (point / "model.safetensors").write_bytes(os.urandom(64 << 10))
        (point / "config.json").write_text("{}")
        mount_id = 90000 + len(self.lines)
        self.lines.append(
            f"{mount_id} 1 0:{mount_id % 256} / {point} rw - {fstype} {source} {options}"
        )
        (self.proc / "self" / "mountinfo").write_text("\n".join(self.lines) + "\n")
        return point

    def file(self, relative: str, text: str, under: Path | None = None) -> Path:
        path = (under or self.proc) / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        return path

    def clock(self) -> float:
        return self.now


@pytest.fixture
def host(tmp_path: Path) -> Iterator[FakeHost]:
    yield FakeHost(tmp_path)


def mountstats(point: Path, extra_server_bytes: int = 0) -> str:
    """The fixture with its first NFS mount placed on `point`, its server bytes grown."""
    text = (FIXTURES / "mountstats").read_text()
    text = text.replace(f"mounted on {NFS_POINT} ", f"mounted on {point} ", 1)
    grown = f"{SERVER_READ + extra_server_bytes}"
    return text.replace(f" {SERVER_READ} ", f" {grown} ", 1)


def source(host: FakeHost, *paths: Path) -> NetFsSource:
    return NetFsSource(
        {"m": [str(p) for p in paths]},
        proc_root=str(host.proc),
        sys_root=str(host.sys),
        clock=host.clock,
    )


def test_mountstats_fixture_parses_per_mount_point() -> None:
    stats = parse_mountstats((FIXTURES / "mountstats").read_text())
    assert set(stats) == {"/mnt/nfs/test", "/mnt/nfs/test-dupe"}  # not the ext4 and proc lines
    first = stats["/mnt/nfs/test"]
    assert (first.normal_read, first.direct_read, first.server_read) == (1207640230, 0, SERVER_READ)


def test_nfs_reads_are_counted_per_mount_with_a_rate(host: FakeHost) -> None:
    point = host.mount("nfs4", "192.168.1.1:/srv/test", "nfs", "rw,vers=4.0,addr=192.168.1.1")
    host.file("self/mountstats", mountstats(point))
    netfs = source(host, point)

    first = netfs.sample()
    assert first.mounts == (
        MountReads(StorageKind.NFS, "192.168.1.1:/srv/test", str(point), SERVER_READ, None,
                   buffered_read_bytes_total=1207640230, direct_read_bytes_total=0),
    )  # fmt: skip
    assert first.mounts_by_target == {"m": (("192.168.1.1:/srv/test", str(point)),)}
    assert first.read_bytes_of("m") == SERVER_READ and first.health().note is None

    host.now += 2.0
    host.file("self/mountstats", mountstats(point, extra_server_bytes=480_000_000))
    (second,) = netfs.sample().mounts
    assert second.read_bytes_total == SERVER_READ + 480_000_000
    assert second.read_bytes_per_second == pytest.approx(240e6)

    host.now += 1.0
    text = exposition(host_snapshot(NETFS, netfs.sample()))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    labels = {"mount": "192.168.1.1:/srv/test", "mountpoint": str(point)}
    [total] = families["model_load_nfs_read_bytes"].samples
    assert (total.labels, total.value) == (labels, SERVER_READ + 480_000_000)
    [rate] = families["model_load_nfs_read_bytes_per_second"].samples
    assert rate.value == 0.0  # nothing more was read since
    by_io = {
        s.labels["io"]: s.value for s in families["model_load_nfs_application_read_bytes"].samples
    }
    assert by_io == {"buffered": 1207640230, "direct": 0}


def test_a_mount_missing_from_mountstats_is_named_not_counted(host: FakeHost) -> None:
    point = host.mount("nfs4", "192.168.1.1:/srv/other", "elsewhere")
    host.file("self/mountstats", mountstats(host.root / "not-this-one"))
    sample = source(host, point).sample()
    assert sample.mounts == ()
    assert sample.health().note == f"{point} (nfs4): not in mountstats"
    assert sample.read_bytes_of("m") is None


def test_weights_on_local_disk_read_no_network_counter(host: FakeHost) -> None:
    """No mountstats, llite or debugfs exists here: reading any of them would be a note."""
    point = host.mount("ext4", "/dev/vda", "local")
    sample = source(host, point).sample()
    assert (sample.mounts, sample.health().note, sample.mounts_by_target) == ((), None, {"m": ()})


def test_lustre_reads_from_llite_stats(host: FakeHost) -> None:
    assert parse_llite_stats((FIXTURES / "llite-stats").read_text()) == 54975581388
    assert lustre_fsname("10.0.0.9@o2ib:/lustre/models") == "lustre"
    point = host.mount("lustre", "10.0.0.9@o2ib:/lustre", "lustre", "rw,flock,lazystatfs")
    stats = host.file("fs/lustre/llite/lustre-ffff9a0c3b6e1000/stats",
                      (FIXTURES / "llite-stats").read_text())  # fmt: skip
    netfs = source(host, point)
    (first,) = netfs.sample().mounts
    assert (first.kind, first.mount, first.read_bytes_total) == (
        StorageKind.LUSTRE, "10.0.0.9@o2ib:/lustre", 54975581388,
    )  # fmt: skip
    host.now += 4.0
    stats.write_text(stats.read_text().replace("54975581388", str(54975581388 + 4_000_000_000)))
    (second,) = netfs.sample().mounts
    assert second.read_bytes_per_second == pytest.approx(1e9)


def test_lustre_mounted_twice_is_not_guessed(host: FakeHost) -> None:
    point = host.mount("lustre", "10.0.0.9@o2ib:/lustre", "lustre")
    for instance in ("ffff9a0c3b6e1000", "ffff9a0c3b6e2000"):
        host.file(
            f"fs/lustre/llite/lustre-{instance}/stats", (FIXTURES / "llite-stats").read_text()
        )
    sample = source(host, point).sample()
    assert sample.mounts == ()
    assert "2 llite instances of lustre" in (sample.health().note or "")


def test_lustre_stats_in_debugfs_count_too(host: FakeHost) -> None:
    """Lustre 2.12 on moved llite stats to /sys/kernel/debug/lustre/llite."""
    point = host.mount("lustre", "10.0.0.9@o2ib:/scratch", "scratch")
    host.file("kernel/debug/lustre/llite/scratch-ffff9a0c3b6e1000/stats",
              (FIXTURES / "llite-stats").read_text(), under=host.sys)  # fmt: skip
    (reads,) = source(host, point).sample().mounts
    assert reads.read_bytes_total == 54975581388


@pytest.mark.parametrize(
    ("mount_source", "clients", "counted"),
    [
        (f"admin@{FSID}.cephfs=/models", [FSID, "0c2b9a1e-3d4f-4a5b-8c6d-7e8f9a0b1c2d"], True),
        ("10.0.0.1:6789,10.0.0.2:6789:/models", [FSID], True),  # one client: that one
        ("10.0.0.1:6789:/models", [FSID, "0c2b9a1e-3d4f-4a5b-8c6d-7e8f9a0b1c2d"], False),
    ],
)
def test_cephfs_reads_from_the_client_metrics(
    host: FakeHost, mount_source: str, clients: list[str], counted: bool
) -> None:
    size = (FIXTURES / "ceph-metrics-size").read_text()
    assert parse_ceph_size(size) == 171798691840
    point = host.mount("ceph", mount_source, "ceph", "rw,name=admin,acl")
    for n, fsid in enumerate(clients):
        host.file(f"kernel/debug/ceph/{fsid}.client{4305 + n}/metrics/size", size, under=host.sys)
    sample = source(host, point).sample()
    if counted:
        (reads,) = sample.mounts
        assert (reads.kind, reads.mount, reads.read_bytes_total) == (
            StorageKind.CEPHFS, mount_source, 171798691840,
        )  # fmt: skip
    else:
        assert sample.mounts == ()
        assert "2 ceph clients and no fsid in the mount source" in (sample.health().note or "")


def test_network_storage_is_described_and_its_residency_measured(host: FakeHost) -> None:
    """The page cache serves NFS reads: residency is true there and decides the label."""
    point = host.mount("nfs4", "192.168.1.1:/srv/test", "nfs")
    weights = WeightsConfig(paths=(str(point),))
    storage = WeightStorage(weights, proc_root=str(host.proc), sys_root=str(host.sys))
    described = storage.describe()
    (mount,) = described.mounts
    assert (mount.kind, mount.fstype, mount.source) == (
        StorageKind.NFS,
        "nfs4",
        "192.168.1.1:/srv/test",
    )
    assert mount.read_rate.value is True and mount.read_rate.reason == "nfs: 192.168.1.1:/srv/test"
    assert mount.residency.value is True and mount.page_cache.value is True
    assert described.fixed_cache() is None and not described.in_memory
    residency = ResidencySource(weights, storage=storage).sample()
    assert residency.resident_bytes is not None and residency.total_bytes == 64 << 10
