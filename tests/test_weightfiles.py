"""The weight-file view against real processes doing real reads, maps and preads.

A child process (`LOADER`) does exactly what it is told over a pipe (open, read, map, touch,
pread, unmap, close a shard) and answers when done, so each look of the source lands at a known
point of a real loader's life; /proc, the page tables and the file offsets are the kernel's own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.require import require
from helpers.users import as_nobody, nobody_python

from exporter.config.schema import WeightsConfig
from exporter.storage.cachectl import evict
from exporter.sources.process import ProcessSample
from exporter.sources.weightfiles import WeightFilesSample, WeightFilesSource

MIB = 1 << 20
SHARD = 16 * MIB

LOADER = r"""
import mmap, os, signal, sys
files, maps, later = {}, {}, []


def do(op, args):
    if op == "open":
        files[args[0]] = os.open(args[0], os.O_RDONLY | int(args[1]) if len(args) > 1 else 0)
    elif op == "read":
        os.read(files[args[0]], int(args[1]))
    elif op == "pread":
        os.pread(files[args[0]], int(args[2]), int(args[1]))
    elif op == "map":
        maps[args[0]] = mmap.mmap(files[args[0]], 0, prot=mmap.PROT_READ)
    elif op == "random":  # no read-around: the page cache holds what was touched
        maps[args[0]].madvise(mmap.MADV_RANDOM)
    elif op == "touch":
        m, start, end = maps[args[0]], int(args[1]), int(args[2])
        sum(m[i] for i in range(start, end, mmap.PAGESIZE))
    elif op == "unmap":
        maps.pop(args[0]).close()
    elif op == "close":
        os.close(files.pop(args[0]))
    elif op == "ping":
        pass
    elif op == "import":
        with open(args[0], "rb") as f:
            f.read()
    elif op == "later":  # on SIGUSR1, without a read() of a command: a loader busy on its own
        later.append(" ".join(args))


def run_later(signum, frame):
    for command in later.pop(0).split(";"):
        do(*(lambda op, *args: (op, args))(*command.split()))
    print("ok", flush=True)


signal.signal(signal.SIGUSR1, run_later)
for line in sys.stdin:
    do(*(lambda op, *args: (op, args))(*line.split()))
    print("ok", flush=True)
"""


class Loader:
    """A real process that opens, reads and maps files when told to."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", LOADER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.do("ping")  # started: the interpreter's own reads are behind it, as a server's are

    def do(self, *commands: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        for command in commands:
            self.proc.stdin.write(command + "\n")
            self.proc.stdin.flush()
            assert self.proc.stdout.readline() == "ok\n", command

    def later(self, *commands: str) -> None:
        """Told now, run at `signal()`: then no read() moves the process's rchar, as a loader
        between two shards reads nothing (safetensors maps the next one)."""
        self.do(f"later {';'.join(commands)}")

    def signal(self) -> None:
        assert self.proc.stdout is not None
        os.kill(self.pid, signal.SIGUSR1)
        assert self.proc.stdout.readline() == "ok\n"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def shards(tmp_path: Path) -> list[Path]:
    paths = []
    for index in range(1, 4):
        path = tmp_path / "model" / f"model-{index:05d}-of-00003.safetensors"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(os.urandom(SHARD))
        paths.append(path)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "torch.so").write_bytes(os.urandom(4 * MIB))  # what imports read
    return paths


@pytest.fixture
def loaders() -> Iterator[list[Loader]]:
    started: list[Loader] = []
    yield started
    for loader in started:
        loader.stop()


def view(shards: list[Path], *loaders: Loader) -> WeightFilesSource:
    pids = tuple(loader.pid for loader in loaders)
    tree = ProcessSample(True, pids, pids[0], 1000.0, 0, 0, None)
    weights = WeightsConfig(paths=(str(shards[0].parent),), include=("*.safetensors",))
    return WeightFilesSource(weights, lambda: tree)


def consumed(sample: WeightFilesSample) -> dict[str, int]:
    return {f.name: f.consumed_bytes for f in sample.files}


def test_imports_hold_no_weight_file_and_the_first_open_begins_the_weights(
    shards: list[Path], loaders: list[Loader], tmp_path: Path
) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    loader.do(f"import {tmp_path / 'torch.so'}", f"import {tmp_path / 'model' / 'config.json'}")
    before = source.sample()
    assert before.visible and before.first_open_at is None and before.consumed_bytes == 0
    loader.do(f"open {shards[0]}")
    opened = source.sample()
    assert opened.first_open_at == opened.measured_at
    assert opened.first_open_seen  # a look before it saw nothing held
    assert opened.seen_bytes == SHARD and opened.held_files == 1
    assert opened.total_bytes == 3 * SHARD and opened.files_total == 3


