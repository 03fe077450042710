"""Where the weights live, on real filesystems made inside each test (tests/helpers/filesystems.py).

Each storage gets a cold and a warm load of the simulator, throttled through a blkio cgroup on
the block device its filesystem reads: the read rate must land on that device (and at the
throttle's rate), residency must equal util-linux fincore on the files whose page cache really
serves the reads (the real file below an overlay or a FUSE passthrough), and the storage
description must say what it is and what can be measured there. Where residency cannot be
measured truthfully or harmlessly, it must be absent with the reason, and measuring must not
change what it measures. DAMON pages cold page cache out in the background on this VM, so
residency is compared with fincore taken right after it, within a few pages.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers.filesystems import (
    MIB,
    Scratch,
    fincore_bytes,
    into_cgroup,
    require_filesystem,
    scratch,
)
from helpers.processes import Simulator, cli
from helpers.support import RunningExporter, free_port, sample_value, sim_target, wait_for
from test_disk import lsblk_whole_disk
from test_e2e import finished

from exporter.config.schema import ProcessConfig, WeightsConfig
from exporter.load.progress import temperature
from exporter.sim.shards import generate_shards
from exporter.sources.disk import DiskSample, DiskSource
from exporter.sources.process import ProcessFinder
from exporter.sources.residency import ResidencySample, ResidencySource
from exporter.sources.storage import StorageDescription, WeightStorage
from exporter.sources.weightfiles import WeightFilesSample, WeightFilesSource
from exporter.storage.cachectl import evict
from exporter.storage.pagecache import CachestatCall
from exporter.vocabulary import Cache, StorageKind

pytestmark = pytest.mark.system

SHARDS, SHARD = 2, 8 * MIB
TOTAL = SHARDS * SHARD
LIMIT = 16_000_000  # bytes per second a cold load may read from its device
SLACK_PAGES = 16  # DAMON may page a few cold pages out between two measurements
PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class Weights:
    path: Path  # what the simulator loads and the exporter watches
    real: tuple[Path, ...]  # the files whose page cache serves those reads
    device: str | None  # the block device the weights' filesystem reads from
    images: tuple[Path, ...] = ()  # loop images: their own page cache must be cold too
    readers: tuple[int, ...] = ()  # processes that read for the loader (a FUSE daemon)


def make_cold(weights: Weights) -> None:
    """Drop the weights from the page cache, and the loop images under them from theirs."""
    for path in (*weights.real, *weights.images):
        evict(str(path))


def shards_in(directory: Path) -> tuple[Path, ...]:
    return tuple(sorted(directory.glob("*.safetensors")))


def with_shards(directory: Path) -> Path:
    generate_shards(directory, SHARDS, SHARD)
    (directory / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    return directory


def on_block_image(fstype: str) -> Callable[[Scratch], Weights]:
    def build(s: Scratch) -> Weights:
        point, device, image = s.block_image(fstype)
        model = with_shards(point / "model")
        return Weights(model, shards_in(model), device, (image,))

    return build


def on_read_only_image(fstype: str) -> Callable[[Scratch], Weights]:
    def build(s: Scratch) -> Weights:
        point, device, image = s.read_only_image(fstype, with_shards(s.path("content")))
        return Weights(point, shards_in(point), device, (image,))

    return build


def on_overlay(s: Scratch) -> Weights:
    """A model shipped in a squashfs image, seen through a container's overlay root."""
    lower, device, image = s.read_only_image("squashfs", with_shards(s.path("content")))
    merged = s.overlay(lower, s.tmpfs())
    return Weights(merged, shards_in(lower), device, (image,))


def on_tmpfs(s: Scratch) -> Weights:
    model = with_shards(s.tmpfs() / "model")
    return Weights(model, shards_in(model), None)


def on_bindfs(s: Scratch) -> Weights:
    """bindfs (no keep_cache: every open drops a file's page cache) over an ext4 image."""
    point, device, image = s.block_image("ext4")
    source = with_shards(point / "model")
    mount, daemon = s.bindfs(source)
    return Weights(mount, shards_in(source), device, (image,), (daemon,))


