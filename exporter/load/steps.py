"""A load's fine steps (weights, KV cache, compile, CUDA graphs, warm-up) from its log's events.

Part of the load model: the tracker keeps one timeline per load and asks it which step runs and
how long each took; exporter/sources/logs.py keeps one per log to show the current step between
ticks. Pure, as the tracker is: events in, steps and durations out.
"""

from __future__ import annotations

import math

from exporter.load.events import CYCLE_BEGINS, EventKind, LogEvent
from exporter.vocabulary import Step

STAMP_WINDOW = 1.0  # how long before its event time a whole-second stamped line was written


def tighten(began: float, ended: float, seconds: float | None) -> tuple[float, float]:
    """A step's begin and end from its two lines, made exact by the duration the end line states.

    Each line's event time is at or after the moment it names (a whole-second stamp, refined by
    when the line was read: `_event_time` in exporter/logs/markers.py), so `ended - seconds` and
    `began + seconds` are upper bounds too, and the smaller of each pair is the closer. A stated
    duration that disagrees with the lines by more than a stamp's second measures something else:
    the lines stand.
    """
    if seconds is None:
        return began, ended
    said_begin, said_end = ended - seconds, began + seconds
    if said_begin < began - STAMP_WINDOW or said_end < ended - STAMP_WINDOW:
        return began, ended
    return min(began, said_begin), min(ended, said_end)


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
    step's duration counts even without its begin line, backdated by that duration. The KV
    cache's line comes as its allocation ends (SGLang's `KV Cache is allocated`): the allocation
    time the server states afterwards (kv_cache_timed) moves the step's begin back by as much,
    never before the step before it ended, or counts that time alone where no KV line was
    seen. Progress
    opens its step only when no step is open and that step has not run yet (its begin line was
    missed). A step that runs twice (a draft model's weights) adds up. ready and fatal end the
    load; the next weights_begin starts a new one and clears the durations.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.step = Step.NONE
        self.since: float | None = None
        self._left_at = -math.inf  # when the last step ended: none begins before it
        # When the KV cache's step began, and when the step before it had ended.
        self._kv_began: tuple[float, float] | None = None
        self.durations: dict[Step, float] = {}
        self.finished = False
        self.ready_at: float | None = None
        self.fatal: str | None = None
        self.weights: tuple[int, int] | None = None
        self.cuda_graphs: tuple[int, int] | None = None

    def apply(self, event: LogEvent) -> None:
        kind, at = event.kind, event.time
        if kind is EventKind.UNLOADED:
            return
        if self.finished:
            if kind not in CYCLE_BEGINS:
                return
            self._reset()
        if kind in _ENTERS:
            self._enter(_ENTERS[kind], at)
        elif kind is EventKind.KV_CACHE_TIMED:
            self._date_kv_cache(event)
        elif kind in _LEAVES:
            step = _LEAVES[kind]
            if self.step is step:
                if self.since is not None:
                    self.since, at = tighten(self.since, at, event.seconds)
                self._leave(at)
            elif event.seconds is not None:
                self._count_unseen(step, at, event.seconds)
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

    def _count_unseen(self, step: Step, at: float, seconds: float) -> None:
        """A step whose begin line was missed ran for the `seconds` its end line states, up to
        `at` ("Graph capturing finished in 3 secs"); a step still open ended where it began."""
        began = at - seconds
        if self.since is not None:
            self._leave(max(self.since, began))
        self.durations[step] = self.durations.get(step, 0.0) + seconds
        self._left_at = max(self._left_at, at)

    def _date_kv_cache(self, event: LogEvent) -> None:
        """The KV cache's allocation time, stated after its line: the open step began that much
        before the line (not before the step before it ended); without the line it ran alone."""
        seconds = event.seconds
        if seconds is None:
            return
        if self._kv_began is None:
            if Step.KV_CACHE not in self.durations:
                self._count_unseen(Step.KV_CACHE, event.time, seconds)
            return
        began, floor = self._kv_began
        earlier = max(0.0, min(seconds, began - floor))
        self._kv_began = (began - earlier, floor)
        if self.step is Step.KV_CACHE and self.since is not None:
            self.since -= earlier
        else:  # over already (CUDA graphs came between it and the timings, as on a GPU)
            self.durations[Step.KV_CACHE] = self.durations.get(Step.KV_CACHE, 0.0) + earlier

    def close(self, at: float) -> None:
        """The load ended at `at` without the log saying so (the process died): end the step."""
        self._leave(at)

    def _enter(self, step: Step, at: float) -> None:
        if step is self.step:
            return
        self._leave(at)
        self.step, self.since = step, at
        if step is Step.KV_CACHE and self._kv_began is None:
            self._kv_began = (at, self._left_at)

    def _leave(self, at: float) -> None:
        if self.step is not Step.NONE and self.since is not None:
            spent = max(0.0, at - self.since)
            self.durations[self.step] = self.durations.get(self.step, 0.0) + spent
            self._left_at = max(self._left_at, at)
        self.step, self.since = Step.NONE, None
