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
  first start after they left the page cache spent 25 s more importing). So starting is the
  median of the loads that found their environment cached, whatever the weights' temperature:
  those whose environment (the files the tree maps, as much of them as a run keeps cached:
  exporter/sources/environment.py) was at most ENVIRONMENT_BYTES or (1 -
  ENVIRONMENT_CACHED_SHARE) out of the page cache as they began,
  and those without that measurement whose start-up read at most ENVIRONMENT_READ_SHARE of what
  the most-reading one did, once one read ENVIRONMENT_BYTES. With the environment's residency
  measured now, a restart that would not find it cached (by the same rule) starts longer by its
  bytes out of the cache at the seconds per uncached byte the loads that began so showed
  (their starting less that median, over their uncached bytes; the median of them), else by
  nothing: not foreseen without such a load;
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

from exporter.load.progress import COLD_SHARE, WARM_SHARE, temperature
from exporter.load.records import LoadRecord
from exporter.vocabulary import Cache, Outcome, Phase

NEGLIGIBLE_SHARE = 0.01
# A start-up that read at most this share of what the most-reading one did found its environment
# in the page cache; below ENVIRONMENT_BYTES read by any, none read it from storage.
ENVIRONMENT_READ_SHARE = 0.1
ENVIRONMENT_BYTES = 64 << 20
# A start that found at least this share of its environment cached found it cached.
ENVIRONMENT_CACHED_SHARE = 0.9


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
    # What each byte of the environment out of the page cache added to a start (median).
    starting_seconds_per_uncached_byte: float | None = None

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
    # Of the server's environment (what a run keeps cached), the share in the page cache now.
    environment_resident_share: float | None = None
    starting_seconds: float | None = None  # the start-up part of `seconds`


@dataclass(frozen=True)
class Environment:
    """The server's environment now: what a start needs in the page cache (what a run keeps
    there, exporter/sources/environment.py) and how much of that is there."""

    total_bytes: int
    resident_bytes: int

    @property
    def uncached_bytes(self) -> int:
        return max(0, self.total_bytes - self.resident_bytes)


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
    cached_environment = _environment_cached(good)
    starting_cached = _median(r.phase_seconds.get(Phase.STARTING) for r in cached_environment)
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
        starting_cached_environment=starting_cached,
        starting_seconds_per_uncached_byte=_per_uncached_byte(good, starting_cached),
    )


def _uncached_environment(record: LoadRecord) -> int | None:
    """Bytes of the environment out of the page cache as the load began; None: not measured."""
    total, resident = record.environment_bytes, record.environment_resident_bytes
    if not total or resident is None:
        return None
    return max(0, total - resident)


def _cached(total: int, uncached: int) -> bool:
    """An environment of `total` bytes with `uncached` of them out of the page cache."""
    return uncached <= max(ENVIRONMENT_BYTES, (1 - ENVIRONMENT_CACHED_SHARE) * total)


def _environment_cached(loads: Sequence[LoadRecord]) -> list[LoadRecord]:
    """The loads whose start found the server's environment cached: by its residency measured
    then, else by start-up's reads being little of the most any read (none where none read
    much: the temperatures' own medians hold then)."""
    cached = []
    unmeasured = []
    for r in loads:
        uncached = _uncached_environment(r)
        if uncached is None:
            unmeasured.append(r)
        elif _cached(r.environment_bytes or 0, uncached):
            cached.append(r)
    known = [r for r in unmeasured if r.startup_read_bytes is not None]
    most = max((r.startup_read_bytes or 0 for r in loads), default=0)
    if most >= ENVIRONMENT_BYTES:
        cached += [r for r in known if (r.startup_read_bytes or 0) <= ENVIRONMENT_READ_SHARE * most]
    return cached


def _per_uncached_byte(loads: Sequence[LoadRecord], cached_starting: float | None) -> float | None:
    """Seconds each byte of the environment out of the page cache added to a start: over the
    loads that began with more than ENVIRONMENT_BYTES of it uncached, against the median start
    of those that found it cached."""
    if cached_starting is None:
        return None
    per_byte = []
    for r in loads:
        uncached, starting = _uncached_environment(r), r.phase_seconds.get(Phase.STARTING)
        if uncached is None or starting is None or _cached(r.environment_bytes or 0, uncached):
            continue
        per_byte.append(max(0.0, starting - cached_starting) / uncached)
    return statistics.median(per_byte) if per_byte else None


def forecast(
    known: Rates,
    weights_bytes: int | None,
    resident_bytes: int | None,
    environment: Environment | None = None,
) -> Forecast:
    """A restart begun now, from the residency of its weights and of its environment now."""
    env_share = (
        min(1.0, environment.resident_bytes / environment.total_bytes)
        if environment is not None and environment.total_bytes
        else None
    )
    if not weights_bytes or resident_bytes is None:
        return Forecast(None, None, "the weights' page-cache residency is not measured", env_share)
    share = min(1.0, resident_bytes / weights_bytes)
    if known.loads == 0:
        return Forecast(None, share, "no finished load of this target in history", env_share)
    starting, initializing = known.phases(temperature(share))
    if starting is None or initializing is None:
        return Forecast(None, share, "no load in history whose phases were all timed", env_share)
    starting = _starting(known, environment, starting)
    uncached, cached = weights_bytes - resident_bytes, resident_bytes
    weights = 0.0
    for part, rate, missing in (
        (uncached, known.storage_bytes_per_second, "no cold load in history to time storage"),
        (cached, known.cache_bytes_per_second, "no warm load in history to time the page cache"),
    ):
        if part <= NEGLIGIBLE_SHARE * weights_bytes:
            continue
        if not rate:
            return Forecast(None, share, missing, env_share)
        weights += part / rate
    total = starting + weights + initializing
    return Forecast(total, share, None, env_share, starting)


def _starting(known: Rates, environment: Environment | None, median: float) -> float:
    """Start-up now: the median start, longer by each byte of the environment out of the page
    cache now where that is measured and the loads before timed such bytes."""
    per_byte, cached_start = (
        known.starting_seconds_per_uncached_byte,
        known.starting_cached_environment,
    )
    if environment is None or per_byte is None or cached_start is None:
        return median
    uncached = environment.uncached_bytes
    if _cached(environment.total_bytes, uncached):
        return median
    return cached_start + uncached * per_byte


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
