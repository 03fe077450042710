from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest
from helpers.pagecache_io import MIB, diskstats_read_bytes, read_all, write_cold_file

from exporter.sources.disk import DeviceReads, DiskSource

DISKSTATS_LINE = "{major:4d} {minor:7d} {name} 100 0 {sectors} 50 0 0 0 0 0 10 60 0 0 0 0 0 0\n"


def lsblk_whole_disk(path: Path) -> str:
    """Whole-disk kernel name for `path` according to util-linux, an independent oracle."""
    st_dev = os.stat(path).st_dev
    wanted = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    out = subprocess.run(
        ["lsblk", "-nro", "KNAME,PKNAME,TYPE,MAJ:MIN"], check=True, capture_output=True, text=True
    ).stdout
    for line in out.splitlines():
        fields = line.split(" ")
        kname, pkname, kind, majmin = fields[0], fields[1], fields[2], fields[-1]
        if majmin == wanted:
            return pkname if kind == "part" else kname
    raise LookupError(wanted)


def fake_sys(tmp_path: Path, st_dev: int, device_path: str, partition: bool) -> str:
    """A /sys where `st_dev` links to `device_path` under devices/, as the kernel lays it out."""
    sys_root = tmp_path / "sys"
    device_dir = sys_root / "devices" / device_path
    device_dir.mkdir(parents=True)
    if partition:
        (device_dir / "partition").write_text("1\n")
    block = sys_root / "dev" / "block"
    block.mkdir(parents=True)
    majmin = f"{os.major(st_dev)}:{os.minor(st_dev)}"
    (block / majmin).symlink_to(Path("../..") / "devices" / device_path)
    return str(sys_root)


def fake_proc(tmp_path: Path, sectors: dict[str, int]) -> str:
    """diskstats with these sectors, and a mount table whose root is the tmp files' device."""
    proc_root = tmp_path / "proc"
    (proc_root / "self").mkdir(parents=True, exist_ok=True)
    text = "".join(
        DISKSTATS_LINE.format(major=8, minor=i * 16, name=name, sectors=count)
        for i, (name, count) in enumerate(sectors.items())
    )
    (proc_root / "diskstats").write_text(text)
    st_dev = os.stat(tmp_path).st_dev
    (proc_root / "self" / "mountinfo").write_text(
        f"90001 1 {os.major(st_dev)}:{os.minor(st_dev)} / / rw - ext4 /dev/vdz rw\n"
    )
    return str(proc_root)


def test_real_cold_read_is_counted_on_the_whole_disk(tmp_path: Path) -> None:
    size = 64 * MIB
    weights = write_cold_file(tmp_path / "model.safetensors", size)
    source = DiskSource({"m": [str(weights)]})

    first = source.sample()
    expected_device = lsblk_whole_disk(weights)
    assert first.devices_by_target == {"m": (expected_device,)}
    assert first.unbacked_by_target == {"m": ()}
    (before,) = first.devices
    assert before.device == expected_device
    assert before.read_bytes_per_second is None

    assert read_all(weights) == size

    oracle_before = diskstats_read_bytes(expected_device)
    (after,) = source.sample().devices
    oracle_after = diskstats_read_bytes(expected_device)
    assert after.read_bytes_total - before.read_bytes_total >= size
    assert oracle_before <= after.read_bytes_total <= oracle_after
    assert after.read_bytes_per_second is not None
    assert after.read_bytes_per_second > 0


