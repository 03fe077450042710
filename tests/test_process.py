"""ProcessFinder against real processes reading real files, plus fake /proc and cgroup trees."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pagecache_io import MIB, write_cold_file

from exporter.config.schema import ProcessConfig
from exporter.sources.process import ProcessFinder, ProcessSample

pytestmark = pytest.mark.system  # child processes, servers

# A stand-in model server: starts a long-lived worker, then reads files or spawns short-lived
# readers when told to on stdin, answering one line per command.
SERVER = r"""
import os, subprocess, sys
tag, py = sys.argv[1], sys.executable

def read(path):
    n = 0
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(1 << 20):
            n += len(chunk)
    return n

# Reads a file, reports (pid, bytes), then lives until stdin closes or, if told to, forever.
READER = '''
import os, sys, time
n = 0
with open(sys.argv[1], "rb", buffering=0) as f:
    while chunk := f.read(1 << 20):
        n += len(chunk)
print(os.getpid(), n, flush=True)
sys.stdin.read()
if sys.argv[2] == "linger":
    time.sleep(600)
'''
# Starts a lingering reader, then exits without waiting for it: the reader is orphaned.
ORPHANER = '''
import os, subprocess, sys
subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], "linger"])
sys.stdin.read()
os._exit(0)
'''

worker = subprocess.Popen([py, "-c", "import time; time.sleep(600)", f"mle-worker-{tag}"])
print("ready", worker.pid, flush=True)
helper = None
for line in sys.stdin:
    cmd, _, arg = line.strip().partition(" ")
    if cmd == "read":
        print("done", read(arg), flush=True)
    elif cmd in ("spawn-reader", "orphan-reader"):
        argv = [READER, arg, "exit"] if cmd == "spawn-reader" else [ORPHANER, READER, arg]
        helper = subprocess.Popen([py, "-c", *argv], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        print("done", helper.stdout.readline().strip(), flush=True)
    elif cmd == "reap-helper":
        helper.stdin.close()
        helper.wait()
        print("done", flush=True)
"""


class Server:
    def __init__(self) -> None:
        self.tag = uuid.uuid4().hex[:12]
        self.spawned_after = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVER, self.tag, f"mle-server-{self.tag}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = self.proc.pid
        self.spawned_before = time.time()
        self.worker_pid = int(self.readline().split()[1])
        self.stray: list[int] = []

    def readline(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "server exited"
        return line.strip()

    def command(self, text: str) -> list[str]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()
        reply = self.readline().split()
        assert reply[0] == "done"
        return reply[1:]

    def kill(self) -> None:
        for pid in [self.worker_pid, *self.stray]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def server() -> Iterator[Server]:
    srv = Server()
    yield srv
    srv.kill()


def by_cmdline(srv: Server) -> ProcessFinder:
    return ProcessFinder(ProcessConfig(cmdline=rf"mle-server-{srv.tag}\b"))


def test_found_by_pidfile_with_tree_start_time_and_cmdline(server: Server, tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(f"{server.pid}\n")
    sample = ProcessFinder(ProcessConfig(pidfile=str(pidfile))).sample()
    assert sample.found
    assert sample.root_pid == server.pid
    assert set(sample.pids) == {server.pid, server.worker_pid}
    # Exact to a clock tick (10 ms): psutil's create_time() is up to a second early here.
    assert sample.start_time is not None
    assert server.spawned_after - 0.011 <= sample.start_time <= server.spawned_before + 0.011
    assert sample.cmdline is not None
    assert sample.cmdline.endswith(f"{server.tag} mle-server-{server.tag}")
    assert sample.read_bytes is not None
    assert sample.read_chars is not None


def test_found_by_cmdline_regex_never_a_descendant(server: Server) -> None:
    # Matches the server and its worker: the root is the server, the worker is in its tree.
    finder = ProcessFinder(ProcessConfig(cmdline=rf"mle-(server|worker)-{server.tag}"))
    sample = finder.sample()
    assert sample.root_pid == server.pid
    assert server.worker_pid in sample.pids


def test_cold_read_counts_storage_bytes_and_warm_read_counts_chars(
    server: Server, tmp_path: Path
) -> None:
    size = 32 * MIB
    weights = write_cold_file(tmp_path / "shard-00001.safetensors", size)
    finder = by_cmdline(server)
    before = finder.sample()
    assert server.command(f"read {weights}") == [str(size)]
    cold = finder.sample()
    assert before.read_bytes is not None and cold.read_bytes is not None
    assert cold.read_bytes - before.read_bytes >= size
    assert server.command(f"read {weights}") == [str(size)]
    warm = finder.sample()
    assert cold.read_chars is not None and warm.read_chars is not None
    assert warm.read_chars - cold.read_chars >= size
    assert warm.read_bytes is not None
    assert warm.read_bytes - cold.read_bytes < size // 2


def test_reaped_child_is_counted_once(server: Server, tmp_path: Path) -> None:
    size = 16 * MIB
    weights = write_cold_file(tmp_path / "w.bin", size)
    finder = by_cmdline(server)
    base = finder.sample()
    reader_pid, n = (int(x) for x in server.command(f"spawn-reader {weights}"))
    assert n == size
    during = finder.sample()
    assert reader_pid in during.pids
    server.command("reap-helper")  # the server's wait() folds the reader's counters into its own
    after = finder.sample()
    assert reader_pid not in after.pids
    assert base.read_bytes is not None and after.read_bytes is not None
    assert during.read_bytes is not None
    assert after.read_bytes >= during.read_bytes
    assert size <= after.read_bytes - base.read_bytes < 2 * size
    assert base.read_chars is not None and after.read_chars is not None
    assert size <= after.read_chars - base.read_chars < 2 * size


def test_orphaned_child_keeps_its_bytes_in_the_sum(server: Server, tmp_path: Path) -> None:
    size = 16 * MIB
    weights = write_cold_file(tmp_path / "w.bin", size)
    finder = by_cmdline(server)
    base = finder.sample()
    reader_pid, _ = (int(x) for x in server.command(f"orphan-reader {weights}"))
    server.stray.append(reader_pid)
    during = finder.sample()
    assert reader_pid in during.pids
    server.command("reap-helper")  # the reader's parent exits: it is re-parented out of the tree
    left = finder.sample()
    assert reader_pid not in left.pids
    # Growth after the orphan left must add on top of its bytes, not be swallowed by their loss.
    assert server.command(f"read {weights}") == [str(size)]
    later = finder.sample()
    assert base.read_chars is not None and later.read_chars is not None
    assert later.read_chars - base.read_chars >= 2 * size
    assert later.read_bytes is not None and base.read_bytes is not None
    assert later.read_bytes - base.read_bytes >= size


def test_killed_server_is_not_found(server: Server) -> None:
    finder = by_cmdline(server)
    assert finder.sample().found
    server.kill()
    assert finder.sample() == ProcessSample(False, (), None, None, None, None, None)


def test_pidfile_of_dead_missing_or_garbage_is_not_found(tmp_path: Path) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    pidfile = tmp_path / "server.pid"
    finder = ProcessFinder(ProcessConfig(pidfile=str(pidfile)))
    assert not finder.sample().found
    for text in (f"{dead.pid}\n", "not-a-pid\n", ""):
        pidfile.write_text(text)
        assert not finder.sample().found


@pytest.mark.parametrize(
    ("layout", "unit"),
    [("", "mle-test"), ("", "mle-test.service"), ("unified", "mle-test")],
    ids=["v2", "v2-suffix", "hybrid"],
)
def test_systemd_unit_from_cgroup_tree(
    server: Server, tmp_path: Path, layout: str, unit: str
) -> None:
    unit_dir = tmp_path / "cgroup" / layout / "system.slice" / "mle-test.service"
    (unit_dir / "workers").mkdir(parents=True)
    (unit_dir / "cgroup.procs").write_text(f"{server.worker_pid}\n{server.pid}\n")
    (unit_dir / "workers" / "cgroup.procs").write_text("")
    finder = ProcessFinder(ProcessConfig(systemd_unit=unit), cgroup_root=str(tmp_path / "cgroup"))
    sample = finder.sample()
    assert sample.root_pid == server.pid  # the oldest process of the unit
    assert set(sample.pids) == {server.pid, server.worker_pid}


def test_systemd_unit_without_cgroup_is_not_found(tmp_path: Path) -> None:
    finder = ProcessFinder(ProcessConfig(systemd_unit="absent"), cgroup_root=str(tmp_path))
    assert not finder.sample().found


def fake_stat(pid: int, ppid: int, start_ticks: int, state: str = "S") -> str:
    fields = [state, str(ppid)] + ["0"] * 17 + [str(start_ticks)] + ["0"] * 32
    return f"{pid} (python3 (worker)) {' '.join(fields)}\n"


def fake_process(proc: Path, pid: int, ppid: int, start: int, rb: int, rc: int) -> Path:
    d = proc / str(pid)
    d.mkdir()
    (d / "stat").write_text(fake_stat(pid, ppid, start))
    (d / "cmdline").write_bytes(b"python3\0-m\0sglang.launch_server\0")
    (d / "io").write_text(f"rchar: {rc}\nwchar: 0\nread_bytes: {rb}\nwrite_bytes: 0\n")
    return d


def test_fake_proc_vanished_and_unreadable_entries(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("cpu 1 2 3\nbtime 1700000000\n")
    fake_process(proc, 100, 1, 500, rb=1000, rc=5000)
    fake_process(proc, 101, 100, 600, rb=10, rc=20)
    (proc / "102").mkdir()  # vanished between listdir and reading its stat
    finder = ProcessFinder(ProcessConfig(cmdline="sglang"), proc_root=str(proc))
    sample = finder.sample()
    assert sample.pids == (100, 101)
    assert sample.start_time == pytest.approx(1700000000 + 500 / os.sysconf("SC_CLK_TCK"), abs=1e-3)
    assert (sample.read_bytes, sample.read_chars) == (1010, 5020)
    assert sample.cmdline == "python3 -m sglang.launch_server"
    unreadable = fake_process(proc, 103, 100, 700, rb=1, rc=1)
    (unreadable / "io").unlink()
    (unreadable / "io").mkdir()  # any read error stands in for EACCES (we run as root here)
    sample = finder.sample()
    assert (sample.read_bytes, sample.read_chars) == (None, None)
    assert sample.read_problem is not None and "pid 103" in sample.read_problem
    assert sample.health().note == sample.read_problem


def test_cmdline_match_is_never_the_exporter_itself(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "stat").write_text("btime 1700000000\n")
    fake_process(proc, os.getpid(), 1, 100, rb=0, rc=0)  # older, and matches too
    fake_process(proc, os.getpid() + 1, 1, 200, rb=0, rc=0)
    finder = ProcessFinder(ProcessConfig(cmdline="sglang"), proc_root=str(proc))
    assert finder.sample().root_pid == os.getpid() + 1
