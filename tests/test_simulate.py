"""The stand-in model server, run for real: child processes, real files, loopback HTTP."""

from __future__ import annotations

import contextlib
import http.client
import itertools
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from helpers.procview import Look, look
from helpers.support import free_port, wait_for
from safetensors import safe_open

from exporter.load.events import EventKind
from exporter.logs.markers import MarkerParser
from exporter.sim.imports import imports_dir
from exporter.sim.shards import (
    CHUNK_SIZE,
    PAGE_SIZE,
    Layout,
    Throttle,
    generate_shards,
    parse_layout,
    read_chunk,
)
from exporter.sim.simulate import Endpoint
from exporter.storage.cachectl import evict, prewarm
from exporter.vocabulary import ServerKind

pytestmark = pytest.mark.system  # child processes, servers

ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20

# Regexes copied from shared/reference/server-startup.md.
SGLANG_LINE = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{3})?)((?: [A-Z_]+\d+)*)\] (.*)"
)
SGLANG_TQDM = ("Loading safetensors checkpoint shards", "Capturing batches")
SGLANG_PROGRESS = r"Loading (?:safetensors|pt) checkpoint shards:\s+(\d+)% Completed \| (\d+)/(\d+)"
SGLANG_MARKERS = [
    r"Load weight begin\. avail mem=([\d.]+) GB",
    SGLANG_PROGRESS,
    r"Load weight end\. (?:elapsed=([\d.]+) s, )?type=(\w+), .*?avail mem=([\d.]+) GB, "
    r"mem usage=([\d.]+) GB\.",
    r"KV Cache is allocated\. dtype: (\S+), #tokens: (\d+)",
    r"Memory pool end\. avail mem=([\d.]+) GB",
    r"Compiling num tokens \(num_tokens=(\d+)\)",
    r"Capture \S+ \S+ CUDA graph begin\.",
    r"Capturing batches \(bs=(\d+)",
    r"Capture \S+ \S+ CUDA graph end\. .*elapsed=([\d.]+) s",
    r"Engine startup timings \(s\): load_weight=([\d.]+), kv_cache_allocation=([\d.]+), "
    r".*cuda_graph=\{([^}]*)\}",
    r"The server is fired up and ready to roll!",
]
SGLANG_FAILURE = r"Rank (\d+) scheduler died during initialization"
# vLLM's line shape as the reference describes it:
# `(<proc> pid=N) LEVEL MM-DD HH:MM:SS [file.py:line] message`.
VLLM_LINE = re.compile(r"^\((APIServer|EngineCore(?:_DP\d+)?|Worker_TP\d+) pid=(\d+)\) (.*)")
VLLM_LOGGED = re.compile(
    r"^(INFO|WARNING|ERROR|DEBUG) \d\d-\d\d \d\d:\d\d:\d\d \[[\w.]+\.py:\d+\] "
)
VLLM_PROGRESS = (
    r"Loading safetensors checkpoint shards(?: \(eager\))?:\s+(\d+)% Completed \| (\d+)/(\d+)"
)
VLLM_MARKERS = [
    r"vLLM server version (\S+), serving model (\S+)",
    r"Starting to load model (.+)\.\.\.|Loading model from scratch\.\.\.",
    r"Filesystem type for checkpoints: (\S+)\. Checkpoint size: ([\d.]+) GiB\. "
    r"Available RAM: ([\d.]+) GiB\.",
    VLLM_PROGRESS,
    r"Loading weights took ([\d.]+) seconds",
    r"Model loading took ([\d.]+) GiB memory and ([\d.]+) seconds",
    r"Starting torch\.compile",
    r"Dynamo bytecode transform time: ([\d.]+) s",
    r"torch\.compile (?:and initial profiling/warmup run together )?took ([\d.]+) s in total",
    r"Available KV cache memory: ([\d.]+) GiB",
    r"KV cache size: ([\d,]+) tokens",
    r"Capturing CUDA graphs",
    r"Graph capturing finished in (\d+) secs, took ([\d.]+) GiB",
    r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s",
    r"Starting vLLM server on (\S+)",
    r"Application startup complete\.",
]
LLAMACPP_MARKERS = [
    r"srv\s+load_model: loading model '(.+)'",
    r"load_tensors: loading model tensors, this can take a while\.\.\. "
    r"\((?:load_mode = \w+|mmap = \w+)\)",
    r"^\.+$",
    r"llama_kv_cache:\s+(\S+) KV buffer size =\s+([\d.]+) MiB",
    r"srv\s+\S+: model loaded",
    r"listening on (\S+)",
]
LLAMACPP_FAILURE = r"exiting due to model loading error"
TGI_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\s+(TRACE|DEBUG|INFO|WARN|ERROR) "
)
TGI_MARKERS = [
    r"Starting shard",
    r"Server started at (unix://\S+)",
    r"Shard ready in ([\d.]+\w+)",
    r"Warming up model",
    r"KV-cache blocks: (\d+), size: (\d+)",
    r"Cuda Graphs are enabled for sizes (.+)",
    r"Connected",
]
MARKERS = {
    "sglang": SGLANG_MARKERS,
    "vllm": VLLM_MARKERS,
    "llamacpp": LLAMACPP_MARKERS,
    "tgi": TGI_MARKERS,
}
LLAMACPP_LOADING = {"error": {"message": "Loading model", "type": "unavailable_error", "code": 503}}


