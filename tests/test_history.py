"""The SQLite load history, on real database files, including broken, locked and unwritable ones."""

from __future__ import annotations

import logging
import sqlite3
import statistics
import threading
from dataclasses import replace
from pathlib import Path

import pytest

from exporter.config.schema import HistoryRetention
from exporter.history.store import SCHEMA_VERSION, HistoryStore
from exporter.load.records import LoadRecord
from exporter.load.report import LoadReport, PhaseTime, ReadRate, StorageRead
from exporter.vocabulary import Cache

T0 = 1_750_000_000.0


def record(
    duration: float,
    *,
    target: str = "kimi",
    at: float = T0,
    outcome: str = "ready",
    cache: str | None = "cold",
    partial: bool = False,
    gpu: int | None = None,
    phases: dict[str, float] | None = None,
    seen_late: bool = False,
) -> LoadRecord:
    return LoadRecord(
        target=target,
        started_at=at,
        ended_at=at + duration,
        outcome=outcome,
        cache=cache,
        partial=partial,
        phase_seconds=phases if phases is not None else {"starting": 10.0, "loading_weights": 60.0},
        weights_bytes=548 * 10**9,
        bytes_read=500 * 10**9,
        gpu_bytes_at_weights_end=gpu,
        seen_late=seen_late,
    )


@pytest.fixture
def store(tmp_path: Path) -> HistoryStore:
    return HistoryStore(str(tmp_path / "history.sqlite"))


def errors(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if r.name == "exporter.history.store" and r.levelno >= logging.ERROR
    ]


def test_round_trip_newest_first(store: HistoryStore) -> None:
    first = record(600.0, phases={"starting": 20.0, "loading_weights": 500.5, "initializing": 79.5})
    second = record(90.0, at=T0 + 3600, cache=None, partial=True, outcome="failed", gpu=7)
    other = record(30.0, target="other", at=T0 + 1000)
    for r in (first, second, other):
        store.add(r)
    assert store.enabled and store.problem is None
    # Read back with the row's id: the one /api/v1/loads/ID finds them by.
    first, second, other = (replace(r, id=i) for i, r in enumerate((first, second, other), 1))
    assert store.loads() == [second, other, first]
    assert store.loads("kimi") == [second, first]
    assert store.loads("kimi", limit=1) == [second]
    assert store.loads("nobody") == []
    assert [store.load(i) for i in (1, 2, 3, 4)] == [first, second, other, None]


def test_a_load_keeps_its_report_as_the_document_it_is(store: HistoryStore) -> None:
    report = LoadReport(
        expected_seconds=600.0,
        phases=(
            PhaseTime("loading_weights", 1500.0, 500.0),
            PhaseTime("compile", 9.0, None),
        ),
        page_cache_bytes=0,
        storage_bytes=548 * 10**9,
        storage_reads=(StorageRead("disk", "nvme0n1", 549 * 10**9),),
        read_rate=ReadRate("storage", 365e6, 1.1e9),
        reason="weights took 3.0x their cold median: storage delivered 365 MB/s against 1.1 GB/s",
    )
    store.add(replace(record(1600.0), report=report))
    store.add(record(1.0, at=T0 + 5000))  # a load without a report reads back without one
    assert [r.report for r in store.loads()] == [None, report]


def test_a_report_this_version_cannot_read_is_left_out_not_an_error(
    store: HistoryStore, tmp_path: Path
) -> None:
    store.add(record(10.0))
    with sqlite3.connect(tmp_path / "history.sqlite") as db:
        db.execute("UPDATE loads SET report = '{\"phases\": 7}'")
    [kept] = store.loads()
    assert kept.report is None and kept.duration_seconds == 10.0 and store.enabled


def test_survives_reopen_and_creates_the_directory(tmp_path: Path) -> None:
    path = tmp_path / "var" / "lib" / "mle" / "history.sqlite"
    store = HistoryStore(str(path))
    store.add(record(300.0, gpu=100))
    store.close()
    reopened = HistoryStore(str(path))
    assert reopened.loads() == [replace(record(300.0, gpu=100), id=1)]
    assert reopened.last_duration("kimi") == 300.0
    assert reopened.expected_weights_gpu_bytes("kimi") == 100
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    reopened.close()


def test_expectations_are_medians_of_the_last_ten_good_loads(store: HistoryStore) -> None:
    durations = [100.0 + 7 * i for i in range(14)]
    for i, d in enumerate(durations):
        store.add(
            record(d, at=T0 + 1000 * i, phases={"starting": d / 10, "loading_weights": d / 2})
        )
    store.add(record(500.0, at=T0 + 20_000, outcome="failed"))
    store.add(record(1.0, at=T0 + 21_000, partial=True))
    store.add(record(9.0, at=T0 + 22_000, cache="warm", phases={"starting": 3.0}))
    last_ten = durations[-10:]
    assert store.expected_duration("kimi", "cold") == statistics.median(last_ten)
    assert store.expected_phase_seconds("kimi", "cold") == {
        "starting": statistics.median(d / 10 for d in last_ten),
        "loading_weights": statistics.median(d / 2 for d in last_ten),
    }
    assert store.expected_duration("kimi", "warm") == 9.0
    assert store.expected_duration("kimi", "mixed") is None
    assert store.expected_phase_seconds("kimi", "mixed") == {}
    assert store.expected_duration("other", "cold") is None
    assert store.last_duration("kimi") == 9.0  # any outcome, the newest
    assert store.last_duration("other") is None


