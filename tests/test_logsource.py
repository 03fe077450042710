"""LogSource on real files (rotation, truncation, absence, bad bytes, huge lines) and on a real
`journalctl`-shaped child process; the journald system test is in test_logs_e2e.py."""

from __future__ import annotations

import json
import math
import random
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.logreplay import FIXTURES

from exporter.config.schema import LogConfig
from exporter.logs.decode import MAX_LINE
from exporter.logs.journal import journalctl_command, parse_journal_json
from exporter.sources.logs import (
    CPU_BURST,
    MAX_EVENTS,
    PARSE_CHUNK,
    READ_BUDGET,
    LogSample,
    LogSource,
    new_events,
)
from exporter.vocabulary import LogEncoding, ServerKind, Step

SGLANG = (FIXTURES / "sglang-0.5-tp2.log").read_bytes()


def kinds(sample: LogSample, after: int = 0) -> list[str]:
    return [e.kind.value for e in new_events(sample, after)]


def source_for(path: Path, fmt: str = "auto") -> LogSource:
    return LogSource(LogConfig(file=str(path), format=fmt))  # type: ignore[arg-type]


def test_missing_file_is_not_up_then_read_from_its_start(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    source = source_for(path)
    sample = source.sample()
    assert not sample.up
    assert sample.reason == f"{path} does not exist (yet)"
    assert sample.format is None and sample.events == ()
    path.write_bytes(SGLANG)  # appeared after following began: all of it is this load's
    sample = source.sample()
    assert sample.up and sample.reason is None
    assert sample.format == ServerKind.SGLANG
    assert kinds(sample)[0] == "weights_begin" and kinds(sample)[-1] == "ready"
    assert sample.ready_at is not None and sample.step is Step.NONE
    # The fixture's March stamps are far from now, so read times stand in for them.
    assert [step for step, _ in sample.steps] == [
        Step.WEIGHTS,
        Step.KV_CACHE,
        Step.CUDA_GRAPH,
        Step.WARMUP,
    ]
    assert sample.weights == (4, 4) and sample.cuda_graphs == (4, 4)
    assert sample.bytes_total == len(SGLANG)
    assert sample.lines_total == SGLANG.count(b"\n") + SGLANG.count(b"\r")


def test_existing_file_is_read_from_its_end(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(SGLANG)  # an older load's history
    source = source_for(path)
    sample = source.sample()
    assert sample.up and sample.events == () and sample.bytes_total == 0
    with path.open("ab") as f:
        f.write(b"[2026-03-02 11:00:00] Load weight begin. avail mem=70.00 GB\n")
    assert kinds(source.sample()) == ["weights_begin"]


def test_follows_rename_rotation_and_copytruncate(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "sglang")
    source.sample()
    lines = SGLANG.split(b"\n")
    third = len(lines) // 3
    with path.open("ab") as f:
        f.write(b"\n".join(lines[:third]) + b"\n")
    first = source.sample()
    # logrotate's create: the old file is renamed after more was written to it, a new one starts.
    with path.open("ab") as f:
        f.write(b"\n".join(lines[third : 2 * third]) + b"\n")
    path.rename(tmp_path / "server.log.1")
    path.write_bytes(b"\n".join(lines[2 * third :]))
    rotated = source.sample()
    assert rotated.up
    assert kinds(rotated)[-1] == "ready"
    assert rotated.last_seq > first.last_seq
    assert rotated.bytes_total == len(SGLANG)  # every byte once, no line lost or doubled
    everything = [e.kind.value for e in rotated.events]
    assert everything.count("weights_begin") == 1 and everything.count("ready") == 1
    # copytruncate: the same inode cut to nothing, then a new load writes into it.
    with path.open("r+b") as f:
        f.truncate(0)
    with path.open("ab") as f:
        f.write(b"[2026-03-02 12:00:00] Load weight begin. avail mem=70.00 GB\n")
    assert kinds(source.sample(), rotated.last_seq) == ["weights_begin"]


def test_file_removed_and_recreated_later(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "sglang")
    source.sample()
    path.unlink()
    assert source.sample().up  # still reading the deleted file's open descriptor
    path.write_bytes(b"[2026-03-02 12:00:00] Load weight begin. avail mem=70.00 GB\n")
    assert kinds(source.sample()) == ["weights_begin"]


def test_a_path_that_is_no_file_says_why(tmp_path: Path) -> None:
    sample = source_for(tmp_path).sample()
    assert not sample.up
    assert sample.reason == f"{tmp_path} is not a regular file"


def test_bytes_that_are_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path)
    source.sample()
    with path.open("ab") as f:
        f.write(b"\xff\xfe[2026-03-02 10:00:00] \xc3(\n")
        f.write(b"[2026-03-02 10:00:01] Load weight begin. avail mem=70.00 GB \xe2\x82\n")
    sample = source.sample()
    assert sample.up and sample.format == ServerKind.SGLANG
    assert kinds(sample) == ["weights_begin"]
    assert "\ufffd" in sample.events[0].detail


def test_a_10_mb_line_without_newline_keeps_memory_bounded(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "sglang")
    source.sample()
    with path.open("ab") as f:
        f.write(b"[2026-03-02 10:00:00] Load weight begin. avail mem=70.00 GB " + b"x" * 10_000_000)
    for _ in range(3):  # 8 MiB per sample at most: the rest is skipped unread
        sample = source.sample()
    assert sample.bytes_total <= READ_BUDGET
    assert sample.bytes_total + sample.skipped_bytes > 10_000_000
    [(_, tail)] = source._files[0].decoder.tails()
    assert len(tail) <= MAX_LINE  # the rest of the line is skipped, not kept
    assert kinds(sample) == ["weights_begin"]  # its start is parsed like any line's
    with path.open("ab") as f:
        f.write(b"yyy\n[2026-03-02 10:00:09] Load weight end. elapsed=9.00 s, type=X, a\n")
    sample = source.sample()
    assert kinds(sample)[-1] == "weights_end"
    assert sample.lines_total == 2  # the cut line counts once


def test_open_tqdm_bar_is_seen_before_its_next_redraw(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "sglang")
    source.sample()
    bar = "\rLoading safetensors checkpoint shards: {}% Completed | {}/4 [00:01<00:01]"
    with path.open("a") as f:
        f.write("[2026-03-02 10:00:00] Load weight begin. avail mem=70.00 GB\n" + bar.format(25, 1))
    sample = source.sample()
    assert [(e.kind.value, e.done) for e in sample.events] == [
        ("weights_begin", None),
        ("weights_progress", 1),
    ]
    assert sample.step is Step.WEIGHTS and sample.weights == (1, 4)
    with path.open("a") as f:
        f.write(bar.format(50, 2))
    sample = source.sample()
    assert [e.done for e in new_events(sample, 2)] == [2]
    assert source.sample().last_seq == sample.last_seq  # nothing new, nothing counted twice


def test_events_are_bounded_and_numbered(tmp_path: Path) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "vllm")
    source.sample()
    line = "(Worker_TP0 pid=1) Loading safetensors checkpoint shards: 1% Completed | {}/9999\n"
    with path.open("a") as f:
        f.write("".join(line.format(k) for k in range(3 * MAX_EVENTS)))
    sample = source.sample()
    assert len(sample.events) == MAX_EVENTS
    assert sample.last_seq == 3 * MAX_EVENTS + 1  # the synthesized weights_begin, then each bar
    first = sample.last_seq - MAX_EVENTS + 1
    assert [e.seq for e in sample.events] == list(range(first, sample.last_seq + 1))


