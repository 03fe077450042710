"""The server's environment (exporter/sources/environment.py) learned from a real child process's
/proc/PID/maps and fds, and its residency measured on real files in the page cache: evicted
with fadvise, read back in, and checked against util-linux fincore (the kernel's own count)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
from helpers.filesystems import fincore_bytes

from exporter.config.schema import DEFAULT_RESIDENCY_CPU_BUDGET, WeightsConfig
from exporter.history.forecast import ENVIRONMENT_BYTES
from exporter.runtime.admission import on_behalf_of
from exporter.sources.environment import (
    LEARN_SHARE,
    LEARN_SLICE,
    MIN_DEPARTED_BYTES,
    NOT_LEARNED,
    EnvironmentSource,
)
from exporter.sources.process import NOT_FOUND, ProcessSample, process_start_time
from exporter.storage.cachectl import evict, prewarm
from exporter.trust.asprocess import Actor

PAGE = os.sysconf("SC_PAGE_SIZE")
pytestmark = [pytest.mark.system, pytest.mark.requires("fincore", "cachestat")]

# The child maps each MAP path, holds each READ path open read-only, each WRITE path open for
# writing, maps a file it then deletes, and waits for stdin to close.
CHILD = r"""
import mmap, os, sys
maps, reads, writes, gone = (a.split(",") if a else [] for a in sys.argv[1:5])
held = []
for path in maps + gone:
    fd = os.open(path, os.O_RDONLY)
    held.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    os.close(fd)
for path in reads:
    held.append(os.open(path, os.O_RDONLY))
for path in writes:
    held.append(os.open(path, os.O_RDWR))
for path in gone:
    os.unlink(path)
print("ready", flush=True)
sys.stdin.read()
"""


class Child:
    """A real process holding files as a server would."""

    def __init__(
        self,
        maps: Sequence[Path] = (),
        reads: Sequence[Path] = (),
        writes: Sequence[Path] = (),
        gone: Sequence[Path] = (),
    ) -> None:
        args = [",".join(map(str, group)) for group in (maps, reads, writes, gone)]
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        started = process_start_time(self.proc.pid)
        assert started is not None
        self.tree = ProcessSample(True, (self.proc.pid,), self.proc.pid, started, None, None, None)

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(10)


def write(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Environment files of sizes no page divides, a weights folder, and what must not count."""
    weights = tmp_path / "model"
    weights.mkdir()
    env = tmp_path / "venv"
    env.mkdir()
    made = {
        "lib_a": write(env / "liba.so", (5 << 20) + 123),
        "lib_b": write(env / "libb.so.1", (1 << 20) + 1),
        "data": write(env / "vocab.txt", 300_001),
        "shard": write(weights / "model-00001-of-00002.safetensors", 2 << 20),
        "config": write(weights / "config.json", 10_000),
        "elsewhere_shard": write(env / "adapter.safetensors", 1 << 20),
        "log": write(tmp_path / "server.log", 0),
        "state": write(env / "state.db", 70_000),
        "gone": write(env / "deleted.so", 1 << 20),
    }
    os.link(made["lib_a"], env / "liba-link.so")  # the same inode under a second name
    made["lib_a_link"] = env / "liba-link.so"
    return made


@pytest.fixture
def shm_file() -> Iterator[Path]:
    with tempfile.NamedTemporaryFile(dir="/dev/shm", prefix="mle-env-") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        yield Path(f.name)


ACTOR = Actor()


def source(tree: list[ProcessSample], weights: Path) -> EnvironmentSource:
    """A source that measures at every sample (no refresh wait, all the CPU it wants), acting
    with its process's rights as the exporter does."""
    return EnvironmentSource(
        WeightsConfig(paths=(str(weights),)),
        lambda: tree[0],
        lambda pid: on_behalf_of(ACTOR, "/proc", pid),
        cpu_budget=1.0,
        refresh_after=lambda: 0.0,
        learn_share=1.0,
    )


def learned_total(maps: list[Path], reads: list[Path], weights: Path, **extra: list[Path]) -> int:
    """The environment's bytes as learned from a child holding these files."""
    child = Child(maps, reads, **extra)
    try:
        sample = source([child.tree], weights).sample()
    finally:
        child.stop()
    assert sample.resident_bytes is not None, sample
    return sample.total_bytes


