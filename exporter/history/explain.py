"""The report of a finished load: where its time went against the loads before it, and, when it
was slower than expected, why, in one line.

Built once, as the load finishes (runtime/filing.py: Filing.file), against history *before* it,
and kept in history with the load: later loads move the medians, not what this load was compared
with.

* each phase and fine step against its median over the recent good loads of the same cache
  temperature; the phases after the weights, which do not read the weight files, against
  loads of any temperature where the same temperature has none (as the tracker's ETA does);
* bytes from the page cache (the weights' residency at the start, where residency is what
  serves the reads) and from storage (the server tree's own storage reads), and what each
  device, network mount or ZFS pool under the weights read meanwhile;
* the rate the weights came at (storage's for a cold load, the page cache's for a warm one,
  as exporter/history/forecast.py measures it) against the best one of the loads before;
* the reason, only for a ready load that took more than SLOWER_THAN_EXPECTED times the median
  of its temperature: the phase with the most time over its median (the fine step, when one
  holds most of an initialization's excess), with the read rate when it is the weights.

A part without a basis (no earlier load, no residency, no counters at the start) is None.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.history.forecast import Rates, load_rate, rates
from exporter.history.store import EXPECTATION_LOADS, HistoryStore
from exporter.load.eta import CACHE_INDEPENDENT, FINE_STEPS, expected_phases
from exporter.load.records import LoadRecord
from exporter.load.report import LoadReport, PhaseTime, ReadRate, StorageRead
from exporter.vocabulary import Cache, Outcome, Phase, Step

# As ModelLoadSlowerThanExpected (prometheus/rules/model-load.yml) judges a load in progress.
SLOWER_THAN_EXPECTED = 1.5
PHASES = (Phase.STARTING, Phase.LOADING_WEIGHTS, Phase.INITIALIZING)
NAMES: Mapping[str, str] = {
    Phase.STARTING: "start-up",
    Phase.LOADING_WEIGHTS: "weights",
    Phase.INITIALIZING: "initialization",
    Step.KV_CACHE: "the KV cache",
    Step.COMPILE: "compile",
    Step.CUDA_GRAPH: "CUDA graphs",
    Step.WARMUP: "warm-up",
}
PLURAL = frozenset({Phase.LOADING_WEIGHTS, Step.CUDA_GRAPH})
READ_FROM = {"storage": "storage", "page_cache": "the page cache"}
# Temperatures that residency decides: there the page cache served what was resident.
FROM_RESIDENCY = (Cache.COLD, Cache.WARM, Cache.MIXED)

Counters = Mapping[tuple[str, str], int]  # (kind, name) of a device, mount or pool -> bytes read


@dataclass(frozen=True)
class Baseline:
    """What a target's loads before this one showed, for a load of one cache temperature."""

    expected_seconds: float | None  # median duration of the good loads of that temperature
    phase_medians: Mapping[str, float]
    rates: Rates  # the median rates, to take a load's minority part out of its time
    best_storage: float | None  # bytes per second, the best one load read from storage
    best_cache: float | None  # and from the page cache


def baseline(history: HistoryStore, target: str, cache: Cache | None) -> Baseline:
    """History's view of a load of this temperature, read before that load is added to it."""
    recent = history.loads(target, EXPECTATION_LOADS)
    known = rates(recent)
    good = [r for r in recent if r.outcome is Outcome.READY and not r.partial]
    return Baseline(
        expected_seconds=history.expected_duration(target, cache or Cache.UNKNOWN),
        phase_medians=expected_phases(history, target, cache),
        rates=known,
        best_storage=_best(good, cold=True, other=known.cache_bytes_per_second),
        best_cache=_best(good, cold=False, other=known.storage_bytes_per_second),
    )


def storage_reads(start: Counters | None, end: Counters) -> tuple[StorageRead, ...] | None:
    """What each device, mount or pool read between the load's start and end; None when the
    counters at the start are unknown, or none of them can be compared (read before the
    storage under the weights was described): "nothing read" would be a guess. A counter that
    went back (a device made anew) or had none at the start is left out rather than guessed."""
    if start is None:
        return None
    reads = tuple(
        StorageRead(kind, name, end[(kind, name)] - start[(kind, name)])
        for kind, name in sorted(end)
        if (kind, name) in start and end[(kind, name)] >= start[(kind, name)]
    )
    return reads if reads or not end else None


def report(
    record: LoadRecord,
    base: Baseline,
    reads: tuple[StorageRead, ...] | None,
    environment_unknown: str | None = None,
) -> LoadReport:
    """The report of a finished load against `base`, with what the storage read meanwhile and
    why its environment's residency at the start is not known, where it is not."""
    phases = tuple(
        PhaseTime(phase, seconds, base.phase_medians.get(phase))
        for phase, seconds in _in_order(record.phase_seconds)
    )
    good = record.outcome is Outcome.READY and not record.partial
    rate = _read_rate(record, base) if good else None
    expected, reason = base.expected_seconds, None
    if good and expected is not None and record.duration_seconds > SLOWER_THAN_EXPECTED * expected:
        reason = _reason(record, phases, rate, expected)
    return LoadReport(
        expected_seconds=expected,
        phases=phases,
        page_cache_bytes=_page_cache_bytes(record),
        storage_bytes=record.bytes_read,
        storage_reads=reads,
        read_rate=rate,
        reason=reason,
        startup_storage_bytes=record.startup_read_bytes,
        environment_bytes=record.environment_bytes,
        environment_resident_bytes=record.environment_resident_bytes,
        environment_unknown=environment_unknown if record.environment_bytes is None else None,
    )


