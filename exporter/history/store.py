"""SQLite store of finished loads: what the histograms forget across restarts, and what ETAs need.

History is a nice-to-have next to the live metrics, so it never takes the exporter down: a corrupt
file, a database locked by someone else or a read-only location logs one ERROR line and turns
history off (every method then returns empty or None) instead of raising into the sampler.
A failed write (a full disk) is different: what is stored stays readable, the record waits in
memory (a bounded few) and `retry()` writes it once the disk has room again; `up` says whether
finished loads are being kept.

A row is a `records.LoadRecord`, a column per field of the same name (`id` is the row's, stable
for /api/v1/loads/ID): `_row` and `_record` derive both from the dataclass, so a field added to
the record needs only its column's migration (a test holds the two together). A field that is a
mapping or a dataclass (the phases, the report of exporter/load/report.py) is a JSON column,
written and read by `_plain` and `_typed` from the same fields; the report's JSON is the shape
the /api/v1 document it becomes has always had (api_build.py alone turns one into the other), so
files of earlier versions read the same.

Retention: discovered targets are whatever any local user starts, so the store keeps at most
`max_rows` loads, none that ended more than `max_age` before the newest (config
`history_retention`); each write prunes.

Ownership: a discovered target's name is its user's (runtime/targetnames.py), and so is what
its past says. Each load is filed with the user whose server loaded (`owner`); for a name
`own()` gave an owner, every question about that name counts only that user's loads (and those
of versions that filed none), so a server of another user that held the name before
(started first) shapes none of its ETAs, forecasts or startupProbe advice.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sqlite3
import stat
import statistics
import threading
import types
from collections import deque
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any, TypeVar, Union, get_args, get_origin, get_type_hints

from exporter.config.schema import HistoryRetention
from exporter.load.records import LoadRecord
from exporter.vocabulary import Cache

log = logging.getLogger(__name__)

SCHEMA_VERSION = 8
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
    ("ALTER TABLE loads ADD COLUMN owner INTEGER",),
)
# The record's fields but `id` (the row's own), each a column of the same name.
_FIELDS = tuple(f for f in dataclasses.fields(LoadRecord) if f.name != "id")
_HINTS = get_type_hints(LoadRecord)
_COLUMNS = ", ".join(f.name for f in _FIELDS)
_PLACES = ",".join("?" * len(_FIELDS))
_SELECT = f"id, {_COLUMNS}"
_NEWEST_FIRST = "ORDER BY ended_at DESC, id DESC"

_T = TypeVar("_T")
_Row = tuple[Any, ...]  # id, then the columns in _FIELDS' order


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
        self._owners: dict[str, int] = {}  # a discovered target's name -> its user
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

    def own(self, target: str, owner: int | None) -> None:
        """The loads of `target` that count are `owner`'s from now on (None: anyone's)."""
        with self._lock:
            if owner is None:
                self._owners.pop(target, None)
            else:
                self._owners[target] = owner

    def owner(self, target: str) -> int | None:
        """The user whose load was filed last under `target` (None: none, or not known)."""
        sql = f"SELECT owner FROM loads WHERE target = ? {_NEWEST_FIRST} LIMIT 1"
        row = self._run(lambda db: db.execute(sql, (target,)).fetchone(), None)
        return int(row[0]) if row is not None and row[0] is not None else None

    def loads(self, target: str | None = None, limit: int = 100) -> list[LoadRecord]:
        """Finished loads, newest first (of `target`: its owner's)."""
        where, args = self._of(target) if target is not None else ("", ())
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
        where, args = self._of(target)
        sql = (
            f"SELECT gpu_bytes_at_weights_end FROM loads {where} AND outcome = 'ready' "
            f"AND partial = 0 AND gpu_bytes_at_weights_end IS NOT NULL {_NEWEST_FIRST} LIMIT 1"
        )
        row = self._run(lambda db: db.execute(sql, args).fetchone(), None)
        return int(row[0]) if row else None

    def last_duration(self, target: str) -> float | None:
        """Duration of the last finished load of any outcome."""
        where, args = self._of(target)
        sql = f"SELECT started_at, ended_at FROM loads {where} {_NEWEST_FIRST} LIMIT 1"
        row = self._run(lambda db: db.execute(sql, args).fetchone(), None)
        return float(row[1] - row[0]) if row else None

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None
            self.enabled = False

    def _good_loads(self, target: str, cache: Cache | None) -> list[LoadRecord]:
        """Recent successful, non-partial loads; of one cache temperature, or any (None)."""
        where, owned = self._of(target)
        args: list[object] = list(owned)
        if cache is not None:
            # Unknown temperature is stored as NULL.
            where += " AND cache IS ?"
            args.append(None if cache == Cache.UNKNOWN else str(cache))
        sql = (
            f"SELECT {_SELECT} FROM loads {where} AND outcome = 'ready' "
            f"AND partial = 0 {_NEWEST_FIRST} LIMIT {EXPECTATION_LOADS}"
        )
        rows: list[_Row] = self._run(lambda db: db.execute(sql, args).fetchall(), [])
        return [_record(row) for row in rows]

    def _of(self, target: str) -> tuple[str, tuple[object, ...]]:
        """The WHERE clause of one target's loads: its owner's, where it has one (`own`)."""
        with self._lock:
            owner = self._owners.get(target)
        if owner is None:
            return "WHERE target = ?", (target,)
        return "WHERE target = ? AND (owner = ? OR owner IS NULL)", (target, owner)

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
    """The record as its columns: numbers, text and NULL as they are (a flag as 0 or 1, a word of
    the vocabulary as its text), a mapping or a dataclass as JSON."""
    return tuple(_column(getattr(record, f.name)) for f in _FIELDS)


def _column(value: object) -> object:
    if value is None or isinstance(value, int | float | str):
        return str(value) if isinstance(value, StrEnum) else value  # a bool is an int already
    return json.dumps(_plain(value))


def _plain(value: object) -> object:
    """A value as JSON types: a dataclass an object of its fields (a None where None is the
    field's default left out, as the report's JSON has always had it), a mapping with its keys
    sorted, a tuple a list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        kept = (
            (f.name, getattr(value, f.name))
            for f in dataclasses.fields(value)
            if not (getattr(value, f.name) is None and f.default is None)
        )
        return {name: _plain(v) for name, v in kept}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in sorted(value.items())}
    if isinstance(value, tuple):
        return [_plain(v) for v in value]
    return str(value) if isinstance(value, StrEnum) else value


def _record(row: _Row) -> LoadRecord:
    """A row as the record it was written from."""
    load_id, *columns = row
    values = {
        f.name: _column_value(_HINTS[f.name], raw, f.name)
        for f, raw in zip(_FIELDS, columns, strict=True)
    }
    return LoadRecord(id=load_id, **values)


def _column_value(hint: Any, raw: object, name: str) -> Any:
    """One column as its field. A JSON column that does not read (edited by hand, or a newer
    exporter's without a key this one needs) is left out, the load kept: the report None, the
    phases empty."""
    if raw is None or not _is_json(hint):
        return _typed(hint, raw, name)
    try:
        return _typed(hint, json.loads(str(raw)), name)
    except ValueError as exc:  # bad JSON, or a value of another shape
        log.debug("load history: a %s that does not read: %s", name, exc)
        return None if _optional(hint) else {}


def _optional(hint: Any) -> bool:
    return get_origin(hint) in (Union, types.UnionType) and types.NoneType in get_args(hint)


def _inner(hint: Any) -> Any:
    """X of `X | None`, else the hint."""
    if not _optional(hint):
        return hint
    (inner,) = (a for a in get_args(hint) if a is not types.NoneType)
    return inner


def _is_json(hint: Any) -> bool:
    inner = _inner(hint)
    return get_origin(inner) is Mapping or dataclasses.is_dataclass(inner)


def _typed(hint: Any, value: object, where: str) -> Any:
    """`value` (a column, or parsed JSON) as `hint` says; ValueError naming where it is not."""
    if value is None and _optional(hint):
        return None
    hint = _inner(hint)
    origin, args = get_origin(hint), get_args(hint)
    if origin is tuple and isinstance(value, list):
        return tuple(_typed(args[0], v, f"{where}[{i}]") for i, v in enumerate(value))
    if origin is Mapping and isinstance(value, dict):
        return {str(k): _typed(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(hint, type) and dataclasses.is_dataclass(hint) and isinstance(value, dict):
        hints = get_type_hints(hint)
        given = [f for f in dataclasses.fields(hint) if f.name in value]
        try:
            return hint(**{f.name: _typed(hints[f.name], value[f.name], f"{where}.{f.name}")
                           for f in given})  # fmt: skip
        except TypeError as exc:  # a key without a default missing
            raise ValueError(f"{where}: {exc}") from None
    if hint is bool and isinstance(value, int):
        return bool(value)
    if hint is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if hint is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)  # JSON and SQLite keep 5.0 as 5
    if isinstance(hint, type) and issubclass(hint, str) and isinstance(value, str):
        return hint(value)  # a StrEnum: ValueError for a word it does not know
    raise ValueError(f"{where}: {value!r} is not {hint}")
