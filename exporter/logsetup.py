"""Process-wide logging in logfmt (the Prometheus ecosystem's default) or JSON."""

from __future__ import annotations

import json
import logging
import sys
import time

LEVELS = ("debug", "info", "warn", "error")


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


def _level(record: logging.LogRecord) -> str:
    return {"WARNING": "warn", "CRITICAL": "error"}.get(record.levelname, record.levelname.lower())


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += " " + self.formatException(record.exc_info).replace("\n", " | ")
        quoted = json.dumps(message)
        return f"ts={_timestamp(record)} level={_level(record)} logger={record.name} msg={quoted}"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        data = {
            "ts": _timestamp(record),
            "level": _level(record),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            data["exception"] = self.formatException(record.exc_info)
        return json.dumps(data)


def setup_logging(level: str = "info", fmt: str = "logfmt") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel({"warn": logging.WARNING}.get(level, level.upper()))
