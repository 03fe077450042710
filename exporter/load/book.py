"""One load's bookkeeping while the tracker follows it, shared by the rules that keep it.

The tracker (exporter/load/tracker.py) owns the load's boundaries and phases, the progress rules
(exporter/load/progress.py) what each signal says of the weights, the ETA (exporter/load/eta.py)
the rate window: each reads and writes this one record of the load, as the tracker's methods did
when all three were one class.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from exporter.load.observation import FileView
from exporter.load.steps import StepTimeline
from exporter.vocabulary import Cache, Signal


class Evidence(NamedTuple):
    """What one signal says of the weights this tick."""

    ratio: float
    basis: float | None  # bytes that make a ratio of 1.0; None: not bytes (shards of a log)


@dataclass
class LoadBook:
    """Mutable bookkeeping of the current (or last) load: what the tracker, the progress rules
    and the ETA keep of it from tick to tick."""

    started_at: float
    seen_at: float  # the first tick of this load
    partial: bool
    seen_late: bool
    seen_failing: bool
    expected_gpu: int | None
    disk_base: int | None
    gpu_base: int | None
    last_move: float
    weights_began: float | None = None
    weights_ended: float | None = None
    # Whether those boundaries were watched; a load seen late may have crossed them before.
    weights_began_seen: bool = False
    weights_ended_seen: bool = False
    progress: float | None = None
    source: Signal | None = None
    basis: float | None = None
    cache: Cache | None = None
    resident_start: int | None = None
    last_rise: float = 0.0
    flat_time: float = 0.0
    flat_progress: float = 0.0
    gpu_prev: int | None = None
    gpu_at_rise: int | None = None
    gpu_at_weights_end: int | None = None
    log_weights_open: bool = False  # the log said the weights began and has not said they ended
    log_from_start: bool = False  # the log showed this load's weights begin: its steps are whole
    log_shards: tuple[int, int] | None = None  # (done, total) from the log's progress lines
    # Storage bytes the tree had read when its first weight file opened: reads before it are
    # start-up (imports), never weights.
    reads_at_open: int | None = None
    rx_at_open: int | None = None  # the GPUs' PCIe receive counter then
    startup_reads: int | None = None  # storage bytes read at the last look before that open
    files: FileView | None = None  # the last view of the weight files in this load
    files_looked: bool = False  # the view has looked at this load's process (not pending)
    # First seen mid-way with no weight file held: the weights may be behind or ahead of it,
    # so its phases are unknown unless a weight file is seen opening after all.
    phases_unknown: bool = False
    steps: StepTimeline = field(default_factory=StepTimeline)  # the log's fine steps, this load
    fatal: str | None = None
    fatal_at: float | None = None
    node_up_at: float | None = None  # a follower's log said its start-up ended (its ready)
    ready_at: float | None = None  # the first ready answer, while the log is read up to it
    log_weights_began: float | None = None  # when the log's weights-begin line was dated
    unready_at: float | None = None  # when the last answer that said not ready was asked
    in_server: bool = False  # a running server's load: its process started before it
    reads_base: int | None = None  # the tree's storage reads as an in-server load began
    bytes_read: int | None = None
    weights_bytes: int | None = None
    evidence: dict[Signal, Evidence] = field(default_factory=dict)
    rate: deque[tuple[float, float]] = field(default_factory=deque)
    expected: dict[Cache | None, Mapping[str, float]] = field(default_factory=dict)

    def weights_in_by(self, files: FileView | None, at: float) -> float:
        """A later step's line says the weights were in by `at`, not when. Where the tree let go
        of every weight file before it, they were in then: vLLM's ranks after the first write
        no end line of their own (measured on 0.32 at TP 2: the tree let go 5 s before the line
        that implied their end)."""
        idle = files.idle_since if files is not None else None
        if idle is None:
            return at
        return min(at, max(idle, self.weights_began or self.started_at))
