"""Log marker parsing: lines/s on one core, and the CPU share of a LogSource following a busy log.

1. Parser throughput: 1,000,000 lines in the five servers' formats (startup markers, tqdm bars
   redrawn with `\\r`, ANSI-coloured vLLM worker prefixes, request noise, garbage), fed as the
   source feeds them (64 KiB chunks), through `MarkerParser` with `format: auto`. Beside it, the
   same text through `str.splitlines()` alone: the floor any line-based reader pays.
2. Follower cost: a child process appends `--rate` lines/s to a file for `--seconds`; a LogSource
   samples it once a second; the CPU time of sampling (thread CPU clock) over wall time is the share
   of one core it costs, quoted beside `tail -F` following the same file (its CPU from /proc).
   As root with journald running, the same lines through `systemd-cat` into the journal, followed by
   unit (its `journalctl` child's CPU counted separately).

Run: `.venv/bin/python bench/logparse.py [--lines N] [--rate 2000] [--seconds 20]`
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from exporter.config.schema import LogConfig
from exporter.logs.markers import MarkerParser
from exporter.sources.logs import LogSource

CHUNK = 64 * 1024
TARGET_LINES_PER_SECOND = 200_000

FIXTURES = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "logs"


def _noise(fmt: str, rng: random.Random, i: int) -> str:
    """One line of what a serving instance logs between startups (requests, stats)."""
    n = rng.randrange(1, 4096)
    if fmt == "sglang":
        return (
            f"[2026-11-30 08:13:{i % 60:02d} TP{i % 8}] Decode batch. #running-req: {n % 64}, "
            f"#token: {n}, token usage: 0.{n % 100:02d}, gen throughput (token/s): {n / 7:.2f}, "
            "#queue-req: 0, "
        )
    if fmt == "vllm":
        return (
            f"\x1b[1;36m(VllmWorker rank={i % 4} pid=4242)\x1b[0;0m INFO 11-30 08:13:{i % 60:02d}"
            f" [loggers.py:123] Engine 000: Avg prompt throughput: {n / 3:.1f} tokens/s, Avg "
            f"generation throughput: {n / 5:.1f} tokens/s, Running: {n % 9} reqs, Waiting: 0 reqs"
        )
    if fmt == "tgi":
        return (
            f"2026-11-30T08:13:{i % 60:02d}.{n:06d}Z  INFO generate{{parameters=GenerateParameters"
            f" {{ best_of: None, max_new_tokens: Some({n}) }}}}: text_generation_router::server: "
            f"router/src/server.rs:402: Success"
        )
    if fmt == "triton":
        return f"I1130 08:13:{i % 60:02d}.{n:06d} 1 http_server.cc:4713] HTTP request: 2 /v2/infer"
    return (
        f"slot update_slots: id  {n % 4} | task {i} | n_past = {n}, n_tokens = {n % 512}, "
        f"progress = 0.{n % 1000:03d}"
    )


def _bar(rng: random.Random, i: int) -> str:
    """A tqdm redraw that is no marker: a download or a dataset bar, `\\r`-terminated."""
    done = i % 1000
    meter = f"{done // 10:3d}%|{'█' * (done // 100):10s}| {done}/1000 [00:01<00:09]"
    return f"Downloading shards: {meter}\r"


def _garbage(rng: random.Random) -> str:
    return bytes(rng.randrange(32, 256) for _ in range(rng.randrange(10, 120))).decode("latin-1")


def build_streams(total_lines: int, seed: int = 1) -> dict[str, str]:
    """Per format: its startup fixture, again now and then, among noise, bars and garbage."""
    rng = random.Random(seed)
    fixtures = {
        "sglang": "sglang-0.5-tp2.log",
        "vllm": "vllm-0.9-tp2-ansi.log",
        "llamacpp": "llamacpp-server.log",
        "tgi": "tgi-3.3-sharded.log",
        "triton": "triton-2.log",
    }
    per_stream = total_lines // len(fixtures)
    streams = {}
    for fmt, name in fixtures.items():
        startup = (FIXTURES / name).read_text(encoding="utf-8", errors="replace")
        startup_lines = startup.count("\n") + startup.count("\r")
        parts: list[str] = [startup]
        lines = startup_lines
        i = 0
        while lines < per_stream:
            roll = rng.random()
            if roll < 0.8:
                parts.append(_noise(fmt, rng, i) + "\n")
            elif roll < 0.95:
                parts.append(_bar(rng, i))
            elif roll < 0.999:
                parts.append(_garbage(rng) + "\n")
            else:
                parts.append(startup)
                lines += startup_lines - 1
            lines += 1
            i += 1
        streams[fmt] = "".join(parts)
    return streams


def _lines(text: str) -> int:
    return text.count("\n") + text.count("\r")


def parse_throughput(total_lines: int) -> None:
    streams = build_streams(total_lines)
    lines = sum(_lines(text) for text in streams.values())
    chunks = {
        fmt: [text[i : i + CHUNK] for i in range(0, len(text), CHUNK)]
        for fmt, text in streams.items()
    }

    started = time.process_time()
    for parts in chunks.values():
        for part in parts:
            part.splitlines()
    floor = time.process_time() - started

    events = 0
    started = time.process_time()
    for parts in chunks.values():
        parser = MarkerParser("auto")
        tail = ""
        for part in parts:
            text = tail + part
            cut = max(text.rfind("\n"), text.rfind("\r")) + 1
            tail = text[cut:]
            events += len(parser.feed(text[:cut], 0.0))
        events += len(parser.feed(tail, 0.0))
    spent = time.process_time() - started
    rate = lines / spent
    megabytes = sum(map(len, streams.values())) / 1e6
    verdict = "OK" if rate >= TARGET_LINES_PER_SECOND else "BELOW TARGET"
    print(f"parser: {lines:,} lines ({megabytes:.0f} MB) in {spent:.2f} s CPU, {events:,} events")
    print(f"  {rate:,.0f} lines/s on one core (target >= {TARGET_LINES_PER_SECOND:,}): {verdict}")
    print(f"  str.splitlines() alone: {lines / floor:,.0f} lines/s ({spent / floor:.1f}x cheaper)")


_WRITER = r"""
import sys, time
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
out = open(sys.argv[3], "a", buffering=1) if len(sys.argv) > 3 else sys.stdout
line = "[2026-11-30 08:13:23 TP0] Decode batch. #running-req: 12, #token: 4312, "
line += "token usage: 0.05, gen throughput (token/s): 812.44, #queue-req: 0, \n"
start = time.monotonic(); n = 0
while time.monotonic() - start < seconds:
    due = int((time.monotonic() - start) * rate)
    while n < due:
        out.write(line); n += 1
    out.flush()
    time.sleep(0.01)