def request(port: int, method: str, path: str, body: Any = None) -> tuple[int, bytes] | None:
    """(status, body), or None when the connection is refused."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        payload = None if body is None else json.dumps(body)
        headers = {} if body is None else {"Content-Type": "application/json"}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    except ConnectionRefusedError:
        return None
    finally:
        conn.close()


def make_shards(directory: Path, count: int, size: int) -> list[Path]:
    generate_shards(directory, count, size)
    return sorted(directory.glob("*.safetensors"))


class Sim:
    """One `python -m exporter simulate` child with its own port, log, report and pidfile."""

    def __init__(self, tmp_path: Path, weights: Path, *extra: str, name: str = "sim") -> None:
        self.port = free_port()
        self.log = tmp_path / f"{name}.log"
        self.report = tmp_path / f"{name}.report.json"
        self.pidfile = tmp_path / f"{name}.pid"
        self.trace = tmp_path / f"{name}.trace.jsonl"
        self.started = time.time()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "simulate", "--port", str(self.port),
             "--weights", str(weights), "--log-file", str(self.log),
             "--report", str(self.report), "--pidfile", str(self.pidfile),
             "--trace", str(self.trace), *extra],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        self.spawned = time.time()

    def text(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def pieces(self) -> list[str]:
        """Log output split like a log reader must: on newlines and on tqdm's carriage returns."""
        return [p for p in re.split(r"[\r\n]", self.text()) if p]

    def result(self, timeout: float = 15.0) -> dict[str, Any]:
        text = wait_for(lambda: self.report.read_text() if self.report.exists() else None, timeout)
        return dict(json.loads(text))

    def events(self) -> list[dict[str, Any]]:
        """The `--trace`: what every rank consumed, when."""
        return [json.loads(line) for line in self.trace.read_text().splitlines()]

    def consumed(self) -> int:
        """The weights' truly consumed bytes by the end: each rank's last count, summed."""
        last = {event["rank"]: event["consumed"] for event in self.events()}
        return sum(last.values())

    def get(self, path: str) -> tuple[int, bytes] | None:
        return request(self.port, "GET", path)

    def wait(self, timeout: float = 15.0) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stderr:
            self.proc.stderr.close()


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[Callable[..., Sim]]:
    started: list[Sim] = []

    def start(weights: Path, *extra: str, name: str = "sim") -> Sim:
        child = Sim(tmp_path, weights, *extra, name=name)
        started.append(child)
        return child

    yield start
    for child in started:
        child.stop()


def first_index(pieces: list[str], pattern: str) -> int:
    for index, piece in enumerate(pieces):
        if re.search(pattern, piece):
            return index
    raise AssertionError(f"no line matches {pattern!r}")


# --- endpoint behaviour -----------------------------------------------------------------------


def test_closed_port_refuses_while_loading_then_serves(tmp_path: Path, sim: Any) -> None:
    weights = tmp_path / "Tiny-Model"
    make_shards(weights, 2, 2 * MiB)
    # Both rates equal, so the load takes ~1 s whether the data is cached or not.
    child = sim(weights, "--read-rate", "4MB/s", "--cached-read-rate", "4MB/s", "--init-seconds",
                "0.4")  # fmt: skip
    wait_for(lambda: "Load weight begin" in child.text())
    refused = 0
    while (health := child.get("/health")) is None or health[0] != 200:
        assert child.proc.poll() is None, child.proc.stderr.read()  # type: ignore[union-attr]
        refused += health is None
        time.sleep(0.02)
    seen_ready = time.time()
    assert refused > 10  # the port stayed closed through the ~1 s of weights

    models = child.get("/v1/models")
    assert models is not None and models[0] == 200
    listing = json.loads(models[1])
    assert listing["object"] == "list"
    assert [(m["id"], m["owned_by"]) for m in listing["data"]] == [("Tiny-Model", "sglang")]
    completion = request(child.port, "POST", "/v1/completions",
                         {"model": "Tiny-Model", "prompt": "hi", "max_tokens": 3})  # fmt: skip
    assert completion is not None and completion[0] == 200
    answer = json.loads(completion[1])
    assert answer["choices"] and isinstance(answer["choices"][0]["text"], str)
    assert answer["usage"]["completion_tokens"] == 3
    missing = child.get("/nope")
    assert missing is not None and missing[0] == 404

    report = child.result()
    assert report["pid"] == child.proc.pid and report["outcome"] == "ready"
    # Between the test's clock before and after it spawned the child, to a clock tick (psutil's
    # create_time counts from /proc/stat's whole-second btime: up to a second early).
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert child.started - tick <= report["start_time"] <= child.spawned + tick
    assert report["load_seconds"] == pytest.approx(report["ready_at"] - report["start_time"])
    assert report["start_time"] < report["weights_done_at"] < report["ready_at"] <= seen_ready
    # 4 MiB at 4 MB/s plus 0.4 s of init is a floor; the test's own clock is a ceiling, give or
    # take the second by which psutil's create_time can run early (it rests on /proc/stat's
    # btime, which is whole seconds).
    assert 4 * MiB / 4e6 + 0.4 <= report["load_seconds"] <= seen_ready - child.started + 1.05


