"""How a server module describes its startup log: line prefix, stamp, and marker rules.

Data only: `exporter/logs/markers.py` is the engine that reads these rows (cleaning, rank merging,
event times). A rule's `keyword` is a substring every match contains, so the engine searches a
chunk for all of a format's keywords at once (C speed) and runs a regex only on lines that hold
one: most log lines cost nothing.
"""

from __future__ import annotations

import calendar
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.load.events import EventKind

CAUSE = "cause"  # a rule kind that records an error line for the next fatal instead of firing


@dataclass(frozen=True)
class Rule:
    kind: EventKind | str  # an EventKind, or CAUSE
    pattern: re.Pattern[str]  # searched in the message (the line without its prefix)
    keyword: str  # a substring every match contains: the cheap prefilter before the regex


def rule(kind: EventKind | str, keyword: str, pattern: str) -> Rule:
    return Rule(kind, re.compile(pattern), keyword)


# A prefix match and the reference time -> the line's stamp in unix seconds (None: no stamp).
StampFn = Callable[[re.Match[str], float], float | None]
# A prefix match -> seconds since the process's logger started (None: no such stamp); the
# process's own start time makes it a unix time (llama.cpp's `M.SS.mmm.uuu`).
ElapsedFn = Callable[[re.Match[str]], float | None]


@dataclass(frozen=True)
class LogFormat:
    """One server's log lines: how to recognise them, split their prefix, and read markers."""

    signature: re.Pattern[str]  # `auto`: a line only this format writes (matched at its start)
    prefix: re.Pattern[str] | None  # matched at a line's start; group "who" names the rank
    stamp: StampFn | None  # reads the prefix's groups y, mo, d, H, M, S, f
    rules: tuple[Rule, ...]
    # The end of a follower node's start-up (EventKind.NODE_UP), fired beside whatever event
    # the same line is (vLLM's "Graph capturing finished" ends the CUDA graphs too).
    node_up: tuple[Rule, ...] = ()
    # Where the message itself names the rank (TGI ends its lines with `rank=N`).
    rank_in_message: re.Pattern[str] | None = None
    elapsed: ElapsedFn | None = None  # reads the prefix's groups em, es, ems, eus
    keywords: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        words = sorted({r.keyword for r in (*self.rules, *self.node_up)}, key=len, reverse=True)
        object.__setattr__(self, "keywords", re.compile("|".join(map(re.escape, words))))


def _local(year: int, month: int, day: int, h: int, m: int, s: int, frac: str | None) -> float:
    base = time.mktime((year, month, day, h, m, s, 0, 0, -1))
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def stamp_local(m: re.Match[str], ref: float) -> float | None:
    """A full local date and time (SGLang)."""
    g = m.group
    return _local(int(g("y")), int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")),
                  g("f"))  # fmt: skip


def stamp_local_no_year(m: re.Match[str], ref: float) -> float | None:
    """Month and day without a year (vLLM, Triton): the reference's year, the previous one
    across New Year. None when the line has no stamp (the prefix is optional)."""
    if m.group("mo") is None:
        return None
    g = m.group
    year = time.localtime(ref).tm_year
    args = (int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")), g("f"))
    stamp = _local(year, *args)
    if stamp > ref + 86400:  # a December line read in January
        stamp = _local(year - 1, *args)
    return stamp


def elapsed_since_start(m: re.Match[str]) -> float | None:
    """Minutes, seconds, milliseconds and microseconds since the logger started (llama.cpp
    stamps every line so since 2024). None on a line without them (the prefix is optional)."""
    if m.group("em") is None:
        return None
    g = m.group
    return int(g("em")) * 60 + int(g("es")) + int(g("ems")) / 1e3 + int(g("eus")) / 1e6


def stamp_utc(m: re.Match[str], ref: float) -> float | None:
    """A full date and time in UTC (TGI's RFC 3339 `Z`)."""
    g = m.group
    base = calendar.timegm(
        (int(g("y")), int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")), 0, 0, 0)
    )
    frac = g("f")
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


# Exception lines: kept as the cause of the next fatal, whatever the server.
CAUSE_RULES = (
    rule(CAUSE, "Error", r"^\s*[\w.]*Error: "),
    rule(CAUSE, "Exception", r"^\s*[\w.]*Exception: "),
)

# A tqdm meter after its description: `:  40% Completed | 2/5` or `:  40%|####  | 2/5`.
TQDM = r":\s+(?P<pct>\d+)%(?: Completed)? ?\|[^|]*?\|? (?P<done>\d+)/(?P<total>\d+)"