def test_partition_resolves_to_parent_disk(tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x")
    st_dev = os.stat(weights).st_dev
    sys_root = fake_sys(
        tmp_path, st_dev, "pci0000:00/0000:00:04.0/nvme/nvme0/nvme0n1/nvme0n1p2", partition=True
    )
    proc_root = fake_proc(tmp_path, {"nvme0n1": 1000, "nvme0n1p2": 900})
    sample = DiskSource({"m": [str(weights)]}, proc_root=proc_root, sys_root=sys_root).sample()
    assert sample.devices_by_target == {"m": ("nvme0n1",)}
    assert sample.devices == (DeviceReads("nvme0n1", 1000 * 512, None),)


@pytest.mark.parametrize("name", ["dm-0", "md127"])
def test_dm_and_md_devices_are_kept(tmp_path: Path, name: str) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x")
    sys_root = fake_sys(tmp_path, os.stat(weights).st_dev, f"virtual/block/{name}", False)
    slaves = Path(sys_root) / "devices" / "virtual" / "block" / name / "slaves"
    slaves.mkdir()
    (slaves / "sda2").mkdir()
    proc_root = fake_proc(tmp_path, {"sda": 7, "sda2": 5, name: 3})
    sample = DiskSource({"m": [str(weights)]}, proc_root=proc_root, sys_root=sys_root).sample()
    assert sample.devices_by_target == {"m": (name,)}
    assert [d.device for d in sample.devices] == [name]
    assert sample.devices[0].read_bytes_total == 3 * 512


def test_tmpfs_path_is_unbacked_and_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shm = Path("/dev/shm") / f"mle-test-{os.getpid()}"
    shm.mkdir()
    try:
        weights = write_cold_file(tmp_path / "w.bin", MIB)
        source = DiskSource({"a": [str(shm)], "b": [str(weights), str(shm)]})
        with caplog.at_level(logging.INFO, logger="exporter.sources.disk"):
            first = source.sample()
            second = source.sample()
    finally:
        shm.rmdir()
    assert first.unbacked_by_target == {"a": (str(shm),), "b": (str(shm),)}
    assert first.devices_by_target["a"] == ()
    assert len(first.devices_by_target["b"]) == 1
    assert second.unbacked_by_target == first.unbacked_by_target
    messages = [r.getMessage() for r in caplog.records if str(shm) in r.getMessage()]
    assert len(messages) == 1
    assert "tmpfs" in messages[0]


def test_rate_uses_the_injected_clock(tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x")
    sys_root = fake_sys(tmp_path, os.stat(weights).st_dev, "virtual/block/vdz", False)
    times = iter([100.0, 102.0, 103.0, 104.0])
    source = DiskSource(
        {"m": [str(weights)]},
        proc_root=fake_proc(tmp_path, {"vdz": 1000}),
        sys_root=sys_root,
        clock=lambda: next(times),
    )
    assert source.sample().devices[0].read_bytes_per_second is None
    fake_proc(tmp_path, {"vdz": 1000 + 4096})
    (reads,) = source.sample().devices
    assert reads.read_bytes_total == (1000 + 4096) * 512
    assert reads.read_bytes_per_second == pytest.approx(4096 * 512 / 2.0)
    fake_proc(tmp_path, {"vdz": 1000 + 4096})
    assert source.sample().devices[0].read_bytes_per_second == 0.0
    fake_proc(tmp_path, {"vdz": 10})  # counter reset (device re-attached): no negative rate
    assert source.sample().devices[0].read_bytes_per_second is None


def test_missing_path_is_skipped(tmp_path: Path) -> None:
    sample = DiskSource({"m": [str(tmp_path / "gone")]}).sample()
    assert sample.devices == ()
    assert sample.devices_by_target == {"m": ()}
    assert sample.unbacked_by_target == {"m": ()}


def test_malformed_diskstats_raises(tmp_path: Path) -> None:
    weights = tmp_path / "w.bin"
    weights.write_bytes(b"x")
    sys_root = fake_sys(tmp_path, os.stat(weights).st_dev, "virtual/block/vdz", False)
    proc_root = fake_proc(tmp_path, {})
    (Path(proc_root) / "diskstats").write_text(" 254 0 vdz 1 2 many 4\n")
    with pytest.raises(ValueError):
        DiskSource({"m": [str(weights)]}, proc_root=proc_root, sys_root=sys_root).sample()
