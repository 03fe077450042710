"""What a real vLLM does with its weight files while it starts, seen from /proc.

    .venv/bin/python bench/vllm_file_timeline.py [--cache cold,warm] [--hz 20] [--log-dir DIR]

Needs root (fanotify, other processes' /proc/PID/io) and vLLM on CPU (`make test-servers`
installs it; MLE_VLLM_PYTHON names another). Per cache state it makes the test checkpoint cold
(evicted) or warm (read through), starts vLLM exactly as tests/servers/ do, and until `/health`
answers samples every process of its tree about `--hz` times a second: comm and cmdline; the
fds pointing at a shard (`*.safetensors`) with their fdinfo pos and flags; the maps lines of the
shards and the pages of each in page tables (numa_maps); /proc/PID/io and statm. fanotify on the
shards adds what sampling misses: every open, read() and close with its process, so a header
peek of a millisecond shows too. Its events carry no time, so each is stamped when read (late by
about a millisecond on an idle CPU), and a close is the last reference going: for a mapped file
that is the munmap, not the close(fd). The server's log is read as it grows, each boundary line
stamped when it arrived (at most 1/hz late).

Prints per run, in seconds since the API server's process start: the processes, the log's
boundary lines, the events (opens, maps, growth of offsets and mapped pages, closes, unmaps),
a summary per shard, the tree's read counters, and the processes outside the tree that opened
the shards. `--log-dir` keeps the logs."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import select
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import psutil

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))  # the launcher the real-server tests use

from helpers.support import free_port  # noqa: E402
from servers import checkpoint  # noqa: E402
from servers.vllm_server import (  # noqa: E402
    CHECKPOINTS,
    VllmServer,
    find_python,
    set_cache,
)

T = TypeVar("T")
MB = 1e6
COUNTER_STEP = 50 * MB  # the counter table gets a row when the tree has read this much more
PAGE = os.sysconf("SC_PAGE_SIZE")
BOUNDARY = re.compile(
    r"non-default args|Resolved architecture|Initializing a V1 LLM engine|Starting to load model"
    r"|Initializing model took|Filesystem type for checkpoints|Auto-prefetch"
    r"|Loading safetensors checkpoint shards|Loading weights took|Model loading took"
    r"|Warming up model|Compil|compil|Dynamo|Initial profiling/warmup run took|Warming up done"
    r"|KV cache|init engine|Starting vLLM server|Waiting for application startup"
    r"|Application startup complete|Uvicorn running"
)
OPEN_FLAGS = {
    0o100000: "O_LARGEFILE",
    0o40000: "O_DIRECT",
    0o1000000: "O_NOATIME",
    0o2000000: "O_CLOEXEC",
}


# --- /proc ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ShardFd:
    fd: int
    shard: str
    pos: int
    flags: int


@dataclass(frozen=True)
class ShardVma:
    shard: str
    start: int
    end: int
    perms: str  # r--p: MAP_PRIVATE, r--s: MAP_SHARED
    offset: int
    mapped: int  # bytes of the VMA in this process's page tables


@dataclass(frozen=True)
class ProcState:
    comm: str
    fds: dict[tuple[int, str], ShardFd]  # by fd and shard: a number reused is another open
    vmas: dict[int, ShardVma]  # by start address
    rchar: int
    read_bytes: int
    rss: int


def _text(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()


def _fdinfo(base: str, fd: str, shard: str) -> ShardFd:
    fields = dict(line.split(":", 1) for line in _text(f"{base}/fdinfo/{fd}").splitlines())
    return ShardFd(int(fd), shard, int(fields["pos"]), int(fields["flags"], 8))


def _vmas(base: str, shards: dict[str, str]) -> dict[int, ShardVma]:
    found: dict[int, tuple[str, int, str, int]] = {}
    for line in _text(f"{base}/maps").splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5] in shards:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            found[start] = (shards[parts[5]], end, parts[1], int(parts[2], 16))
    if not found:
        return {}
    mapped: dict[int, int] = {}
    for line in _text(f"{base}/numa_maps").splitlines():
        head, _, rest = line.partition(" ")
        start = int(head, 16)
        if start in found:
            fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
            page = int(fields.get("kernelpagesize_kB", "4")) * 1024
            # `mapped=` is left out when it equals `anon=` or `dirty=` (a file still dirty
            # after it was written): the per-node counts N<n>= always add up to it.
            pages = sum(int(v) for k, v in fields.items() if re.fullmatch(r"N\d+", k))
            mapped[start] = pages * page
    return {
        start: ShardVma(shard, start, end, perms, offset, mapped.get(start, 0))
        for start, (shard, end, perms, offset) in found.items()
    }


def read_state(pid: int, shards: dict[str, str]) -> ProcState | None:
    """One process's view of the shards now; None once it is gone."""
    base = f"/proc/{pid}"
    try:
        fds = {}
        for fd in os.listdir(f"{base}/fd"):
            try:
                target = os.readlink(f"{base}/fd/{fd}")
            except OSError:
                continue  # closed meanwhile
            if target in shards:
                fds[(int(fd), shards[target])] = _fdinfo(base, fd, shards[target])
        io = dict(line.split(": ") for line in _text(f"{base}/io").splitlines())
        return ProcState(
            comm=_text(f"{base}/comm").strip(),
            fds=fds,
            vmas=_vmas(base, shards),
            rchar=int(io["rchar"]),
            read_bytes=int(io["read_bytes"]),
            rss=int(_text(f"{base}/statm").split()[1]) * PAGE,
        )
    except (FileNotFoundError, ProcessLookupError, KeyError):
        return None