BUILD: dict[str, Callable[[Scratch], Weights]] = {
    "ext4": on_block_image("ext4"),
    "xfs": on_block_image("xfs"),
    "btrfs": on_block_image("btrfs"),
    "squashfs": on_read_only_image("squashfs"),
    "erofs": on_read_only_image("erofs"),
    "overlay": on_overlay,
    "tmpfs": on_tmpfs,
    "fuse": on_bindfs,
}
NEEDS = {"overlay": ("overlay", "squashfs", "tmpfs"), "fuse": ("fuse", "ext4")}
KIND = {
    "ext4": StorageKind.BLOCK,
    "xfs": StorageKind.BLOCK,
    "btrfs": StorageKind.BTRFS,
    "squashfs": StorageKind.IMAGE,
    "erofs": StorageKind.IMAGE,
    "overlay": StorageKind.OVERLAY,
    "tmpfs": StorageKind.MEMORY,
    "fuse": StorageKind.FUSE,
}


@dataclass(frozen=True)
class Load:
    device_bytes: int  # read by the weights' device during the load
    weights_seconds: float  # the simulator's weights phase
    rate: float  # the median of the rates the disk source reported for the device while it read


def run_load(
    tmp_path: Path,
    weights: Weights,
    procs: Path | None,
    *extra: str,
    during: Callable[[], None] | None = None,
) -> Load:
    """One load of the simulator in the throttled cgroup, the disk source sampling meanwhile
    (and `during` called each time it does)."""
    disk = DiskSource({"m": [str(weights.path)]})
    device = weights.device

    def total(sample: DiskSample) -> int:
        return sum(d.read_bytes_total for d in sample.devices if d.device == device)

    before = total(disk.sample())
    report = tmp_path / f"report-{time.monotonic_ns()}.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "simulate", "--weights", str(weights.path),
         "--port", "0", "--read-rate", "100GB/s", "--startup-seconds", "0", "--import-bytes", "0",
         "--init-seconds", "0.05", "--exit-after", "0.01s", "--report", str(report),
         "--log-file", str(tmp_path / "server.log"), *extra],
        preexec_fn=into_cgroup(procs) if procs is not None else None,
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    rates: list[float] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.2):
            if during is not None:
                during()
            for reads in disk.sample().devices:
                if reads.device == device and reads.read_bytes_per_second:
                    rates.append(reads.read_bytes_per_second)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        stop.set()
        watcher.join()
    assert proc.returncode == 0, stderr
    after = total(disk.sample())
    result = json.loads(report.read_text())
    seconds = result["weights_done_at"] - result["weights_started_at"]
    return Load(after - before, seconds, statistics.median(rates) if rates else 0.0)


def residency(weights: Weights) -> tuple[ResidencySample, int]:
    """The exporter's residency of the weights, and fincore's of the real files right after."""
    config = WeightsConfig(paths=(str(weights.path),))
    sample = ResidencySource(config, storage=WeightStorage(config)).sample()
    return sample, sum(fincore_bytes(p) for p in weights.real)


def assert_residency_is_fincore(weights: Weights, expected: int) -> ResidencySample:
    for _ in range(3):  # measured again when DAMON paged something out in between
        sample, truth = residency(weights)
        if sample.resident_bytes == truth:
            break
    assert sample.resident_bytes is not None, sample.reason
    assert abs(sample.resident_bytes - truth) <= SLACK_PAGES * PAGE, (sample, truth)
    # Against what the load should have left: DAMON takes more in the time since (1 % here).
    assert abs(sample.resident_bytes - expected) <= TOTAL // 100, (sample, expected)
    assert sample.total_bytes == TOTAL
    return sample


def label(described: StorageDescription, sample: ResidencySample) -> Cache:
    """The cache label the description and residency give a load starting now."""
    fixed = described.fixed_cache()
    if fixed is not None:
        return fixed
    assert sample.resident_bytes is not None
    return temperature(sample.resident_bytes / sample.total_bytes)


