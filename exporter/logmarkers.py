"""Turn model servers' own startup log lines into typed events (pure: no I/O, no clock).

Only the server knows it is capturing CUDA graphs or on shard 32 of 64, so its log gives the exact
fine steps. The strings come from `shared/reference/server-startup.md`; old and new releases of
each server are both accepted. Text arrives in chunks of whole lines; `\\r` (tqdm redraws) ends a
line like `\\n`, ANSI colour codes are removed, and rank/process prefixes give each line its rank.

Tensor parallelism: with several ranks every rank logs the same markers, so events are merged:

* a *begin* (weights, compile, CUDA graphs) fires when the first rank begins, an *end* when every
  named rank that began has ended (the last one; an unprefixed line, such as a tqdm redraw, names
  none); a span that ended and begins again (a draft model's weights) fires again;
* progress (shard k of n, CUDA graph batches) is the slowest rank's, fired only when it changes;
* kv_cache, warmup_begin, ready and fatal fire once per load;
* a step after the weights (KV cache, compile, CUDA graphs, warm-up, ready) while the weights are
  still open ends them first: ranks synchronise before allocating the KV cache, and a release
  that reworded its "weights done" line still gets its boundary (detail "implied by: ...").

A load (a *cycle*) is over after ready or fatal; the next weights_begin starts a new one.

Event time: the line's own timestamp where the format has one, else the reference time the caller
gives (journald's `__REALTIME_TIMESTAMP`, or when the line was read). A stamp is corrected by a
whole number of quarter hours towards the reference (a container logging in UTC beside an exporter
in local time) and used only within `MAX_SKEW` of it; a whole-second stamp is refined by the
reference within its second (journald's time is exact to the microsecond). vLLM and Triton stamps
carry no year, so the reference's year is taken (the previous one across New Year). Event times
never go back.
"""

from __future__ import annotations

import calendar
import re
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from exporter.vocabulary import LogFormat, Step

MAX_SKEW = 120.0  # seconds a line's stamp may differ from its reference time and still be used
_QUARTER_HOUR = 900.0
_MAX_ZONE_OFFSET = 14 * 3600.0
DETECT_ANNOUNCE_LINES = 2000  # lines without a recognisable one before `auto` says "unknown"
DETECT_BACKLOG = 256  # lines kept (their first DETAIL_MAX characters) until `auto` decides
CAUSE_WINDOW = 200  # a fatal line takes the last error line seen at most this many lines before
DETAIL_MAX = 1000  # characters of a line kept in an event (status pages show them)


class EventKind(StrEnum):
    WEIGHTS_BEGIN = "weights_begin"
    WEIGHTS_PROGRESS = "weights_progress"
    WEIGHTS_END = "weights_end"
    KV_CACHE = "kv_cache"
    COMPILE_BEGIN = "compile_begin"
    COMPILE_END = "compile_end"
    CUDA_GRAPH_BEGIN = "cuda_graph_begin"
    CUDA_GRAPH_PROGRESS = "cuda_graph_progress"
    CUDA_GRAPH_END = "cuda_graph_end"
    WARMUP_BEGIN = "warmup_begin"
    READY = "ready"
    FATAL = "fatal"


@dataclass(frozen=True, slots=True)
class LogEvent:
    kind: EventKind
    time: float  # unix seconds
    rank: int | None = None  # tensor-parallel rank (else data-parallel) of the line, if it has one
    detail: str = ""  # the line's message; for fatal the server's message and its cause
    done: int | None = None  # progress: shards or batches done
    total: int | None = None
    seconds: float | None = None  # a duration the server itself reported (elapsed=, took N s)
    who: str | None = None  # the prefix that names the rank or process ("TP1", "Worker_TP0")
    seq: int = 0  # 1, 2, 3... per parser, so a consumer loses none and counts none twice


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
        EventKind.COMPILE_BEGIN,
        EventKind.CUDA_GRAPH_BEGIN,
        EventKind.WARMUP_BEGIN,
        EventKind.READY,
    }
)
_ONCE = frozenset({EventKind.KV_CACHE, EventKind.WARMUP_BEGIN, EventKind.READY, EventKind.FATAL})
_CAUSE = "cause"  # a rule kind that records an error line for the next fatal instead of firing