def _group(pid: int) -> int:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return -1


def cmdline(pid: int) -> str:
    try:
        return _text(f"/proc/{pid}/cmdline").replace("\0", " ").strip()
    except OSError:
        return "?"


# --- fanotify ------------------------------------------------------------------------------------

FAN_ACCESS, FAN_CLOSE_NOWRITE, FAN_OPEN, FAN_Q_OVERFLOW = 0x01, 0x10, 0x20, 0x4000
FAN_CLOEXEC, FAN_MARK_ADD, AT_FDCWD = 0x1, 0x1, -100
_EVENT = struct.Struct("=IBBHQii")  # struct fanotify_event_metadata
FAN_NAMES = ((FAN_OPEN, "open"), (FAN_ACCESS, "read()"), (FAN_CLOSE_NOWRITE, "close"))


@dataclass(frozen=True)
class FileEvent:
    at: float  # when the watch read it: fanotify events carry no time of their own
    pid: int
    group: int  # process group: vLLM's tree is one group, other processes are reported apart
    what: str
    shard: str


class FileWatch:
    """fanotify on the shards: every open, read() and close, with the process that did it."""

    def __init__(self, shards: dict[str, str]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fanotify_mark.argtypes = [
            ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p,
        ]  # fmt: skip
        self.fd = libc.fanotify_init(FAN_CLOEXEC, os.O_RDONLY | os.O_LARGEFILE)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "fanotify_init (needs root)")
        for path in shards:
            mask = FAN_OPEN | FAN_ACCESS | FAN_CLOSE_NOWRITE
            if libc.fanotify_mark(self.fd, FAN_MARK_ADD, mask, AT_FDCWD, path.encode()) < 0:
                raise OSError(ctypes.get_errno(), f"fanotify_mark {path}")
        self.shards = shards
        self.events: list[FileEvent] = []
        self.groups: dict[int, int] = {}
        self.cmdlines: dict[int, str] = {}
        self.overflowed = False
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            ready, _, _ = select.select([self.fd, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            now = time.time()
            data = os.read(self.fd, 65536)
            for offset in range(0, len(data), _EVENT.size):
                length, _, _, _, mask, fd, pid = _EVENT.unpack_from(data, offset)
                assert length == _EVENT.size  # no info records without FAN_REPORT_* flags
                if mask & FAN_Q_OVERFLOW:
                    self.overflowed = True
                if fd < 0:
                    continue
                path = os.readlink(f"/proc/self/fd/{fd}")
                os.close(fd)
                if pid not in self.groups:
                    self.groups[pid] = _group(pid)
                    self.cmdlines[pid] = cmdline(pid)
                for bit, name in FAN_NAMES:
                    if mask & bit:
                        shard = self.shards.get(path, path)
                        self.events.append(FileEvent(now, pid, self.groups[pid], name, shard))

    def close(self) -> None:
        os.write(self._stop_w, b"x")
        self._thread.join()
        for fd in (self.fd, self._stop_r, self._stop_w):
            os.close(fd)


# --- one run -------------------------------------------------------------------------------------


@dataclass
class Run:
    cache: str
    pid: int = 0  # the API server's, and its process group's
    t0: float = 0.0  # the API server's process start (unix seconds)
    healthy_at: float = 0.0
    samples: list[tuple[float, dict[int, ProcState]]] = field(default_factory=list)
    lines: list[tuple[float, str]] = field(default_factory=list)
    names: dict[int, list[tuple[float, str, str]]] = field(default_factory=dict)  # comm, cmdline
    files: list[FileEvent] = field(default_factory=list)
    file_cmdlines: dict[int, str] = field(default_factory=dict)
    overflowed: bool = False


class LogTail:
    """The boundary lines of a growing log, each with the time it was read."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("rb")
        self.partial = b""

    def poll(self, now: float, out: list[tuple[float, str]]) -> None:
        self.partial += self.file.read()
        *complete, self.partial = re.split(rb"[\r\n]", self.partial)
        for raw in complete:
            line = raw.decode(errors="replace").strip()
            if line and BOUNDARY.search(line):
                out.append((now, line))


def measure(python: str, model: Path, cache: str, hz: float, log: Path) -> Run:
    # /proc shows resolved paths: a checkpoint reached through a symlink is seen by its target
    shards = {os.path.realpath(p): p.name.split("-")[1] for p in model.glob("*.safetensors")}
    set_cache(model, cache)
    run = Run(cache)
    watch = FileWatch(shards)
    log.write_bytes(b"")
    server = VllmServer(python, model, free_port(), log)
    tail = LogTail(log)
    run.pid, run.t0 = server.pid, psutil.Process(server.pid).create_time()
    period = 1.0 / hz
    next_at = time.monotonic()
    try:
        while True:
            now = time.time()
            states = {}
            for process in server.tree():
                state = read_state(process.pid, shards)
                if state is not None:
                    states[process.pid] = state
                    names = run.names.setdefault(process.pid, [])
                    if not names or names[-1][1] != state.comm:  # new, or renamed itself
                        names.append((now, state.comm, cmdline(process.pid)))
            run.samples.append((now, states))
            tail.poll(now, run.lines)
            if server.proc.poll() is not None:
                raise SystemExit(f"vLLM exited with {server.proc.returncode}:\n{server.tail()}")
            if server.healthy():
                run.healthy_at = time.time()
                break
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
        tail.poll(time.time(), run.lines)
    finally:
        watch.close()
        left = server.stop()
        tail.file.close()
    if left:
        raise SystemExit(f"vLLM left processes behind: {left}")
    run.files, run.file_cmdlines, run.overflowed = watch.events, watch.cmdlines, watch.overflowed
    return run


# --- report --------------------------------------------------------------------------------------


def _flags(flags: int) -> str:
    names = [("O_RDONLY", "O_WRONLY", "O_RDWR")[flags & 3]]
    names += [name for bit, name in OPEN_FLAGS.items() if flags & bit]
    return "|".join(names)


def _perms(perms: str) -> str:
    return f"{perms} ({'MAP_SHARED' if perms.endswith('s') else 'MAP_PRIVATE'})"


def _changes(
    old: dict[Any, T], new: dict[Any, T], measure: Callable[[T], int]
) -> tuple[list[T], list[T], list[T]]:
    """Between two samples: the entries that appeared, those whose measure moved, and those gone
    (the last value they had)."""
    appeared = [v for k, v in new.items() if k not in old]
    moved = [v for k, v in new.items() if k in old and measure(old[k]) != measure(v)]
    return appeared, moved, [v for k, v in old.items() if k not in new]


def _totals(states: dict[int, ProcState]) -> tuple[int, int, int]:
    values = states.values()
    rchar, read = sum(s.rchar for s in values), sum(s.read_bytes for s in values)
    return rchar, read, sum(s.rss for s in values)


class Report:
    def __init__(self, run: Run, sizes: dict[str, int]) -> None:
        self.run = run
        self.sizes = sizes
        self.comm = {pid: names[-1][1] for pid, names in run.names.items()}  # vLLM's names
        self.ours = [e for e in run.files if e.group == run.pid]

    def t(self, at: float) -> str:
        return f"{at - self.run.t0:8.3f}"

    def who(self, pid: int) -> str:
        return f"{pid:>7} {self.comm.get(pid, '?'):<16}"

    def print(self) -> None:
        run = self.run
        gaps = [b[0] - a[0] for a, b in zip(run.samples, run.samples[1:], strict=False)]
        mean, longest = sum(gaps) / max(1, len(gaps)), max(gaps, default=0.0)
        print(
            f"\n=== {run.cache} start: /health 200 at {run.healthy_at - run.t0:.2f} s; "
            f"{len(run.samples)} samples, {1000 * mean:.0f} ms apart, longest {1000 * longest:.0f}"
        )
        print("\n-- processes of the tree (when seen with this name, pid, comm, cmdline)")
        for pid, names in run.names.items():
            for at, comm, line in names:
                print(f"{self.t(at)} {pid:>7} {comm:<16} {line[:100]!r}")
        print("\n-- log boundary lines (when read)")
        for at, line in run.lines:
            print(f"{self.t(at)} {line[:150]}")
        print(
            "\n-- shard events of the tree (fan: fanotify, stamped when read; the others sampled)"
        )
        for at, text in sorted(self.events()):
            print(f"{self.t(at)} {text}")
        print("\n-- shards")
        self.shards()
        print("\n-- tree counters (sum over its live processes)")
        self.counters()
        self.others()
        if run.overflowed:
            print("fanotify queue overflowed: some events are missing")

    def events(self) -> list[tuple[float, str]]:
        out = [(e.at, f"{self.who(e.pid)} fan {e.what} {e.shard}") for e in self.ours
               if e.what != "read()"]  # fmt: skip
        reads: dict[tuple[int, str], list[float]] = {}
        for e in self.ours:
            if e.what == "read()":
                reads.setdefault((e.pid, e.shard), []).append(e.at)
        for (pid, shard), times in reads.items():
            until = times[-1] - self.run.t0
            text = f"{self.who(pid)} fan read() {shard}: {len(times)} events until {until:.3f}"
            out.append((times[0], text))
        previous: dict[int, ProcState] = {}
        for at, states in self.run.samples:
            for pid, state in states.items():
                texts = self.diff(previous.get(pid), state)
                out += [(at, f"{self.who(pid)} {text}") for text in texts]
            for pid in previous.keys() - states.keys():
                out.append((at, f"{self.who(pid)} exited"))
            previous = states
        return out

    def diff(self, old: ProcState | None, new: ProcState) -> list[str]:
        texts = []
        opened, moved, closed = _changes(old.fds if old else {}, new.fds, lambda f: f.pos)
        for f in opened:
            texts.append(f"fd {f.fd} -> {f.shard} open, flags {_flags(f.flags)}, pos {f.pos}")
        for f in moved:
            share = self.share(f.shard, f.pos)
            texts.append(f"fd {f.fd} -> {f.shard} pos {f.pos / MB:.1f} MB ({share})")
        for f in closed:
            texts.append(f"fd {f.fd} -> {f.shard} closed (last pos {f.pos})")
        mapped, grown, unmapped = _changes(old.vmas if old else {}, new.vmas, lambda v: v.mapped)
        for v in mapped:
            size = (v.end - v.start) / MB
            texts.append(
                f"map {v.shard} {_perms(v.perms)} file offset {v.offset}, {size:.1f} MB"
                f" at {v.start:x}, mapped {v.mapped / MB:.1f} MB"
            )
        for v in grown:
            share = self.share(v.shard, v.mapped)
            texts.append(f"mapped {v.shard} {v.mapped / MB:.1f} MB ({share})")
        for v in unmapped:
            texts.append(f"unmap {v.shard} at {v.start:x} (last mapped {v.mapped / MB:.1f} MB)")
        return texts

    def share(self, shard: str, nbytes: int) -> str:
        return f"{100 * nbytes / self.sizes[shard]:.0f} % of the shard"

    def shards(self) -> None:
        """Per shard: opens and closes (fanotify), then what sampling saw of its fds and maps."""
        row = "{:<6} {:>8} {:<16} {:>5} {:>8} {:>7} {:>8} {:>8} {:<5} {:>20}"
        print(row.format("shard", "opened", "by", "opens", "closed", "fd pos", "mapped",
                         "last map", "perms", "peak mapped"))  # fmt: skip
        for shard in sorted(self.sizes):
            files = [e for e in self.ours if e.shard == shard]
            opens = [e for e in files if e.what == "open"]
            closes = [e.at for e in files if e.what == "close"]
            pos = [f.pos for _, st in self.run.samples for s in st.values()
                   for f in s.fds.values() if f.shard == shard]  # fmt: skip
            vmas = [(at, v) for at, st in self.run.samples for s in st.values()
                    for v in s.vmas.values() if v.shard == shard]  # fmt: skip
            peak = max((sum(v.mapped for t, v in vmas if t == at) for at, _ in vmas), default=0)
            print(row.format(
                shard,
                self.t(opens[0].at) if opens else "-",
                self.comm.get(opens[0].pid, "?") if opens else "-",
                len(opens),
                self.t(closes[-1]) if closes else "-",
                f"{max(pos) / MB:.1f}" if pos else "-",
                self.t(vmas[0][0]) if vmas else "-",
                self.t(vmas[-1][0]) if vmas else "-",
                ",".join(sorted({v.perms for _, v in vmas})) or "-",
                f"{peak / MB:.1f} MB ({self.share(shard, peak)})" if vmas else "-",
            ))  # fmt: skip
        print("opened, closed: its first open and last close (fanotify); fd pos: the largest file")
        print("offset sampled on a fd of it, MB; mapped, last map: the first and last samples with")
        print("a map of it; peak mapped: the most of it in the tree's page tables at one sample")

    def counters(self) -> None:
        run = self.run
        print(
            f"{'t':>8} {'rchar MB':>9} {'read_bytes MB':>13} {'rss MB':>7}  (a row per 50 MB read)"
        )
        shown = (-1.0, -COUNTER_STEP, -COUNTER_STEP)
        for at, states in run.samples:
            rchar, read, rss = _totals(states)
            moved = max(rchar - shown[1], read - shown[2]) >= COUNTER_STEP
            if moved or at - shown[0] >= 10.0 or at == run.samples[-1][0]:
                shown = (at, rchar, read)
                print(f"{self.t(at)} {rchar / MB:9.1f} {read / MB:13.1f} {rss / MB:7.0f}")
        opens = [e.at for e in self.ours if e.what == "open"]
        busy = [i for i, (_, states) in enumerate(run.samples)
                if any(s.fds or s.vmas for s in states.values())]  # fmt: skip
        if not opens or not busy:
            return
        before = [i for i, (at, _) in enumerate(run.samples) if at < opens[0]]
        first, last = (before[-1] if before else 0), min(busy[-1] + 1, len(run.samples) - 1)
        (t1, s1), (t2, s2) = run.samples[first], run.samples[last]
        (r1, b1, _), (r2, b2, _) = _totals(s1), _totals(s2)
        print(
            f"before the first shard open (sample at {t1 - run.t0:.3f}): "
            f"rchar {r1 / MB:.1f} MB, read_bytes {b1 / MB:.1f} MB"
        )
        print(
            f"from then to the first sample with no shard open or mapped ({t2 - run.t0:.3f}): "
            f"rchar +{(r2 - r1) / MB:.1f} MB, read_bytes +{(b2 - b1) / MB:.1f} MB"
        )

    def others(self) -> None:
        """Processes outside vLLM's tree that opened the shards (an exporter's residency pass)."""
        others: dict[int, list[float]] = {}
        for e in self.run.files:
            if e.group != self.run.pid and e.what == "open":
                others.setdefault(e.pid, []).append(e.at)
        for pid, times in others.items():
            line = self.run.file_cmdlines.get(pid, "?")[:100]
            first, last = times[0] - self.run.t0, times[-1] - self.run.t0
            print(
                f"not vLLM: pid {pid} opened shards {len(times)} times, {first:.3f} to {last:.3f}"
            )
            print(f"    {line!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", default="cold,warm", help="comma-separated: cold, warm")
    parser.add_argument("--hz", type=float, default=20.0)
    parser.add_argument("--log-dir", type=Path, help="keep each start's log here")
    args = parser.parse_args()
    python = find_python()
    if python is None:
        raise SystemExit("needs vLLM: `make test-servers` installs it (or set MLE_VLLM_PYTHON)")
    if os.geteuid() != 0:
        raise SystemExit("needs root (fanotify, other processes' /proc/PID/io)")
    model = checkpoint.ensure(CHECKPOINTS, python)
    sizes = {p.name.split("-")[1]: p.stat().st_size for p in model.glob("*.safetensors")}
    print(f"model {model}: " + ", ".join(f"{k} {v / MB:.1f} MB" for k, v in sorted(sizes.items())))
    log_dir = args.log_dir or Path(f"/tmp/vllm-timeline-{os.getpid()}")
    log_dir.mkdir(parents=True, exist_ok=True)
    for cache in args.cache.split(","):
        log = log_dir / f"vllm-0.32-cpu-{cache}.log"
        Report(measure(python, model, cache, args.hz, log), sizes).print()
        print(f"log: {log}")


if __name__ == "__main__":
    main()
