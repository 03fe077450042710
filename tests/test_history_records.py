"""History keeps domain records: a column per LoadRecord field, the report as the values
exporter/history/explain.py made (exporter/load/report.py), in the JSON shape files have always
had."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from exporter.exposition import api
from exporter.exposition.api_build import load_document
from exporter.history.store import SCHEMA_VERSION, HistoryStore
from exporter.load.records import LoadRecord
from exporter.load.report import LoadReport, PhaseTime, ReadRate, StorageRead
from exporter.vocabulary import Cache, Outcome, Phase, Step

T0 = 1_760_000_000.0
SLOW = LoadReport(
    expected_seconds=600.0,
    phases=(PhaseTime(Phase.LOADING_WEIGHTS, 1500.0, 500.0), PhaseTime(Step.COMPILE, 9.0, None)),
    page_cache_bytes=0,
    storage_bytes=548 * 10**9,
    storage_reads=(StorageRead("disk", "nvme0n1", 549 * 10**9), StorageRead("nfs", "/mnt/m", 0)),
    read_rate=ReadRate("storage", 365e6, 1.1e9),
    reason="weights took 3.0x their cold median: storage delivered 365 MB/s against 1.1 GB/s",
    startup_storage_bytes=6_100_000_000,
    environment_bytes=1_750_000_000,
    environment_resident_bytes=50_000_000,
)
# Reports of other shapes: nothing to compare with, no counters at the start, no rate.
FIRST = LoadReport(None, (PhaseTime(Phase.STARTING, 3.0, None),), None, None, None, None, None,
                   environment_unknown="not learned yet")  # fmt: skip
BARE = LoadReport(12.0, (), 5, 0, (), ReadRate("page_cache", 4e9, None), None)


def load(at: float, report: LoadReport | None, **changes: Any) -> LoadRecord:
    record = LoadRecord(
        target="kimi", started_at=at, ended_at=at + 100.0, outcome=Outcome.READY,
        cache=Cache.COLD, partial=False, phase_seconds={"starting": 10.0, "loading_weights": 60.0},
        weights_bytes=548 * 10**9, bytes_read=500 * 10**9, gpu_bytes_at_weights_end=None,
        report=report,
    )  # fmt: skip
    return replace(record, **changes)


def test_the_table_has_a_column_for_each_field_of_the_record(tmp_path: Path) -> None:
    """A field added to LoadRecord without its column's migration fails here, not in a write."""
    path = tmp_path / "history.sqlite"
    HistoryStore(str(path)).close()
    with sqlite3.connect(path) as db:
        columns = [row[1] for row in db.execute("PRAGMA table_info(loads)")]
    assert sorted(columns) == sorted(f.name for f in dataclasses.fields(LoadRecord))


@pytest.mark.parametrize("report", [SLOW, FIRST, BARE, None], ids=["slow", "first", "bare", "none"])
def test_each_shape_of_record_reads_back_as_written(tmp_path: Path, report: LoadReport) -> None:
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    written = load(T0, report, cache=None, fatal="CUDA out of memory", seen_late=True,
                   resident_bytes_at_start=3, startup_read_bytes=2, phase_seconds={})  # fmt: skip
    store.add(written)
    [read] = store.loads()
    assert read == replace(written, id=1)
    assert read.report == report and isinstance(read.outcome, Outcome)


@pytest.mark.parametrize("report", [SLOW, FIRST, BARE], ids=["slow", "first", "bare"])
def test_the_report_is_stored_as_the_json_the_api_document_has(
    tmp_path: Path, report: LoadReport
) -> None:
    """What an earlier version wrote (the document's JSON) is what this one writes: files read
    the same either way (version 8 only added the owner's column)."""
    path = tmp_path / "history.sqlite"
    store = HistoryStore(str(path))
    store.add(load(T0, report))
    with sqlite3.connect(path) as db:
        [(stored,)] = db.execute("SELECT report FROM loads").fetchall()
    assert stored == json.dumps(load_document(load(T0, report))["report"])
    assert api.LoadReport.from_json(json.loads(stored)).to_json() == json.loads(stored)
    assert SCHEMA_VERSION == 8


def _old_file(path: Path, version: int, rows: list[dict[str, object]]) -> None:
    """A history file as the version before domain records wrote it: its own SQL, the report
    as the /api/v1 document's JSON."""
    columns = ["target", "started_at", "ended_at", "outcome", "cache", "partial", "phase_seconds",
               "weights_bytes", "bytes_read", "gpu_bytes_at_weights_end", "seen_late", "fatal",
               "resident_bytes_at_start", "report", "startup_read_bytes"]  # fmt: skip
    if version < 6:
        columns.remove("startup_read_bytes")
    with sqlite3.connect(path) as db:
        db.executescript(
            "CREATE TABLE loads (id INTEGER PRIMARY KEY AUTOINCREMENT, target TEXT NOT NULL, "
            "started_at REAL NOT NULL, ended_at REAL NOT NULL, outcome TEXT NOT NULL, cache TEXT, "
            "partial INTEGER NOT NULL, phase_seconds TEXT NOT NULL, weights_bytes INTEGER, "
            "bytes_read INTEGER, gpu_bytes_at_weights_end INTEGER, seen_late INTEGER NOT NULL "
            "DEFAULT 0, fatal TEXT, resident_bytes_at_start INTEGER, report TEXT"
            + (", startup_read_bytes INTEGER" if version >= 6 else "")
            + ");"
            "CREATE INDEX loads_by_target ON loads (target, ended_at);"
            "CREATE INDEX loads_by_end ON loads (ended_at);"
            f"PRAGMA user_version = {version};"
        )
        for row in rows:
            db.execute(
                f"INSERT INTO loads ({', '.join(columns)}) VALUES ({','.join('?' * len(columns))})",
                [row.get(c) for c in columns],
            )


