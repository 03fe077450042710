"""One target's past loads as the snapshot shows them (exporter/history/pastloads.py), read from
a real SQLite history holding loads of several targets and temperatures."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from exporter.history.explain import baseline, report
from exporter.history.forecast import NO_RATES
from exporter.history.pastloads import PastLoads, past_loads_of
from exporter.history.store import HistoryStore
from exporter.load.records import LoadRecord
from exporter.vocabulary import Cache, Outcome

T0 = 1_750_000_000.0
GB = 10**9


def load(
    store: HistoryStore,
    seconds: float,
    at: float,
    *,
    target: str = "kimi",
    cache: Cache = Cache.COLD,
) -> LoadRecord:
    """A finished load filed as the runtime files it: with its report against the loads
    before it (exporter/history/explain.py), which says why it was slower when it was."""
    record = LoadRecord(
        target=target,
        started_at=at,
        ended_at=at + seconds,
        outcome=Outcome.READY,
        cache=cache,
        partial=False,
        phase_seconds={"starting": 5.0, "loading_weights": seconds - 5.0},
        weights_bytes=40 * GB,
        bytes_read=40 * GB if cache is Cache.COLD else 0,
        gpu_bytes_at_weights_end=None,
    )
    record = replace(record, report=report(record, baseline(store, target, cache), None))
    store.add(record)
    return record


def test_a_target_without_loads_reads_as_the_empty_view(tmp_path: Path) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    load(store, 100.0, T0, target="other")
    past = past_loads_of(store, "kimi")
    assert past.expected == {} and past.last is None and past.slower is None
    assert past.rates == NO_RATES
    assert past.advice is not None and past.advice == past_loads_of(store, "nobody").advice
    assert PastLoads().advice is None  # before history was read at all


def test_the_view_holds_medians_per_temperature_the_last_load_and_its_reason(
    tmp_path: Path,
) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    for n, seconds in enumerate((100.0, 120.0, 140.0)):
        load(store, seconds, T0 + n * 1000, cache=Cache.COLD)
    load(store, 20.0, T0 + 5000, cache=Cache.WARM)
    slow = load(store, 45.0, T0 + 6000, cache=Cache.WARM)  # over 1.5 times the 20 s before it
    load(store, 9.0, T0 + 7000, target="other", cache=Cache.WARM)
    assert slow.report is not None and slow.report.reason is not None
    past = past_loads_of(store, "kimi")
    assert past.expected == {Cache.COLD: 120.0, Cache.WARM: 32.5}
    assert past.last == 45.0 and past.slower == slow.report.reason
    assert past.rates != NO_RATES
    # A later load that was not slower clears the reason: only the newest load's counts.
    load(store, 22.0, T0 + 8000, cache=Cache.WARM)
    again = past_loads_of(store, "kimi")
    assert again.slower is None and again.last == 22.0 and again.expected[Cache.WARM] == 22.0
    assert past_loads_of(store, "other").expected == {Cache.WARM: 9.0}