# --- format table -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rule:
    kind: EventKind | str
    pattern: re.Pattern[str]
    keyword: str  # a substring every match contains: the cheap prefilter before the regex


def _rule(kind: EventKind | str, keyword: str, pattern: str) -> _Rule:
    return _Rule(kind, re.compile(pattern), keyword)


@dataclass(frozen=True)
class _Prefix:
    """What a line's prefix says: its stamp (unix seconds, uncorrected) and who wrote it."""

    stamp: float | None
    resolution: float  # a whole-second stamp says "some time within this second"
    who: str | None
    message: str


_StampFn = Callable[[re.Match[str], float], float | None]


@dataclass(frozen=True)
class _Format:
    name: LogFormat
    signature: re.Pattern[str]  # `auto`: a line only this format writes (matched at its start)
    prefix: re.Pattern[str] | None  # matched at a line's start; group "who" names the rank
    stamp: _StampFn | None
    rules: tuple[_Rule, ...]
    rank_in_message: bool = False  # TGI puts `rank=N` at the end of the message
    keywords: re.Pattern[str] = field(init=False)

    def __post_init__(self) -> None:
        words = sorted({rule.keyword for rule in self.rules}, key=len, reverse=True)
        object.__setattr__(self, "keywords", re.compile("|".join(map(re.escape, words))))


def _local(year: int, month: int, day: int, h: int, m: int, s: int, frac: str | None) -> float:
    base = time.mktime((year, month, day, h, m, s, 0, 0, -1))
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


def _stamp_full_local(m: re.Match[str], ref: float) -> float | None:
    g = m.group
    return _local(int(g("y")), int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")),
                  g("f"))  # fmt: skip


def _stamp_no_year(m: re.Match[str], ref: float) -> float | None:
    if m.group("mo") is None:
        return None
    g = m.group
    year = time.localtime(ref).tm_year
    args = (int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")), g("f"))
    stamp = _local(year, *args)
    if stamp > ref + 86400:  # a December line read in January
        stamp = _local(year - 1, *args)
    return stamp


def _stamp_utc(m: re.Match[str], ref: float) -> float | None:
    g = m.group
    base = calendar.timegm(
        (int(g("y")), int(g("mo")), int(g("d")), int(g("H")), int(g("M")), int(g("S")), 0, 0, 0)
    )
    frac = g("f")
    return base + (int(frac) / 10 ** len(frac) if frac else 0.0)


_RANK_RES = (re.compile(r"TP(\d+)"), re.compile(r"rank=(\d+)"), re.compile(r"DP(\d+)"))
_TGI_RANK_RE = re.compile(r"\brank=\d+")

# Exception lines, and the servers' own words for what went wrong: kept as a fatal's cause.
_CAUSE_RULES = (
    _rule(_CAUSE, "Error", r"^\s*[\w.]*Error: "),
    _rule(_CAUSE, "Exception", r"^\s*[\w.]*Exception: "),
    _rule(_CAUSE, "error loading model", r"error loading model: "),
    _rule(_CAUSE, "failed to initialize the context", r"failed to initialize the context: "),
)

_TQDM = r":\s+(?P<pct>\d+)%(?: Completed)? ?\|[^|]*?\|? (?P<done>\d+)/(?P<total>\d+)"

SGLANG = _Format(
    name=LogFormat.SGLANG,
    signature=re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{3})?(?: [A-Z_]+\d+)*\] "),
    prefix=re.compile(
        r"\[(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)"
        r"(?:\.(?P<f>\d{3}))?(?: (?P<who>[A-Z_]+\d+(?: [A-Z_]+\d+)*))?\] "
    ),
    stamp=_stamp_full_local,
    rules=(
        _rule(EventKind.WEIGHTS_BEGIN, "Load weight begin", r"^Load weight begin\."),
        _rule(
            EventKind.WEIGHTS_PROGRESS,
            "checkpoint shards",
            r"Loading (?:safetensors|pt) checkpoint shards" + _TQDM,
        ),
        _rule(EventKind.WEIGHTS_PROGRESS, "Multi-thread loading", r"Multi-thread loading[^:]*" + _TQDM),
        _rule(
            EventKind.WEIGHTS_END,
            "Load weight end",
            r"^Load weight end\. (?:elapsed=(?P<seconds>[\d.]+) s, )?",
        ),
        _rule(EventKind.KV_CACHE, "KV Cache is allocated", r"^KV Cache is allocated\."),
        _rule(EventKind.COMPILE_BEGIN, "Compiling num tokens", r"Compiling num tokens \("),
        _rule(EventKind.COMPILE_BEGIN, "DeepGEMM", r"Entering DeepGEMM JIT Pre-Compile|DeepGEMM warmup"),
        _rule(EventKind.CUDA_GRAPH_BEGIN, "graph begin", r"^Capture (?:\S+ \S+ )?(?:cuda|CUDA) graph begin\."),
        _rule(
            EventKind.CUDA_GRAPH_PROGRESS,
            "Capturing batches",
            r"Capturing batches \([^)]*\)" + _TQDM,
        ),
        _rule(
            EventKind.CUDA_GRAPH_END,
            "graph end",
            r"^Capture (?:\S+ \S+ )?(?:cuda|CUDA) graph end\.(?:.*?elapsed[:=] ?(?P<seconds>[\d.]+) s)?",
        ),
        # The port opens and the warm-up request is sent: uvicorn's own lines.
        _rule(EventKind.WARMUP_BEGIN, "startup", r"Waiting for application startup\.|Application startup complete\."),
        _rule(EventKind.WARMUP_BEGIN, "Uvicorn running", r"Uvicorn running on"),
        _rule(EventKind.READY, "fired up", r"The server is fired up and ready to roll!"),
        _rule(EventKind.FATAL, "scheduler died", r"^Rank \d+ scheduler died during initialization"),
        _rule(EventKind.FATAL, "scheduler is dead", r"^Rank \d+ scheduler is dead"),
        _rule(EventKind.FATAL, "Initialization failed", r"^Initialization failed\."),
        *_CAUSE_RULES,
    ),
)  # fmt: skip