def test_503_style_answers_every_path_with_the_llamacpp_body_until_ready(
    tmp_path: Path, sim: Any
) -> None:
    weights = tmp_path / "gguf-ish"
    make_shards(weights, 2, 1 * MiB)
    child = sim(weights, "--log-format", "llamacpp", "--port-style", "503", "--read-rate", "2MB/s",
                "--cached-read-rate", "2MB/s", "--init-seconds", "0.2")  # fmt: skip
    loading = wait_for(lambda: child.get("/health"))
    assert loading[0] == 503 and json.loads(loading[1]) == LLAMACPP_LOADING
    models = child.get("/v1/models")
    assert models is not None and models[0] == 503
    assert json.loads(models[1]) == LLAMACPP_LOADING
    health = wait_for(lambda: (r := child.get("/health")) and r[0] != 503 and r, timeout=10)
    assert health == (200, b'{"status":"ok"}') or json.loads(health[1]) == {"status": "ok"}
    assert child.result()["outcome"] == "ready"
    models = child.get("/v1/models")
    assert models is not None and models[0] == 200
    assert json.loads(models[1])["data"][0]["owned_by"] == "llamacpp"


# --- page cache -------------------------------------------------------------------------------


def tree_read_bytes(server: psutil.Process) -> int:
    """Storage bytes read by the server and its ranks."""
    total = 0
    for process in (server, *server.children()):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += process.io_counters().read_bytes
    return total


def run_to_ready(child: Sim) -> tuple[dict[str, Any], int]:
    """The report and the most storage bytes psutil saw the tree read before it was ready."""
    process = psutil.Process(child.proc.pid)
    most = 0
    while not child.report.exists():
        assert child.proc.poll() is None
        most = max(most, tree_read_bytes(process))
        time.sleep(0.02)
    report = child.result()
    most = max(most, tree_read_bytes(process))
    child.stop()
    return report, most


LOADS = [("mmap", 1), ("read", 1), ("pread", 1), ("mmap", 4)]


@pytest.mark.parametrize(("loader", "ranks"), LOADS)
def test_cold_load_reads_storage_at_the_cold_rate_and_warm_load_does_not(
    tmp_path: Path, sim: Any, loader: str, ranks: int
) -> None:
    weights = tmp_path / "w"
    paths = make_shards(weights, 5, 4 * MiB)
    total = 20 * MiB
    how = ("--loader", loader, "--tensor-parallel", str(ranks), "--read-rate", "20MB/s",
           "--init-seconds", "0")  # fmt: skip
    for path in paths:
        evict(str(path))
    cold_child = sim(weights, *how, name="cold")
    cold, cold_read = run_to_ready(cold_child)
    for path in paths:  # cached by the cold run; again, in case this VM has shed some since
        prewarm(str(path))
    warm_child = sim(weights, *how, name="warm")
    warm, warm_read = run_to_ready(warm_child)

    assert cold_child.consumed() == warm_child.consumed() == total
    assert cold["cache"] == "cold" and cold["cached_bytes"] < total // 10
    assert cold_read >= 0.9 * total and cold["read_bytes"] >= 0.9 * total
    cold_weights = cold["weights_done_at"] - cold["weights_started_at"]
    assert cold_weights >= total / 20e6
    # Not `== total`: this VM's page cache sheds a few pages a minute even with memory free.
    assert warm["cache"] == "warm" and warm["cached_bytes"] >= 0.9 * total
    assert warm_read < total // 2
    # Page-cache reads are unthrottled by default: far faster than the cold disk.
    assert warm["weights_done_at"] - warm["weights_started_at"] < cold_weights / 2


def test_read_chunk_asks_the_kernel_what_was_cached(tmp_path: Path) -> None:
    (path,) = make_shards(tmp_path, 1, 2 * MiB)
    expected = path.read_bytes()
    evict(str(path))
    view = memoryview(bytearray(MiB))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        first = read_chunk(fd, view, 0)
        assert (first.cached, first.cold, first.known) == (0, MiB, True)
        assert bytes(view) == expected[:MiB]
        again = read_chunk(fd, view, 0)
        assert (again.cached, again.cold) == (MiB, 0)
        # Only the first half is cached now; the second half must still count as cold.
        second = read_chunk(fd, view, MiB)
        assert (second.cached, second.cold) == (0, MiB)
        tail = read_chunk(fd, view, 2 * MiB - 4096)
        assert tail.total == 4096
    finally:
        os.close(fd)


