"""How long a load still needs: the weights' rate over a window, and history's medians for the
phases and fine steps ahead.

Functions of the load's bookkeeping (exporter/load/book.py), its phase and what history expects;
the tracker (exporter/load/tracker.py) asks them for each state it hands out. None wherever a
part has no basis: an ETA is never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from exporter.load.book import LoadBook
from exporter.vocabulary import Cache, Phase, Step

# Throughput is the progress over the last RATE_WINDOW_SECONDS, and over no fewer than
# RATE_MIN_INTERVALS intervals: smooth enough for an ETA, still following a change of pace.
RATE_WINDOW_SECONDS = 10.0
RATE_MIN_INTERVALS = 3
# Phases whose length does not depend on the page cache: ETAs may take them from any load.
FINE_STEPS = (Step.KV_CACHE, Step.COMPILE, Step.CUDA_GRAPH, Step.WARMUP)
CACHE_INDEPENDENT: tuple[str, ...] = (Phase.INITIALIZING, *FINE_STEPS)


class Expectations(Protocol):
    """What history expects of a target's next load (implemented by history.store.HistoryStore)."""

    def expected_phase_seconds(self, target: str, cache: Cache | None) -> Mapping[str, float]:
        """Median seconds per phase of recent good loads of this cache temperature (None: any)."""
        ...

    def expected_weights_gpu_bytes(self, target: str) -> int | None: ...


def expected_phases(history: Expectations, target: str, cache: Cache | None) -> dict[str, float]:
    """History's phase medians for a load of this cache temperature: those of loads of the same
    temperature, and for the phases after the weights (which do not depend on the page cache)
    those of any temperature where the same temperature has none."""
    same = history.expected_phase_seconds(target, cache or Cache.UNKNOWN)
    anywhere = history.expected_phase_seconds(target, None)
    return {**{p: anywhere[p] for p in CACHE_INDEPENDENT if p in anywhere}, **same}


def expected(load: LoadBook, history: Expectations | None, target: str) -> Mapping[str, float]:
    """History's phase medians for this load's cache (`expected_phases`), read once per load and
    cache value."""
    if history is None:
        return {}
    if load.cache not in load.expected:
        load.expected[load.cache] = expected_phases(history, target, load.cache)
    return load.expected[load.cache]


def note_rate(load: LoadBook, now: float, progress: float, interval: float) -> None:
    """One more point of the weights' progress, the window kept to RATE_WINDOW_SECONDS and at
    least RATE_MIN_INTERVALS intervals."""
    load.rate.append((now, progress))
    horizon = now - max(RATE_WINDOW_SECONDS, RATE_MIN_INTERVALS * interval)
    while len(load.rate) >= 2 and load.rate[1][0] <= horizon:
        load.rate.popleft()


def rate(load: LoadBook, phase: Phase, interval: float) -> float | None:
    """Progress per second over the rate window; None until it spans 3 intervals."""
    if phase is not Phase.LOADING_WEIGHTS or len(load.rate) < 2:
        return None
    (t0, p0), (t1, p1) = load.rate[0], load.rate[-1]
    if t1 - t0 < RATE_MIN_INTERVALS * interval:
        return None
    return max(0.0, p1 - p0) / (t1 - t0)


def eta(
    load: LoadBook,
    phase: Phase,
    now: float,
    weights_eta: float | None,
    medians: Mapping[str, float],
    logged: bool,
) -> float | None:
    """Seconds until ready: the weights' own ETA while they load, history's medians for the
    phases ahead (`medians`, from `expected`); in initializing, the fine steps still to come
    where the log (`logged`) showed this load's steps."""
    init = medians.get(Phase.INITIALIZING)
    if init is None:
        return None
    if phase is Phase.INITIALIZING:
        left = init - (now - (load.weights_ended or load.started_at))
        steps = _steps_left(load, medians, now) if logged else None
        return max(0.0, left if steps is None else max(left, steps))
    if phase is Phase.LOADING_WEIGHTS:
        return None if weights_eta is None else weights_eta + init
    starting, weights = medians.get(Phase.STARTING), medians.get(Phase.LOADING_WEIGHTS)
    if starting is None or weights is None:
        return None
    return max(0.0, starting - (now - load.started_at)) + weights + init


def _steps_left(load: LoadBook, medians: Mapping[str, float], now: float) -> float | None:
    """Seconds the log's fine steps still need: the rest of the current step's median and
    the medians of the steps history knows that this load has not begun yet.

    An initializing phase running over its median still has the steps it has not done;
    None without a log that showed this load from its weights on.
    """
    if not load.log_from_start:
        return None
    timeline = load.steps
    left = 0.0
    for step in FINE_STEPS:
        median = medians.get(step)
        if median is None or step in timeline.durations:
            continue
        if step is timeline.step and timeline.since is not None:
            left += max(0.0, median - (now - timeline.since))
        else:
            left += median
    return left