VLLM = _Format(
    name=LogFormat.VLLM,
    signature=re.compile(
        r"(?:\([^()]*? pid=\d+\) (?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d )?"
        r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d )"
    ),
    prefix=re.compile(
        r"(?:\((?P<who>[^()]*?) pid=\d+\) )?"
        r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<mo>\d\d)-(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d)"
        r":(?P<S>\d\d)(?:\.(?P<f>\d+))? (?:\[[^\]]*\] |[\w.]+:\d+\] ))?"
    ),
    stamp=_stamp_no_year,
    rules=(
        _rule(EventKind.WEIGHTS_BEGIN, "Starting to load model", r"^Starting to load model "),
        _rule(EventKind.WEIGHTS_BEGIN, "Loading model from scratch", r"^Loading model from scratch"),
        _rule(
            EventKind.WEIGHTS_PROGRESS,
            "checkpoint shards",
            r"Loading (?:safetensors|pt) checkpoint shards(?: \(eager\))?" + _TQDM,
        ),
        _rule(EventKind.WEIGHTS_END, "Loading weights took", r"^Loading weights took (?P<seconds>[\d.]+) s"),
        _rule(EventKind.WEIGHTS_END, "Model loading took", r"^Model loading took [\d.]+ GiB(?: memory)? and (?P<seconds>[\d.]+) s"),
        _rule(EventKind.WEIGHTS_END, "Loading model weights took", r"^Loading model weights took [\d.]+ GB"),
        _rule(EventKind.COMPILE_BEGIN, "Starting torch.compile", r"^Starting torch\.compile"),
        # The CPU runner (0.32): compile and the profiling run, then dummy runs until "Warming up
        # done." and the KV cache.
        _rule(EventKind.COMPILE_BEGIN, "Warming up model for the compilation", r"^Warming up model for the compilation"),
        _rule(EventKind.WARMUP_BEGIN, "Initial profiling/warmup run took", r"^(?:\[\w+\] )?Initial profiling/warmup run took [\d.]+ s"),
        _rule(EventKind.COMPILE_BEGIN, "torch.compile", r"^Using cache directory: .* for vLLM's torch\.compile"),
        _rule(EventKind.COMPILE_BEGIN, "Dynamo bytecode transform", r"^Dynamo bytecode transform time: "),
        _rule(
            EventKind.COMPILE_END,
            "torch.compile t",
            r"^torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) (?P<seconds>[\d.]+) s in total",
        ),
        _rule(EventKind.KV_CACHE, "Available KV cache memory", r"^Available KV cache memory: "),
        _rule(EventKind.KV_CACHE, "KV cache size", r"KV cache size: [\d,]+ tokens"),
        _rule(EventKind.KV_CACHE, "# GPU blocks", r"^# GPU blocks: \d+"),
        _rule(EventKind.CUDA_GRAPH_BEGIN, "Capturing cudagraphs", r"^Capturing cudagraphs for decoding"),
        _rule(EventKind.CUDA_GRAPH_BEGIN, "Capturing the model for CUDA graphs", r"^Capturing the model for CUDA graphs"),
        _rule(EventKind.CUDA_GRAPH_PROGRESS, "Capturing CUDA graph", r"Capturing CUDA graph(?:s| shapes)[^:]*" + _TQDM),
        _rule(
            EventKind.CUDA_GRAPH_END,
            "Graph capturing finished",
            r"^Graph capturing finished in (?P<seconds>[\d.]+) secs?",
        ),
        _rule(EventKind.READY, "Application startup complete", r"Application startup complete\."),
        _rule(EventKind.FATAL, "Engine core initialization failed", r"^\w*Error: Engine core initialization failed"),
        _rule(EventKind.FATAL, "Engine process failed to start", r"^\w*Error: Engine process failed to start"),
        *_CAUSE_RULES,
    ),
)  # fmt: skip

