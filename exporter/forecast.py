"""How long a restart begun now would take to be ready, from what this target's past loads showed.

An operator who sees the disk read at 3 GB/s and reasons "the page cache is warm, this will be
quick" still waits minutes for compile and CUDA graphs; one whose weights were half evicted
overnight waits for storage. Both are knowable before the restart:

    restart = starting + weights + initializing

* starting and initializing: medians over this target's recent good loads of the temperature the
  residency now makes the restart (cold, mixed or warm), else of any temperature, as the tracker's
  ETA takes them: imports, NCCL set-up, compile and graphs read no weight files, but imports come
  faster from a warm cache, and an mmap loader (llama.cpp) still faults weights in after its
  weights phase, in the warm-up of initializing. Starting, though, reads no weight file at all:
  what it reads is the server's own environment (interpreter, packages, libraries: SGLang's
  first start after they left the page cache spent 25 s more importing). So where loads say what
  start-up read from storage, starting is the median of those that found their environment
  cached (read at most ENVIRONMENT_READ_SHARE of what the most-reading one did, once one read
  ENVIRONMENT_BYTES), whatever the weights' temperature: a restart follows a run, which read it.
  An environment evicted since is not foreseen (its residency is not measured): such a restart
  takes longer by what its imports read;
* weights = bytes not in the page cache now / storage rate + bytes in it / page-cache rate, each
  rate the median over the past loads that measured it: a load that had at most COLD_SHARE of
  its weights cached read at the storage's rate, one with at least WARM_SHARE at the cache's
  (once the other rate is known, each load's own other part is taken out of its time first). A
  weights phase timed at 0 s (over between two looks: llama.cpp maps a cached GGUF in a tenth of
  a second) read faster than can be told: its rate is infinite, its bytes cost nothing.

Absent, with the reason, when a part lacks a basis: no good load in history, bytes to read from
storage but no load that read from it, or bytes in the cache but no load that came from it (a
share under NEGLIGIBLE_SHARE of the weights needs no rate).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from exporter.tracker import COLD_SHARE, WARM_SHARE, LoadRecord, temperature
from exporter.vocabulary import Cache, Outcome, Phase

NEGLIGIBLE_SHARE = 0.01
# A start-up that read at most this share of what the most-reading one did found its environment
# in the page cache; below ENVIRONMENT_BYTES read by any, none read it from storage.
ENVIRONMENT_READ_SHARE = 0.1
ENVIRONMENT_BYTES = 64 << 20


class _Phases(NamedTuple):
    """Median seconds of the phases around the weights."""

    starting: float | None
    initializing: float | None


_UNTIMED = _Phases(None, None)


@dataclass(frozen=True)
class Rates:
    """What this target's past loads measured: bytes per second, and the phase medians over
    loads of any temperature and over those of each temperature that has some."""

    storage_bytes_per_second: float | None
    cache_bytes_per_second: float | None
    loads: int  # the good loads they come from
    anywhere: _Phases = _UNTIMED
    by_cache: Mapping[Cache, _Phases] = field(default_factory=dict)
    # Starting's median over the loads whose start-up found the environment cached.
    starting_cached_environment: float | None = None

    def phases(self, cache: Cache) -> _Phases:
        """Starting and initializing for a load of this temperature: its own loads' medians,
        else those of any temperature; starting from loads that found the environment cached
        where start-up's reads are known."""
        own = self.by_cache.get(cache, _UNTIMED)
        starting = self.starting_cached_environment
        if starting is None:
            starting = own.starting if own.starting is not None else self.anywhere.starting
        return _Phases(
            starting,
            own.initializing if own.initializing is not None else self.anywhere.initializing,
        )


@dataclass(frozen=True)
class Forecast:
    seconds: float | None
    resident_share: float | None  # of the weights in the page cache now
    reason: str | None  # why there is no forecast, or None


NO_RATES = Rates(None, None, 0)