def test_garbage_never_raises(tmp_path: Path) -> None:
    rng = random.Random(3)
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path)
    source.sample()
    for _ in range(30):
        with path.open("ab") as f:
            f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 50_000))))
        sample = source.sample()
        assert sample.up
    assert sample.format is None and sample.events == ()


def test_unknown_format_is_announced_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path)
    source.sample()
    for _ in range(3):
        with path.open("a") as f:
            f.write("".join(f"worker {i}: all good\n" for i in range(1500)))
        sample = source.sample()
    assert sample.format is None and sample.format_reason.startswith("auto: unknown format")
    assert [r.getMessage() for r in caplog.records] == [
        f"log file:{path}: {sample.format_reason}; phases come from the other signals"
    ]


# --- journald, through a stand-in journalctl ------------------------------------------------------


def test_parse_journal_json() -> None:
    array = json.dumps(
        {
            "MESSAGE": list(b"\x1b[1;36mA\x1b[0;0m\rB\xff"),
            "__REALTIME_TIMESTAMP": "1796026693473897",
        }
    ).encode()
    entry = parse_journal_json(array)
    assert entry is not None
    assert entry.message == "\x1b[1;36mA\x1b[0;0m\rB\ufffd"
    assert entry.realtime == 1796026693.473897
    for bad in (b"", b"{", b"[]", b'{"MESSAGE": null}', b'{"MESSAGE": [300]}', b"\xff\xfe"):
        assert parse_journal_json(bad) is None