LLAMACPP = _Format(
    name=LogFormat.LLAMACPP,
    signature=re.compile(
        r"(?:\d+\.\d\d\.\d{3}\.\d{3} [IWEDN] )?(?:build: \d+ \(|llama_model_loader: |load_tensors: "
        r"|llm_load_\w+: |llama_(?:model_load|context|kv_cache|new_context)\w*: |print_info: "
        r"|srv\s+\w+: |gguf_init_from_file)"
    ),
    prefix=re.compile(r"(?:\d+\.\d\d\.\d{3}\.\d{3} [IWEDN] )?"),
    stamp=None,
    rules=(
        _rule(EventKind.WEIGHTS_BEGIN, "load_tensors: ", r"^(?:llm_)?load_tensors: "),
        # Progress: a line of dots that grows while the tensors load and ends at 100 %.
        _rule(EventKind.WEIGHTS_PROGRESS, "..", r"^(?P<dots>\.{2,})$"),
        _rule(EventKind.WEIGHTS_END, "llama_context: constructing", r"^llama_context: constructing"),
        _rule(EventKind.WEIGHTS_END, "llama_new_context_with_model", r"^llama_new_context_with_model: "),
        _rule(EventKind.KV_CACHE, "KV buffer size", r"^llama_kv_cache\w*:\s+\S+ KV buffer size"),
        _rule(EventKind.WARMUP_BEGIN, "warming up the model", r"warming up the model"),
        _rule(EventKind.READY, "model loaded", r"^(?:srv\s+)?\w+: model loaded$"),
        _rule(EventKind.READY, "server is listening on", r"^main: server is listening on "),
        # llama-cpp-python's server: uvicorn starts once the model is in.
        _rule(EventKind.READY, "Uvicorn running on", r"Uvicorn running on"),
        _rule(EventKind.FATAL, "exiting due to model loading error", r"^main: exiting due to model loading error"),
        _rule(EventKind.FATAL, "failed to load model", r"^llama_model_load_from_file\w*: failed to load model"),
        *_CAUSE_RULES,
    ),
)  # fmt: skip