def test_a_phase_a_load_skipped_counts_as_zero(store: HistoryStore) -> None:
    store.add(record(100.0, phases={"starting": 100.0}))
    store.add(record(100.0, at=T0 + 1, phases={"starting": 40.0, "initializing": 60.0}))
    store.add(record(100.0, at=T0 + 2, phases={"starting": 50.0, "initializing": 50.0}))
    assert store.expected_phase_seconds("kimi", "cold") == {"starting": 50.0, "initializing": 50.0}


def test_a_phase_a_late_seen_load_could_not_time_is_left_out_not_zero(store: HistoryStore) -> None:
    store.add(record(100.0, phases={"starting": 10.0, "initializing": 30.0}))
    store.add(record(300.0, at=T0 + 1, phases={"initializing": 50.0}, seen_late=True))
    store.add(record(100.0, at=T0 + 2, phases={"starting": 20.0, "initializing": 40.0}))
    assert store.loads()[0].seen_late  # the newest: it ended last
    assert store.expected_phase_seconds("kimi", "cold") == {"starting": 15.0, "initializing": 40.0}
    assert store.expected_duration("kimi", "cold") == 100.0  # its duration is exact: it counts


def test_phase_medians_of_any_temperature(store: HistoryStore) -> None:
    store.add(record(100.0, cache="cold", phases={"loading_weights": 80.0, "initializing": 20.0}))
    store.add(record(50.0, at=T0 + 1, cache="warm", phases={"loading_weights": 8.0}))
    store.add(record(60.0, at=T0 + 2, cache=None, phases={"initializing": 40.0}))
    assert store.expected_phase_seconds("kimi", None) == {
        "loading_weights": 8.0,
        "initializing": 20.0,
    }
    assert store.expected_phase_seconds("kimi", Cache.UNKNOWN) == {"initializing": 40.0}


def test_a_version_1_file_is_migrated_in_place(tmp_path: Path) -> None:
    """Files written before `seen_late` existed keep their loads, as watched from the start."""
    path = tmp_path / "history.sqlite"
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE loads (id INTEGER PRIMARY KEY AUTOINCREMENT, target TEXT NOT NULL, "
            "started_at REAL NOT NULL, ended_at REAL NOT NULL, outcome TEXT NOT NULL, cache TEXT, "
            "partial INTEGER NOT NULL, phase_seconds TEXT NOT NULL, weights_bytes INTEGER, "
            "bytes_read INTEGER, gpu_bytes_at_weights_end INTEGER);"
            "INSERT INTO loads (target, started_at, ended_at, outcome, cache, partial, "
            "phase_seconds) VALUES ('kimi', 10.0, 70.0, 'ready', 'warm', 0, '{\"starting\": 5}');"
            "PRAGMA user_version = 1;"
        )
    store = HistoryStore(str(path))
    [old] = store.loads()
    assert (old.duration_seconds, old.cache, old.seen_late) == (60.0, "warm", False)
    assert old.resident_bytes_at_start is None  # not measured by a version-1 exporter
    store.add(replace(record(30.0, seen_late=True), resident_bytes_at_start=7))
    assert store.loads()[0].seen_late and store.enabled
    assert store.loads()[0].resident_bytes_at_start == 7
    assert old.startup_read_bytes is None  # nor start-up's reads by one before version 6
    store.add(replace(record(40.0), startup_read_bytes=6_100_000_000))
    assert store.loads()[0].startup_read_bytes == 6_100_000_000
    assert old.environment_bytes is None  # nor the environment by one before version 7
    store.add(replace(record(50.0), environment_bytes=9_800_000_000,
                      environment_resident_bytes=9_500_000_000))  # fmt: skip
    newest = store.loads()[0]
    assert (newest.environment_bytes, newest.environment_resident_bytes) == (9.8e9, 9.5e9)
    assert old.owner is None  # nor whose server loaded by one before version 8
    store.add(replace(record(60.0), owner=0))
    assert store.loads()[0].owner == 0 and store.owner("kimi") == 0
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION == 8
    assert store.loads()[-1].report is None  # no report was made of it


