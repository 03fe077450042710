"""Process-wide logging in logfmt (the Prometheus ecosystem's default) or JSON, folded per kind
of message and what it is about.

Why folded: what the exporter logs follows what others do. A server that logs an unload 2,000
times a second, a flapping endpoint, a flood of fake servers each refused once: one line per
event let a single user fill the exporter's log, and journald's rate limit then dropped the
exporter's other messages with it. So each kind of line (its template) about each subject (its
first argument: the target, GPU or refusal reason it names) is written at most FOLD_BURST times at
once and then once every FOLD_EVERY_SECONDS; the first line past the burst says `folding=`, the
next one written says how many like it were `folded=` meanwhile. Debug lines, asked for, are never
folded, nor the answers to an operator's own act (`extra=UNFOLDED`: a reload said each time).
The events themselves are counted in metrics (e.g. model_load_unloads_total), not here.
"""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass

LEVELS = ("debug", "info", "warn", "error")
FOLD_BURST = 5  # lines of one kind about one subject written at once: a restart says a few
FOLD_EVERY_SECONDS = 60.0  # past the burst, one such line this often, with the count folded
FOLD_KEYS = 1024  # kinds x subjects remembered, the least recent forgotten: a flood of names
UNFOLDED = {"unfolded": True}  # `extra` of a line never folded


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _level(record: logging.LogRecord) -> str:
    return {"WARNING": "warn", "CRITICAL": "error"}.get(record.levelname, record.levelname.lower())


def _folding(record: logging.LogRecord) -> dict[str, object]:
    """What Folding noted on a record: `folding` (seconds between lines from now), `folded`."""
    return {key: getattr(record, key) for key in ("folding", "folded") if hasattr(record, key)}


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += " " + self.formatException(record.exc_info).replace("\n", " | ")
        quoted = json.dumps(message)
        line = f"ts={_timestamp(record)} level={_level(record)} logger={record.name} msg={quoted}"
        return "".join([line, *(f" {k}={v:g}" for k, v in _folding(record).items())])


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": _timestamp(record),
            "level": _level(record),
            "logger": record.name,
            "msg": record.getMessage(),
            **_folding(record),
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data)


@dataclass
class _Bucket:
    tokens: float
    at: float
    folding: bool = False  # past the burst, the full bucket not refilled since
    folded: int = 0  # lines not written since the last one that was


class Folding(logging.Filter):
    """A token bucket per (logger, template, first argument): FOLD_BURST lines, then one every
    FOLD_EVERY_SECONDS; the lines between are folded and counted on the next one written."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        burst: int = FOLD_BURST,
        every: float = FOLD_EVERY_SECONDS,
    ) -> None:
        super().__init__()
        self._clock = clock
        self._burst = burst
        self._every = every
        self._lock = threading.Lock()
        self._buckets: OrderedDict[Hashable, _Bucket] = OrderedDict()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO or getattr(record, "unfolded", False):
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        subject = args[0] if args and isinstance(args[0], str | int) else None
        key = (record.name, str(record.msg), subject)
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(key)
            if bucket is None:
                bucket = self._buckets[key] = _Bucket(self._burst, now)
                if len(self._buckets) > FOLD_KEYS:
                    self._buckets.popitem(last=False)
            else:
                self._buckets.move_to_end(key)
                bucket.tokens = min(self._burst, bucket.tokens + (now - bucket.at) / self._every)
                bucket.at = now
                bucket.folding = bucket.folding and bucket.tokens < self._burst
            if bucket.tokens >= 1:
                bucket.tokens -= 1
                if bucket.folded:
                    record.folded, bucket.folded = bucket.folded, 0
                return True
            if not bucket.folding:  # the first past the burst: written, saying what follows
                bucket.folding = True
                record.folding = self._every
                return True
            bucket.folded += 1
            return False


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    handler.addFilter(Folding())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel({"warn": logging.WARNING}.get(level, level.upper()))