def rates(loads: Sequence[LoadRecord]) -> Rates:
    """The rates and phase medians of recent loads (newest first, as history returns them)."""
    good = [r for r in loads if r.outcome is Outcome.READY and not r.partial]
    samples = [s for s in (_sample(r) for r in good) if s is not None]
    storage = _rate(samples, cold=True, other=None)
    cache = _rate(samples, cold=False, other=None)
    # Each rate again, the other part of each load taken out at the other rate.
    storage, cache = (
        _rate(samples, cold=True, other=cache),
        _rate(samples, cold=False, other=storage),
    )
    return Rates(
        storage_bytes_per_second=storage,
        cache_bytes_per_second=cache,
        loads=len(good),
        anywhere=_phases(good),
        by_cache={
            c: _phases([r for r in good if r.cache is c])
            for c in {r.cache for r in good}
            if c is not None
        },
        starting_cached_environment=_median(
            r.phase_seconds.get(Phase.STARTING) for r in _environment_cached(good)
        ),
    )


def _environment_cached(loads: Sequence[LoadRecord]) -> list[LoadRecord]:
    """The loads whose start-up read little of the server's environment from storage; none
    where no start-up read much of it (the temperatures' own medians hold then)."""
    known = [r for r in loads if r.startup_read_bytes is not None]
    most = max((r.startup_read_bytes or 0 for r in known), default=0)
    if most < ENVIRONMENT_BYTES:
        return []
    return [r for r in known if (r.startup_read_bytes or 0) <= ENVIRONMENT_READ_SHARE * most]


def forecast(known: Rates, weights_bytes: int | None, resident_bytes: int | None) -> Forecast:
    """A restart begun now, from the residency now."""
    if not weights_bytes or resident_bytes is None:
        return Forecast(None, None, "the weights' page-cache residency is not measured")
    share = min(1.0, resident_bytes / weights_bytes)
    if known.loads == 0:
        return Forecast(None, share, "no finished load of this target in history")
    starting, initializing = known.phases(temperature(share))
    if starting is None or initializing is None:
        return Forecast(None, share, "no load in history whose phases were all timed")
    uncached, cached = weights_bytes - resident_bytes, resident_bytes
    weights = 0.0
    for part, rate, missing in (
        (uncached, known.storage_bytes_per_second, "no cold load in history to time storage"),
        (cached, known.cache_bytes_per_second, "no warm load in history to time the page cache"),
    ):
        if part <= NEGLIGIBLE_SHARE * weights_bytes:
            continue
        if not rate:
            return Forecast(None, share, missing)
        weights += part / rate
    total = starting + weights + initializing
    return Forecast(total, share, None)


@dataclass(frozen=True)
class _Sample:
    uncached: int
    cached: int
    seconds: float


def _sample(record: LoadRecord) -> _Sample | None:
    weights, resident = record.weights_bytes, record.resident_bytes_at_start
    seconds = record.phase_seconds.get(Phase.LOADING_WEIGHTS)
    if not weights or resident is None or seconds is None:
        return None
    resident = min(resident, weights)
    return _Sample(weights - resident, resident, seconds)


def load_rate(record: LoadRecord, *, cold: bool, other: float | None) -> float | None:
    """The rate one load's weights came at from storage (`cold`) or the page cache: None unless
    it read mostly from there and was timed, its time less the minority part at the `other` rate
    if known."""
    sample = _sample(record)
    rate = _sample_rate(sample, cold=cold, other=other) if sample is not None else None
    return rate if rate is not None and math.isfinite(rate) else None


def _sample_rate(s: _Sample, *, cold: bool, other: float | None) -> float | None:
    total = s.uncached + s.cached
    main, minority = (s.uncached, s.cached) if cold else (s.cached, s.uncached)
    measured_it = s.cached <= COLD_SHARE * total if cold else s.cached >= WARM_SHARE * total
    if not measured_it or main <= 0:
        return None
    if s.seconds <= 0:
        return math.inf  # in before it could be timed: its bytes cost nothing
    seconds = s.seconds - (minority / other if other else 0.0)
    return main / seconds if seconds > 0 else None


def _rate(samples: Sequence[_Sample], *, cold: bool, other: float | None) -> float | None:
    """Median rate of the part the loads mostly read (storage for cold ones, the cache for warm
    ones)."""
    rates = [r for r in (_sample_rate(s, cold=cold, other=other) for s in samples) if r]
    return statistics.median(rates) if rates else None


def _phases(loads: Sequence[LoadRecord]) -> _Phases:
    return _Phases(
        _median(r.phase_seconds.get(Phase.STARTING) for r in loads),
        _median(r.phase_seconds.get(Phase.INITIALIZING) for r in loads),
    )


def _median(values: Iterable[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None
