"""What a server's log says happened, as the load model reads it: typed events.

exporter/logs/markers.py makes them from log lines, by the marker rows each server module fills
in (exporter/servers/logformat.py); the tracker and its step timeline (exporter/load/steps.py)
read them. Defined here, at the bottom of the layers, so that the load model reads a log's events
without importing the logs that produce them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class EventKind(StrEnum):
    WEIGHTS_BEGIN = "weights_begin"
    WEIGHTS_PROGRESS = "weights_progress"
    WEIGHTS_END = "weights_end"
    KV_CACHE = "kv_cache"
    # The KV cache's allocation time in the server's own account, stated after the step began
    # (SGLang's `Engine startup timings (s): ... kv_cache_allocation=N`): it dates the step.
    KV_CACHE_TIMED = "kv_cache_timed"
    COMPILE_BEGIN = "compile_begin"
    COMPILE_END = "compile_end"
    CUDA_GRAPH_BEGIN = "cuda_graph_begin"
    CUDA_GRAPH_PROGRESS = "cuda_graph_progress"
    CUDA_GRAPH_END = "cuda_graph_end"
    WARMUP_BEGIN = "warmup_begin"
    READY = "ready"
    # The last line of a follower node's start-up (one node of a model over several hosts that
    # serves nothing itself): its part of the model is up. Written by the head's workers too,
    # where it says nothing of readiness: only a follower's tracker reads it.
    NODE_UP = "node_up"
    FATAL = "fatal"
    # A running server loads (a model into Triton in explicit or poll mode) or unloads one.
    LOAD_BEGIN = "load_begin"
    UNLOADED = "unloaded"


# The kinds that begin a load's cycle: the first weights of a load, or a model loaded into a
# running server. After ready or fatal, only these start anything again.
CYCLE_BEGINS = frozenset({EventKind.WEIGHTS_BEGIN, EventKind.LOAD_BEGIN})


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
    # An end no line stated: a later step's line says the span was over by then, not when
    # (a release that reworded its end line; vLLM's ranks after the first, which write none).
    implied: bool = False