TGI = _Format(
    name=LogFormat.TGI,
    signature=re.compile(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\s+(?:TRACE|DEBUG|INFO|WARN|ERROR) "
    ),
    prefix=re.compile(
        r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)T(?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)(?:\.(?P<f>\d+))?Z"
        r"\s+(?:TRACE|DEBUG|INFO|WARN|ERROR) "
    ),
    stamp=_stamp_utc,
    rank_in_message=True,
    rules=(
        _rule(EventKind.WEIGHTS_BEGIN, "Starting shard", r"Starting shard\b"),
        _rule(EventKind.WEIGHTS_END, "Shard ready in", r"Shard ready in (?P<seconds>[\d.]+)s"),
        _rule(EventKind.WARMUP_BEGIN, "Warming up model", r"Warming up model"),
        _rule(EventKind.KV_CACHE, "KV-cache blocks", r"KV-cache blocks: \d+"),
        _rule(EventKind.CUDA_GRAPH_BEGIN, "Cuda Graphs are enabled", r"Cuda Graphs are enabled for sizes"),
        _rule(EventKind.CUDA_GRAPH_END, "Setting max batch total tokens", r"Setting max batch total tokens to \d+"),
        _rule(EventKind.READY, "Connected", r"\bConnected$"),
        _rule(EventKind.FATAL, "failed to start", r"(?:^|: )Shard \d+ failed to start"),
        _rule(EventKind.FATAL, "Error: ", r"^Error: \w+"),
        *_CAUSE_RULES,
    ),
)  # fmt: skip

TRITON = _Format(
    name=LogFormat.TRITON,
    signature=re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6}\s+\d+ [\w.]+:\d+\] "),
    prefix=re.compile(
        r"[IWEF](?P<mo>\d\d)(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)\.(?P<f>\d{6})"
        r"\s+\d+ [\w.]+:\d+\] "
    ),
    stamp=_stamp_no_year,
    rules=(
        _rule(EventKind.WEIGHTS_BEGIN, "loading: ", r"^loading: (?P<who>[^:\s]+):\d+"),
        _rule(EventKind.WEIGHTS_END, "successfully loaded", r"^successfully loaded '(?P<who>[^']+)'"),
        _rule(EventKind.READY, "Started HTTPService", r"^Started HTTPService at "),
        _rule(EventKind.FATAL, "failed to load", r"^failed to load '[^']+' version \d+: .+"),
        _rule(EventKind.FATAL, "creating server", r"^error: creating server: .+"),
        *_CAUSE_RULES,
    ),
)  # fmt: skip

FORMATS: dict[LogFormat, _Format] = {f.name: f for f in (SGLANG, VLLM, LLAMACPP, TGI, TRITON)}

_ANSI_RE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)|[@-Z\\-_])")


def clean(text: str) -> str:
    """ANSI codes out, every `\\r`, `\\r\\n` and `\\n` one `\\n`: lines as the parser reads them."""
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    if "\r" in text:
        text = text.replace("\r\n", "\n").replace("\r", "\n")
    return text


def detect(line: str) -> LogFormat | None:
    """The format whose signature a cleaned line starts with, if any."""
    for fmt in FORMATS.values():
        if fmt.signature.match(line):
            return fmt.name
    return None


# --- merging ranks into events -------------------------------------------------------------------