def _old_row(at: float, report: dict[str, object] | None, **more: object) -> dict[str, object]:
    return {"target": "kimi", "started_at": at, "ended_at": at + 100.0, "outcome": "ready",
            "cache": "cold", "partial": 0, "phase_seconds": '{"loading_weights": 60.0, '
            '"starting": 10.0}', "weights_bytes": 548 * 10**9, "bytes_read": 500 * 10**9,
            "seen_late": 0, "report": json.dumps(report) if report is not None else None,
            **more}  # fmt: skip


@pytest.mark.parametrize("version", [5, 6])
def test_files_of_earlier_versions_read_as_domain_records(tmp_path: Path, version: int) -> None:
    path = tmp_path / "history.sqlite"
    slow = api.LoadReport(
        expected_seconds=600.0,
        phases=(api.PhaseTime("loading_weights", 1500.0, 500.0),),
        page_cache_bytes=0, storage_bytes=548 * 10**9,
        storage_reads=(api.StorageRead("disk", "nvme0n1", 549 * 10**9),),
        read_rate=api.ReadRate("storage", 365e6, 1.1e9), reason="weights took 3.0x",
    )  # fmt: skip
    first = api.LoadReport(None, (), None, None, None, None, None)
    more = {"startup_read_bytes": 7} if version >= 6 else {}
    rows = [
        _old_row(T0, slow.to_json(), **more),
        _old_row(T0 + 1000, first.to_json()),
        _old_row(T0 + 2000, None, outcome="failed", fatal="boom"),
    ]
    _old_file(path, version, rows)
    store = HistoryStore(str(path))
    newest, middle, oldest = store.loads()
    assert oldest.report == LoadReport(
        600.0, (PhaseTime("loading_weights", 1500.0, 500.0),), 0, 548 * 10**9,
        (StorageRead("disk", "nvme0n1", 549 * 10**9),), ReadRate("storage", 365e6, 1.1e9),
        "weights took 3.0x",
    )  # fmt: skip
    assert oldest.startup_read_bytes == (7 if version >= 6 else None)
    assert oldest.phase_seconds == {"starting": 10.0, "loading_weights": 60.0}
    assert middle.report == LoadReport(None, (), None, None, None, None, None)
    assert (newest.report, newest.outcome, newest.fatal) == (None, Outcome.FAILED, "boom")
    assert isinstance(oldest.report.phases[0], PhaseTime) if oldest.report else False
    # And what it shows: the same document the earlier version served.
    assert load_document(oldest)["report"] == slow.to_json()
    store.add(load(T0 + 3000, SLOW))
    assert store.loads()[0].report == SLOW
    with sqlite3.connect(path) as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION


@pytest.mark.parametrize(
    ("column", "text"),
    [
        ("report", '{"phases": 7}'),  # a part of another shape
        ("report", '{"expected_seconds": 1.0}'),  # a key without a default missing
        ("report", "{not json"),
        (
            "report",
            '{"expected_seconds": "soon", "phases": [], "page_cache_bytes": null, '
            '"storage_bytes": null, "storage_reads": null, "read_rate": null, '
            '"reason": null}',
        ),
        (
            "report",
            '{"expected_seconds": 1.0, "phases": [], "page_cache_bytes": 2.5, '
            '"storage_bytes": null, "storage_reads": null, "read_rate": null, '
            '"reason": null}',
        ),  # a count that is not whole: not cut to 2
        ("phase_seconds", '["starting", 10]'),
        ("phase_seconds", '{"starting": "ten"}'),
    ],
)
def test_a_json_column_that_does_not_read_is_left_out_and_the_load_kept(
    tmp_path: Path, column: str, text: str
) -> None:
    path = tmp_path / "history.sqlite"
    store = HistoryStore(str(path))
    store.add(load(T0, SLOW))
    with sqlite3.connect(path) as db:
        db.execute(f"UPDATE loads SET {column} = ?", (text,))
    [kept] = store.loads()
    assert kept.duration_seconds == 100.0 and store.enabled
    assert (kept.report, kept.phase_seconds) == (
        (None, {"starting": 10.0, "loading_weights": 60.0}) if column == "report" else (SLOW, {})
    )