def test_a_read_loader_is_followed_by_its_file_offset_and_a_closed_file_is_consumed(
    shards: list[Path], loaders: list[Loader]
) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.do(f"open {shards[0]}", f"read {shards[0]} {5 * MIB}")
    first = source.sample()
    assert consumed(first) == {shards[0].name: 5 * MIB}
    assert first.files[0].how == "read"
    loader.do(f"read {shards[0]} {3 * MIB}")
    assert source.sample().consumed_bytes == 8 * MIB
    # Closed before its end (the loader took what it needed), and the next shard opened on the
    # same descriptor number between two looks: the count of descriptors never changed.
    loader.do(f"close {shards[0]}", f"open {shards[1]}", f"read {shards[1]} {MIB}")
    swapped = source.sample()
    assert consumed(swapped) == {shards[0].name: SHARD, shards[1].name: MIB}
    assert [f.held for f in swapped.files] == [False, True]
    assert swapped.files[0].how == "closed"
    loader.do(f"close {shards[1]}")
    done = source.sample()
    assert done.idle_since == done.measured_at and done.held_files == 0
    assert done.consumed_bytes == 2 * SHARD


def test_a_weight_file_on_a_reused_descriptor_is_found_by_its_reads(
    shards: list[Path], loaders: list[Loader], tmp_path: Path
) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    config = tmp_path / "model" / "config.json"
    loader.do(f"open {config}")
    source.sample()  # config.json held at this look: an old descriptor from now on
    for _ in range(5):
        source.sample()
    # Closed, and the first shard opened on its number: the count never changed. The server
    # reads the shard and, in the same second, 60 MiB of something else.
    (tmp_path / "lib.so").write_bytes(os.urandom(60 * MIB))
    loader.do(f"close {config}", f"open {shards[0]}", f"read {shards[0]} {SHARD}")
    loader.do(f"import {tmp_path / 'lib.so'}")
    source.sample()
    found = source.sample()
    assert consumed(found) == {shards[0].name: SHARD}


def test_a_descriptor_number_reused_for_the_next_mapped_shard_names_that_shard(
    shards: list[Path], loaders: list[Loader]
) -> None:
    """safetensors keeps a shard's descriptor open while its tensors are copied out of the
    mapping, then closes it and opens the next shard on the same number, mapped and touched
    without a read(): the count stays, the process reads nothing, yet the number names another
    file (seen on vLLM's workers: the shard before was shown held until the next one closed)."""
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.later(
        f"unmap {shards[0]}",
        f"close {shards[0]}",
        f"open {shards[1]}",
        f"map {shards[1]}",
        f"touch {shards[1]} 0 {2 * MIB}",
    )
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"touch {shards[0]} 0 {SHARD}")
    assert [f.held for f in source.sample().files] == [True]
    loader.signal()
    swapped = source.sample()
    assert [(f.name, f.held, f.holders) for f in swapped.files] == [
        (shards[0].name, False, 0),
        (shards[1].name, True, 1),
    ]
    assert consumed(swapped)[shards[0].name] == SHARD  # let go: done with it


def test_an_mmap_loader_is_followed_by_the_pages_it_maps(
    shards: list[Path], loaders: list[Loader]
) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"close {shards[0]}")
    mapped = source.sample()
    # Mapped, nothing touched: nothing consumed (the commands it read on stdin are no part of
    # a mapped shard).
    assert mapped.held_files == 1 and mapped.consumed_bytes < 4096
    loader.do(f"touch {shards[0]} 0 {6 * MIB}")
    touched = source.sample()
    # Fault-around may map a few pages beyond the touched ones; never fewer.
    assert 6 * MIB <= touched.consumed_bytes <= 6 * MIB + MIB
    assert touched.files[0].how == "mmap"
    # One shard unmapped and another of the same size mapped between two looks keeps the
    # process's size: the look must still tell them apart.
    loader.do(
        f"unmap {shards[0]}",
        f"open {shards[1]}",
        f"map {shards[1]}",
        f"close {shards[1]}",
        f"touch {shards[1]} 0 {2 * MIB}",
    )
    swapped = source.sample()
    assert consumed(swapped)[shards[0].name] == SHARD
    assert 2 * MIB <= consumed(swapped)[shards[1].name] <= 3 * MIB
    assert [f.held for f in swapped.files] == [False, True]