@pytest.mark.parametrize("name", list(BUILD))
def test_a_cold_then_a_warm_load(name: str, tmp_path: Path) -> None:
    require_filesystem(*NEEDS.get(name, (name,)))
    with scratch(tmp_path / "fs") as s:
        weights = BUILD[name](s)
        described = WeightStorage(WeightsConfig(paths=(str(weights.path),))).describe()
        (mount,) = described.mounts
        assert mount.kind is KIND[name], mount
        assert mount.residency.value is True, mount.residency
        assert mount.page_cache.value is True and mount.bypass.value is False
        assert described.fixed_cache() is None
        assert described.in_memory is (name == "tmpfs")
        if weights.device is None:
            assert mount.devices == () and mount.read_rate.value is False
        else:
            # The device the filesystem reads, and the disk under its image file below it.
            assert mount.devices == (weights.device,), mount
            assert mount.lower_devices == (lsblk_whole_disk(weights.images[0]),), mount
            assert mount.read_rate.reason.startswith(f"disk: {weights.device} ")
            assert f"{weights.device} (buffered, backing {weights.images[0]})" in mount.summary
        expected_type = {"fuse": "fuse", "overlay": "overlay", "tmpfs": "tmpfs"}.get(name, name)
        assert mount.summary.startswith(expected_type), mount.summary
        procs = s.throttle(weights.device, LIMIT) if weights.device is not None else None
        for pid in weights.readers:  # the daemon reads the device for the loader
            assert procs is not None
            procs.write_text(f"{pid}\n")

        make_cold(weights)
        cold_start = assert_residency_is_fincore(weights, TOTAL if name == "tmpfs" else 0)
        cold = run_load(tmp_path, weights, procs)
        after_cold = assert_residency_is_fincore(weights, TOTAL)
        warm = run_load(tmp_path, weights, procs)

    if name == "tmpfs":  # in memory by construction: nothing to evict, no device to read
        assert label(described, cold_start) is Cache.WARM
        assert cold.device_bytes == warm.device_bytes == 0
        return
    assert label(described, cold_start) is Cache.COLD
    assert label(described, after_cold) is Cache.WARM
    assert TOTAL <= cold.device_bytes <= TOTAL + 8 * MIB, cold  # the shards, and metadata
    assert cold.weights_seconds >= 0.8 * TOTAL / LIMIT, cold  # read at the throttle's pace
    assert 0.5 * LIMIT <= cold.rate <= 1.5 * LIMIT, cold  # as the disk source reported it
    # From the page cache: a quarter of the cold load's bytes at most, since on a busy machine
    # this VM's DAMON pages out cold metadata (squashfs tables, FUSE's inodes) between the two
    # loads: up to 2 MiB seen.
    assert warm.device_bytes < TOTAL / 4, warm
    assert warm.weights_seconds < 0.5 * TOTAL / LIMIT, warm