def test_throttle_sleeps_to_the_schedule_of_each_rate() -> None:
    throttle = Throttle(cold_rate=100.0, cached_rate=1000.0)
    # 100 cold bytes cost 1 s and 1000 cached bytes 1 s, counted from when the read began.
    assert throttle.pace(started=10.0, now=10.2, cold=100, cached=1000) == pytest.approx(1.8)
    # The next read starts on schedule; a read slower than its budget is not made up later.
    assert throttle.pace(started=12.0, now=12.0, cold=50, cached=0) == pytest.approx(0.5)
    assert throttle.pace(started=12.5, now=20.0, cold=100, cached=0) == 0.0
    assert throttle.pace(started=20.0, now=20.0, cold=100, cached=0) == pytest.approx(1.0)
    unthrottled = Throttle(cold_rate=100.0, cached_rate=None)
    assert unthrottled.pace(started=0.0, now=0.0, cold=0, cached=10**9) == 0.0


# --- loaders and ranks, seen from outside through /proc ----------------------------------------


def watch(child: Sim, weights: Path) -> list[Look]:
    """Look at the server and its ranks every few milliseconds until it is ready."""
    server = psutil.Process(child.proc.pid)
    looks = []
    while not child.report.exists():
        assert child.proc.poll() is None, child.proc.stderr.read()  # type: ignore[union-attr]
        with contextlib.suppress(psutil.NoSuchProcess):
            for pid in (server.pid, *(rank.pid for rank in server.children())):
                if (seen := look(pid, weights, imports_dir(weights))) is not None:
                    looks.append(seen)
        time.sleep(0.005)
    return looks


def imports_came_first(child: Sim, looks: list[Look], import_bytes: int) -> None:
    """Until the first weight file opened, nothing of the weights was open or mapped, while the
    server read `import_bytes` with read(), spread over its start-up, and mapped its libraries;
    its ranks started after that."""
    first_open = min(event["time"] for event in child.events() if event["event"] == "open")
    before = [seen for seen in looks if seen.ended < first_open]
    assert before and not any(seen.positions or seen.mapped for seen in before)
    server = [seen for seen in before if seen.pid == child.proc.pid]
    rchar = [seen.rchar for seen in server]
    assert rchar[-1] - rchar[0] >= import_bytes and len(set(rchar)) >= 8
    assert any(seen.libraries == {"libsim-0.so", "libsim-1.so"} for seen in server)
    ranks = [seen.began for seen in looks if seen.pid != child.proc.pid]
    if ranks:  # the server read nothing more (but its ranks' pipes) once they had started
        later = [seen.rchar for seen in server if seen.began > min(ranks)]
        assert later and later[-1] - later[0] < MiB


def loaded_in_turn(looks: list[Look], names: list[str], opened: Callable[[Look], Any]) -> None:
    """One weight file open (or mapped) at a time, in load order, each gone once the next opens."""
    order = [name for seen in looks for name in opened(seen)]
    assert all(len(opened(seen)) <= 1 for seen in looks)
    assert [name for i, name in enumerate(order) if i == 0 or order[i - 1] != name] == names


@pytest.mark.parametrize("loader", ["read", "mmap", "pread"])
def test_each_loader_imports_first_then_leaves_its_own_signals_in_proc(
    tmp_path: Path, sim: Any, loader: str
) -> None:
    weights = tmp_path / "w"
    paths = make_shards(weights, 3, 8 * MiB)
    names = [path.name for path in paths]
    child = sim(weights, "--loader", loader, "--read-rate", "16MB/s", "--cached-read-rate",
                "16MB/s", "--init-seconds", "0", "--startup-seconds", "1",
                "--import-bytes", "16MiB")  # fmt: skip
    looks = [seen for seen in watch(child, weights) if seen.pid == child.proc.pid]
    imports_came_first(child, looks, 16 * MiB)
    ready = look(child.proc.pid, weights, imports_dir(weights))
    assert ready is not None and not ready.positions and not ready.mapped
    assert child.consumed() == 24 * MiB
    for name in names:
        positions = [seen.positions[name] for seen in looks if name in seen.positions]
        pages = [seen.mapped[name] for seen in looks if name in seen.mapped]
        if loader == "read":  # the file offset moves through the file
            assert positions == sorted(positions) and 0 < max(positions) <= 8 * MiB
            assert len(set(positions)) >= 2 and not pages
        elif loader == "pread":  # the offset stays 0 while rchar grows, read by two threads
            during = [i for i, seen in enumerate(looks) if name in seen.positions]
            assert set(positions) == {0} and not pages and during[0] > 0
            assert looks[during[-1]].rchar - looks[during[0] - 1].rchar >= 0.9 * 8 * MiB
            threads = [looks[i].thread_rchar.values() for i in during]
            assert any(sum(r >= MiB for r in rchar) >= 2 for rchar in threads)
        else:  # mapped, its pages growing as tensors are copied out; no descriptor kept open
            assert pages == sorted(pages) and len(set(pages)) >= 2
            assert max(pages) * PAGE_SIZE >= 0.9 * 8 * MiB
            assert len(positions) <= 0.1 * len(pages)
    loaded_in_turn(
        looks, names, (lambda s: s.mapped) if loader == "mmap" else lambda s: s.positions
    )