def test_a_mapped_file_is_followed_by_its_pages_not_by_the_processs_reads(
    shards: list[Path], loaders: list[Loader], tmp_path: Path
) -> None:
    """safe_open maps a shard while its descriptor is still open; whatever the process reads
    with read() meanwhile (its imports, a config) is no read of that shard: a mapped file's
    progress is its pages alone."""
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"touch {shards[0]} 0 {2 * MIB}")
    first = source.sample()
    loader.do(f"import {tmp_path / 'torch.so'}", f"touch {shards[0]} 0 {3 * MIB}")
    second = source.sample()
    assert 2 * MIB <= first.consumed_bytes <= 3 * MIB
    # The 4 MiB read() of torch.so left the shard's offset at 0: not a pread of it.
    assert 3 * MIB <= second.consumed_bytes <= 4 * MIB
    assert second.files[0].how == "mmap" and second.files[0].held
    loader.do(f"close {shards[0]}", f"unmap {shards[0]}")
    assert source.sample().consumed_bytes == SHARD  # let go: done with it


def test_a_restart_accounts_afresh_for_a_model_loaded_again_by_the_same_process(
    shards: list[Path], loaders: list[Loader]
) -> None:
    """A model unloaded and loaded again inside a running server (Triton's explicit mode):
    what the files were to the load before, consumed and let go, is no progress of this one."""
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"close {shards[0]}", f"unmap {shards[0]}")
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"close {shards[0]}")
    held = source.sample()
    loader.do(f"unmap {shards[0]}")
    before = source.sample()
    assert before.consumed_bytes == SHARD and before.first_open_at is not None  # let go: whole
    source.restart()
    fresh = source.sample()
    assert fresh.root_pid == loader.pid and held.first_open_at is not None
    assert (fresh.consumed_bytes, fresh.files, fresh.first_open_at) == (0, (), None)
    loader.do(f"open {shards[0]}", f"map {shards[0]}", f"close {shards[0]}")
    loader.do(f"touch {shards[0]} 0 {4 * MIB}")
    again = source.sample()
    assert 4 * MIB <= again.consumed_bytes <= 5 * MIB and again.first_open_seen


def test_a_pread_loader_is_followed_by_its_read_bytes_beyond_its_offset(
    shards: list[Path], loaders: list[Loader]
) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    loader.do(f"open {shards[0]}")
    source.sample()
    loader.do(f"pread {shards[0]} 0 {4 * MIB}", f"pread {shards[0]} {4 * MIB} {4 * MIB}")
    sample = source.sample()
    assert sample.files[0].how == "pread"
    assert 8 * MIB <= sample.consumed_bytes <= 8 * MIB + 64 * 1024  # rchar counts a little more


def test_ranks_reading_slices_of_one_shard_count_it_once(
    shards: list[Path], loaders: list[Loader]
) -> None:
    ranks = [Loader() for _ in range(4)]
    loaders.extend(ranks)
    source = view(shards, *ranks)
    source.sample()
    quarter = SHARD // 4
    for rank, loader in enumerate(ranks):
        # mmap: each rank touches its own quarter; read(): every rank reads to the same offset.
        loader.do(f"open {shards[0]}", f"map {shards[0]}")
        loader.do(f"touch {shards[0]} {rank * quarter} {rank * quarter + quarter // 2}")
        loader.do(f"open {shards[1]}", f"read {shards[1]} {quarter}")
    sample = source.sample()
    by_map, by_read = consumed(sample)[shards[0].name], consumed(sample)[shards[1].name]
    assert SHARD // 2 <= by_map <= SHARD // 2 + 4 * MIB // 4  # the four halves of quarters
    assert by_read == quarter  # not four quarters: the same bytes, four times
    assert {f.name: f.holders for f in sample.files} == {shards[0].name: 4, shards[1].name: 4}


def test_pages_two_ranks_both_map_count_once_where_the_page_cache_says_so(
    shards: list[Path], loaders: list[Loader]
) -> None:
    """vLLM's ranks each map every shard: the header both parse, the pages around each one's
    slice edge (fault-around), a row-parallel tensor's rows are mapped by both. Every mapped
    page is in the page cache, so a cold shard's cached bytes bound what the ranks consumed."""
    ranks = [Loader(), Loader()]
    loaders.extend(ranks)
    source = view(shards, *ranks)
    source.sample()
    with shards[0].open("rb+") as written:
        os.fsync(written.fileno())  # dirty pages stay cached: written back, they can go
    evict(str(shards[0]))
    for loader in ranks:
        loader.do(f"open {shards[0]}", f"map {shards[0]}", f"random {shards[0]}")
        loader.do(f"touch {shards[0]} 0 {4 * MIB}")
    both = source.sample()
    # The same 4 MiB in each: once, not twice (fault-around maps a few cached pages more).
    assert 4 * MIB <= consumed(both)[shards[0].name] <= 5 * MIB
    assert both.files[0].holders == 2 and both.files[0].how == "mmap"


