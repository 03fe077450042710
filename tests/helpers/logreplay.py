"""Replay a captured server log through the marker parser on a simulated clock.

Each line is "read" at the time its own stamp says (the stamp shapes of the fixtures, found here
independently of the parser), and a line without one `per_line` seconds after the line before:
the reference time a live reader would have given it. llama.cpp logs carry no stamps, so their
step durations come from `per_line` alone.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from exporter.load.events import LogEvent
from exporter.load.steps import StepTimeline
from exporter.logs.journal import parse_journal_json
from exporter.logs.markers import MarkerParser, as_lines
from exporter.vocabulary import Step

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures" / "logs"

_LOCAL = re.compile(r"(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?")
_UTC = re.compile(r"^(\d{4})-(\d\d)-(\d\d)T(\d\d):(\d\d):(\d\d)(?:\.(\d+))?Z")
_NO_YEAR = re.compile(r"(?:^|\) |^[IWEF])(?:\w+ )?(\d\d)-?(\d\d) (\d\d):(\d\d):(\d\d)(?:\.(\d+))?")


def line_stamp(line: str, year: int) -> float | None:
    """The unix time a fixture line's own stamp gives, if it has one."""
    m = _UTC.match(line)
    if m:
        fields = [int(g) for g in m.groups()[:6]]
        return calendar.timegm((*fields, 0, 0, 0)) + _fraction(m.group(7))
    m = _LOCAL.search(line[:40])
    if m:
        fields = [int(g) for g in m.groups()[:6]]
        return time.mktime((*fields, 0, 0, -1)) + _fraction(m.group(7))  # type: ignore[arg-type]
    m = _NO_YEAR.search(line[:60])
    if m:
        fields = [int(g) for g in m.groups()[:5]]
        return time.mktime((year, *fields, 0, 0, -1)) + _fraction(m.group(6))  # type: ignore[arg-type]
    return None


def _fraction(digits: str | None) -> float:
    return int(digits) / 10 ** len(digits) if digits else 0.0


def segments(data: str) -> Iterator[str]:
    """The lines of `data` as a reader sees them: no ANSI codes, split on `\\n`, `\\r\\n`, `\\r`."""
    yield from as_lines(data).split("\n")


@dataclass
class Replay:
    events: list[LogEvent]
    timeline: StepTimeline
    parser: MarkerParser

    @property
    def kinds(self) -> list[str]:
        return [e.kind.value for e in self.events]

    def durations(self) -> dict[str, float]:
        return {step.value: round(s, 3) for step, s in self.timeline.durations.items()}

    def first(self, kind: str) -> LogEvent:
        return next(e for e in self.events if e.kind == kind)


def replay(
    data: str,
    fmt: str = "auto",
    *,
    start: float = 0.0,
    year: int = 2026,
    per_line: float = 0.1,
    origin: float | None = None,
    model: str | None = None,
    lines_of: str | None = None,
) -> Replay:
    """Feed `data` line by line, each at its simulated read time; `origin`: the start of the
    process whose own log this is (llama-server's stamps count from it); `model`: the one
    model of a server serving several whose events these are; `lines_of`: the mark of the
    lines of the process whose events these are, in a log it shares (a router's)."""
    parser = MarkerParser(fmt, origin, model, lines_of)
    timeline = StepTimeline()
    events: list[LogEvent] = []
    now = start
    for line in segments(data):
        stamp = line_stamp(line, year) if line else None
        now = stamp if stamp is not None and stamp >= now - 1 else now + per_line
        new = parser.feed(line, now)
        for event in new:
            timeline.apply(event)
        events += new
    return Replay(events, timeline, parser)


def replay_fixture(name: str, fmt: str = "auto", **kwargs: float | str | None) -> Replay:
    return replay((FIXTURES / name).read_text(encoding="utf-8"), fmt, **kwargs)  # type: ignore[arg-type]


__all__ = ["FIXTURES", "Replay", "Step", "replay", "replay_fixture", "replay_journal", "segments"]


def replay_journal(name: str, fmt: str = "auto") -> Replay:
    """Feed a `journalctl -o json` export entry by entry, each at its __REALTIME_TIMESTAMP."""
    parser = MarkerParser(fmt)
    timeline = StepTimeline()
    events: list[LogEvent] = []
    for raw in (FIXTURES / name).read_bytes().splitlines():
        entry = parse_journal_json(raw)
        assert entry is not None and entry.realtime is not None, raw[:200]
        new = parser.feed(entry.message, entry.realtime)
        for event in new:
            timeline.apply(event)
        events += new
    return Replay(events, timeline, parser)