def layout_of(path: Path) -> Layout:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return parse_layout(data[8 : 8 + length], len(data))


@pytest.mark.parametrize("loader", ["read", "mmap"])
def test_four_ranks_start_after_the_imports_and_each_consume_a_quarter_of_every_shard(
    tmp_path: Path, sim: Any, loader: str
) -> None:
    weights = tmp_path / "w"
    paths = make_shards(weights, 2, 16 * MiB)
    child = sim(weights, "--tensor-parallel", "4", "--loader", loader, "--read-rate", "32MB/s",
                "--cached-read-rate", "32MB/s", "--init-seconds", "0", "--startup-seconds", "1",
                "--import-bytes", "16MiB")  # fmt: skip
    looks = watch(child, weights)
    imports_came_first(child, looks, 16 * MiB)
    server = child.proc.pid
    pids = sorted({seen.pid for seen in looks if seen.pid != server})
    assert len(pids) == 4 and all(seen.ppid == server for seen in looks if seen.pid != server)
    assert not any(seen.mapped or seen.positions for seen in looks if seen.pid == server)
    events = child.events()
    opened = {e["rank"]: e["time"] for e in reversed(events) if e["event"] == "open"}
    for pid in pids:
        mine = [seen for seen in looks if seen.pid == pid]
        loaded_in_turn(mine, [p.name for p in paths], lambda s: s.mapped or s.positions)
        loading = [seen for seen in mine if seen.mapped or seen.positions]
        if loader == "read":
            # Each offset seen starts or ends a piece of this rank's quarter of a tensor: it seeks
            # to its slice and reads it, and reads about a quarter of the weights in all. The
            # ranks start one after another in rank order, so their pids sort as their ranks.
            rank = pids.index(pid)
            assert slice_of(paths, rank, loading), (rank, [s.positions for s in loading])
            before = [seen.rchar for seen in mine if seen.ended < opened[rank]]
            assert 0.24 * 32 * MiB <= mine[-1].rchar - before[-1] <= 0.27 * 32 * MiB
        else:  # its quarter of each shard at least (the kernel may map whole folios around it)
            for path in paths:
                most = max(seen.mapped.get(path.name, 0) for seen in mine) * PAGE_SIZE
                assert most >= 0.24 * path.stat().st_size, (pid, path.name, most)
    for rank in range(4):
        for path in paths:
            mine = [e["consumed"] for e in events if e["rank"] == rank and e["file"] == path.name]
            assert abs(mine[-1] - mine[0] - path.stat().st_size / 4) <= 4096, (rank, path.name)
    assert child.consumed() == 32 * MiB
    report = child.result()
    assert report["weights_started_at"] == min(opened.values())
    assert report["weights_done_at"] >= max(e["time"] for e in events)


def slice_of(paths: list[Path], rank: int, looks: list[Look]) -> bool:
    """Whether every file offset seen is the start or the end of one of `rank`'s pieces (a look
    on a busy machine may fall between its seek and its read), of the header, or 0 (opened,
    nothing read yet)."""
    bounds = set()
    for path in paths:
        layout = layout_of(path)
        bounds |= {(path.name, 0), (path.name, layout.header_end)}
        for p in layout.pieces(rank, 4):
            bounds |= {(path.name, p.offset), (path.name, p.offset + p.length)}
    seen = {(name, pos) for look in looks for name, pos in look.positions.items()}
    return bool(seen) and seen <= bounds


def ranks_loading(child: Sim, count: int) -> list[psutil.Process]:
    """The ranks, once each of them has opened its first shard."""
    server = psutil.Process(child.proc.pid)
    wait_for(lambda: child.trace.exists() and
             len({e["rank"] for e in child.events() if e["event"] == "open"}) == count)  # fmt: skip
    ranks = server.children()
    assert len(ranks) == count
    return ranks


def gone(process: psutil.Process) -> bool:
    try:
        return not process.is_running() or process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL], ids=["TERM", "KILL"])
def test_ranks_never_outlive_their_server(tmp_path: Path, sim: Any, signum: int) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 2, 8 * MiB)
    child = sim(weights, "--tensor-parallel", "4", "--read-rate", "1MB/s", "--cached-read-rate",
                "1MB/s", "--import-bytes", "0")  # fmt: skip
    ranks = ranks_loading(child, 4)
    child.proc.send_signal(signum)
    assert child.wait(timeout=5) == (0 if signum == signal.SIGTERM else -signal.SIGKILL)
    if signum == signal.SIGTERM:  # stopped and reaped by the server before it exited
        assert not any(rank.is_running() for rank in ranks)
    else:  # the kernel tells each rank its parent died
        wait_for(lambda: all(gone(rank) for rank in ranks), timeout=5)