def test_journalctl_command_starts_from_boot_and_since() -> None:
    cmd = journalctl_command("sglang.service", 1796026693.5, None)
    assert cmd[:3] == ["journalctl", "--unit=sglang.service", "--boot"]
    assert "--since=@1796026693.500000" in cmd and "--follow" in cmd and "--output=json" in cmd
    assert "--after-cursor=s=1;i=2" in journalctl_command("u", 0.0, "s=1;i=2")


FAKE_JOURNALCTL = """#!{python}
import sys, time
args = sys.argv[1:]
with open({argv_log!r}, "a") as f:
    f.write(" ".join(args) + "\\n")
if any(a.startswith("--after-cursor=") for a in args):
    time.sleep(60)
for line in open({export!r}, "rb"):
    sys.stdout.buffer.write(line)
sys.stdout.flush()
print("Journal file /run/log/journal/x.journal corrupted", file=sys.stderr)
sys.exit(1)
"""


@pytest.mark.system
def test_journal_reader_with_a_stand_in_journalctl(tmp_path: Path) -> None:
    """A real child on a real pipe; it exits after the export, so the source restarts it after
    the last cursor (asserted through the arguments it was given)."""
    argv_log = tmp_path / "argv"
    fake = tmp_path / "journalctl"
    fake.write_text(
        FAKE_JOURNALCTL.format(
            python=sys.executable,
            argv_log=str(argv_log),
            export=str(FIXTURES / "journald-sglang-sim.jsonl"),
        )
    )
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    source = LogSource(
        LogConfig(journald_unit="sglang-demo.service"),
        since=1000.0,
        journalctl=str(fake),
        restart_after=0.5,
    )
    try:
        sample = source.sample()
        for _ in range(200):
            if not sample.up:
                break
            time.sleep(0.05)
            sample = source.sample()
        assert sample.source == "journald:sglang-demo.service"
        assert kinds(sample)[0] == "weights_begin" and kinds(sample)[-1] == "ready"
        # The graph step by its own line ("elapsed=1.20 s"), within the journal times' 1.204 s.
        assert dict(sample.steps)[Step.CUDA_GRAPH] == pytest.approx(1.20, abs=1e-3)
        assert not sample.up
        assert sample.reason == (
            "journalctl exited with 1: Journal file /run/log/journal/x.journal corrupted"
        )
        time.sleep(0.6)  # the restart back-off
        assert source.sample().up
        for _ in range(100):
            calls = argv_log.read_text().splitlines()
            if len(calls) == 2:
                break
            time.sleep(0.05)
        assert "--since=@1000.000000" in calls[0]
        last_cursor = json.loads(
            (FIXTURES / "journald-sglang-sim.jsonl").read_bytes().splitlines()[-1]
        )["__CURSOR"]
        assert f"--after-cursor={last_cursor}" in calls[1]
    finally:
        source.close()


def test_journalctl_missing(tmp_path: Path) -> None:
    source = LogSource(LogConfig(journald_unit="x.service"), journalctl=str(tmp_path / "nope"))
    sample = source.sample()
    assert not sample.up
    assert sample.reason == f"{tmp_path / 'nope'} not found; cannot read the journal"
    assert source.sample().events == ()


