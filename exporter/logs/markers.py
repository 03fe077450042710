"""Turn model servers' own startup log lines into typed events (pure: no I/O, no clock).

The events (exporter/load/events.py) are the load model's input; it folds them into fine steps
(exporter/load/steps.py).

Only the server knows it is capturing CUDA graphs or on shard 32 of 64, so its log gives the exact
fine steps. Each server's format (prefix, stamp, marker rules) is a row of its module in
exporter/servers/, from `shared/reference/server-startup.md`; old and new releases of each server
are both accepted. Text arrives in chunks of whole lines; `\\r` (tqdm redraws) ends a
line like `\\n`, ANSI colour codes are removed, and rank/process prefixes give each line its rank.

Tensor parallelism: with several ranks every rank logs the same markers, so events are merged:

* a *begin* (weights, compile, CUDA graphs) fires when the first rank begins, an *end* when every
  named rank that began has ended (the last one; an unprefixed line, such as a tqdm redraw, names
  none); a span that ended and begins again (a draft model's weights) fires again;
* progress (shard k of n, CUDA graph batches) is the slowest rank's, fired only when it changes;
* kv_cache, warmup_begin, ready, node_up and fatal fire once per load; node_up (a follower
  node's last start-up line, `LogFormat.node_up`) fires beside the line's own event and, unlike
  ready, ends nothing: the head's workers write the same lines while the head still starts
  (weights that begin after it are a new load's: a follower started again);
* a step after the weights (KV cache, compile, CUDA graphs, warm-up, ready) while the weights are
  still open ends them first: ranks synchronise before allocating the KV cache, and a release
  that reworded its "weights done" line still gets its boundary (detail "implied by: ...",
  `implied`: the line says the weights were in by then, not when). vLLM writes "Loading weights
  took" from the first rank of a host alone (`info_once`), so its TP>1 weights end so.

A load (a *cycle*) is over after ready or fatal; the next weights_begin starts a new one, as does
a load_begin (a model loaded into a running server) once the weights of the cycle before are in,
and a weights_begin after a node_up (a follower node started again, appending to the same file).
unloaded (a model let go by a running server) belongs to no cycle.

Event time: the process's start plus a line's time since that start (llama-server's stamps), where
the caller knows the log is that process's own; else the line's own timestamp where the format
has one, else the reference time the caller gives (journald's `__REALTIME_TIMESTAMP`, or when the
line was read). A clock stamp is corrected by a whole number of quarter hours towards the
reference (a container logging in UTC beside an exporter in local time) and used only within
`MAX_SKEW` of it; a whole-second stamp is refined by the reference within its second (journald's
time is exact to the microsecond). vLLM and Triton stamps carry no year, so the reference's year is
taken (the previous one across New Year). Event times never go back, except that a line without
the stamp its format has (a tqdm redraw, dated when it was read) does not push the next stamped
line past that line's own second.
"""

from __future__ import annotations

import functools
import re
from collections import deque
from dataclasses import dataclass, field

from exporter.load.events import CYCLE_BEGINS, EventKind, LogEvent
from exporter.servers import SERVERS
from exporter.servers.logformat import CAUSE, LogFormat
from exporter.vocabulary import AUTO

MAX_SKEW = 120.0  # seconds a line's stamp may differ from its reference time and still be used
_QUARTER_HOUR = 900.0
_MAX_ZONE_OFFSET = 14 * 3600.0
DETECT_ANNOUNCE_LINES = 2000  # lines without a recognisable one before `auto` says "unknown"
DETECT_BACKLOG = 256  # lines kept (their first DETAIL_MAX characters) until `auto` decides
CAUSE_WINDOW = 200  # a fatal line takes the last error line seen at most this many lines before
DETAIL_MAX = 1000  # characters of a line kept in an event (status pages show them)


