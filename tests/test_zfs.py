"""ZFS under the weights, from fixtures of the SPL kstats: pool reads, the ARC's hit share, and the
temperature rule (the ARC serves reads, so page-cache residency is dropped and the label is
`unknown`), through the same sources the exporter runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_exposition import exposition, host_snapshot
from test_netfs import FIXTURES, FakeHost

from exporter.config.schema import WeightsConfig
from exporter.sources.residency import ResidencySource
from exporter.sources.storage import WeightStorage
from exporter.sources.zfs import ZFS, ZfsSource, parse_kstat_io, parse_kstat_named, pool_of
from exporter.storage.cachectl import prewarm
from exporter.vocabulary import Cache, StorageKind

HITS, MISSES = 7221032, 73300  # demand_data_hits, demand_data_misses in the arcstats fixture
NREAD = 1884160  # pool1/io


@pytest.fixture
def host(tmp_path: Path) -> FakeHost:
    host = FakeHost(tmp_path)
    host.file("spl/kstat/zfs/arcstats", (FIXTURES / "arcstats").read_text())
    host.file("spl/kstat/zfs/pool1/io", (FIXTURES / "pool1-io").read_text())
    return host


def zfs_source(host: FakeHost, *paths: Path) -> ZfsSource:
    return ZfsSource(
        {"m": [str(p) for p in paths]},
        proc_root=str(host.proc),
        sys_root=str(host.sys),
        clock=host.clock,
    )


def grow(host: FakeHost, hits: int, misses: int, nread: int) -> None:
    arc = host.proc / "spl/kstat/zfs/arcstats"
    text = arc.read_text()
    text = text.replace(f"demand_data_hits                4    {HITS}\n",
                        f"demand_data_hits                4    {HITS + hits}\n")  # fmt: skip
    text = text.replace(f"demand_data_misses              4    {MISSES}\n",
                        f"demand_data_misses              4    {MISSES + misses}\n")  # fmt: skip
    arc.write_text(text)
    io = host.proc / "spl/kstat/zfs/pool1/io"
    io.write_text(io.read_text().replace(f"{NREAD}  ", f"{NREAD + nread}  "))


def test_kstat_fixtures_parse() -> None:
    named = parse_kstat_named((FIXTURES / "arcstats").read_text())
    assert (named["demand_data_hits"], named["demand_data_misses"]) == (HITS, MISSES)
    assert parse_kstat_io((FIXTURES / "pool1-io").read_text()) == NREAD
    assert parse_kstat_io("12 3 0x00 1 80\n") is None
    assert pool_of("pool1/models/llama") == "pool1" and pool_of("tank") == "tank"


def test_pool_reads_and_the_arc_hit_share_over_an_interval(host: FakeHost) -> None:
    point = host.mount("zfs", "pool1/models", "zfs", "rw,xattr,noacl")
    zfs = zfs_source(host, point)
    first = zfs.sample()
    (pool,) = first.pools
    assert (pool.pool, pool.read_bytes_total, pool.read_bytes_per_second) == ("pool1", NREAD, None)
    assert first.arc is not None
    assert (first.arc.hits_total, first.arc.misses_total, first.arc.hit_ratio) == (
        HITS,
        MISSES,
        None,
    )
    assert first.read_bytes_of("m") == NREAD and first.health().note is None

    host.now += 2.0
    grow(host, hits=300, misses=100, nread=200 << 20)  # a warm-ish load: 75 % from the ARC
    second = zfs.sample()
    assert second.pools[0].read_bytes_per_second == pytest.approx((200 << 20) / 2.0)
    assert second.arc is not None and second.arc.hit_ratio == pytest.approx(0.75)

    host.now += 1.0
    text = exposition(host_snapshot(ZFS, zfs.sample()))
    families = {f.name: f for f in text_string_to_metric_families(text)}
    [total] = families["model_load_zfs_read_bytes"].samples
    assert (total.labels, total.value) == ({"pool": "pool1"}, NREAD + (200 << 20))
    reads = {
        s.labels["result"]: s.value
        for s in families["model_load_zfs_arc_demand_data_reads"].samples
    }
    assert reads == {"hit": HITS + 300, "miss": MISSES + 100}
    assert families["model_load_zfs_arc_hit_ratio"].samples == []  # nothing read since: no share


def test_a_pool_without_its_io_kstat_is_named(host: FakeHost) -> None:
    point = host.mount("zfs", "tank/models", "tank")
    sample = zfs_source(host, point).sample()
    assert sample.pools == () and sample.arc is not None
    assert "spl/kstat/zfs/tank/io" in (sample.health().note or "")
    assert sample.read_bytes_of("m") is None


def test_no_kstat_is_read_while_no_weights_are_on_zfs(host: FakeHost) -> None:
    (host.proc / "spl/kstat/zfs/arcstats").unlink()  # would be a note if it were read
    sample = zfs_source(host, host.mount("xfs", "/dev/nvme0n1", "local")).sample()
    assert (sample.pools, sample.arc, sample.health().note) == ((), None, None)


def test_on_zfs_residency_is_dropped_and_the_label_is_unknown(host: FakeHost) -> None:
    point = host.mount("zfs", "pool1/models", "zfs")
    prewarm(str(point / "model.safetensors"))  # in the page cache: still not the temperature
    weights = WeightsConfig(paths=(str(point),))
    storage = WeightStorage(weights, proc_root=str(host.proc), sys_root=str(host.sys))
    described = storage.describe()
    (mount,) = described.mounts
    assert mount.kind is StorageKind.ZFS
    assert mount.page_cache.value is False and "ARC" in mount.page_cache.reason
    assert mount.residency.value is False and mount.read_rate.reason == "zfs: pool1/models"
    assert described.fixed_cache() is Cache.UNKNOWN and not described.residency_is_temperature
    residency = ResidencySource(weights, storage=storage).sample()
    assert residency.resident_bytes is None and "ARC" in (residency.reason or "")
    assert (residency.files, residency.total_bytes) == (1, 64 << 10)  # sizes are still measured