@pytest.mark.parametrize("how", ["kill", "--crash-at=0.5"])
def test_a_rank_that_fails_fails_the_server(tmp_path: Path, sim: Any, how: str) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 2, 8 * MiB)
    extra = [] if how == "kill" else [how]
    child = sim(weights, "--tensor-parallel", "2", "--read-rate", "4MB/s", "--cached-read-rate",
                "4MB/s", "--import-bytes", "0", *extra)  # fmt: skip
    ranks = ranks_loading(child, 2)
    if how == "kill":
        ranks[1].kill()
        reason = r"rank \d was killed by SIGKILL"
    else:
        reason = r"simulated crash after loading 50% of weights"
    assert child.wait(timeout=20) == 1
    assert re.search(reason, child.text()) and re.search(SGLANG_FAILURE, child.text())
    assert child.result(timeout=1)["outcome"] == "failed"
    assert not any(rank.is_running() for rank in ranks)


@pytest.mark.parametrize("loader", ["mmap", "read", "pread"])
def test_a_shard_that_is_not_safetensors_fails_the_load(
    tmp_path: Path, sim: Any, loader: str
) -> None:
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "model-00001-of-00001.safetensors").write_bytes(os.urandom(MiB))
    child = sim(weights, "--loader", loader, "--import-bytes", "0")
    assert child.wait() == 1
    assert "cannot load model-00001-of-00001.safetensors: " in child.text()
    assert child.result(timeout=1)["outcome"] == "failed"
    assert "Traceback" not in child.proc.stderr.read()  # type: ignore[union-attr]


def test_rank_slices_partition_every_tensor() -> None:
    big = 3 * CHUNK_SIZE + 5  # rows of one byte: more than one chunk per rank at small worlds
    tensors = {
        "a": {"dtype": "F32", "shape": [10, 3], "data_offsets": [0, 120]},
        "b": {"dtype": "U8", "shape": [big], "data_offsets": [120, 120 + big]},
        "c": {"dtype": "F16", "shape": [], "data_offsets": [120 + big, 122 + big]},
    }
    header = json.dumps(tensors).encode()
    end = 8 + len(header) + 122 + big
    layout = parse_layout(header, end)
    for world in range(1, 6):
        pieces = sorted(
            (piece.offset, piece.length, rank)
            for rank in range(world)
            for piece in layout.pieces(rank, world)
        )
        # Disjoint and contiguous, every tensor byte once, in chunks; along each tensor the
        # ranks' slices come in rank order (interleaved through the file, tensor by tensor).
        assert pieces[0][0] == layout.header_end and sum(p[1] for p in pieces) == end - 8 - len(
            header
        )
        assert all(a[0] + a[1] == b[0] for a, b in itertools.pairwise(pieces))
        assert all(length <= CHUNK_SIZE for _, length, _ in pieces)
        for tensor in layout.tensors:
            ranks = [r for offset, _, r in pieces if 0 <= offset - tensor.offset < tensor.length]
            assert ranks == sorted(ranks)
            assert len(set(ranks)) == (1 if tensor.rows == 1 else min(world, tensor.rows))


# --- scripted trouble -------------------------------------------------------------------------


def test_stall_stops_progress_and_keeps_the_port_closed(tmp_path: Path, sim: Any) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 4, 1 * MiB)
    child = sim(weights, "--cached-read-rate", "8MB/s", "--read-rate", "8MB/s", "--stall-at",
                "0.5", "--stall-for", "2s", "--init-seconds", "0.1")  # fmt: skip
    wait_for(lambda: "| 2/4" in child.text(), timeout=10, interval=0.01)
    halfway = time.monotonic()
    refused_during_stall = 0
    while "| 3/4" not in child.text():
        assert child.proc.poll() is None
        refused_during_stall += child.get("/health") is None
        time.sleep(0.01)
    resumed = time.monotonic()
    assert resumed - halfway >= 1.5
    assert refused_during_stall > 10
    report = child.result()
    assert report["outcome"] == "ready" and report["load_seconds"] >= 2 + 4 * MiB / 8e6
    assert wait_for(lambda: child.get("/health"))[0] == 200


