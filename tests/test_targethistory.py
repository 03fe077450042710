"""One target's past loads as the snapshot shows them (exporter/targethistory.py), read from a
real SQLite history holding loads of several targets, temperatures and outcomes."""

from __future__ import annotations

from pathlib import Path

from exporter import api
from exporter.forecast import NO_RATES
from exporter.history import HistoryStore
from exporter.targethistory import TargetHistory, read_history
from exporter.tracker import LoadRecord
from exporter.vocabulary import Cache

T0 = 1_750_000_000.0
GB = 10**9


def load(
    seconds: float,
    at: float,
    *,
    target: str = "kimi",
    cache: Cache | None = Cache.COLD,
    outcome: str = "ready",
    reason: str | None = None,
) -> LoadRecord:
    report = None
    if reason is not None:
        report = api.LoadReport(
            expected_seconds=seconds / 2,
            phases=(),
            page_cache_bytes=None,
            storage_bytes=None,
            storage_reads=None,
            read_rate=None,
            reason=reason,
        )
    return LoadRecord(
        target=target,
        started_at=at,
        ended_at=at + seconds,
        outcome=outcome,
        cache=cache,
        partial=False,
        phase_seconds={"starting": 5.0, "loading_weights": seconds - 5.0},
        weights_bytes=40 * GB,
        bytes_read=40 * GB if cache is Cache.COLD else 0,
        gpu_bytes_at_weights_end=None,
        report=report,
    )


def test_a_target_without_loads_reads_as_the_empty_view(tmp_path: Path) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    store.add(load(100.0, T0, target="other"))
    past = read_history(store, "kimi")
    assert past.expected == {} and past.last is None and past.slower is None
    assert past.rates == NO_RATES
    assert past.advice is not None and past.advice == read_history(store, "nobody").advice
    assert TargetHistory().advice is None  # before history was read at all


def test_the_view_holds_medians_per_temperature_the_last_load_and_its_reason(
    tmp_path: Path,
) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    for n, seconds in enumerate((100.0, 120.0, 140.0)):
        store.add(load(seconds, T0 + n * 1000, cache=Cache.COLD))
    store.add(load(20.0, T0 + 5000, cache=Cache.WARM))
    store.add(load(30.0, T0 + 6000, cache=Cache.WARM, reason="read at 1 GB/s, 3x slower"))
    store.add(load(9.0, T0 + 7000, target="other", cache=Cache.WARM))
    past = read_history(store, "kimi")
    assert past.expected == {Cache.COLD: 120.0, Cache.WARM: 25.0}
    assert past.last == 30.0 and past.slower == "read at 1 GB/s, 3x slower"
    assert past.rates != NO_RATES
    # A later load that was not slower clears the reason: only the newest load's counts.
    store.add(load(22.0, T0 + 8000, cache=Cache.WARM))
    again = read_history(store, "kimi")
    assert again.slower is None and again.last == 22.0 and again.expected[Cache.WARM] == 22.0
    assert read_history(store, "other").expected == {Cache.WARM: 9.0}