def test_a_rank_that_exits_lets_go_of_its_files(shards: list[Path], loaders: list[Loader]) -> None:
    ranks = [Loader(), Loader()]
    loaders.extend(ranks)
    source = view(shards, *ranks)
    source.sample()
    for loader in ranks:
        loader.do(f"open {shards[0]}", f"read {shards[0]} {MIB}")
    assert source.sample().files[0].holders == 2
    ranks[1].stop()
    assert source.sample().files[0].holders == 1


def test_o_direct_descriptors_are_flagged(shards: list[Path], loaders: list[Loader]) -> None:
    loader = Loader()
    loaders.append(loader)
    source = view(shards, loader)
    source.sample()
    try:
        loader.do(f"open {shards[0]} {os.O_DIRECT}")
        refused = False
    except AssertionError:
        refused = True
    require(not refused, "the filesystem under pytest's tmp_path refuses O_DIRECT")
    assert source.sample().files[0].direct


@pytest.mark.requires("root", "setpriv")
def test_another_users_tree_is_not_visible_and_says_why(
    shards: list[Path], loaders: list[Loader]
) -> None:
    loader = Loader()  # root's
    loaders.append(loader)
    loader.do(f"open {shards[0]}")
    code = (
        "from exporter.config.schema import WeightsConfig\n"
        "from exporter.sources.process import ProcessSample\n"
        "from exporter.sources.weightfiles import WeightFilesSource\n"
        f"tree = ProcessSample(True, ({loader.pid},), {loader.pid}, 1.0, 0, 0, None)\n"
        f"w = WeightsConfig(paths=({str(shards[0].parent)!r},), include=('*.safetensors',))\n"
        "s = WeightFilesSource(w, lambda: tree).sample()\n"
        "print(s.visible, s.first_open_at, s.reason, sep='|')\n"
    )
    python = nobody_python()
    require(python is not None, "no Python that nobody can run the exporter with")
    assert python is not None
    out = as_nobody(python, "-c", code)
    assert out.returncode == 0, out.stderr
    visible, first, reason = out.stdout.strip().split("|")
    assert (visible, first) == ("False", "None")
    assert "cannot see the server's weight files" in reason and "Permission denied" in reason


HOLDER = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_NOFILE, (resource.getrlimit(resource.RLIMIT_NOFILE)[1],) * 2)
others, count = sys.argv[1], int(sys.argv[2])
held = [os.open(others, os.O_RDONLY) for _ in range(count)]
churn = []
print("ok", flush=True)
for line in sys.stdin:
    op, *args = line.split()
    if op == "open":
        churn.append(os.open(args[0] if args else others, os.O_RDONLY))
    elif op == "close":
        os.close(churn.pop())
    elif op == "dup2":  # onto a number of its choosing, not the lowest free one
        os.dup2(os.open(args[0], os.O_RDONLY), int(args[1]))
    print("ok", flush=True)
"""


def test_descriptor_churn_costs_work_for_what_changed_not_what_is_held(
    shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 27 row 7: a process holding thousands of descriptors that opens or closes one
    between looks. Work is counted, not timed: descriptors identified (a stat each) and
    listings of /proc/PID/fd per look, which were all of them and one at every look."""
    held = 5000
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path / "torch.so"), str(held)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "ok\n"
        loader = Loader.__new__(Loader)
        loader.proc = holder
        source = view(shards, loader)
        identified = listings = 0
        plain_identify, plain_listdir = source._identify, os.listdir

        def identify(fd_dir: str, number: int) -> Any:
            nonlocal identified
            identified += 1
            return plain_identify(fd_dir, number)

        def listdir(path: Any) -> list[str]:
            nonlocal listings
            listings += str(path) == f"/proc/{holder.pid}/fd"
            return plain_listdir(path)

        monkeypatch.setattr(source, "_identify", identify)
        monkeypatch.setattr(os, "listdir", listdir)
        source.sample()  # the first look lists and identifies everything, once
        assert identified >= held
        looks = 30
        identified = listings = 0
        for look in range(looks):
            loader.do("open" if look % 2 == 0 else "close")
            source.sample()
        # Per look: the numbers the count moved by and PROBE_SLACK, a 300th of the old ones
        # (the rotation), the young ones: a few dozen, not 5,000; a listing every 5 looks.
        assert identified / looks < 60, identified / looks
        assert listings <= looks // (held // 1000) + 1, listings
        # A weight file opened meanwhile is seen at that look, wherever its number is.
        loader.do(f"open {shards[0]}")
        assert [(f.name, f.held) for f in source.sample().files] == [(shards[0].name, True)]
        loader.do(f"dup2 {shards[1]} {held + 4000}")  # not where the kernel would put it
        seen = [len(source.sample().files) for _ in range(held // 1000 + 1)]
        assert seen[-1] == 2, seen
    finally:
        holder.kill()
        holder.wait()