@pytest.mark.parametrize(
    ("kind", "flag", "failure"),
    [
        ("sglang", "--crash-at=0.5", SGLANG_FAILURE),
        ("sglang", "--crash-during-init", SGLANG_FAILURE),
        ("llamacpp", "--crash-at=0.5", LLAMACPP_FAILURE),
        ("vllm", "--crash-during-init", r"EngineCore failed to start\."),
    ],
)
def test_scripted_crash_exits_1_after_the_failure_line(
    tmp_path: Path, sim: Any, kind: str, flag: str, failure: str
) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 2, 1 * MiB)
    child = sim(weights, "--log-format", kind, "--init-seconds", "0.4", flag)
    assert child.wait() == 1
    pieces = child.pieces()
    assert re.search(failure, pieces[-1]) or any(re.search(failure, p) for p in pieces[-4:])
    report = child.result(timeout=1)
    assert report["outcome"] == "failed" and report["ready_at"] is None
    if flag.startswith("--crash-at"):
        assert report["weights_done_at"] is None
        if kind == "sglang":  # progress reached half of the shards and no further
            assert any("1/2" in p for p in pieces) and not any("2/2" in p for p in pieces)
    else:
        assert report["weights_done_at"] is not None
        elapsed = report["start_time"] + report["load_seconds"] - report["weights_done_at"]
        assert elapsed >= 0.2  # halfway through the 0.4 s of init
    assert not child.pidfile.exists()


def test_sigterm_mid_load_exits_promptly_and_removes_the_pidfile(tmp_path: Path, sim: Any) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 2, 4 * MiB)
    child = sim(weights, "--read-rate", "1MB/s", "--cached-read-rate", "1MB/s")
    wait_for(lambda: "Load weight begin" in child.text())
    assert child.pidfile.read_text().strip() == str(child.proc.pid)
    child.proc.send_signal(signal.SIGTERM)
    assert child.wait(timeout=1.5) == 0
    assert not child.pidfile.exists() and not child.report.exists()


def test_sigint_ends_an_endless_stall(tmp_path: Path, sim: Any) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 1, 1 * MiB)
    child = sim(weights, "--stall-at", "0", "--stall-for", "1000d", "--log-format", "vllm")
    wait_for(lambda: "Loading safetensors checkpoint shards:   0%" in child.text())
    time.sleep(0.2)
    child.proc.send_signal(signal.SIGINT)
    assert child.wait(timeout=1.5) == 0
    assert not child.pidfile.exists()


# --- log formats ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sglang", "vllm", "llamacpp", "tgi"])
def test_startup_log_has_the_reference_markers_in_order(
    tmp_path: Path, sim: Any, kind: str
) -> None:
    weights = tmp_path / "w"
    make_shards(weights, 3, 256 * 1024)
    child = sim(weights, "--log-format", kind, "--init-seconds", "0.3", "--exit-after", "100ms")
    assert child.wait() == 0
    pieces = child.pieces()
    order = [first_index(pieces, marker) for marker in MARKERS[kind]]
    assert order == sorted(order), list(zip(MARKERS[kind], order, strict=True))
    assert any(child.report.read_text())

    if kind == "sglang":
        progress = [m.groups() for p in pieces if (m := re.search(SGLANG_PROGRESS, p))]
        assert progress[-1] == ("100", "3", "3")
        for piece in pieces:
            match = SGLANG_LINE.match(piece)
            assert match or piece.startswith(SGLANG_TQDM), piece
            if match:
                stamp = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S"))
                assert child.started - 1 <= stamp <= time.time() + 1
    elif kind == "vllm":
        progress = [m.groups() for p in pieces if (m := re.search(VLLM_PROGRESS, p))]
        assert progress[-1] == ("100", "3", "3")
        for piece in pieces:
            match = VLLM_LINE.match(piece)
            assert match and match.group(2) == str(child.proc.pid), piece
            assert (
                VLLM_LOGGED.match(match.group(3))
                or "INFO:     " in piece
                or (re.search(r"(Loading safetensors|Capturing CUDA graphs)", piece))
            ), piece
        served = re.search(VLLM_MARKERS[-2], child.text())
        assert served and served.group(1) == f"http://127.0.0.1:{child.port}"
    elif kind == "llamacpp":
        assert sum(p.count(".") for p in pieces if re.fullmatch(r"\.+", p)) == 100
    else:
        assert all(TGI_LINE.match(p) for p in pieces), pieces
        assert re.search(r"Starting shard rank=0$", child.text(), re.M)


@pytest.mark.parametrize("kind", ["sglang", "vllm"])
def test_a_follower_binds_no_port_and_ends_with_a_followers_line(
    tmp_path: Path, sim: Any, kind: str
) -> None:
    """A node of a model over several hosts: nothing listens, its head's own steps and lines
    (the warm-up, the ready line) are not its, and its last line is a follower's end."""
    weights = tmp_path / "w"
    make_shards(weights, 2, 256 * 1024)
    child = sim(weights, "--log-format", kind, "--follower", "--init-seconds", "0.3")
    report = child.result()
    assert report["outcome"] == "ready" and report["ready_at"] is not None
    with socket.socket() as probe:
        assert probe.connect_ex(("127.0.0.1", child.port)) != 0  # refused: nothing bound
    parser = MarkerParser(kind)
    kinds = [e.kind for e in parser.feed(child.text(), time.time())]
    assert kinds[-1] is EventKind.NODE_UP and EventKind.READY not in kinds
    assert EventKind.WARMUP_BEGIN not in kinds


