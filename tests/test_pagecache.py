"""Page-cache residency against the kernel's own truth, on real files in the real page cache.

Reads use POSIX_FADV_RANDOM so readahead does not blur what is cached, and every figure is
checked against util-linux `fincore` (run as root, where its mincore answers are true).
"""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pagecache_io import file_residency
from helpers.users import NOBODY, as_nobody, nobody_python

from exporter.config.schema import WeightsConfig
from exporter.sources.residency import (
    DEPARTED_SHARE_FOR_PASS,
    MIN_READS_FOR_PASS,
    QUIET_REFRESH_SECONDS,
    SERVING_REFRESH_SECONDS,
    ResidencySource,
)
from exporter.storage import pagecache
from exporter.storage.cachectl import evict
from exporter.storage.pagecache import measure
from exporter.storage.weighttree import walk_weights

MiB = 1 << 20
PAGE = os.sysconf("SC_PAGE_SIZE")

needs_fincore = pytest.mark.requires("fincore")
needs_root = pytest.mark.requires("root", "setpriv", "nobody_python")
needs_cachestat = pytest.mark.requires("cachestat")


def write_uncached(path: Path, size: int) -> Path:
    """Random data, flushed and dropped from the page cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.write(os.urandom(size))
        f.flush()
        os.fsync(f.fileno())
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return path


def read_part(path: Path, length: int, offset: int = 0) -> None:
    """Bring exactly [offset, offset+length) into the page cache (no readahead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        pos, end = offset, offset + length
        while pos < end:
            chunk = os.pread(fd, min(MiB, end - pos), pos)
            if not chunk:
                break
            pos += len(chunk)
    finally:
        os.close(fd)


def fincore_bytes(path: Path) -> int:
    out = subprocess.run(
        ["fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", str(path)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return int(out.split()[0])


def pages_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def weights(*paths: Path, include: tuple[str, ...] = ("*.safetensors",), per_file: bool = True):
    return WeightsConfig(paths=tuple(str(p) for p in paths), include=include, per_file=per_file)


@needs_fincore
@needs_cachestat
def test_residency_equals_kernel_truth(tmp_path: Path) -> None:
    a = write_uncached(tmp_path / "a.safetensors", 16 * MiB)
    b = write_uncached(tmp_path / "b.safetensors", 16 * MiB)
    c = write_uncached(tmp_path / "c.safetensors", 16 * MiB)
    read_part(a, 4 * MiB)
    read_part(b, 16 * MiB)
    read_part(c, 1_000_000, offset=5 * MiB)  # not page aligned at either end

    s = ResidencySource(weights(tmp_path)).sample()

    per_file = {f.path: f for f in s.per_file}
    assert set(per_file) == {"a.safetensors", "b.safetensors", "c.safetensors"}
    assert [per_file[p.name].resident_bytes for p in (a, b, c)] == [
        fincore_bytes(p) for p in (a, b, c)
    ]
    expected = {a: 4 * MiB, b: 16 * MiB, c: 1_000_000}
    for path, amount in expected.items():
        assert amount <= per_file[path.name].resident_bytes <= pages_up(amount) + PAGE
        assert per_file[path.name].size_bytes == 16 * MiB
    assert s.files == 3 and s.total_bytes == 48 * MiB
    assert s.resident_bytes == sum(f.resident_bytes for f in s.per_file)
    assert s.method == "cachestat" and s.up and s.reason is None


@needs_fincore
def test_mincore_fallback_is_exact_where_truthful(tmp_path: Path) -> None:
    """As root (or owner) mincore is truthful; the fallback must agree with fincore to the byte."""
    a = write_uncached(tmp_path / "a.safetensors", 16 * MiB)
    b = write_uncached(tmp_path / "b.safetensors", 3 * MiB + 123)  # partial last page
    read_part(a, 1_000_000, offset=7 * MiB)
    read_part(b, 3 * MiB + 123)

    s = ResidencySource(weights(tmp_path), methods=("mincore",)).sample()

    assert s.method == "mincore"
    assert {f.path: f.resident_bytes for f in s.per_file} == {
        "a.safetensors": fincore_bytes(a),
        "b.safetensors": 3 * MiB + 123,  # never more than the file holds
    }
    assert 1_000_000 <= fincore_bytes(a) <= pages_up(1_000_000) + PAGE


@needs_fincore
def test_without_cachestat_the_source_falls_back_to_mincore(tmp_path: Path, monkeypatch) -> None:
    """Syscall -1 gets a real ENOSYS from the kernel, as on Linux < 6.5."""
    monkeypatch.setattr(pagecache, "SYS_CACHESTAT", None)
    f = write_uncached(tmp_path / "a.safetensors", 8 * MiB)
    read_part(f, 3 * MiB)

    s = ResidencySource(weights(tmp_path)).sample()

    assert (s.method, s.resident_bytes, s.up) == ("mincore", fincore_bytes(f), True)
    assert s.resident_bytes == 3 * MiB
    with pytest.raises(OSError) as raised:
        fd = os.open(f, os.O_RDONLY)
        try:
            pagecache.cachestat(fd)
        finally:
            os.close(fd)
    assert raised.value.errno == errno.ENOSYS


def test_mincore_windows_cover_the_whole_file(tmp_path: Path, monkeypatch) -> None:
    """Small windows force several mmap/mincore rounds; the pages at each boundary must count."""
    monkeypatch.setattr(pagecache, "MINCORE_WINDOW", 4 * PAGE)
    f = write_uncached(tmp_path / "w.bin", 10 * PAGE + 7)
    read_part(f, 2 * PAGE, offset=3 * PAGE)  # straddles the first window boundary
    read_part(f, 8, offset=10 * PAGE)  # the partial last page

    m = file_residency(str(f), methods=("mincore",))

    assert (m.size_bytes, m.resident_bytes, m.method) == (10 * PAGE + 7, 2 * PAGE + 7, "mincore")


@pytest.mark.parametrize(
    "method", [pytest.param("cachestat", marks=needs_cachestat), pytest.param("mincore")]
)
def test_partial_last_page_counts_only_the_bytes_it_holds(tmp_path: Path, method: str) -> None:
    f = write_uncached(tmp_path / "p.bin", 10 * PAGE + 7)

    def resident() -> int | None:
        m = file_residency(str(f), methods=(method,))
        assert (m.size_bytes, m.method) == (10 * PAGE + 7, method)
        return m.resident_bytes

    assert resident() == 0
    read_part(f, 8, offset=10 * PAGE)
    assert resident() == 7
    read_part(f, 1)
    assert resident() == PAGE + 7
    read_part(f, 10 * PAGE + 7)
    assert resident() == 10 * PAGE + 7


@needs_cachestat
def test_hugging_face_cache_layout_counts_each_blob_once(tmp_path: Path) -> None:
    model = tmp_path / "models--org--model"
    blob1 = write_uncached(model / "blobs" / "1f0e", 2 * MiB)
    blob2 = write_uncached(model / "blobs" / "9a7b", 3 * MiB)
    read_part(blob1, 2 * MiB)
    (model / "refs").mkdir()
    (model / "refs" / "main").write_text("rev2")
    for rev, blobs in (("rev1", (blob1,)), ("rev2", (blob1, blob2))):
        snap = model / "snapshots" / rev
        snap.mkdir(parents=True)
        for i, blob in enumerate(blobs, 1):
            (snap / f"model-0000{i}.safetensors").symlink_to(f"../../blobs/{blob.name}")

    s = ResidencySource(weights(model)).sample()

    assert (s.files, s.total_bytes, s.resident_bytes) == (2, 5 * MiB, 2 * MiB)
    assert [f.path for f in s.per_file] == [
        "snapshots/rev1/model-00001.safetensors",
        "snapshots/rev2/model-00002.safetensors",
    ]
    # A snapshot directory as the root: its symlinks lead outside it and are still followed.
    rev2 = ResidencySource(weights(model / "snapshots" / "rev2")).sample()
    assert (rev2.files, rev2.total_bytes, rev2.resident_bytes) == (2, 5 * MiB, 2 * MiB)


@pytest.mark.timeout(20)
def test_include_globs_and_non_regular_files(tmp_path: Path) -> None:
    write_uncached(tmp_path / "a.safetensors", 1 * MiB)
    write_uncached(tmp_path / "b.bin", 2 * MiB)
    write_uncached(tmp_path / "model.safetensors.index.json", 1000)
    write_uncached(tmp_path / "nested.safetensors" / "deep" / "c.gguf", 3 * MiB)
    os.mkfifo(tmp_path / "fifo.safetensors")  # opening it for reading would block
    (tmp_path / "broken.safetensors").symlink_to(tmp_path / "missing")
    (tmp_path / "null.bin").symlink_to("/dev/null")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock.safetensors"))
        tree = walk_weights(weights(tmp_path, include=("*.safetensors", "*.gguf")))
        s = ResidencySource(weights(tmp_path, include=("*.safetensors", "*.gguf"))).sample()

    assert [f.name for f in tree.files] == ["a.safetensors", "nested.safetensors/deep/c.gguf"]
    assert (s.files, s.total_bytes) == (2, 4 * MiB)


@pytest.mark.timeout(20)
def test_symlink_loops_terminate(tmp_path: Path) -> None:
    write_uncached(tmp_path / "m" / "sub" / "a.safetensors", MiB)
    (tmp_path / "m" / "sub" / "up").symlink_to("..")
    (tmp_path / "m" / "sub" / "self").symlink_to(".")
    (tmp_path / "m" / "x").symlink_to("y")
    (tmp_path / "m" / "y").symlink_to("x")

    s = ResidencySource(weights(tmp_path / "m")).sample()

    assert (s.files, s.total_bytes) == (1, MiB)
    assert [f.path for f in s.per_file] == ["sub/a.safetensors"]


def test_root_may_be_a_file_and_names_stay_unique_across_roots(tmp_path: Path) -> None:
    one = write_uncached(tmp_path / "one" / "model.safetensors", MiB)
    two = write_uncached(tmp_path / "two" / "model.safetensors", 2 * MiB)

    s = ResidencySource(weights(one, tmp_path / "two")).sample()

    assert [(f.path, f.size_bytes) for f in s.per_file] == [
        ("model.safetensors", MiB),
        (str(two), 2 * MiB),
    ]


def test_file_vanishing_between_discovery_and_measurement(tmp_path: Path) -> None:
    for name in ("a", "b", "c"):
        write_uncached(tmp_path / f"{name}.safetensors", MiB)
    tree = walk_weights(weights(tmp_path))
    (tmp_path / "b.safetensors").unlink()

    r = measure(tree.files, per_file=True)

    assert (r.files, r.total_bytes, r.stale) == (2, 2 * MiB, True)
    assert [f.path for f in r.per_file] == ["a.safetensors", "c.safetensors"]
    assert r.resident_bytes is not None


@needs_fincore
def test_file_replaced_by_another_inode(tmp_path: Path) -> None:
    a = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    b = write_uncached(tmp_path / "b.safetensors", 4 * MiB)
    tree = walk_weights(weights(tmp_path))
    new = write_uncached(tmp_path / "new.tmp", 6 * MiB)
    read_part(new, 3 * MiB)
    os.replace(new, a)  # a is now a different, bigger, partly cached file
    b.unlink()
    os.link(a, b)  # b is now the same inode as a: must count once

    r = measure(tree.files, per_file=True)

    assert (r.files, r.total_bytes, r.stale) == (1, 6 * MiB, True)
    assert r.resident_bytes == fincore_bytes(a)
    assert 3 * MiB <= fincore_bytes(a) <= 3 * MiB + PAGE


def test_exact_counts_nothing_of_a_path_that_names_another_inode_now(tmp_path: Path) -> None:
    """A server's environment (exporter/sources/environment.py): a name planted where its file
    was is not its file, so neither its size nor its pages count; the pass says it is stale."""
    a = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    write_uncached(tmp_path / "b.safetensors", 2 * MiB)
    tree = walk_weights(weights(tmp_path))
    planted = write_uncached(tmp_path / "planted.tmp", 6 * MiB)
    a.unlink()
    a.symlink_to(planted)

    r = measure(tree.files, exact=True)

    assert (r.files, r.total_bytes, r.stale) == (1, 2 * MiB, True)


@needs_fincore
def test_file_shrunk_after_discovery(tmp_path: Path) -> None:
    a = write_uncached(tmp_path / "a.safetensors", 8 * MiB)
    tree = walk_weights(weights(tmp_path))
    read_part(a, 8 * MiB)
    os.truncate(a, 5 * MiB + 10)

    r = measure(tree.files, per_file=True)

    assert (r.files, r.total_bytes, r.stale) == (1, 5 * MiB + 10, False)
    assert r.resident_bytes == min(fincore_bytes(a), 5 * MiB + 10)
    assert r.resident_bytes == 5 * MiB + 10


class FakeClocks:
    """Wall clock set by the test; each CPU-clock read advances by `cost`, a pass reads it twice."""

    def __init__(self, cost: float) -> None:
        self.now = 1000.0
        self._cpu = itertools.count(0.0, cost)

    def clock(self) -> float:
        return self.now

    def cpu_clock(self) -> float:
        return next(self._cpu)


def test_budget_defers_the_next_full_pass(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    clocks = FakeClocks(cost=0.1)
    src = ResidencySource(weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock)

    first = src.sample()
    assert first.pass_cpu_seconds == pytest.approx(0.1)
    assert first.measured_at == 1000.0
    assert first.next_pass_due == pytest.approx(1010.0)
    assert first.resident_bytes == 0

    read_part(f, 4 * MiB)
    src.note_device_reads(None)
    clocks.now = 1009.9
    assert src.sample() is first  # within budget: the last measurement, not a new pass

    clocks.now = 1010.0
    second = src.sample()
    assert (second.measured_at, second.resident_bytes) == (1010.0, 4 * MiB)
    assert second.next_pass_due == pytest.approx(1020.0)

    clocks.now = 900.0  # the wall clock was stepped back: measure now, not in 110 s
    assert src.sample().measured_at == 900.0


def test_a_serving_target_refreshes_seldom_but_reads_still_bring_a_pass(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    clocks = FakeClocks(cost=0.001)
    serving = [True]
    src = ResidencySource(
        weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock,
        refresh_after=lambda: SERVING_REFRESH_SECONDS if serving[0] else QUIET_REFRESH_SECONDS,
    )  # fmt: skip
    first = src.sample()
    read_part(f, 4 * MiB)  # pages pulled in by a reader we were not told of
    clocks.now = 1000.0 + QUIET_REFRESH_SECONDS
    assert src.sample() is first  # serving: a 30-s-old pass is fresh enough
    clocks.now = 1000.0 + SERVING_REFRESH_SECONDS
    assert src.sample().resident_bytes == 4 * MiB
    evict(str(f))
    serving[0] = False  # the server went away: the quiet refresh applies again at once
    clocks.now += QUIET_REFRESH_SECONDS
    assert src.sample().resident_bytes == 0
    serving[0] = True
    read_part(f, 2 * MiB)
    src.note_device_reads(None)  # reads: measured as soon as the budget allows, serving or not
    clocks.now += 1.0
    assert src.sample().resident_bytes == 2 * MiB


def test_without_device_reads_passes_wait_for_the_quiet_refresh(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    clocks = FakeClocks(cost=0.001)
    src = ResidencySource(weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock)
    first = src.sample()
    assert first.next_pass_due == pytest.approx(1000.1)
    read_part(f, 4 * MiB)  # e.g. pages pulled in by an unrelated reader we were not told of
    clocks.now = 1000.0 + QUIET_REFRESH_SECONDS - 0.1
    assert src.sample() is first  # the budget allows a pass, but nothing says it is worth one
    clocks.now = 1000.0 + QUIET_REFRESH_SECONDS
    assert src.sample().resident_bytes == 4 * MiB
    src.note_device_reads(None)
    clocks.now += 1.0
    assert src.sample().measured_at == clocks.now  # reads seen: measure once the budget allows


def test_device_reads_ask_for_a_pass_only_past_the_threshold(tmp_path: Path) -> None:
    """A 16 KB log read on the weights' disk must not buy a pass; a megabyte of reads does."""
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    clocks = FakeClocks(cost=0.001)
    src = ResidencySource(weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock)
    first = src.sample()
    read_part(f, 4 * MiB)
    src.note_device_reads(5_000_000_000)  # the first counter seen is the baseline
    clocks.now += 1.0
    src.note_device_reads(5_000_000_000 + MIN_READS_FOR_PASS - 1)
    assert src.sample() is first
    src.note_device_reads(5_000_000_000 + MIN_READS_FOR_PASS)
    clocks.now += 1.0
    second = src.sample()
    assert (second.measured_at, second.resident_bytes) == (clocks.now, 4 * MiB)
    src.note_device_reads(5_000_000_000 + 2 * MIN_READS_FOR_PASS - 1)  # counted from the last ask
    clocks.now += 1.0
    assert src.sample() is second
    src.note_device_reads(0)  # a counter that went back (device replaced) is a new baseline
    src.note_device_reads(MIN_READS_FOR_PASS - 1)
    clocks.now += 1.0
    assert src.sample() is second


def test_pages_leaving_the_host_cache_bring_a_pass_while_some_weights_are_cached(
    tmp_path: Path,
) -> None:
    """A serving target's residency follows an eviction once the host's page cache lost a
    share of the weights' size; not for a host's smaller churn, and not while nothing of the
    weights is cached (nothing to lose)."""
    shard = tmp_path / "a.safetensors"
    with open(shard, "wb") as f:
        f.truncate(256 * MiB)  # sparse: its holes read as zero pages, cached like data
    threshold = math.ceil(256 * MiB * DEPARTED_SHARE_FOR_PASS)
    assert threshold > MIN_READS_FOR_PASS  # the share decides here, not the floor
    clocks = FakeClocks(cost=0.001)
    src = ResidencySource(
        weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock,
        refresh_after=lambda: SERVING_REFRESH_SECONDS,
    )  # fmt: skip
    evict(str(shard))
    assert src.sample().resident_bytes == 0
    assert not src.note_departures(7 << 30)  # nothing cached: no pass, a new baseline
    read_part(shard, 8 * MiB)
    src.request_full_pass()
    warm = src.sample()
    assert warm.resident_bytes == 8 * MiB
    evict(str(shard))
    clocks.now += 60.0
    assert not src.note_departures((7 << 30) + threshold - 1)
    assert src.sample() is warm  # serving: no pass on a hunch
    assert src.note_departures((7 << 30) + threshold)
    clocks.now += 1.0
    evicted = src.sample()
    assert (evicted.measured_at, evicted.resident_bytes) == (clocks.now, 0)
    assert not src.note_departures(8 << 30)  # all gone already: nothing more to lose


def test_a_departure_pass_keeps_to_the_cpu_budget(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    read_part(f, 4 * MiB)
    clocks = FakeClocks(cost=0.1)  # 0.1 s a pass at a 1 % budget: the next is due 10 s later
    src = ResidencySource(
        weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock,
        refresh_after=lambda: SERVING_REFRESH_SECONDS,
    )  # fmt: skip
    first = src.sample()
    src.note_departures(0)
    evict(str(f))
    assert src.note_departures(MIN_READS_FOR_PASS)
    clocks.now += 5.0
    assert src.sample() is first
    clocks.now += 5.0
    assert src.sample().resident_bytes == 0  # asked for, and now within budget


def test_request_full_pass_overrides_the_budget(tmp_path: Path) -> None:
    f = write_uncached(tmp_path / "a.safetensors", 4 * MiB)
    clocks = FakeClocks(cost=0.1)
    src = ResidencySource(weights(tmp_path), 0.01, clocks.clock, clocks.cpu_clock)
    assert src.sample().resident_bytes == 0

    read_part(f, 2 * MiB)
    clocks.now = 1001.0
    assert src.sample().resident_bytes == 0
    src.request_full_pass()
    forced = src.sample()
    assert (forced.measured_at, forced.resident_bytes) == (1001.0, 2 * MiB)
    assert forced.next_pass_due == pytest.approx(1011.0)
    clocks.now = 1002.0
    assert src.sample() is forced  # the request is used up


def test_source_rediscovers_files_that_appear_and_vanish(tmp_path: Path) -> None:
    write_uncached(tmp_path / "a.safetensors", MiB)
    write_uncached(tmp_path / "sub" / "b.safetensors", MiB)
    src = ResidencySource(weights(tmp_path))
    assert src.sample().files == 2

    write_uncached(tmp_path / "sub" / "c.safetensors", 2 * MiB)
    src.request_full_pass()
    assert (src.sample().files, src.sample().total_bytes) == (3, 4 * MiB)

    (tmp_path / "a.safetensors").unlink()
    src.request_full_pass()
    s = src.sample()
    assert (s.files, s.total_bytes) == (2, 3 * MiB)
    assert [f.path for f in s.per_file] == ["sub/b.safetensors", "sub/c.safetensors"]


def test_unmeasurable_residency_is_absent_and_logged_once(tmp_path: Path, caplog) -> None:
    write_uncached(tmp_path / "a.safetensors", MiB)
    src = ResidencySource(weights(tmp_path), methods=())
    with caplog.at_level(logging.WARNING, logger="exporter.sources.residency"):
        for _ in range(3):
            src.request_full_pass()
            s = src.sample()
    assert (s.files, s.total_bytes, s.resident_bytes, s.up, s.per_file) == (1, MiB, None, False, ())
    assert s.method is None and s.reason
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "run as the files' owner or root" in warnings[0].getMessage()


# --- unprivileged: a real `nobody` process against root-owned files -------------------------

NOBODY_PROBE = """
import json, os, sys
from exporter.storage.cachectl import evict
from exporter.config.schema import WeightsConfig
from exporter.storage import pagecache
from exporter.sources.residency import ResidencySource
directory, path = sys.argv[1], sys.argv[2]
out = {}
for methods in (("cachestat", "mincore"), ("mincore",)):
    src = ResidencySource(
        WeightsConfig(paths=(directory,), include=("*.safetensors",)), methods=methods
    )
    s = src.sample()
    out["+".join(methods)] = {
        "files": s.files, "total": s.total_bytes, "resident": s.resident_bytes, "up": s.up,
        "method": s.method, "reason": s.reason,
    }
fd = os.open(path, os.O_RDONLY)
try:
    pagecache.cachestat(fd)
    out["cachestat_errno"] = 0
except OSError as exc:
    out["cachestat_errno"] = exc.errno
out["raw_mincore"] = pagecache.mincore_resident_bytes(fd, os.fstat(fd).st_size)
print(json.dumps(out))
"""


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory `nobody` can traverse (pytest's tmp_path is 0700 root)."""
    path = Path(tempfile.mkdtemp(prefix="pagecache-test-", dir="/tmp"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def run_as_nobody(directory: Path, path: Path) -> dict:
    python = nobody_python()
    assert python is not None  # needs_root requires it
    done = as_nobody(python, "-c", NOBODY_PROBE, str(directory), str(path), cwd=directory)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.system
@needs_root
@needs_fincore
@needs_cachestat
def test_unprivileged_caller_gets_no_number_rather_than_a_false_one(shared_dir: Path) -> None:
    f = write_uncached(shared_dir / "model.safetensors", 16 * MiB)
    f.chmod(0o644)
    read_part(f, 4 * MiB)  # 25 % cached
    assert fincore_bytes(f) == 4 * MiB  # the truth, seen by root

    out = run_as_nobody(shared_dir, f)

    for variant in ("cachestat+mincore", "mincore"):
        s = out[variant]
        assert (s["files"], s["total"]) == (1, 16 * MiB)
        assert (s["resident"], s["up"], s["method"]) == (None, False, None)
        assert "run as the files' owner or root" in s["reason"]
    assert "cachestat: Operation not permitted" in out["cachestat+mincore"]["reason"]
    assert out["cachestat_errno"] == 1  # EPERM: what makes the source fall back
    # The control: mincore as nobody claims every page resident (what vmtouch would print).
    assert out["raw_mincore"] == 16 * MiB
    # Nothing changed for root in the meantime.
    assert ResidencySource(weights(shared_dir)).sample().resident_bytes == 4 * MiB


@pytest.mark.system
@needs_root
@needs_fincore
@needs_cachestat
def test_unprivileged_owner_is_measured_truthfully(shared_dir: Path) -> None:
    f = write_uncached(shared_dir / "model.safetensors", 16 * MiB)
    os.chown(f, NOBODY, NOBODY)
    f.chmod(0o444)  # not writable, but owned: both methods are truthful
    # DAMON may page a cold page out between our count and fincore's: read and count again
    # until both saw the same cache (an exporter that miscounts never gets there).
    for _ in range(3):
        read_part(f, 6 * MiB)
        out = run_as_nobody(shared_dir, f)
        truth = fincore_bytes(f)
        if out["cachestat+mincore"]["resident"] == truth:
            break

    assert out["cachestat_errno"] == 0
    assert out["cachestat+mincore"]["resident"] == truth == 6 * MiB
    assert out["cachestat+mincore"]["method"] == "cachestat"
    assert out["mincore"]["resident"] == 6 * MiB
    assert out["mincore"]["method"] == "mincore"
    assert out["raw_mincore"] == 6 * MiB