_BEGIN_OF = {
    EventKind.WEIGHTS_END: EventKind.WEIGHTS_BEGIN,
    EventKind.COMPILE_END: EventKind.COMPILE_BEGIN,
    EventKind.CUDA_GRAPH_END: EventKind.CUDA_GRAPH_BEGIN,
}
_SPAN_BEGINS = frozenset(_BEGIN_OF.values())
_BEGIN_OF_PROGRESS = {
    EventKind.WEIGHTS_PROGRESS: EventKind.WEIGHTS_BEGIN,
    EventKind.CUDA_GRAPH_PROGRESS: EventKind.CUDA_GRAPH_BEGIN,
}
_PROGRESS = frozenset(_BEGIN_OF_PROGRESS)
_AFTER_WEIGHTS = frozenset(
    {
        EventKind.KV_CACHE,
        EventKind.KV_CACHE_TIMED,
        EventKind.COMPILE_BEGIN,
        EventKind.CUDA_GRAPH_BEGIN,
        EventKind.WARMUP_BEGIN,
        EventKind.READY,
        EventKind.NODE_UP,
    }
)
_ONCE = frozenset(
    {
        EventKind.KV_CACHE,
        EventKind.KV_CACHE_TIMED,
        EventKind.WARMUP_BEGIN,
        EventKind.READY,
        EventKind.NODE_UP,
        EventKind.FATAL,
        EventKind.LOAD_BEGIN,
    }
)


@dataclass(frozen=True)
class _Prefix:
    """What a line's prefix says: its stamp (unix seconds, uncorrected) and who wrote it."""

    stamp: float | None
    resolution: float  # a whole-second stamp says "some time within this second"
    who: str | None
    message: str
    exact: float | None = None  # the process's start plus the time since it, never after `ref`


_RANK_RES = (re.compile(r"TP(\d+)"), re.compile(r"rank=(\d+)"), re.compile(r"DP(\d+)"))
_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def as_lines(text: str) -> str:
    """ANSI codes out, every `\\r`, `\\r\\n` and `\\n` one `\\n`: lines as the parser reads them."""
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def detect(line: str) -> str | None:
    """The server kind whose log format's signature a cleaned line starts with, if any."""
    for kind, server in SERVERS.items():
        if server.log.signature.match(line):
            return kind
    return None


@functools.lru_cache(maxsize=4)
def _signature_search(kinds: tuple[str, ...]) -> re.Pattern[str]:
    """Every signature at a line's start, as one multi-line pattern: a chunk of lines that no
    format knows costs one C-level search, not a Python loop over its lines (a log of short
    unrecognised lines cost 2 s of CPU per MiB that way). It may also match across a line end
    (`\\s`, `[^()]`), so a hit is only a candidate that `detect` checks on its own line; no line
    that `detect` accepts is missed. Keyed by the kinds registered (a test registers one)."""
    either = "|".join(f"(?:{SERVERS[kind].log.signature.pattern})" for kind in kinds)
    return re.compile(f"^(?:{either})", re.MULTILINE)


# --- merging ranks into events -------------------------------------------------------------------


@dataclass
class _Span:
    open: bool = False
    ended_once: bool = False
    begun: set[str | None] = field(default_factory=set)
    ended: set[str | None] = field(default_factory=set)
    ended_at: float | None = None  # when it last ended (its end line, or a later step's)