@dataclass
class _Span:
    open: bool = False
    ended_once: bool = False
    begun: set[str | None] = field(default_factory=set)
    ended: set[str | None] = field(default_factory=set)


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

    def close(self, begin: EventKind) -> bool:
        """End a span still open (its end line never came); whether it was open."""
        span = self.spans[begin]
        if not span.open:
            return False
        span.open, span.ended_once = False, True
        return True

    def unseen(self, begin: EventKind) -> bool:
        """Whether this span has neither begun nor ended in this load."""
        span = self.spans[begin]
        return not span.open and not span.ended_once

    def merge(self, kind: EventKind, who: str | None) -> bool:
        """Whether this rank's begin, end or once-per-load marker fires an event now."""
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
                # The begin was never seen (read from the middle): the first end counts, once.
                first = not span.ended_once
                span.ended_once = True
                return first
            span.ended.add(who)
            if span.begun - {None} <= span.ended:
                span.open, span.ended_once = False, True
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

    def __init__(self, fmt: LogFormat | str = LogFormat.AUTO) -> None:
        self.configured = LogFormat(fmt)
        self.format: LogFormat | None = (
            None if self.configured is LogFormat.AUTO else self.configured
        )
        self.format_reason = "configured" if self.format else "auto: no recognisable line yet"
        self.unknown_announced = False  # set once `auto` has seen DETECT_ANNOUNCE_LINES in vain
        self._spec = FORMATS[self.format] if self.format else None
        self._backlog: deque[tuple[str, float]] = deque(maxlen=DETECT_BACKLOG)
        self._undecided_lines = 0
        self._cycle = _Cycle()
        self._seq = 0
        self._line_no = 0
        self._cause: tuple[int, str] | None = None
        self._last_at = 0.0  # event times never go back: the log is written in order

    @property
    def seq(self) -> int:
        """The sequence number of the last event fired."""
        return self._seq

    def feed(self, text: str, ref: float) -> list[LogEvent]:
        """Events from a chunk of whole lines (raw or cleaned) read or stamped at `ref`."""
        text = clean(text)
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
        tail = clean(tail)
        line = tail[tail.rfind("\n") + 1 :]
        events: list[LogEvent] = []
        if line and spec.keywords.search(line):
            self._line(spec, line, ref, events, progress_only=True)
        return events

    def _detect(self, text: str, ref: float) -> str:
        """Try each line until one names the format; return the text after it (or "")."""
        start = 0
        while start < len(text):
            end = text.find("\n", start)
            if end < 0:
                end = len(text)
            line = text[start:end]
            start = end + 1
            if not line:
                continue
            self._undecided_lines += 1
            fmt = detect(line)
            if fmt is not None:
                self.format, self._spec = fmt, FORMATS[fmt]
                shown = line if len(line) <= 120 else line[:117] + "..."
                self.format_reason = (
                    f"auto: line {self._undecided_lines} matched {fmt}'s line prefix: {shown!r}"
                )
                self._backlog.append((line[:DETAIL_MAX], ref))
                return text[start:]
            self._backlog.append((line[:DETAIL_MAX], ref))
        if self._undecided_lines >= DETECT_ANNOUNCE_LINES and not self.unknown_announced:
            self.unknown_announced = True
            self.format_reason = (
                f"auto: unknown format, none of {self._undecided_lines} lines matched a known"
                " server; no events"
            )
        return ""

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
        spec: _Format,
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
                prefix = _split_prefix(spec, line, ref)
            match = rule.pattern.search(prefix.message)
            if match is None:
                continue
            if rule.kind == _CAUSE:
                self._cause = (self._line_no, prefix.message.strip())
                continue
            self._fire(EventKind(rule.kind), match, prefix, ref, events, partial=progress_only)
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
        cycle = self._cycle
        if cycle.finished:
            if kind is not EventKind.WEIGHTS_BEGIN:
                return
            cycle = self._cycle = _Cycle()
            self._cause = None
        detail = prefix.message.strip()
        at = self._last_at = max(_event_time(prefix.stamp, prefix.resolution, ref), self._last_at)
        done = total = None
        if kind in _PROGRESS:
            done, total = _progress(groups, partial)
            if done is None or total is None:
                return
            begin = _BEGIN_OF_PROGRESS[kind]
            if cycle.unseen(begin) and cycle.merge(begin, who):
                # A bar is the first sign of its span (vLLM's CUDA graphs, a missed begin line).
                self._weights_in_before(begin, events, at, who, detail)
                self._emit(events, begin, at, who, detail)
            per_rank = cycle.progress[kind]
            per_rank[who] = (done, total)
            who, (done, total) = min(per_rank.items(), key=lambda item: _fraction(item[1]))
            if cycle.last_progress.get(kind) == (done, total):
                return
            cycle.last_progress[kind] = (done, total)
        elif not cycle.merge(kind, who):
            return
        self._weights_in_before(kind, events, at, who, detail)
        if kind is EventKind.FATAL:
            cycle.finished = True
            detail = self._with_cause(detail)
        elif kind is EventKind.READY:
            cycle.finished = True
        seconds = groups.get("seconds")
        self._emit(events, kind, at, who, detail, done, total, float(seconds) if seconds else None)

    def _weights_in_before(
        self, kind: EventKind, events: list[LogEvent], at: float, who: str | None, detail: str
    ) -> None:
        """Ranks synchronise before the KV cache: a later step means the weights are in."""
        if kind in _AFTER_WEIGHTS and self._cycle.close(EventKind.WEIGHTS_BEGIN):
            self._emit(events, EventKind.WEIGHTS_END, at, who, f"implied by: {detail}")

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
    ) -> None:
        self._seq += 1
        detail = detail[:DETAIL_MAX]
        events.append(LogEvent(kind, at, _rank(who), detail, done, total, seconds, who, self._seq))