"""


def _proc_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children_cpu(pid: int) -> float:
    """CPU of `pid`'s direct children (journalctl under the LogSource)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(OSError):
                total += _proc_cpu(int(child))
    return total


def _sample_for(source: LogSource, writer: subprocess.Popen[bytes]) -> tuple[float, float, int]:
    """Sample once a second until the writer ends; (own CPU s, wall s, lines read)."""
    cpu, started, lines = 0.0, time.monotonic(), 0
    while True:
        done = writer.poll() is not None
        time.sleep(1.0)
        before = time.thread_time()
        lines = source.sample().lines_total
        cpu += time.thread_time() - before
        if done:
            return cpu, time.monotonic() - started, lines


def _share(label: str, cpu: float, wall: float) -> None:
    print(f"  {label}: {cpu * 1000:.0f} ms CPU = {100 * cpu / wall:.2f} % of one core")


def follow_file(rate: float, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "server.log"
        path.write_text("[2026-11-30 08:13:22] server_args=ServerArgs(model_path='/m')\n")
        source = LogSource(LogConfig(file=str(path)))
        source.sample()
        tail = subprocess.Popen(
            ["tail", "-F", "-n", "0", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(rate), str(seconds), str(path)]
        )
        cpu, wall, lines = _sample_for(source, writer)
        tail_cpu = _proc_cpu(tail.pid)
        tail.terminate()
        tail.wait()
        source.close()
    print(f"file follower: {lines:,} lines at {rate:,.0f} lines/s over {wall:.1f} s, 1 sample/s")
    _share("LogSource", cpu, wall)
    _share("tail -F on the same file", tail_cpu, wall)


def follow_journal(rate: float, seconds: float) -> None:
    """The same through journald (root, a running journald): the LogSource plus its journalctl."""
    if os.geteuid() != 0 or not Path("/run/systemd/journal/socket").exists():
        print("journal follower: skipped (needs root and a running journald)")
        return
    tag = f"mle-bench-{os.getpid()}"
    source = LogSource(LogConfig(journald_unit=f"{tag}.service"), since=time.time())
    cgroup = Path("/sys/fs/cgroup/unified/system.slice") / f"{tag}.service"
    if not Path("/sys/fs/cgroup/unified/cgroup.procs").exists():
        cgroup = Path("/sys/fs/cgroup/system.slice") / f"{tag}.service"
    cgroup.mkdir(parents=True)
    source.sample()
    script = f"echo $$ > {cgroup}/cgroup.procs && exec systemd-cat -t {tag} {sys.executable} -c"
    writer = subprocess.Popen(["sh", "-c", f'{script} "$0" {rate} {seconds}', _WRITER])
    cpu, wall, lines = _sample_for(source, writer)
    child_cpu = _children_cpu(os.getpid())
    source.close()
    cgroup.rmdir()
    print(f"journal follower: {lines:,} lines at {rate:,.0f} lines/s over {wall:.1f} s")
    _share("LogSource", cpu, wall)
    _share("its journalctl --follow -o json", child_cpu, wall)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--rate", type=float, default=2000.0)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    parse_throughput(args.lines)
    follow_file(args.rate, args.seconds)
    follow_journal(args.rate, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