class _Cycle:
    """One load's merge state: which spans are open, which ranks began and ended them."""

    def __init__(self) -> None:
        self.spans: dict[EventKind, _Span] = {kind: _Span() for kind in _SPAN_BEGINS}
        self.progress: dict[EventKind, dict[str | None, tuple[int, int]]] = {
            k: {} for k in _PROGRESS
        }
        self.last_progress: dict[EventKind, tuple[int, int]] = {}
        self.fired: set[EventKind] = set()
        self.finished = False

    def close(self, begin: EventKind, at: float) -> bool:
        """End a span still open (its end line never came); whether it was open."""
        span = self.spans[begin]
        if not span.open:
            return False
        span.open, span.ended_once, span.ended_at = False, True, at
        return True

    def unseen(self, begin: EventKind) -> bool:
        """Whether this span has neither begun nor ended in this load."""
        span = self.spans[begin]
        return not span.open and not span.ended_once

    def merge(
        self, kind: EventKind, who: str | None, at: float, seconds: float | None = None
    ) -> bool:
        """Whether this rank's begin, end or once-per-load marker fires an event at `at` now.

        An end line without its begin line seen fires when it is the span's first end, or when
        the duration it states began after the span last ended: a second run (SGLang's prefill
        then decode graphs) and not the same one told again (every rank, and vLLM's "Model
        loading took" after its "Loading weights took"). Stamps are whole seconds: one of slack.
        """
        if kind in _SPAN_BEGINS:
            span = self.spans[kind]
            if span.open:
                span.begun.add(who)
                return False
            span.open, span.begun, span.ended = True, {who}, set()
            if kind is EventKind.WEIGHTS_BEGIN:
                self.progress[EventKind.WEIGHTS_PROGRESS].clear()
                self.last_progress.pop(EventKind.WEIGHTS_PROGRESS, None)
            return True
        begin = _BEGIN_OF.get(kind)
        if begin is not None:
            span = self.spans[begin]
            if not span.open:
                # The begin was never seen (read from the middle, or the server logs none).
                last = span.ended_at
                anew = seconds is not None and last is not None and at - seconds > last - 1.0
                if span.ended_once and not anew:
                    return False
                span.ended_once, span.ended_at = True, at
                return True
            span.ended.add(who)
            if span.begun - {None} <= span.ended:
                span.open, span.ended_once, span.ended_at = False, True, at
                return True
            return False
        if kind in _ONCE:
            if kind in self.fired:
                return False
            self.fired.add(kind)
            return True
        return False