def test_a_names_loads_count_for_its_owner_only(store: HistoryStore) -> None:
    """A discovered name's past is its user's: loads another user's server filed under it (it
    held the name first) shape none of its expectations, listings or startup advice; loads of
    versions that filed no owner count for whoever owns it; unowned, every load counts."""
    store.add(replace(record(900.0, at=T0, gpu=99), owner=65534))  # the look-alike's, first
    store.add(replace(record(40.0, at=T0 + 100, gpu=10), owner=0))
    store.add(record(50.0, at=T0 + 200))  # an older version's: no owner filed
    assert store.expected_duration("kimi", "cold") == 50.0  # every load: the median of three
    store.own("kimi", 0)
    assert [r.duration_seconds for r in store.loads("kimi")] == [50.0, 40.0]
    assert store.expected_duration("kimi", "cold") == 45.0
    assert store.expected_weights_gpu_bytes("kimi") == 10
    store.add(replace(record(700.0, at=T0 + 300), owner=65534))
    assert store.last_duration("kimi") == 50.0  # not the other user's load filed since
    assert store.owner("kimi") == 65534  # but who filed last is said as it is
    assert len(store.loads()) == 4  # all of it kept, for `history` and /api/v1/loads
    store.own("kimi", None)
    assert store.last_duration("kimi") == 700.0


def test_partial_and_failed_loads_stay_out_of_expectations(store: HistoryStore) -> None:
    store.add(record(100.0, at=T0 - 1000, gpu=10))
    store.add(record(1.0, at=T0 + 10, partial=True, gpu=20))
    store.add(record(2.0, at=T0 + 20, outcome="failed", gpu=30))
    store.add(record(3.0, at=T0 + 30, cache=None))
    assert store.expected_duration("kimi", "cold") == 100.0
    assert store.expected_weights_gpu_bytes("kimi") == 10
    assert store.expected_duration("kimi", Cache.UNKNOWN) == 3.0  # its own group
    assert store.expected_duration("kimi", None) == 51.5  # any temperature: 100 s and 3 s
    assert store.last_duration("kimi") == 3.0


def test_empty_path_disables_quietly(caplog: pytest.LogCaptureFixture) -> None:
    store = HistoryStore("")
    store.add(record(10.0))
    assert not store.enabled and store.problem is None
    assert store.loads() == [] and store.expected_duration("kimi", "cold") is None
    assert store.expected_phase_seconds("kimi", "cold") == {}
    assert store.last_duration("kimi") is None and store.expected_weights_gpu_bytes("kimi") is None
    assert errors(caplog) == []


def test_corrupt_file_disables_history_with_one_log_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "history.sqlite"
    path.write_bytes(b"this is not an SQLite file, just junk " * 200)
    store = HistoryStore(str(path))
    store.add(record(10.0))
    assert store.loads() == [] and store.last_duration("kimi") is None
    assert not store.enabled
    assert store.problem is not None and "not a database" in store.problem
    [line] = errors(caplog)
    assert str(path) in line.getMessage()
    assert path.read_bytes().startswith(b"this is not an SQLite file")


def test_unwritable_location_disables_history(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    store = HistoryStore(str(blocker / "history.sqlite"))  # root can write anywhere but not here
    store.add(record(10.0))
    assert not store.enabled and store.problem is not None
    assert store.loads() == []
    assert len(errors(caplog)) == 1


def test_newer_schema_is_left_alone(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "history.sqlite"
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    store = HistoryStore(str(path))
    assert not store.enabled and store.problem is not None and "newer" in store.problem
    assert len(errors(caplog)) == 1


def test_database_locked_at_open_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "history.sqlite"
    HistoryStore(str(path)).close()
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store = HistoryStore(str(path), busy_timeout=0.05)
        store.add(record(10.0))
        assert store.loads() == []
        assert not store.enabled and store.problem is not None and "locked" in store.problem
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(errors(caplog)) == 1


def test_database_locked_later_does_not_raise(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A lock held by someone else delays writes and empties reads; it turns nothing off."""
    path = tmp_path / "history.sqlite"
    store = HistoryStore(str(path), busy_timeout=0.05)
    store.add(record(10.0))
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        store.add(record(20.0, at=T0 + 100))
        assert store.expected_duration("kimi", "cold") is None
        assert store.enabled and not store.up and "locked" in (store.write_problem or "")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(errors(caplog)) == 1
    store.retry()
    assert store.up and len(store.loads("kimi")) == 2
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM loads").fetchone()[0] == 2


def test_concurrent_writers_and_readers(store: HistoryStore) -> None:
    def write(n: int) -> None:
        for i in range(50):
            store.add(record(float(i + 1), target=f"t{n}", at=T0 + i))
            store.loads(f"t{n}", limit=5)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert store.enabled
    assert [len(store.loads(f"t{n}", limit=1000)) for n in range(4)] == [50] * 4
    assert store.last_duration("t3") == 50.0


def test_retention_keeps_the_newest_rows_and_drops_old_loads(tmp_path: Path) -> None:
    """Discovered targets are whatever any local user starts: the file must not grow forever."""
    path = tmp_path / "history.sqlite"
    store = HistoryStore(str(path), retention=HistoryRetention(max_rows=5, max_age=86400.0))
    for i in range(8):
        store.add(record(10.0, target=f"fake-{i}", at=T0 + i))
    assert [r.target for r in store.loads()] == [f"fake-{i}" for i in (7, 6, 5, 4, 3)]
    store.add(record(10.0, target="kimi", at=T0 + 2 * 86400))
    assert [r.target for r in store.loads()] == ["kimi"]  # the others ended a day before it
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT count(*) FROM loads").fetchone()[0] == 1
