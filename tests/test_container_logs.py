"""LogSource on container runtimes' log files: Docker's json-file and the CRI format of
/var/log/pods, written record by record as the runtimes write them (tests/helpers/containerlog.py):
each record's own time, lines split over records, stdout and stderr interleaved, bad records,
the process's start as the oldest record read (by bisection in a large file), and rotation."""

from __future__ import annotations

import calendar
import random
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers.containerlog import cri_record, docker_record, rfc3339nano
from helpers.logreplay import FIXTURES

from exporter.config.schema import LogConfig
from exporter.logs.decode import (
    BISECT_WINDOW,
    MAX_LINE,
    MAX_RECORD,
    parse_cri,
    parse_docker_json,
    parse_rfc3339,
)
from exporter.logs.files import ENTRY_SKEW
from exporter.sources.logs import LogSample, LogSource, new_events
from exporter.vocabulary import LogEncoding

LLAMA = (FIXTURES / "llamacpp-server.log").read_bytes().splitlines(keepends=True)
T0 = 1_796_000_000.0  # 2026-11-30: the records' times, well before now
Record = Callable[[bytes, str, float], bytes]
ENCODINGS = [(LogEncoding.DOCKER, docker_record), (LogEncoding.CRI, cri_record)]
IDS = ["docker", "cri"]


def source_for(
    path: Path, encoding: LogEncoding, since: float | None = None, fmt: str = "llamacpp"
) -> LogSource:
    config = LogConfig(file=str(path), encoding=encoding, format=fmt)  # type: ignore[arg-type]
    return LogSource(config, since=since)


def write(path: Path, *records: bytes) -> None:
    with path.open("ab") as f:
        f.write(b"".join(records))


def times_of(sample: LogSample) -> dict[str, float]:
    return {e.kind.value: e.time for e in reversed(sample.events)}  # the first of each kind


def test_rfc3339_as_the_runtimes_write_it() -> None:
    base = calendar.timegm((2026, 3, 2, 10, 0, 0, 0, 0, 0))
    assert parse_rfc3339(b"2026-03-02T10:00:00.123456789Z") == pytest.approx(
        base + 0.123456789, abs=1e-6
    )
    assert parse_rfc3339(b"2026-03-02T10:00:00.5Z") == base + 0.5  # trailing zeros dropped
    assert parse_rfc3339(b"2026-03-02T10:00:00Z") == base
    assert parse_rfc3339(b"2026-03-02T12:00:00.25+02:00") == base + 0.25  # containerd's local
    assert parse_rfc3339(b"2026-03-02T05:30:00-04:30") == base
    assert parse_rfc3339(rfc3339nano(T0 + 0.75).encode()) == pytest.approx(T0 + 0.75, abs=1e-6)
    assert parse_rfc3339(rfc3339nano(T0, offset_minutes=-90).encode()) == pytest.approx(
        T0, abs=1e-3
    )
    for bad in (b"", b"2026-03-02 10:00:00Z", b"2026-13-02T10:00:00Z", b"2026-03-02T10:00:00",
                b"2026-03-02T10:00:00.1234567890Z", b"\xff"):  # fmt: skip
        assert parse_rfc3339(bad) is None, bad