class MarkerParser:
    """Feeds cleaned chunks of lines through one format's rules and merges ranks into events.

    `feed` takes whole lines (the caller keeps an unterminated tail); `peek` looks at such a tail
    for progress only, since a tqdm bar stays unterminated until its next redraw.
    """

    def __init__(
        self,
        fmt: str = AUTO,
        origin: float | None = None,
        model: str | None = None,
        lines_of: str | None = None,
    ) -> None:
        """`fmt`: the server kind whose format the log is in (exporter/servers), or AUTO.
        `origin`: the start of the process whose log this is alone (unix seconds), which makes
        a stamp of the time since its start exact; None where the log may be another's.
        `model`: the one model of a server serving several whose events these are: a line
        naming another model (Triton's `loading: NAME:1`) is none of its, so two models
        loading at once are never merged as if they were two ranks of one load.
        `lines_of`: the mark that begins this process's lines in a log it shares (a router's
        `[PORT] `): the others are none of its, and the mark is no part of the line."""
        self._origin = origin
        self._model = model
        self._lines_of = lines_of
        self.format: str | None = None if fmt == AUTO else fmt  # the kind; None: undecided
        self.format_reason = "configured" if self.format else "auto: no recognisable line yet"
        self.unknown_announced = False  # set once `auto` has seen DETECT_ANNOUNCE_LINES in vain
        self._spec: LogFormat | None = SERVERS[fmt].log if self.format else None
        self._backlog: deque[tuple[str, float]] = deque(maxlen=DETECT_BACKLOG)
        self._undecided_lines = 0
        self._cycle = _Cycle()
        self._seq = 0
        self._line_no = 0
        self._cause: tuple[int, str] | None = None
        self._last_at = 0.0  # stamped event times never go back: the log is written in order

    @property
    def seq(self) -> int:
        """The sequence number of the last event fired."""
        return self._seq

    def feed(self, text: str, ref: float) -> list[LogEvent]:
        """Events from a chunk of whole lines (raw or cleaned) read or stamped at `ref`."""
        text = as_lines(text)
        if self._lines_of is not None:
            text = _lines_marked(text, self._lines_of)
        events: list[LogEvent] = []
        if self._spec is None:
            text = self._detect(text, ref)
            if self._spec is None:
                return events
            self._replay_backlog(events)
        self._scan(text, ref, events)
        return events

    def peek(self, tail: str, ref: float) -> list[LogEvent]:
        """Progress events from an unterminated last line (a bar between redraws)."""
        spec = self._spec
        if spec is None or not tail:
            return []
        tail = as_lines(tail)
        if self._lines_of is not None:
            tail = _lines_marked(tail, self._lines_of)
        line = tail[tail.rfind("\n") + 1 :]
        events: list[LogEvent] = []
        if line and spec.keywords.search(line):
            self._line(spec, line, ref, events, progress_only=True)
        return events

    def _detect(self, text: str, ref: float) -> str:
        """Find the first line that names the format; return the text after it (or "").

        Lines before it are kept (the last DETECT_BACKLOG) to be replayed once it is known."""
        search = _signature_search(tuple(SERVERS))
        at = 0
        while (hit := search.search(text, at)) is not None:
            start = hit.start()
            end = text.find("\n", start)
            end = len(text) if end < 0 else end
            line = text[start:end]
            fmt = detect(line)
            if fmt is None:  # a candidate that crossed a line end
                at = end + 1
                continue
            self._undecided_lines += text.count("\n", 0, start) + 1
            self.format, self._spec = fmt, SERVERS[fmt].log
            shown = line if len(line) <= 120 else line[:117] + "..."
            self.format_reason = (
                f"auto: line {self._undecided_lines} matched {fmt}'s line prefix: {shown!r}"
            )
            self._keep(text[:start], ref)
            self._backlog.append((line[:DETAIL_MAX], ref))
            return text[end + 1 :]
        if text:
            self._undecided_lines += text.count("\n") + (not text.endswith("\n"))
        self._keep(text, ref)
        if self._undecided_lines >= DETECT_ANNOUNCE_LINES and not self.unknown_announced:
            self.unknown_announced = True
            self.format_reason = (
                f"auto: unknown format, none of {self._undecided_lines} lines matched a known"
                " server; no events"
            )
        return ""

    def _keep(self, text: str, ref: float) -> None:
        """The last DETECT_BACKLOG non-empty lines of `text` into the backlog: found from the
        end, so a chunk of a million lines costs no more than one of a few hundred."""
        cut = len(text)
        for _ in range(DETECT_BACKLOG + 1):
            cut = text.rfind("\n", 0, cut)
            if cut < 0:
                break
        lines = text[cut + 1 :].split("\n")
        self._backlog.extend((line[:DETAIL_MAX], ref) for line in lines if line)

    def _replay_backlog(self, events: list[LogEvent]) -> None:
        while self._backlog:
            line, ref = self._backlog.popleft()
            self._scan(line, ref, events)

    def _scan(self, text: str, ref: float, events: list[LogEvent]) -> None:
        """Only lines holding a rule's keyword cost more than the C-level keyword search."""
        spec = self._spec
        assert spec is not None
        self._line_no += text.count("\n") + 1
        done_to = -1
        for hit in spec.keywords.finditer(text):
            at = hit.start()
            if at < done_to:
                continue
            start = text.rfind("\n", 0, at) + 1
            end = text.find("\n", at)
            if end < 0:
                end = len(text)
            done_to = end
            self._line(spec, text[start:end], ref, events)

    def _line(
        self,
        spec: LogFormat,
        line: str,
        ref: float,
        events: list[LogEvent],
        progress_only: bool = False,
    ) -> None:
        prefix: _Prefix | None = None
        for rule in spec.rules:
            if rule.keyword not in line:
                continue
            if progress_only and rule.kind not in _PROGRESS:
                continue
            if prefix is None:
                prefix = _split_prefix(spec, line, ref, self._origin)
            match = rule.pattern.search(prefix.message)
            if match is None:
                continue
            if rule.kind == CAUSE:
                self._cause = (self._line_no, prefix.message.strip())
                continue
            self._fire(EventKind(rule.kind), match, prefix, ref, events, partial=progress_only)
            break
        if progress_only:
            return
        for rule in spec.node_up:  # beside the line's own event, if it has one
            if rule.keyword not in line:
                continue
            if prefix is None:
                prefix = _split_prefix(spec, line, ref, self._origin)
            match = rule.pattern.search(prefix.message)
            if match is not None:
                self._fire(EventKind.NODE_UP, match, prefix, ref, events)
                return

    def _fire(
        self,
        kind: EventKind,
        match: re.Match[str],
        prefix: _Prefix,
        ref: float,
        events: list[LogEvent],
        partial: bool = False,
    ) -> None:
        groups = match.groupdict()
        who = groups.get("who") or prefix.who
        if self._model is not None and groups.get("who") not in (None, self._model):
            return  # another model's line
        cycle = self._cycle
        detail = prefix.message.strip()
        if prefix.exact is not None:
            at = prefix.exact
        else:
            at = _event_time(prefix.stamp, prefix.resolution, ref)
        if kind is EventKind.UNLOADED:  # no part of any load
            self._emit(events, kind, self._stamp(at), who, detail)
            return
        # A model loaded into a running server once the weights before are in is a load of its
        # own (Triton's explicit mode: the server was ready before it).
        # So is a node's weights after it said it is up (node_up ends no cycle, for the head's
        # sake): a follower that starts again, its lines appended to the same file.
        over = (
            cycle.finished
            or (kind is EventKind.LOAD_BEGIN and cycle.spans[EventKind.WEIGHTS_BEGIN].ended_once)
            or (kind is EventKind.WEIGHTS_BEGIN and EventKind.NODE_UP in cycle.fired)
        )
        if over:
            if kind not in CYCLE_BEGINS:
                return
            cycle = self._cycle = _Cycle()
            self._cause = None
        # A line without the stamp its format has (a tqdm redraw) is dated when it was read.
        dated = prefix.stamp is not None or prefix.exact is not None
        at = self._stamp(at, dated or self._spec is None or self._spec.stamp is None)
        stated = groups.get("seconds")
        seconds = float(stated) if stated else None  # a duration the line itself states
        done = total = None
        if kind in _PROGRESS:
            done, total = _progress(groups, partial)
            if done is None or total is None:
                return
            begin = _BEGIN_OF_PROGRESS[kind]
            if cycle.unseen(begin) and cycle.merge(begin, who, at):
                # A bar is the first sign of its span (vLLM's CUDA graphs, a missed begin line).
                self._weights_in_before(begin, events, at, who, detail)
                self._emit(events, begin, at, who, detail)
            per_rank = cycle.progress[kind]
            per_rank[who] = (done, total)
            who, (done, total) = min(per_rank.items(), key=lambda item: _fraction(item[1]))
            if cycle.last_progress.get(kind) == (done, total):
                return
            cycle.last_progress[kind] = (done, total)
        elif not cycle.merge(kind, who, at, seconds):
            return
        self._weights_in_before(kind, events, at, who, detail)
        if kind is EventKind.FATAL:
            cycle.finished = True
            detail = self._with_cause(detail)
        elif kind is EventKind.READY:
            cycle.finished = True
        self._emit(events, kind, at, who, detail, done, total, seconds)

    def _stamp(self, at: float, dated: bool = True) -> float:
        """Event times never go back: the log is written in order. A line not `dated` by the
        stamp its format has (a tqdm redraw, dated when it was read) leaves the floor where it
        was: it may have been read after the next stamped line was written, which keeps its own
        second ("Load weight end" after the weights bar's last redraw)."""
        at = max(at, self._last_at)
        if dated:
            self._last_at = at
        return at

    def _weights_in_before(
        self, kind: EventKind, events: list[LogEvent], at: float, who: str | None, detail: str
    ) -> None:
        """Ranks synchronise before the KV cache: a later step means the weights are in."""
        if kind in _AFTER_WEIGHTS and self._cycle.close(EventKind.WEIGHTS_BEGIN, at):
            self._emit(
                events, EventKind.WEIGHTS_END, at, who, f"implied by: {detail}", implied=True
            )

    def _with_cause(self, detail: str) -> str:
        """The fatal line, and the last error line shortly before it (the traceback's end)."""
        cause = self._cause
        if cause is None or self._line_no - cause[0] > CAUSE_WINDOW or cause[1] == detail:
            return detail
        return f"{detail}; cause: {cause[1]}"

    def _emit(
        self,
        events: list[LogEvent],
        kind: EventKind,
        at: float,
        who: str | None,
        detail: str,
        done: int | None = None,
        total: int | None = None,
        seconds: float | None = None,
        implied: bool = False,
    ) -> None:
        self._seq += 1
        detail = detail[:DETAIL_MAX]
        events.append(
            LogEvent(kind, at, _rank(who), detail, done, total, seconds, who, self._seq, implied)
        )