def _fraction(progress: tuple[int, int]) -> float:
    done, total = progress
    return done / total if total > 0 else 1.0


def _split_prefix(spec: _Format, line: str, ref: float) -> _Prefix:
    stamp = who = None
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
    if spec.rank_in_message:
        r = _TGI_RANK_RE.search(message)
        if r is not None:
            who = r.group(0)
    return _Prefix(stamp, resolution, who, message)


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


# --- fine steps from events ----------------------------------------------------------------------

_ENTERS = {
    EventKind.WEIGHTS_BEGIN: Step.WEIGHTS,
    EventKind.KV_CACHE: Step.KV_CACHE,
    EventKind.COMPILE_BEGIN: Step.COMPILE,
    EventKind.CUDA_GRAPH_BEGIN: Step.CUDA_GRAPH,
    EventKind.WARMUP_BEGIN: Step.WARMUP,
}
_LEAVES = {
    EventKind.WEIGHTS_END: Step.WEIGHTS,
    EventKind.COMPILE_END: Step.COMPILE,
    EventKind.CUDA_GRAPH_END: Step.CUDA_GRAPH,
}
_PROGRESS_STEP = {
    EventKind.WEIGHTS_PROGRESS: Step.WEIGHTS,
    EventKind.CUDA_GRAPH_PROGRESS: Step.CUDA_GRAPH,
}


class StepTimeline:
    """Folds events into the current fine step and the time spent in each finished one.

    A step runs from its begin event to its end event, or else to the next step's begin, ready or
    fatal; between an end and the next begin the step is `none`. An end line that states the
    step's duration counts even without its begin line, backdated by that duration. Progress opens its step only when
    no step is open and that step has not run yet (its begin line was missed). A step that runs
    twice (a draft model's weights) adds up. ready and fatal end the load; the next weights_begin
    starts a new one and clears the durations.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.step = Step.NONE
        self.since: float | None = None
        self.durations: dict[Step, float] = {}
        self.finished = False
        self.ready_at: float | None = None
        self.fatal: str | None = None
        self.weights: tuple[int, int] | None = None
        self.cuda_graphs: tuple[int, int] | None = None

    def apply(self, event: LogEvent) -> None:
        kind, at = event.kind, event.time
        if self.finished:
            if kind is not EventKind.WEIGHTS_BEGIN:
                return
            self._reset()
        if kind in _ENTERS:
            self._enter(_ENTERS[kind], at)
        elif kind in _LEAVES:
            step = _LEAVES[kind]
            if self.step is step:
                self._leave(at)
            elif event.seconds is not None and step not in self.durations:
                # "Graph capturing finished in 3 secs" without its begin line: it ran for the
                # seconds it states, up to now; a step still open ended where this one began.
                began = at - event.seconds
                if self.since is not None:
                    self._leave(max(self.since, began))
                self.durations[step] = event.seconds
        elif kind in _PROGRESS_STEP:
            step = _PROGRESS_STEP[kind]
            if self.step is Step.NONE and step not in self.durations:
                self._enter(step, at)
            progress = (event.done or 0, event.total or 0)
            if kind is EventKind.WEIGHTS_PROGRESS:
                self.weights = progress
            else:
                self.cuda_graphs = progress
        elif kind is EventKind.READY:
            self._leave(at)
            self.finished, self.ready_at = True, at
        elif kind is EventKind.FATAL:
            self._leave(at)
            self.finished, self.fatal = True, event.detail

    def close(self, at: float) -> None:
        """The load ended at `at` without the log saying so (the process died): end the step."""
        self._leave(at)

    def _enter(self, step: Step, at: float) -> None:
        if step is self.step:
            return
        self._leave(at)
        self.step, self.since = step, at

    def _leave(self, at: float) -> None:
        if self.step is not Step.NONE and self.since is not None:
            spent = max(0.0, at - self.since)
            self.durations[self.step] = self.durations.get(self.step, 0.0) + spent
        self.step, self.since = Step.NONE, None
