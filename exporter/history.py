"""SQLite store of finished loads: what the histograms forget across restarts, and what ETAs need.

History is a nice-to-have next to the live metrics, so it never takes the exporter down: a corrupt
file, a database locked by someone else or a read-only location logs one ERROR line and turns
history off (every method then returns empty or None) instead of raising into the sampler.
A failed write (a full disk) is different: what is stored stays readable, the record waits in
memory (a bounded few) and `retry()` writes it once the disk has room again; `up` says whether
finished loads are being kept.

Each load keeps its report (exporter/explain.py) as the JSON of the /api/v1 document it is, so it
reads back as it was written, and `id` is the row's, stable for /api/v1/loads/ID.

Retention: discovered targets are whatever any local user starts, so the store keeps at most
`max_rows` loads, none that ended more than `max_age` before the newest (config
`history_retention`); each write prunes.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import stat
import statistics
import threading
from collections import deque
from collections.abc import Callable, Mapping
from typing import TypeVar

from exporter.api import LoadReport
from exporter.config import HistoryRetention
from exporter.tracker import LoadRecord
from exporter.vocabulary import Cache, Outcome

log = logging.getLogger(__name__)

SCHEMA_VERSION = 7
EXPECTATION_LOADS = 10  # medians over this many recent good loads
BUSY_TIMEOUT_SECONDS = 0.5  # a sampler tick must not wait long on someone else's lock
MAX_PENDING = 100  # finished loads held in memory while writes fail
PRIVATE_FILE = 0o600
PRIVATE_DIRECTORY = 0o700
HISTORY_SUFFIXES = ("", "-journal", "-wal", "-shm")  # the file and what SQLite keeps beside it
# A symlink at the path is refused (ELOOP), a FIFO does not block the open.
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY

_SCHEMA = """
CREATE TABLE IF NOT EXISTS loads (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    target TEXT NOT NULL,
    started_at REAL NOT NULL,
    ended_at REAL NOT NULL,
    outcome TEXT NOT NULL,
    cache TEXT,
    partial INTEGER NOT NULL,
    phase_seconds TEXT NOT NULL,
    weights_bytes INTEGER,
    bytes_read INTEGER,
    gpu_bytes_at_weights_end INTEGER
);
CREATE INDEX IF NOT EXISTS loads_by_target ON loads (target, ended_at)
"""
# Statements that bring a file from version N-1 to N, in order; version 0 is an empty file.
_MIGRATIONS: tuple[tuple[str, ...], ...] = (
    tuple(_SCHEMA.split(";")),
    (
        "ALTER TABLE loads ADD COLUMN seen_late INTEGER NOT NULL DEFAULT 0",
        "ALTER TABLE loads ADD COLUMN fatal TEXT",
    ),
    ("CREATE INDEX IF NOT EXISTS loads_by_end ON loads (ended_at)",),
    ("ALTER TABLE loads ADD COLUMN resident_bytes_at_start INTEGER",),
    ("ALTER TABLE loads ADD COLUMN report TEXT",),
    ("ALTER TABLE loads ADD COLUMN startup_read_bytes INTEGER",),
    (
        "ALTER TABLE loads ADD COLUMN environment_bytes INTEGER",
        "ALTER TABLE loads ADD COLUMN environment_resident_bytes INTEGER",
    ),
)
_COLUMNS = (
    "target, started_at, ended_at, outcome, cache, partial, phase_seconds, weights_bytes, "
    "bytes_read, gpu_bytes_at_weights_end, seen_late, fatal, resident_bytes_at_start, report, "
    "startup_read_bytes, environment_bytes, environment_resident_bytes"
)
_PLACES = ",".join("?" * len(_COLUMNS.split(",")))
_SELECT = f"id, {_COLUMNS}"
_NEWEST_FIRST = "ORDER BY ended_at DESC, id DESC"

_T = TypeVar("_T")
_Row = tuple[
    int,
    str,
    float,
    float,
    str,
    str | None,
    int,
    str,
    int | None,
    int | None,
    int | None,
    int,
    str | None,
    int | None,
    str | None,
    int | None,
    int | None,
    int | None,
]


class HistoryStore:
    """One row per finished load; safe to share between threads."""

    def __init__(
        self,
        path: str,
        busy_timeout: float = BUSY_TIMEOUT_SECONDS,
        retention: HistoryRetention | None = None,
        private: bool = True,
    ) -> None:
        """`private`: the exporter's own store, made private first (`make_private`); the
        `history` command reading a file it was pointed at leaves it as it is."""
        self.path = path
        self.retention = retention or HistoryRetention()
        self.enabled = False
        self.problem: str | None = None
        self.write_problem: str | None = None  # why the last write failed, until one succeeds
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None
        self._pending: deque[LoadRecord] = deque(maxlen=MAX_PENDING)
        if not path:
            return
        problem = make_private(path) if private else None
        if problem is not None:
            self._disable(problem)
            return
        try:
            db = sqlite3.connect(
                path, timeout=busy_timeout, check_same_thread=False, isolation_level=None
            )
        except sqlite3.Error as exc:
            self._disable(str(exc))
            return
        try:
            _migrate(db)
        except (sqlite3.Error, _SchemaError) as exc:
            db.close()
            self._disable(str(exc))
            return
        self._db = db
        self.enabled = True

    @property
    def configured(self) -> bool:
        return bool(self.path)

    @property
    def up(self) -> bool:
        """Finished loads are being kept: the store is open and no write is failing."""
        return self.enabled and self.write_problem is None

    def add(self, record: LoadRecord) -> None:
        """Store a finished load; if the write fails it waits for retry(), reads go on."""
        self._pending.append(record)
        self.retry()

    def retry(self) -> None:
        """Write what earlier writes could not (cheap when nothing waits)."""
        if not self._pending:
            return
        with self._lock:
            db = self._db
            if db is None:
                return
            newest = None
            while self._pending:
                try:
                    db.execute(
                        f"INSERT INTO loads ({_COLUMNS}) VALUES ({_PLACES})",
                        _row(self._pending[0]),
                    )
                except sqlite3.Error as exc:
                    if self.write_problem is None:
                        log.error(
                            "cannot write load history, keeping %d finished load(s) in memory "
                            "and retrying: %s: %s",
                            len(self._pending),
                            self.path,
                            exc,
                        )
                    self.write_problem = f"{self.path}: {exc}"
                    return
                newest = self._pending.popleft().ended_at
            if newest is not None:
                self._prune(db, newest)
            if self.write_problem is not None:
                log.info("load history is writable again: %s", self.path)
                self.write_problem = None

    def _prune(self, db: sqlite3.Connection, now: float) -> None:
        """Drop loads past the retention: ended max_age before `now` (the end of the load just
        written, on the tracker's clock), or beyond the newest max_rows."""
        try:
            db.execute("DELETE FROM loads WHERE ended_at < ?", (now - self.retention.max_age,))
            db.execute(
                "DELETE FROM loads WHERE id <= (SELECT id FROM loads ORDER BY id DESC "
                "LIMIT 1 OFFSET ?)",
                (self.retention.max_rows,),
            )
        except sqlite3.Error as exc:
            log.debug("load history: pruning failed: %s", exc)

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        """Finished loads, newest first."""
        where, args = ("WHERE target = ?", (target,)) if target is not None else ("", ())
        sql = f"SELECT {_SELECT} FROM loads {where} {_NEWEST_FIRST} LIMIT ?"
        rows: list[_Row] = self._run(
            lambda db: db.execute(sql, (*args, max(0, limit))).fetchall(), []
        )
        return [_record(row) for row in rows]

    def load(self, load_id: int) -> LoadRecord | None:
        """One finished load by its id (/api/v1/loads/ID), None when none has it."""
        sql = f"SELECT {_SELECT} FROM loads WHERE id = ?"
        row: _Row | None = self._run(lambda db: db.execute(sql, (load_id,)).fetchone(), None)
        return _record(row) if row is not None else None

    def expected_duration(self, target: str, cache: Cache | None) -> float | None:
        """Median duration of the recent successful, non-partial loads of this target and cache
        temperature (None: any temperature)."""
        good = self._good_loads(target, cache)
        return statistics.median(r.duration_seconds for r in good) if good else None

    def expected_phase_seconds(self, target: str, cache: Cache | None) -> Mapping[str, float]:
        """Median seconds per phase over the same loads.

        A phase a watched load skipped counts as 0 s; a phase of a load first seen mid-way that
        the exporter could not time is left out of that phase's median instead.
        """
        good = self._good_loads(target, cache)
        phases = sorted({phase for r in good for phase in r.phase_seconds})
        medians = {}
        for p in phases:
            known = [
                r.phase_seconds.get(p, 0.0) for r in good if p in r.phase_seconds or not r.seen_late
            ]
            medians[p] = statistics.median(known)
        return medians

    def expected_weights_gpu_bytes(self, target: str) -> int | None:
        """GPU memory at the end of the weights of the last successful load that measured it."""
        sql = (
            "SELECT gpu_bytes_at_weights_end FROM loads WHERE target = ? AND outcome = 'ready' "
            f"AND partial = 0 AND gpu_bytes_at_weights_end IS NOT NULL {_NEWEST_FIRST} LIMIT 1"
        )
        row = self._run(lambda db: db.execute(sql, (target,)).fetchone(), None)
        return int(row[0]) if row else None

    def last_duration(self, target: str) -> float | None:
        """Duration of the last finished load of any outcome."""
        sql = f"SELECT started_at, ended_at FROM loads WHERE target = ? {_NEWEST_FIRST} LIMIT 1"
        row = self._run(lambda db: db.execute(sql, (target,)).fetchone(), None)
        return float(row[1] - row[0]) if row else None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            self.enabled = False

    def _good_loads(self, target: str, cache: Cache | None) -> list[LoadRecord]:
        """Recent successful, non-partial loads; of one cache temperature, or any (None)."""
        where, args = "", list[str | None]([target])
        if cache is not None:
            # Unknown temperature is stored as NULL.
            where = "AND cache IS ?"
            args.append(None if cache == Cache.UNKNOWN else str(cache))
        sql = (
            f"SELECT {_SELECT} FROM loads WHERE target = ? {where} AND outcome = 'ready' "
            f"AND partial = 0 {_NEWEST_FIRST} LIMIT {EXPECTATION_LOADS}"
        )
        rows: list[_Row] = self._run(lambda db: db.execute(sql, args).fetchall(), [])
        return [_record(row) for row in rows]

    def _run(self, query: Callable[[sqlite3.Connection], _T], default: _T) -> _T:
        with self._lock:
            if self._db is None:
                return default
            try:
                return query(self._db)
            except sqlite3.OperationalError as exc:
                if _transient(exc):  # someone else holds a lock: this read only comes back empty
                    log.debug("load history busy: %s", exc)
                    return default
                self._db.close()
                self._db = None
                self._disable(str(exc))
                return default
            except sqlite3.Error as exc:
                self._db.close()
                self._db = None
                self._disable(str(exc))
                return default

    def _disable(self, reason: str) -> None:
        """Called once at most: every method returns early once history is off."""
        self.enabled = False
        self.problem = f"{self.path}: {reason}"
        log.error("load history disabled, finished loads will not be kept: %s", self.problem)


def make_private(path: str) -> str | None:
    """Make the history file 0600 in a 0700 directory; why not, or None.

    Its failure lines are servers' words and its loads say what ran when: no other local user
    reads them, whatever the web config allows. A directory made here is 0700; one that exists
    is made 0700 when it is this user's and holds nothing but the history's files (an older
    version made it 0755), else left as it is (`/var/lib` stays 0755: the file alone is private
    then). Refused: a directory other users may write into without the sticky bit (they could
    swap the file), a symlink or anything but a regular file at the path, a file of another user
    (root's is accepted: no other user can make one). A file of this user's, or a SQLite journal
    beside it, open to others is made 0600.
    """
    directory = os.path.dirname(os.path.abspath(path))
    me = os.geteuid()
    try:
        os.makedirs(directory, mode=PRIVATE_DIRECTORY, exist_ok=True)
        st = os.stat(directory)
        if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
            return f"{directory} is writable by other users: refused"
        dedicated = set(os.listdir(directory)) <= {
            os.path.basename(path) + suffix for suffix in HISTORY_SUFFIXES
        }
        if st.st_uid == me and st.st_mode & 0o077 and dedicated:
            os.chmod(directory, PRIVATE_DIRECTORY)
            log.warning("load history: %s was mode %o, made %o", directory,
                        stat.S_IMODE(st.st_mode), PRIVATE_DIRECTORY)  # fmt: skip
    except OSError as exc:
        return f"cannot make directory {directory} private: {exc.strerror}"
    for suffix in HISTORY_SUFFIXES:
        create = os.O_CREAT if not suffix else 0
        try:
            fd = os.open(path + suffix, _OPEN_FLAGS | create, PRIVATE_FILE)
        except FileNotFoundError:
            continue
        except OSError as exc:
            return f"cannot open {path + suffix}: {exc.strerror}"
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return f"{path + suffix} is not a regular file: refused"
            if st.st_uid not in (me, 0):
                return f"{path + suffix} belongs to uid {st.st_uid}, not this user: refused"
            if st.st_mode & 0o077 and st.st_uid == me:
                os.fchmod(fd, PRIVATE_FILE)
                log.warning("load history: %s was mode %o, made %o", path + suffix,
                            stat.S_IMODE(st.st_mode), PRIVATE_FILE)  # fmt: skip
        except OSError as exc:
            return f"cannot make {path + suffix} private: {exc.strerror}"
        finally:
            os.close(fd)
    return None


def _transient(exc: sqlite3.OperationalError) -> bool:
    text = str(exc)
    return "locked" in text or "busy" in text


class _SchemaError(Exception):
    """The file holds a schema this version does not know."""


def _migrate(db: sqlite3.Connection) -> None:
    version = db.execute("PRAGMA user_version").fetchone()[0]
    if version == SCHEMA_VERSION:
        return
    if version > SCHEMA_VERSION:
        raise _SchemaError(
            f"schema version {version} is newer than this exporter's {SCHEMA_VERSION}"
        )
    db.execute("BEGIN IMMEDIATE")
    try:
        for statements in _MIGRATIONS[version:]:
            for statement in statements:
                if statement.strip():
                    db.execute(statement)
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")
        db.execute("COMMIT")
    except sqlite3.Error:
        db.execute("ROLLBACK")
        raise


def _row(record: LoadRecord) -> tuple[object, ...]:
    return (
        record.target,
        record.started_at,
        record.ended_at,
        record.outcome,
        record.cache,
        int(record.partial),
        json.dumps(dict(record.phase_seconds), sort_keys=True),
        record.weights_bytes,
        record.bytes_read,
        record.gpu_bytes_at_weights_end,
        int(record.seen_late),
        record.fatal,
        record.resident_bytes_at_start,
        json.dumps(record.report.to_json()) if record.report is not None else None,
        record.startup_read_bytes,
        record.environment_bytes,
        record.environment_resident_bytes,
    )


def _record(row: _Row) -> LoadRecord:
    (load_id, target, started, ended, outcome, cache, partial, phases, weights, read, gpu, late,
     fatal, resident, report, startup, environment, environment_resident) = row  # fmt: skip
    try:
        parsed = json.loads(phases)
    except ValueError:
        parsed = {}
    phase_seconds = (
        {str(k): float(v) for k, v in parsed.items() if isinstance(v, int | float)}
        if isinstance(parsed, dict)
        else {}
    )
    return LoadRecord(
        target=target,
        started_at=float(started),
        ended_at=float(ended),
        outcome=Outcome(outcome),
        cache=Cache(cache) if cache is not None else None,
        partial=bool(partial),
        phase_seconds=phase_seconds,
        weights_bytes=weights,
        bytes_read=read,
        gpu_bytes_at_weights_end=gpu,
        seen_late=bool(late),
        fatal=fatal,
        resident_bytes_at_start=resident,
        startup_read_bytes=startup,
        environment_bytes=environment,
        environment_resident_bytes=environment_resident,
        id=load_id,
        report=_report(report),
    )


def _report(text: str | None) -> LoadReport | None:
    """A stored report as the API document it was written from; one this version cannot read
    (edited by hand, or of a newer exporter without a key this one needs) is left out."""
    if text is None:
        return None
    try:
        return LoadReport.from_json(json.loads(text))
    except ValueError as exc:  # bad JSON, or a DocumentError
        log.debug("load history: a report that does not read: %s", exc)
        return None
