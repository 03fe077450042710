from __future__ import annotations

from pathlib import Path

import pytest
from helpers.pagecache_io import MIB, read_all, write_cold_file

from exporter.sources.memory import MemorySample, read_meminfo

GOOD = """\
MemTotal:       24683656 kB
MemFree:        24343500 kB
MemAvailable:   24329128 kB
Buffers:            3200 kB
Cached:           157780 kB
SwapCached:            0 kB
"""


def fake_proc(tmp_path: Path, text: str) -> str:
    (tmp_path / "meminfo").write_text(text)
    return str(tmp_path)


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