# --- setup --------------------------------------------------------------------------------------


def test_generate_writes_valid_incompressible_shards_of_many_tensors_once(
    tmp_path: Path, sim: Any
) -> None:
    weights = tmp_path / "new" / "model"
    args = ("--generate", "2", "--shard-size", "9MiB", "--init-seconds", "0", "--exit-after",
            "50ms")  # fmt: skip
    assert sim(weights, *args, name="first").wait() == 0
    shards = sorted(weights.glob("*.safetensors"))
    assert [p.name for p in shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    for path in shards:
        data = path.read_bytes()
        assert len(data) == 9 * MiB
        (header_len,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + header_len])
        header.pop("__metadata__")
        spans = sorted(tuple(t["data_offsets"]) for t in header.values())
        # 4 MiB tensors, contiguous, filling the file: a loader consumes it tensor by tensor.
        assert [end - start for start, end in spans] == [4 * MiB, 4 * MiB, MiB - 8 - header_len]
        assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
        assert spans[0][0] == 0 and 8 + header_len + spans[-1][1] == len(data)
        with safe_open(str(path), framework="numpy") as tensors:
            for name, entry in header.items():
                start, end = entry["data_offsets"]
                body = data[8 + header_len + start : 8 + header_len + end]
                assert tensors.get_tensor(name).tobytes() == body
        body = data[8 + header_len :]
        assert len(zlib.compress(body)) > 0.99 * len(body)
    before = [(p.stat().st_ino, p.stat().st_mtime_ns) for p in shards]
    assert sim(weights, *args, name="second").wait() == 0
    assert [(p.stat().st_ino, p.stat().st_mtime_ns) for p in shards] == before
    assert not list(weights.glob(".*"))


def test_generate_shards_replaces_a_shard_of_the_wrong_size(tmp_path: Path) -> None:
    generate_shards(tmp_path, 1, 8192)
    (path,) = tmp_path.glob("*.safetensors")
    path.write_bytes(b"short")
    generate_shards(tmp_path, 1, 8192)
    assert path.stat().st_size == 8192


@pytest.mark.parametrize(
    "args",
    [
        ["--read-rate", "fast"],
        ["--crash-at", "1.5"],
        ["--stall-for", "soon"],
        ["--log-format", "triton"],
        ["--shard-size", "12"],
        ["--port", "70000"],
        ["--loader", "direct"],
        ["--tensor-parallel", "0"],
        ["--import-bytes", "lots"],
        ["--direct"],  # the default loader maps its shards: a mapping cannot bypass the cache
        ["--follower", "--log-format", "llamacpp"],  # llama.cpp runs on one host
        ["--no-such-flag"],
    ],
)
def test_bad_flags_fail_with_one_line_and_exit_2(tmp_path: Path, args: list[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "exporter", "simulate", "--weights", str(tmp_path), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr


def test_missing_weights_and_busy_port_fail_with_one_line_and_exit_1(tmp_path: Path) -> None:
    missing = subprocess.run(
        [sys.executable, "-m", "exporter", "simulate", "--weights", str(tmp_path / "absent"),
         "--port", str(free_port()), "--pidfile", str(tmp_path / "pid")],
        cwd=ROOT, capture_output=True, text=True, timeout=15,
    )  # fmt: skip
    assert missing.returncode == 1
    assert missing.stderr.count("\n") == 1 and "absent" in missing.stderr
    assert not (tmp_path / "pid").exists()

    make_shards(tmp_path / "w", 1, 4096)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        done = subprocess.run(
            [sys.executable, "-m", "exporter", "simulate", "--weights", str(tmp_path / "w"),
             "--port", str(busy.getsockname()[1])],
            cwd=ROOT, capture_output=True, text=True, timeout=15,
        )  # fmt: skip
    assert done.returncode == 1
    assert done.stderr.count("\n") == 1 and "cannot bind" in done.stderr


@pytest.mark.parametrize("path", ["/health", "/health_generate", "/ready", "/ping"])
def test_the_simulated_sglang_serves_generations_while_its_status_paths_say_503(path: str) -> None:
    """As the real 0.5.23 does: its status paths read server_status, Starting until its own
    warm-up request was answered; completions are served from the moment the port opens."""
    endpoint = Endpoint(ServerKind.SGLANG, "m", "127.0.0.1", 0)
    try:
        endpoint.state = "warmup"
        assert endpoint.respond("GET", path, b"")[0] == 503
        body = b'{"model": "m", "prompt": "ping", "max_tokens": 1}'
        status, answer = endpoint.respond("POST", "/v1/completions", body)
        assert status == 200 and json.loads(answer)["choices"]
        endpoint.state = "ready"
        assert endpoint.respond("GET", path, b"")[0] == 200
    finally:
        endpoint.close()