def _in_order(phase_seconds: Mapping[str, float]) -> list[tuple[str, float]]:
    order: list[str] = [*PHASES, *FINE_STEPS]
    known = [p for p in order if p in phase_seconds]
    rest = sorted(p for p in phase_seconds if p not in order)
    return [(p, phase_seconds[p]) for p in (*known, *rest)]


def _page_cache_bytes(record: LoadRecord) -> int | None:
    resident, weights = record.resident_bytes_at_start, record.weights_bytes
    if record.cache not in FROM_RESIDENCY or resident is None or not weights:
        return None
    return min(resident, weights)


def _read_rate(record: LoadRecord, base: Baseline) -> ReadRate | None:
    """Storage's rate for a cold load, the page cache's for a warm one; a mixed load read from
    both at rates its own time cannot tell apart."""
    cold = record.cache is Cache.COLD
    if cold:
        source, best, other = "storage", base.best_storage, base.rates.cache_bytes_per_second
    elif record.cache is Cache.WARM:
        source, best, other = "page_cache", base.best_cache, base.rates.storage_bytes_per_second
    else:
        return None
    value = load_rate(record, cold=cold, other=other)
    return ReadRate(source, value, best) if value else None


def _best(loads: Sequence[LoadRecord], *, cold: bool, other: float | None) -> float | None:
    measured = [r for r in (load_rate(x, cold=cold, other=other) for x in loads) if r]
    return max(measured) if measured else None


def _reason(
    record: LoadRecord,
    phases: tuple[PhaseTime, ...],
    rate: ReadRate | None,
    expected: float,
) -> str:
    """The phase that explains most of the excess, against its median; the weights with the
    rate they came at."""
    timed = {p.phase: (p.seconds, p.median_seconds) for p in phases if p.median_seconds is not None}
    over = {
        phase: seconds - median for phase, (seconds, median) in timed.items() if seconds > median
    }
    coarse = [p for p in PHASES if p in over]
    if not coarse:  # the excess is in no phase history timed: the load as a whole
        return _took("the load", False, record.cache, record.duration_seconds, expected)
    top: str = max(coarse, key=over.__getitem__)
    steps = [s for s in FINE_STEPS if s in over]
    if top == Phase.INITIALIZING and steps:
        step = max(steps, key=over.__getitem__)
        if over[step] >= over[top] / 2:
            top = step
    cache = None if top in CACHE_INDEPENDENT else record.cache
    text = _took(NAMES.get(top, top), top in PLURAL, cache, *timed[top])
    if top == Phase.STARTING and record.startup_read_bytes:
        # Start-up reads no weight file: what it read from storage was the server's own files.
        text += (f": it read {_size(record.startup_read_bytes)} of its environment (packages,"
                 " libraries) from storage before its first weight file")  # fmt: skip
    total, resident = record.environment_bytes, record.environment_resident_bytes
    if top == Phase.STARTING and total and resident is not None:
        text += f" ({_size(total)} environment, {resident / total:.0%} cached at its start)"
    if top == Phase.LOADING_WEIGHTS and rate is not None:
        text += f": {READ_FROM[rate.source]} delivered {_rate(rate.bytes_per_second)}"
        if rate.best_before_bytes_per_second:
            text += f" against {_rate(rate.best_before_bytes_per_second)}"
    return text


def _took(name: str, plural: bool, cache: Cache | None, seconds: float, median: float) -> str:
    """Like "weights took 3.1x their cold median" or "compile took 2.4x its median"."""
    which = f"{cache} " if cache is not None and cache is not Cache.UNKNOWN else ""
    median_of = f"{'their' if plural else 'its'} {which}median"
    if median <= 0:  # a phase the earlier loads skipped
        return f"{name} took {seconds:.1f}s, {median_of} 0.0s"
    return f"{name} took {seconds / median:.1f}x {median_of}"


def _rate(bytes_per_second: float) -> str:
    """80 MB/s, 8.5 MB/s, 3.2 GB/s: decimal, as storage is rated."""
    return f"{_size(bytes_per_second)}/s"


def _size(count: float) -> str:
    """80 MB, 8.5 MB, 3.2 GB: decimal, as storage is rated."""
    if count >= 1e9:
        return f"{count / 1e9:.1f} GB"
    mb = count / 1e6
    return f"{mb:.0f} MB" if mb >= 10 else f"{mb:.1f} MB"