def bindfs_over_xfs(s: Scratch, options: tuple[str, ...], probe_file: bool) -> Weights:
    """bindfs with `options` passing a model directory on an XFS image through (its source
    visible: residency is measured on the source files), with or without a file beside the
    shards that is no weight file (what the direct-I/O probe reads)."""
    point, device, image = s.block_image("xfs")
    source = point / "model"
    generate_shards(source, SHARDS, SHARD)
    if probe_file:
        (source / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    mount, daemon = s.bindfs(source, *options)
    return Weights(mount, shards_in(source), device, (image,), (daemon,))


@pytest.mark.parametrize(
    ("options", "probe_file", "expected"),
    [
        (("-o", "direct_io"), True, Cache.BYPASS),
        (("-o", "direct_io,kernel_cache"), True, Cache.BYPASS),
        ((), True, None),  # cold, then warm: as before
        (("-o", "kernel_cache"), True, None),
        (("-o", "direct_io"), False, Cache.UNKNOWN),  # nothing to try the mount on
    ],
    ids=["direct_io", "direct_io-kernel_cache", "plain", "kernel_cache", "direct_io-no-probe"],
)
def test_a_cold_load_through_a_bindfs_over_xfs_is_labelled_by_what_the_kernel_shows(
    tmp_path: Path, options: tuple[str, ...], probe_file: bool, expected: Cache | None
) -> None:
    """Issue 32 row 3: a cold load through `bindfs -o direct_io` of a directory on an XFS image
    read every shard from the device and was labelled `cold`. Its reads skip the FUSE page
    cache, which no mount option in /proc shows; reading one other file of the model through the
    mount and asking cachestat does: `bypass`. Without direct_io the same passthrough keeps its
    cold and warm; where there is no other file to read, the label is `unknown`, saying why."""
    require_filesystem("fuse", "xfs")
    with scratch(tmp_path / "fs") as s:
        weights = bindfs_over_xfs(s, options, probe_file)
        described = WeightStorage(WeightsConfig(paths=(str(weights.path),))).describe()
        (mount,) = described.mounts
        assert mount.kind is StorageKind.FUSE and mount.passthrough is not None, mount
        procs = s.throttle(weights.device, LIMIT) if weights.device is not None else None
        assert procs is not None
        for pid in weights.readers:
            procs.write_text(f"{pid}\n")
        make_cold(weights)
        cold_start = assert_residency_is_fincore(weights, 0)
        cold = run_load(tmp_path, weights, procs)
        after_cold, _ = residency(weights)
    assert TOTAL <= cold.device_bytes <= TOTAL + 8 * MIB, cold  # a cold load, whatever it says
    if expected is Cache.BYPASS:
        assert mount.bypass.value is True and "direct I/O" in mount.bypass.reason, mount.bypass
        assert described.fixed_cache() is Cache.BYPASS
        assert described.reason is not None and "direct I/O" in described.reason
    elif expected is Cache.UNKNOWN:
        assert mount.bypass.value is None, mount.bypass
        assert described.fixed_cache() is Cache.UNKNOWN
        assert "no file other than the weights" in (described.reason or ""), described.reason
    else:
        assert mount.bypass.value is False, mount.bypass
        assert described.fixed_cache() is None
        assert label(described, cold_start) is Cache.COLD
        assert label(described, after_cold) is Cache.WARM


def hidden_bindfs(s: Scratch, *options: str) -> tuple[Path, Path]:
    """A bindfs whose source is then covered: like a FUSE daemon whose backing cannot be known
    (the mount names a directory that no longer shows what the daemon serves)."""
    source = with_shards(s.tmpfs() / "model")
    mount, _ = s.bindfs(source, *options)
    first = mount / shards_in(source)[0].name
    s.hide(source)
    return mount, first


@pytest.mark.requires("root", "cachestat")
def test_fuse_that_drops_its_cache_on_open_is_not_opened(tmp_path: Path) -> None:
    """bindfs without keep_cache drops a file's page cache at every open(): the residency pass
    must not open the weights there (it would evict what the server loaded), and says why."""
    require_filesystem("fuse")
    with scratch(tmp_path / "fs") as s:
        mount, shard = hidden_bindfs(s)
        config = WeightsConfig(paths=(str(mount),))
        storage = WeightStorage(config)
        (described,) = storage.describe().mounts
        assert described.passthrough is None and described.residency.value is False
        assert "drops its page cache (no keep_cache)" in described.residency.reason
        assert storage.describe().fixed_cache() is Cache.UNKNOWN

        held = os.open(shard, os.O_RDONLY)  # the server's descriptor, after reading the shard
        try:
            while os.read(held, 1 << 20):
                pass
            cached = CachestatCall()(held).nr_cache
            assert cached * PAGE >= SHARD
            sample = ResidencySource(config, storage=storage).sample()
            assert sample.resident_bytes is None and "no keep_cache" in (sample.reason or "")
            assert (sample.files, sample.total_bytes) == (SHARDS, TOTAL)
            assert CachestatCall()(held).nr_cache == cached  # the pass left the cache alone
            os.close(os.open(shard, os.O_RDONLY))  # what a pass that opens would have done
            assert CachestatCall()(held).nr_cache == 0
        finally:
            os.close(held)


@pytest.mark.requires("root", "cachestat", "fincore")
def test_fuse_direct_io_is_bypass_and_prewarm_refuses(tmp_path: Path) -> None:
    require_filesystem("fuse")
    with scratch(tmp_path / "fs") as s:
        mount, _ = hidden_bindfs(s, "-o", "direct_io")
        described = WeightStorage(WeightsConfig(paths=(str(mount),))).describe()
        (fuse,) = described.mounts
        assert fuse.bypass.value is True and "direct I/O" in fuse.bypass.reason
        assert described.fixed_cache() is Cache.BYPASS and described.bypass
        done = cli("prewarm", str(mount))
        assert done.returncode == 1
        assert done.stderr.startswith("model-load-exporter prewarm: error: refusing: reads of ")
        assert "bypass the page cache" in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.requires("root", "cachestat", "fincore")
def test_fuse_that_keeps_its_cache_is_measured_through_the_mount(tmp_path: Path) -> None:
    require_filesystem("fuse")
    with scratch(tmp_path / "fs") as s:
        mount, shard = hidden_bindfs(s, "-o", "kernel_cache")
        config = WeightsConfig(paths=(str(mount),))
        storage = WeightStorage(config)
        (fuse,) = storage.describe().mounts
        assert fuse.residency.value is True and "keeps the cache" in fuse.residency.reason
        with open(shard, "rb") as f:
            while f.read(1 << 20):
                pass
        for _ in range(3):
            sample = ResidencySource(config, storage=storage).sample()
            truth = fincore_bytes(shard)  # opens through the mount: kept, so harmless here
            if sample.resident_bytes == truth:
                break
        assert sample.resident_bytes is not None
        assert abs(sample.resident_bytes - truth) <= SLACK_PAGES * PAGE
        assert abs(truth - SHARD) <= SLACK_PAGES * PAGE


@pytest.mark.requires("root", "fincore")
def test_prewarm_through_an_overlay_warms_the_real_file(tmp_path: Path) -> None:
    require_filesystem("overlay", "squashfs", "tmpfs")
    with scratch(tmp_path / "fs") as s:
        weights = on_overlay(s)
        make_cold(weights)
        done = cli("prewarm", str(weights.path))
        assert done.returncode == 0, done.stderr
        # Measured on the squashfs files below: 0 before, all of it after (to 0.1 MiB: DAMON).
        assert "already resident 0 B (0 %), now 16.0 MiB (" in done.stdout, done.stdout
        assert abs(sum(fincore_bytes(p) for p in weights.real) - TOTAL) <= SLACK_PAGES * PAGE
        evicted = cli("prewarm", "--evict", str(weights.path))
        assert evicted.returncode == 0, evicted.stderr
        assert sum(fincore_bytes(p) for p in weights.real) == 0


@pytest.mark.requires("root", "fincore")
def test_overlay_copied_up_file_is_measured_in_the_upper_layer(tmp_path: Path) -> None:
    require_filesystem("overlay", "ext4", "tmpfs")
    with scratch(tmp_path / "fs") as s:
        point, _, _ = s.block_image("ext4")
        lower = with_shards(point / "model")
        upper_base = s.tmpfs()
        merged = s.overlay(lower, upper_base)
        first = shards_in(merged)[0]
        with open(first, "r+b") as f:  # a write copies the file up into the upper layer
            f.write(f.read(PAGE))
        copied = upper_base / "upper" / first.name
        assert copied.is_file()
        for path in (*shards_in(lower), copied):
            evict(str(path))
        with open(first, "rb") as f:
            f.read()  # through the overlay: the upper file's pages
        sample, _ = residency(Weights(merged, (copied, shards_in(lower)[1]), None))
        assert sample.where == "on the real files below the overlay"
        truth = fincore_bytes(copied) + fincore_bytes(shards_in(lower)[1])
        assert sample.resident_bytes is not None
        assert abs(sample.resident_bytes - truth) <= SLACK_PAGES * PAGE
        assert abs(truth - SHARD) <= SLACK_PAGES * PAGE


@pytest.mark.requires("root", "cachestat")
def test_a_warm_restart_from_an_overlay_is_labelled_warm(
    tmp_path: Path, start_exporter: Callable[..., RunningExporter]
) -> None:
    """The exporter watching a server whose weights are in a container image's overlay: its
    cold load is cold and its restart warm (through the overlay's own descriptor every load would
    be cold: cachestat says 0 pages there)."""
    require_filesystem("overlay", "squashfs", "tmpfs")
    with scratch(tmp_path / "fs") as s:
        weights = on_overlay(s)
        make_cold(weights)
        port = free_port()
        target = sim_target(port, weights.path, tmp_path / "server.pid")
        running = start_exporter({"sample_interval": "250ms", "targets": [target]})
        for cache in ("cold", "warm"):
            sim = Simulator(tmp_path, weights.path, port, "--read-rate", "40MB/s")
            try:
                text, _ = finished(running, cache=cache, outcome="ready")
            finally:
                sim.stop()
            wait_for(lambda: running.status()["targets"][0].get("phase") == "down")
        entry = running.status()["targets"][0]
    assert sample_value(text, "model_load_duration_seconds_count", target="sim", cache="cold") == 1
    assert entry["storage"]["kinds"] == ["overlay"]
    assert entry["residency"]["measured_on"] == "on the real files below the overlay"


LABELLED: dict[str, Callable[[Scratch], Weights]] = {
    **BUILD,
    "fuse-direct_io-xfs": lambda s: bindfs_over_xfs(s, ("-o", "direct_io"), probe_file=True),
}
LABELLED_NEEDS = {**NEEDS, "fuse-direct_io-xfs": ("fuse", "xfs")}


@pytest.mark.parametrize(
    ("where", "flags", "label"),
    [
        ("ext4", ("--loader", "read", "--direct"), "bypass"),
        ("tmpfs", (), "warm"),
        ("fuse-direct_io-xfs", (), "bypass"),
    ],
    ids=["o_direct-is-bypass", "tmpfs-is-warm", "fuse-direct_io-is-bypass"],
)
def test_the_exporter_labels_a_load_by_what_served_it(
    tmp_path: Path,
    start_exporter: Callable[..., RunningExporter],
    where: str,
    flags: tuple[str, ...],
    label: str,
) -> None:
    """A load whose weights were read with O_DIRECT bypassed the page cache whatever residency
    said (0 here: it would call it cold); one from tmpfs was in memory all along (never cold)."""
    require_filesystem(*LABELLED_NEEDS.get(where, (where,)))
    with scratch(tmp_path / "fs") as s:
        weights = LABELLED[where](s)
        make_cold(weights)
        port = free_port()
        target = sim_target(port, weights.path, tmp_path / "server.pid")
        running = start_exporter({"sample_interval": "250ms", "targets": [target]})
        sim = Simulator(tmp_path, weights.path, port, "--read-rate", "40MB/s", *flags)
        try:
            text, _ = finished(running, outcome="ready")
        finally:
            sim.stop()
    labels = {k: v for k, v in _labels(text, "model_load_duration_seconds_count").items()}
    assert labels == {label: 1.0}, labels


def _labels(text: str, metric: str) -> dict[str, float]:
    """The cache label of each `metric` sample of target sim, with its value."""
    out = {}
    for line in text.splitlines():
        if line.startswith(metric + "{") and 'target="sim"' in line:
            cache = line.split('cache="', 1)[1].split('"', 1)[0]
            out[cache] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_a_shard_symlinked_from_another_filesystem_is_described_once_a_pass_met_it(
    tmp_path: Path,
) -> None:
    """Hugging Face caches link snapshots to blobs: a blob elsewhere adds its mount."""
    model = with_shards(tmp_path / "model")
    blob = Path(tempfile.mkdtemp(prefix="mle-blob-", dir="/dev/shm")) / "blob.safetensors"
    try:
        blob.write_bytes(os.urandom(64 << 10))
        (model / "extra.safetensors").symlink_to(blob)
        config = WeightsConfig(paths=(str(model),))
        storage = WeightStorage(config)
        assert [m.kind for m in storage.describe().mounts] == [KIND["ext4"]]
        sample = ResidencySource(config, storage=storage).sample()
        assert sample.files == SHARDS + 1 and sample.resident_bytes is not None
        described = storage.describe()
        assert [m.fstype for m in described.mounts][1:] == ["tmpfs"]
        assert described.mounts[1].paths == (str(model / "extra.safetensors"),)
        assert not described.in_memory  # only part of the weights is
        blob.unlink()
        assert len(storage.describe().mounts) == 1  # gone: its mount is no longer described
    finally:
        shutil.rmtree(blob.parent)


@pytest.mark.requires("root", "cachestat", "fincore")
def test_a_direct_io_loader_bypasses_the_page_cache(tmp_path: Path) -> None:
    """`simulate --loader read --direct` opens its shards with O_DIRECT (Run:ai's streamer
    with RUNAI_STREAMER_DIRECTIO=1 does): the weight files show it, every load reads its bytes
    from the device at the throttle's pace, progress reaches the whole, and nothing lands in the
    page cache, so residency (0, as fincore says) would call the next restart cold again."""
    require_filesystem("ext4")
    with scratch(tmp_path / "fs") as s:
        weights = on_block_image("ext4")(s)
        procs = s.throttle(weights.device or "", LIMIT)
        make_cold(weights)
        pidfile = tmp_path / "server.pid"
        config = WeightsConfig(paths=(str(weights.path),))
        finder = ProcessFinder(ProcessConfig(pidfile=str(pidfile)))
        files = WeightFilesSource(config, finder.sample)
        seen: list[WeightFilesSample] = []

        def look() -> None:
            finder.sample()
            seen.append(files.sample())

        # Initializing for 0.5 s (the last value given wins): looks 0.2 s apart see the files
        # read whole before the process exits and takes its file view with it.
        flags = ("--loader", "read", "--direct", "--pidfile", str(pidfile), "--init-seconds", "0.5")
        loads = [run_load(tmp_path, weights, procs, *flags, during=look) for _ in range(2)]
        after, truth = residency(weights)
    for load in loads:  # both read everything from the device: the cache never warms
        assert TOTAL <= load.device_bytes <= TOTAL + 2 * MIB, load
        assert 0.5 * LIMIT <= load.rate <= 1.5 * LIMIT, load
    held = [use for sample in seen for use in sample.files if use.held]
    assert held and all(use.direct for use in held), held
    assert max(sample.consumed_bytes for sample in seen if sample.visible) == TOTAL
    assert after.resident_bytes == truth == 0