def _fraction(progress: tuple[int, int]) -> float:
    done, total = progress
    return done / total if total > 0 else 1.0


def _lines_marked(text: str, mark: str) -> str:
    """The lines of `text` that begin with `mark`, without it."""
    kept = [line[len(mark) :] for line in text.split("\n") if line.startswith(mark)]
    return "\n".join(kept) + ("\n" if kept and text.endswith("\n") else "")


def _split_prefix(spec: LogFormat, line: str, ref: float, origin: float | None) -> _Prefix:
    stamp = who = exact = None
    resolution = 1.0
    message = line
    if spec.prefix is not None:
        m = spec.prefix.match(line)
        if m is not None:
            message = line[m.end() :]
            groups = m.groupdict()
            who = groups.get("who")
            if spec.stamp is not None:
                stamp = spec.stamp(m, ref)
                fraction = groups.get("f")
                resolution = 10.0 ** -len(fraction) if fraction else 1.0
            if spec.elapsed is not None and origin is not None:
                since = spec.elapsed(m)
                exact = None if since is None else min(origin + since, ref)
    if spec.rank_in_message is not None:
        r = spec.rank_in_message.search(message)
        if r is not None:
            who = r.group(0)
    return _Prefix(stamp, resolution, who, message, exact)


def _rank(who: str | None) -> int | None:
    if not who:
        return None
    for pattern in _RANK_RES:
        m = pattern.search(who)
        if m is not None:
            return int(m.group(1))
    return None


def _progress(groups: dict[str, str | None], partial: bool) -> tuple[int | None, int | None]:
    """(done, total) of a bar. llama.cpp prints a dot each time the load's percentage rises and
    ends the line at 100 %: an open line's dots approximate the percentage (well for models of
    more than 100 tensors), a finished line is 100 %."""
    dots = groups.get("dots")
    if dots is not None:
        return (min(len(dots), 99) if partial else 100), 100
    done, total = groups.get("done"), groups.get("total")
    if done is None or total is None:
        return None, None
    return int(done), int(total)


def _event_time(stamp: float | None, resolution: float, ref: float) -> float:
    """The line's stamp, made as precise as the reference allows (see the module docstring)."""
    if stamp is None:
        return ref
    zone = round((ref - stamp) / _QUARTER_HOUR) * _QUARTER_HOUR
    stamp += zone
    if abs(zone) > _MAX_ZONE_OFFSET or abs(ref - stamp) > MAX_SKEW:
        return ref
    return min(max(ref, stamp), stamp + resolution)