def test_records_decode_to_stream_time_and_text() -> None:
    entry = parse_docker_json(docker_record(b"main: model loaded\n", "stderr", T0)[:-1])
    assert entry is not None and (entry.time, entry.stream) == (
        pytest.approx(T0, abs=1e-3),
        "stderr",
    )
    assert entry.text == b"main: model loaded\n"
    partial = parse_cri(cri_record(b"load_tensors: lo", "stdout", T0)[:-1])
    assert partial is not None and partial.text == b"load_tensors: lo"  # P: no line end
    full = parse_cri(cri_record(b"ading model\r tensors\n", "stdout", T0)[:-1])
    assert full is not None and full.text == b"ading model\r tensors\n"  # F: the line ends
    assert parse_cri(b"2026-03-02T10:00:00Z stderr F") == parse_cri(
        b"2026-03-02T10:00:00Z stderr F "
    )
    assert parse_cri(b"2026-03-02T10:00:00Z stderr F:x text") is not None  # more tags may follow
    for bad in (b"", b"{", b"[]", b'{"log": 1, "stream": "stderr", "time": "2026-03-02T10:00:00Z"}',
                b'{"log": "x", "stream": "stdin", "time": "2026-03-02T10:00:00Z"}',
                b'{"log": "x", "stream": "stderr", "time": "yesterday"}', b"\xff\xfe"):  # fmt: skip
        assert parse_docker_json(bad) is None, bad
    for bad in (b"", b"garbage", b"2026-03-02T10:00:00Z stdout X text",
                b"now stdout F text", b"2026-03-02T10:00:00Z stdin F text"):  # fmt: skip
        assert parse_cri(bad) is None, bad


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_each_line_is_timed_by_its_record(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    """llama.cpp's lines carry no stamp: every event's time is its record's, not the read time."""
    path = tmp_path / "0.log"
    write(path, *(record(line, "stderr", T0 + 0.5 * i) for i, line in enumerate(LLAMA)))
    sample = source_for(path, encoding).sample()
    assert sample.up and sample.source == f"{encoding}:{path}"
    kinds = [e.kind.value for e in sample.events]
    assert kinds[0] == "weights_begin" and kinds[-1] == "ready"
    times = times_of(sample)
    markers = {"weights_begin": b"load_model: loading model", "kv_cache": b"KV buffer size",
               "ready": b"main: model loaded"}  # fmt: skip
    for kind, marker in markers.items():
        line = next(i for i, text in enumerate(LLAMA) if marker in text)
        assert times[kind] == pytest.approx(T0 + 0.5 * line, abs=1e-3), kind
    assert sample.lines_total == len(LLAMA)
    assert sample.bytes_total == path.stat().st_size


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_a_line_split_over_records_joins_up_apart_from_the_other_stream(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    path = tmp_path / "0.log"
    source = source_for(path, encoding)
    begin = b"load_tensors: loading model tensors, this can take a while... (mmap = true)"
    write(path,
          record(begin[:20], "stderr", T0),
          record(b"main: loading model\n", "stdout", T0 + 1),  # stdout's line between the parts
          record(begin[20:] + b" " + b"x" * 40_000, "stderr", T0 + 2))  # fmt: skip
    sample = source.sample()
    assert [e.kind.value for e in sample.events] == []  # the stderr line has not ended
    write(path, record(b"x" * 100 + b"\n", "stderr", T0 + 3))
    sample = source.sample()
    [event] = sample.events
    assert event.kind.value == "weights_begin" and event.time == pytest.approx(T0 + 3, abs=1e-3)
    assert sample.lines_total == 2  # stdout's and the joined one
    write(path, *(record(b"y" * 16_384, "stdout", T0 + 4) for _ in range(8)))
    source.sample()
    assert all(len(tail) <= MAX_LINE for _, tail in source._files[0].decoder.tails())
    write(path, record(b"\n", "stdout", T0 + 5))
    assert source.sample().lines_total == 3  # a 128 KiB line of 8 records: cut, counted once


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_a_tqdm_bar_in_partial_records_shows_progress_before_its_line_ends(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    path = tmp_path / "0.log"
    source = source_for(path, encoding, fmt="sglang")
    bar = "\rLoading safetensors checkpoint shards: {}% Completed | {}/4 [00:01<00:01]"
    write(path, record(b"[2026-03-02 10:00:00] Load weight begin. avail mem=70.00 GB\n",
                       "stderr", T0))  # fmt: skip
    write(path, record(bar.format(25, 1).encode(), "stderr", T0 + 1))
    assert source.sample().weights == (1, 4)
    write(path, record(bar.format(50, 2).encode(), "stderr", T0 + 2))
    sample = source.sample()
    assert sample.weights == (2, 4)
    assert [e.time for e in new_events(sample, 2)] == [pytest.approx(T0 + 2, abs=1e-3)]
    write(path, record((bar.format(100, 4) + "\n").encode(), "stderr", T0 + 3))
    assert source.sample().weights == (4, 4)


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_bad_records_are_skipped_and_never_raise(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    path = tmp_path / "0.log"
    source = source_for(path, encoding)
    write(path,
          b'{"log": "main: loading\\n", "stream": "std',  # a record cut short, then the next
          b"\n", b"garbage\n", b"\xff\xfe\xc3(\n", b"\n", b'["a list"]\n',
          record(LLAMA[6], "stderr", T0),
          b"2026-03-02T10:00:00Z stderr Q " + LLAMA[12],
          record(LLAMA[12], "stderr", T0 + 1))  # fmt: skip
    sample = source.sample()
    assert sample.up and [e.kind.value for e in sample.events] == ["weights_begin"]
    assert sample.events[0].time == pytest.approx(T0 + 1, abs=1e-3)  # the well-formed record's
    rng = random.Random(5)
    for _ in range(20):
        write(path, bytes(rng.randrange(256) for _ in range(rng.randrange(1, 30_000))))
        assert source.sample().up
    write(path, b"\n" + record(b"main: model loaded\n", "stderr", T0 + 2))
    assert source.sample().ready_at == pytest.approx(T0 + 2, abs=1e-3)


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_a_record_longer_than_any_is_skipped_with_memory_bounded(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    path = tmp_path / "0.log"
    source = source_for(path, encoding)
    source.sample()
    write(path, record(LLAMA[6], "stderr", T0), b"z" * (3 * MAX_RECORD))
    source.sample()
    assert len(source._files[0].decoder._records._tail) <= MAX_RECORD  # type: ignore[attr-defined]
    write(path, b"z" * 1000 + b"\n" + record(LLAMA[12], "stderr", T0 + 1))
    sample = source.sample()
    assert [e.kind.value for e in sample.events] == ["weights_begin"]
    assert sample.bytes_total == path.stat().st_size


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_an_older_process_lines_in_the_same_file_are_not_this_load(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    """Docker appends a restarted container's output to the same file: the crashed process's
    fatal line stays there. Reading from this process's start skips it, found by bisection
    through 30 MB of older records rather than parsed from the file's start."""
    path = tmp_path / "0.log"
    started = T0 + 3600
    filler = [record(b"srv  update_slots: all slots are idle " + b"." * 200 + b"\n", "stdout",
                     T0 + i * 0.01) for i in range(100_000)]  # fmt: skip
    write(path, *filler, record(b"main: exiting due to model loading error\n", "stderr",
                                started - 1.5))  # fmt: skip
    old = path.stat().st_size
    assert old > 25_000_000
    write(path, record(LLAMA[5], "stderr", started - ENTRY_SKEW / 2))  # within the skew: read
    write(path, *(record(line, "stderr", started + 0.1 * i) for i, line in enumerate(LLAMA[6:])))
    sample = source_for(path, encoding, since=started).sample()
    assert sample.fatal is None and sample.ready_at is not None
    assert sample.events[0].kind.value == "weights_begin"
    assert sample.bytes_total - (path.stat().st_size - old) <= 2 * BISECT_WINDOW


@pytest.mark.parametrize(("encoding", "record"), ENCODINGS, ids=IDS)
def test_follows_rotation_with_a_line_split_across_it(
    tmp_path: Path, encoding: LogEncoding, record: Record
) -> None:
    """Docker's max-size renames `<id>-json.log` to `.1`; the kubelet renames `0.log` to
    `0.log.<timestamp>`; either starts a new file, which may hold the rest of a split line."""
    path = tmp_path / ("0.log" if encoding is LogEncoding.CRI else "c-json.log")
    source = source_for(path, encoding)
    write(path, record(LLAMA[6], "stderr", T0), record(LLAMA[12][:30], "stderr", T0 + 1))
    source.sample()
    write(path, record(b"main: loading model\n", "stdout", T0 + 2))
    path.rename(
        path.with_name(path.name + (".20261130-120000" if encoding is LogEncoding.CRI else ".1"))
    )
    write(path, record(LLAMA[12][30:], "stderr", T0 + 3))
    sample = source.sample()
    assert [e.kind.value for e in sample.events] == ["weights_begin"]
    assert sample.events[0].time == pytest.approx(T0 + 3, abs=1e-3)
    assert sample.lines_total == 3  # the loader's first, main: loading, the joined load_tensors


def test_cri_follows_the_next_restart_file(tmp_path: Path) -> None:
    """A restarted container's log is `<N+1>.log` beside `<N>.log` (the kubelet keeps the last):
    the reader finishes the old file and goes on in the new one, from its start."""
    directory = tmp_path / "ns_pod_uid" / "server"
    directory.mkdir(parents=True)
    first = directory / "0.log"
    write(first, cri_record(LLAMA[12], "stderr", T0))
    source = source_for(first, LogEncoding.CRI, since=T0 - 1)
    assert [e.kind.value for e in source.sample().events] == ["weights_begin"]
    write(first, cri_record(b"main: exiting due to model loading error\n", "stderr", T0 + 1))
    write(directory / "1.log", *(cri_record(line, "stderr", T0 + 10 + i) for i, line in
                                 enumerate(LLAMA[12:])))  # fmt: skip
    sample = source.sample()
    kinds = [e.kind.value for e in sample.events]
    assert kinds[:2] == ["weights_begin", "fatal"] and kinds[2] == "weights_begin"
    assert kinds[-1] == "ready" and sample.fatal is None  # the new load's, read from 1.log
    write(
        directory / "1.log",
        cri_record(b"srv  update_slots: all slots are idle\n", "stdout", T0 + 99),
    )
    assert source.sample().lines_total == sample.lines_total + 1
    assert source.source == f"cri:{first}"