@pytest.mark.system
def test_follow_thread_drains_a_pipe_without_samples(tmp_path: Path) -> None:
    """`follow` reads on its own; report() only reports."""
    fake = tmp_path / "journalctl"
    export = str(FIXTURES / "journald-sglang-sim.jsonl")
    fake.write_text(
        f"#!{sys.executable}\nimport sys, time\n"
        f"sys.stdout.buffer.write(open({export!r}, 'rb').read())\n"
        "sys.stdout.flush()\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    source = LogSource(LogConfig(journald_unit="u.service"), journalctl=str(fake))
    stop = threading.Event()
    thread = threading.Thread(target=source.follow, args=(stop, 0.05), daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if source.report().ready_at is not None:
                break
            stop.wait(0.05)
        assert kinds(source.report())[-1] == "ready"
    finally:
        stop.set()
        thread.join(5)
        source.close()


# --- what a log may cost (issue 27 row 4) -----------------------------------------------------


class Ticks:
    """A stand-in for the sampling thread's CPU clock: every look costs `tick` seconds, so the
    number of chunks a sample parses is counted, whatever the machine's speed."""

    def __init__(self, tick: float) -> None:
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _noise_plain(n: int) -> bytes:
    return b"".join(b"noise %d: no server writes this\n" % i for i in range(n))


def _keywords_vllm(n: int) -> bytes:
    """Lines full of a configured format's keywords: each one costs a regex."""
    return b"".join(b"INFO 03-02 10:00:00 [x.py:1] Loading weights took %d\n" % i for i in range(n))


def _noise_cri(n: int) -> bytes:
    return b"".join(
        b"2026-03-02T10:00:00.%06dZ stdout F noise %d\n" % (i % 999999, i) for i in range(n)
    )


VLLM_WEIGHTS_DONE = b"INFO 03-02 10:00:09 [core.py:1] Loading weights took 1.0 seconds\n"
VLLM_FATAL = b"RuntimeError: Engine core initialization failed. See root cause above.\n"
CRI_SGLANG_BEGIN = (
    b"2026-03-02T10:00:09.000000Z stdout F [2026-03-02 10:00:09] Load weight begin. "
    b"avail mem=70.00 GB\n"
)


@pytest.mark.parametrize(
    ("fmt", "encoding", "noise", "marker"),
    [
        ("auto", "plain", _noise_plain, VLLM_WEIGHTS_DONE),
        ("vllm", "plain", _keywords_vllm, VLLM_FATAL),
        ("auto", "cri", _noise_cri, CRI_SGLANG_BEGIN),
    ],
    ids=["unknown-format", "keyword-flood", "cri-records"],
)
def test_a_sample_parses_within_its_cpu_share_and_skips_the_rest(
    tmp_path: Path, fmt: str, encoding: str, noise: Any, marker: bytes
) -> None:
    """20 MiB arrive at once: a sample parses chunks until its CPU allowance (CPU_BURST) is
    spent, then jumps to the file's end and counts what it skipped; the next line written is
    read (the reader is not left behind); a quiet spell earns the allowance back."""
    path = tmp_path / "0.log"
    path.write_bytes(b"")
    cpu, wall = Ticks(0.1), [1000.0]
    source = LogSource(
        LogConfig(file=str(path), format=fmt, encoding=LogEncoding(encoding)),  # type: ignore[arg-type]
        since=0.0,
        clock=lambda: wall[0],
        cpu_clock=cpu,
    )
    source.sample()
    data = noise(1)
    data = data * (20 * 1024 * 1024 // len(data)) + b"a line cut off"
    path.write_bytes(data)
    wall[0] += 60.0  # the first sample's look is paid back: a full CPU_BURST
    sample = source.sample()
    chunks = math.ceil(CPU_BURST / 0.1)  # the look that finds the allowance spent ends it
    assert sample.bytes_total == chunks * PARSE_CHUNK
    assert sample.bytes_total + sample.skipped_bytes == len(data)
    assert sample.lines_total < len(data) // 4 // len(noise(1))
    assert sample.activity > sample.lines_total  # skipped bytes still show the log moving
    with path.open("ab") as f:
        f.write(b" the rest of a line the skip cut\n" + marker)
    wall[0] += 0.5  # half a second at CPU_SHARE does not pay the overspent chunk back: they wait
    waited = source.sample()
    assert (waited.bytes_total, waited.skipped_bytes) == (sample.bytes_total, sample.skipped_bytes)
    wall[0] += 60.0
    after = source.sample()
    assert after.skipped_bytes == sample.skipped_bytes
    assert after.bytes_total + after.skipped_bytes == path.stat().st_size
    assert len(kinds(after)) == 1, kinds(after)


def _fds_on(path: Path) -> list[str]:
    fds = Path("/proc/self/fd")
    return [fd.name for fd in fds.iterdir() if _link(fd) == str(path)]


def _link(fd: Path) -> str | None:
    try:
        return str(fd.readlink())
    except OSError:
        return None


@pytest.mark.parametrize("tail", [b"", b"half a line"], ids=["whole-lines", "cut-line"])
def test_a_finished_log_reads_its_last_lines_then_lets_the_file_go(
    tmp_path: Path, tail: bytes
) -> None:
    path = tmp_path / "server.log"
    path.write_bytes(b"")
    source = source_for(path, "sglang")
    source.sample()
    assert _fds_on(path)
    with path.open("ab") as f:
        f.write(b"[2026-03-02 10:00:00] Load weight begin. avail mem=70.00 GB\n" + tail)
    source.finish()  # the process is gone: what it wrote last is still read, once
    sample = source.sample()
    assert kinds(sample) == ["weights_begin"] and sample.closed and sample.up
    assert _fds_on(path) == []
    with path.open("ab") as f:
        f.write(b"\n" + SGLANG * 20)  # anything more is no longer this process's
    later = source.sample()
    assert later.bytes_total == sample.bytes_total and later.events == sample.events
    assert _fds_on(path) == []


@pytest.mark.system
def test_a_finished_journal_stops_its_journalctl(tmp_path: Path) -> None:
    fake = tmp_path / "journalctl"
    export = str(FIXTURES / "journald-sglang-sim.jsonl")
    pid_file = tmp_path / "pid"
    fake.write_text(
        f"#!{sys.executable}\nimport os, sys, time\n"
        f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        f"sys.stdout.buffer.write(open({export!r}, 'rb').read())\n"
        "sys.stdout.flush()\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    source = LogSource(LogConfig(journald_unit="u.service"), journalctl=str(fake))
    try:
        source.sample()
        for _ in range(200):
            if pid_file.exists() and pid_file.read_text():
                break
            time.sleep(0.05)
        child = int(pid_file.read_text())
        source.finish()
        sample = source.sample()
        assert sample.closed
        assert not Path(f"/proc/{child}").exists() or "Z" in _state(child)
    finally:
        source.close()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.system
def test_a_flooding_journal_is_parsed_within_the_cpu_share_and_the_rest_dropped(
    tmp_path: Path,
) -> None:
    """journalctl's pipe full of entries no rule knows: a sample parses until its allowance is
    spent, then drops what the pipe holds unparsed (counted); journalctl goes on, unblocked."""
    fake = tmp_path / "journalctl"
    entry = json.dumps({"MESSAGE": "noise " * 20, "__REALTIME_TIMESTAMP": "1000000000"})
    fake.write_text(
        f"#!{sys.executable}\nimport sys, time\n"
        f"line = {entry!r}.encode() + b'\\n'\n"
        "for _ in range(40):\n    sys.stdout.buffer.write(line * 2000)\n"
        "sys.stdout.flush()\ntime.sleep(60)\n"
    )
    fake.chmod(0o755)
    cpu, wall = Ticks(0.1), [1000.0]
    source = LogSource(
        LogConfig(journald_unit="u.service"),
        journalctl=str(fake),
        clock=lambda: wall[0],
        cpu_clock=cpu,
    )
    try:
        source.sample()  # starts journalctl
        time.sleep(1.0)  # its pipe fills (1 MiB), then it blocks
        wall[0] += 60.0
        sample = source.sample()
        assert 0 < sample.bytes_total <= math.ceil(CPU_BURST / 0.1) * PARSE_CHUNK
        assert sample.skipped_bytes > 0 and sample.up
        assert sample.activity > sample.lines_total
    finally:
        source.close()