def test_the_files_a_process_maps_or_reads_are_its_environment_and_nothing_else(
    files: dict[str, Path], shm_file: Path
) -> None:
    weights = files["shard"].parent
    # A bare interpreter maps its own libraries: that much is the baseline's environment too.
    bare = learned_total([], [], weights)
    counted = learned_total(
        [files["lib_a"], files["lib_b"], files["lib_a_link"], files["shard"],
         files["elsewhere_shard"], shm_file],
        [files["data"], files["config"]],
        weights,
        writes=[files["log"], files["state"]],
        gone=[files["gone"]],
    )  # fmt: skip
    # liba once (two names, one inode), libb, the file held open for reading; not the weights
    # (under the weights path, or named like weights anywhere), not what it writes, not memory
    # (/dev/shm), not a deleted file.
    size = [files[k].stat().st_size for k in ("lib_a", "lib_b", "data")]
    assert counted - bare == sum(size)


@pytest.mark.parametrize("sizes", [(1 << 20, 4097), ((8 << 20) + 5, 123_457, 65_536)])
def test_residency_follows_the_page_cache_as_fincore_sees_it(
    tmp_path: Path, sizes: tuple[int, ...]
) -> None:
    env = [write(tmp_path / f"lib{i}.so", size) for i, size in enumerate(sizes)]
    weights = tmp_path / "model"
    weights.mkdir()
    child = Child(env)
    tree = [child.tree]
    try:
        measured = source(tree, weights)
        for path in env:
            prewarm(str(path))
        warm = measured.sample()
        # fincore counts whole pages; the measurement, a cached last page's file bytes.
        assert [fincore_bytes(p) for p in env] == [-(-n // PAGE) * PAGE for n in sizes]
        for path in env:
            evict(str(path))
        cold = measured.sample()
        assert [fincore_bytes(p) for p in env] == [0] * len(sizes)
    finally:
        child.stop()
    assert warm.resident_bytes is not None and cold.resident_bytes is not None
    # The interpreter's own libraries, mapped and in use, stay as they were meanwhile.
    assert warm.resident_bytes - cold.resident_bytes == sum(sizes)
    assert warm.total_bytes == cold.total_bytes >= sum(sizes)
    # What a run keeps cached is what a start needs: the warmest pass; out of it now, the files.
    assert warm.warm_bytes == cold.warm_bytes == warm.resident_bytes
    assert (warm.uncached_bytes, cold.uncached_bytes) == (0, sum(sizes))


def test_a_replaced_file_forgets_what_the_old_ones_kept_cached(tmp_path: Path) -> None:
    """A package upgraded under a stopped server: its old bytes say nothing of what the next
    start needs, so the warm figure starts again from the next pass."""
    libs = [write(tmp_path / f"lib{i}.so", 2 << 20) for i in range(2)]
    weights = tmp_path / "model"
    weights.mkdir()
    tree: list[ProcessSample] = [NOT_FOUND]
    measured = source(tree, weights)
    child = Child(libs)
    tree[0] = child.tree
    warm = measured.sample()
    child.stop()
    tree[0] = NOT_FOUND
    fresh = write(tmp_path / "new.so", 1 << 20)
    fresh.replace(libs[0])  # an upgrade renames the new file over the old
    evict(str(libs[1]))
    measured.sample()  # finds the replaced file and drops it
    after = measured.sample()
    assert warm.warm_bytes is not None and after.warm_bytes is not None
    assert after.files == warm.files - 1
    assert after.warm_bytes == after.resident_bytes == warm.warm_bytes - (4 << 20)


def test_what_a_start_found_is_the_last_pass_before_it_and_the_set_outlives_the_process(
    tmp_path: Path,
) -> None:
    lib = write(tmp_path / "libx.so", 3 << 20)
    weights = tmp_path / "model"
    weights.mkdir()
    tree: list[ProcessSample] = [NOT_FOUND]
    measured = source(tree, weights)
    first = measured.sample()
    assert first.resident_bytes is None and first.reason == NOT_LEARNED
    assert first.health().up  # nothing learned yet is no failure
    child = Child([lib])
    tree[0] = child.tree
    serving = measured.sample()
    child.stop()
    tree[0] = NOT_FOUND
    evict(str(lib))
    down = measured.sample()  # between runs: the files are measured with no process holding them
    assert down.total_bytes == serving.total_bytes and down.files == serving.files
    assert down.resident_bytes is not None and serving.resident_bytes is not None
    assert serving.resident_bytes - down.resident_bytes == 3 << 20  # written, then evicted
    time.sleep(0.05)
    again = Child([lib])
    tree[0] = again.tree
    try:
        during = measured.sample()
    finally:
        again.stop()
    start = again.tree.start_time
    assert start is not None and down.measured_at is not None
    assert down.measured_at <= start < (during.measured_at or 0)
    assert measured.before(start) == down  # not the pass made after it began
    assert measured.before(0.0) is None


def test_a_serving_environment_is_measured_again_once_the_forecast_could_tell(
    tmp_path: Path,
) -> None:
    """A pass while serving comes from the host's page cache losing what could turn a cached
    environment uncached in a forecast (at least its 64 MiB tolerance), not from every megabyte a
    busy host's cache churns: here the environment's 3 MiB leave, the host has lost 8 MiB, and the
    measurement waits until 64 MiB have left."""
    lib = write(tmp_path / "libx.so", 3 << 20)
    weights = tmp_path / "model"
    weights.mkdir()
    child = Child([lib])
    try:
        measured = EnvironmentSource(
            WeightsConfig(paths=(str(weights),)),
            lambda: child.tree,
            lambda pid: on_behalf_of(ACTOR, "/proc", pid),
            cpu_budget=1.0,
            refresh_after=lambda: 3600.0,  # serving: no pass from age
            learn_share=1.0,
        )
        prewarm(str(lib))
        warm = measured.sample()
        assert not measured.note_departures(0)  # the baseline
        evict(str(lib))
        assert not measured.note_departures(8 << 20)
        assert measured.sample() == warm
        assert not measured.note_departures(MIN_DEPARTED_BYTES - 1)
        assert measured.note_departures(MIN_DEPARTED_BYTES)
        cold = measured.sample()
    finally:
        child.stop()
    assert warm.resident_bytes is not None and cold.resident_bytes is not None
    assert warm.resident_bytes - cold.resident_bytes == 3 << 20
    # The tolerance is the forecast's own: an environment this much out of the cache is cached.
    assert MIN_DEPARTED_BYTES == ENVIRONMENT_BYTES


HOLDER = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
directory, per_file = sys.argv[1], int(sys.argv[2])
names = sorted(os.listdir(directory))
held = [os.open(os.path.join(directory, n), os.O_RDONLY) for n in names for _ in range(per_file)]
print("ready", flush=True)
sys.stdin.read()
"""


def test_learning_a_tree_of_many_descriptors_takes_its_cpu_share_a_slice_at_a_time(
    tmp_path: Path,
) -> None:
    """Issue 37 row 5: 18,000 descriptors of 1,800 files. Each sample's learning takes at most
    LEARN_SLICE of CPU (the rest waits), on average LEARN_SHARE of a core, and in the end every
    file is learned. The CPU is the whole process's (the opening runs on the rights' thread)."""
    libs = tmp_path / "libs"
    libs.mkdir()
    for i in range(1800):
        (libs / f"lib{i:04d}.so").write_bytes(b"\1" * 4096)
    weights = tmp_path / "model"
    weights.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(libs), "10"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ready\n"
        started = process_start_time(holder.pid)
        tree = ProcessSample(True, (holder.pid,), holder.pid, started, None, None, None)
        clock = [1000.0]
        measured = EnvironmentSource(
            WeightsConfig(paths=(str(weights),)),
            lambda: tree,
            lambda pid: on_behalf_of(ACTOR, "/proc", pid),
            clock=lambda: clock[0],
            refresh_after=lambda: 0.0,
        )
        costs: list[float] = []
        files = 0
        while files < 1800 and clock[0] < 1000.0 + 600:
            clock[0] += 1.0
            before = time.process_time()
            sample = measured.sample()
            costs.append(time.process_time() - before)
            files = sample.files
        seconds = clock[0] - 1000.0
    finally:
        holder.kill()
        holder.wait()
    assert sample.files >= 1800, (sample, seconds)
    # A slice, the one listing of 18,000 names and a pass: well under a tenth of a second.
    assert max(costs) < 0.1 + LEARN_SLICE, max(costs)
    # Learning's share and the passes' budget (1 %), with room for the pass that ends it.
    assert sum(costs) / seconds < 2 * (LEARN_SHARE + DEFAULT_RESIDENCY_CPU_BUDGET), (
        sum(costs),
        seconds,
    )
