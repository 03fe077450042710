from __future__ import annotations

from pathlib import Path

import pytest
from helpers.pagecache_io import MIB, read_all, write_cold_file

from exporter.sources.memory import (
    CacheFlows,
    MemorySample,
    MemorySource,
    read_cache_flows,
    read_meminfo,
)
from exporter.storage.cachectl import evict
from exporter.storage.pagecache import PAGE_SIZE

GOOD = """\
MemTotal:       24683656 kB
MemFree:        24343500 kB
MemAvailable:   24329128 kB
Buffers:            3200 kB
Cached:           157780 kB
SwapCached:            0 kB
"""


def fake_proc(
    tmp_path: Path, text: str, kib_in: int = 0, dirtied: int = 0, reclaimed: int | None = None
) -> str:
    """A proc root with this meminfo; a vmstat too unless `reclaimed` is None (pages)."""
    (tmp_path / "meminfo").write_text(text)
    if reclaimed is not None:
        (tmp_path / "vmstat").write_text(
            f"nr_free_pages 6000000\nnr_dirtied {dirtied}\npgpgin {kib_in}\npgpgout 9\n"
            f"pgsteal_kswapd 7\npgsteal_file {reclaimed}\npgsteal_anon 3\n"
        )
    return str(tmp_path)


def cached(kib: int) -> str:
    return GOOD.replace("Cached:           157780 kB", f"Cached:           {kib} kB")


def test_real_meminfo_is_sane() -> None:
    sample = read_meminfo()
    assert sample.total_bytes > sample.available_bytes > 0
    assert sample.page_cache_bytes > 0
    assert sample.total_bytes % 1024 == 0


def test_fake_meminfo_values_are_bytes(tmp_path: Path) -> None:
    assert read_meminfo(fake_proc(tmp_path, GOOD)) == MemorySample(
        total_bytes=24683656 * 1024,
        available_bytes=24329128 * 1024,
        page_cache_bytes=157780 * 1024,
    )


def test_page_cache_grows_after_reading_a_file(tmp_path: Path) -> None:
    size = 64 * MIB
    path = write_cold_file(tmp_path / "weights.bin", size)
    before = read_meminfo().page_cache_bytes
    read_all(path)
    after = read_meminfo().page_cache_bytes
    # Other activity on the host can evict or add pages; half the file is a robust lower bound.
    assert after - before >= size // 2


@pytest.mark.parametrize(
    "text",
    [
        "",
        GOOD.replace("MemAvailable:   24329128 kB\n", ""),
        GOOD.replace("Cached:           157780 kB", "Cached:           lots kB"),
        GOOD.replace("MemTotal:       24683656 kB", "MemTotal:       24683656"),
        GOOD.replace("MemTotal:       24683656 kB", "MemTotal:       24683656 MB"),
        "\xff\xfe garbage",
    ],
    ids=["empty", "missing-available", "not-a-number", "no-unit", "wrong-unit", "binary"],
)
def test_malformed_meminfo_raises(tmp_path: Path, text: str) -> None:
    with pytest.raises(ValueError):
        read_meminfo(fake_proc(tmp_path, text))


def test_missing_meminfo_raises_oserror(tmp_path: Path) -> None:
    with pytest.raises(OSError):
        read_meminfo(str(tmp_path))


def test_what_left_the_page_cache_is_what_came_in_less_its_growth_or_what_reclaim_took(
    tmp_path: Path,
) -> None:
    source = MemorySource(fake_proc(tmp_path, cached(1_000_000), reclaimed=500))
    assert source.sample().page_cache_departed_bytes == 0  # the first sample is the baseline
    # (Cached KiB, KiB read in, pages written, pages reclaimed) and what left meanwhile.
    steps = [
        ((900_000, 0, 0, 500), 100_000 * 1024),  # Cached fell (drop_caches, an eviction)
        ((950_000, 50_000, 0, 500), 0),  # grew by what was read: nothing left
        ((950_000, 250_000, 0, 500), 200_000 * 1024),  # 200 MB more read than it grew by
        ((950_000, 250_000, 25_000, 500), 25_000 * PAGE_SIZE),  # written, and level: left
        ((950_000, 250_000, 25_000, 10_500), 10_000 * PAGE_SIZE),  # reclaim, level, no reads
        ((800_000, 250_000, 25_000, 10_600), 150_000 * 1024),  # both: the larger, not the sum
    ]
    departed = 0
    for (kib, kib_in, dirtied, reclaimed), left in steps:
        fake_proc(tmp_path, cached(kib), kib_in, dirtied, reclaimed)
        departed += left
        assert source.sample().page_cache_departed_bytes == departed, (kib, kib_in, reclaimed)


def test_without_vmstat_only_the_fall_of_cached_counts(tmp_path: Path) -> None:
    source = MemorySource(fake_proc(tmp_path, cached(1_000_000)))
    assert read_cache_flows(str(tmp_path)) == CacheFlows(None, None)
    source.sample()
    fake_proc(tmp_path, cached(999_000))
    assert source.sample().page_cache_departed_bytes == 1000 * 1024
    (tmp_path / "vmstat").write_text("nr_dirtied 5\npgpgin lots\npgsteal_file 7\n")
    assert read_cache_flows(str(tmp_path)) == CacheFlows(None, 7 * PAGE_SIZE)


def test_evicting_a_cached_file_counts_as_departed_whatever_else_comes_in(tmp_path: Path) -> None:
    size = 64 * MIB
    path = write_cold_file(tmp_path / "weights.bin", size)
    other = write_cold_file(tmp_path / "other.bin", size)
    read_all(path)
    source = MemorySource()
    source.sample()
    evict(str(path))
    read_all(other)  # as much comes in: Cached alone would not have moved
    assert source.sample().page_cache_departed_bytes >= size // 2  # the host's noise aside
    flows = read_cache_flows()
    assert flows.came_in is not None and flows.reclaimed is not None  # this kernel counts both
