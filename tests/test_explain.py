"""A finished load's report against the loads before it (exporter/history/explain.py), with history
a real SQLite file: phases against their medians, bytes by where they came from, the read rate
against the best before, and the one-line reason only for a load slower than expected."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from exporter.history.explain import Baseline, baseline, report, storage_reads
from exporter.history.forecast import NO_RATES
from exporter.history.store import HistoryStore
from exporter.load.records import LoadRecord
from exporter.load.report import LoadReport, ReadRate, StorageRead
from exporter.vocabulary import Cache, Outcome

GB = 10**9
WEIGHTS = 100 * GB
T0 = 1_750_000_000.0
# A target with no loads before: no medians, no rates, no best reads.
NO_BASELINE = Baseline(None, {}, NO_RATES, None, None)


def load(
    at: float,
    weights_seconds: float,
    *,
    cache: Cache = Cache.COLD,
    starting: float = 20.0,
    initializing: float = 100.0,
    steps: dict[str, float] | None = None,
    outcome: Outcome = Outcome.READY,
    partial: bool = False,
) -> LoadRecord:
    phases = {"starting": starting, "loading_weights": weights_seconds}
    phases |= {"initializing": initializing, **(steps or {})}
    duration = starting + weights_seconds + initializing
    return LoadRecord(
        target="kimi",
        started_at=at,
        ended_at=at + duration,
        outcome=outcome,
        cache=cache,
        partial=partial,
        phase_seconds=phases,
        weights_bytes=WEIGHTS,
        bytes_read=WEIGHTS if cache is not Cache.WARM else 0,
        gpu_bytes_at_weights_end=None,
        resident_bytes_at_start=WEIGHTS if cache is Cache.WARM else 0,
    )


@pytest.fixture
def history(tmp_path: Path) -> HistoryStore:
    store = HistoryStore(str(tmp_path / "history.sqlite"))
    # Two cold loads: storage delivered 240 MB/s, then 200 MB/s.
    store.add(load(T0, WEIGHTS / 240e6))
    store.add(load(T0 + 3600, WEIGHTS / 200e6))
    return store


def explained(history: HistoryStore, record: LoadRecord) -> LoadReport:
    """The report as the runtime builds it: against history before the load, which it then
    joins."""
    result = report(record, baseline(history, "kimi", record.cache), None)
    history.add(record)
    return result


def test_weights_at_a_third_of_the_storage_rate_are_the_reason(history: HistoryStore) -> None:
    slow = explained(history, load(T0 + 7200, WEIGHTS / 80e6))
    assert slow.reason == (
        "weights took 2.7x their cold median: storage delivered 80 MB/s against 240 MB/s"
    )  # 1250 s against the median of 417 s and 500 s; the best rate before, not the median
    weights = next(p for p in slow.phases if p.phase == "loading_weights")
    assert (weights.seconds, weights.median_seconds) == (1250.0, (WEIGHTS / 240e6 + 500.0) / 2)
    assert slow.read_rate == ReadRate("storage", pytest.approx(80e6), pytest.approx(240e6))
    assert slow.expected_seconds == pytest.approx(120.0 + (WEIGHTS / 240e6 + 500.0) / 2)
    assert (slow.page_cache_bytes, slow.storage_bytes) == (0, WEIGHTS)
    assert [p.phase for p in slow.phases] == ["starting", "loading_weights", "initializing"]


def test_a_fine_step_that_holds_most_of_the_excess_is_named(tmp_path: Path) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    steps = {"compile": 40.0, "cuda_graph": 30.0}
    for i in range(2):
        store.add(load(T0 + 3600 * i, WEIGHTS / 240e6, steps=steps))
    slow = explained(
        store,
        load(T0 + 9000, 417.0, initializing=500.0, steps={"compile": 280.0, "cuda_graph": 30.0}),
    )  # initializing 400 s over its median, compile 240 s of them
    assert slow.reason == "compile took 7.0x its median"
    assert [p.phase for p in slow.phases][-2:] == ["compile", "cuda_graph"]


def test_the_phases_after_the_weights_are_compared_with_any_temperature(
    history: HistoryStore,
) -> None:
    """Initializing does not read the weight files: the first warm load's is held to the cold
    loads' median; its weights have nothing to be compared with."""
    warm = explained(history, load(T0 + 7200, WEIGHTS / 4e9, cache=Cache.WARM))
    medians = {p.phase: p.median_seconds for p in warm.phases}
    assert medians == {"starting": None, "loading_weights": None, "initializing": 100.0}
    assert warm.expected_seconds is None and warm.reason is None


def test_a_load_as_fast_as_usual_has_its_medians_and_no_reason(history: HistoryStore) -> None:
    usual = explained(history, load(T0 + 7200, WEIGHTS / 220e6))
    assert usual.reason is None
    assert all(p.median_seconds is not None for p in usual.phases)
    assert usual.read_rate is not None and usual.read_rate.best_before_bytes_per_second == 240e6


def test_the_first_load_has_nothing_to_be_compared_with(tmp_path: Path) -> None:
    first = explained(HistoryStore(str(tmp_path / "h.sqlite")), load(T0, WEIGHTS / 80e6))
    assert first.expected_seconds is None and first.reason is None
    assert all(p.median_seconds is None for p in first.phases)
    assert first.read_rate == ReadRate("storage", pytest.approx(80e6), None)


def test_a_warm_load_is_measured_against_the_page_cache(history: HistoryStore) -> None:
    history.add(load(T0 + 7200, WEIGHTS / 4e9, cache=Cache.WARM))
    warm = explained(history, load(T0 + 9000, WEIGHTS / 1e9, cache=Cache.WARM))
    assert warm.read_rate == ReadRate("page_cache", pytest.approx(1e9), pytest.approx(4e9))
    assert warm.page_cache_bytes == WEIGHTS
    assert warm.reason == (
        "weights took 4.0x their warm median: the page cache delivered 1.0 GB/s against 4.0 GB/s"
    )


def test_failed_and_partial_loads_get_no_rate_and_no_reason(history: HistoryStore) -> None:
    for record in (
        load(T0 + 7200, WEIGHTS / 50e6, outcome=Outcome.FAILED),
        load(T0 + 9000, WEIGHTS / 50e6, partial=True),
    ):
        slow = explained(history, record)
        assert slow.reason is None and slow.read_rate is None
        assert slow.expected_seconds is not None  # still compared, phase by phase


def test_a_slow_load_whose_phases_history_never_timed_is_slow_as_a_whole(tmp_path: Path) -> None:
    store = HistoryStore(str(tmp_path / "h.sqlite"))
    for i in range(2):  # first seen mid-way: exact durations, no phases
        store.add(LoadRecord("kimi", T0 + i, T0 + i + 600, Outcome.READY, Cache.COLD, False, {},
                             WEIGHTS, None, None, seen_late=True))  # fmt: skip
    slow = explained(store, load(T0 + 3600, 1000.0))
    assert slow.reason == "the load took 1.9x its cold median"


def test_where_residency_is_not_what_serves_reads_no_page_cache_bytes() -> None:
    bypass = report(load(T0, 500.0, cache=Cache.BYPASS), NO_BASELINE, None)
    assert bypass.page_cache_bytes is None and bypass.read_rate is None
    assert bypass.storage_bytes == WEIGHTS


def test_storage_reads_from_counters_at_the_start_and_the_end() -> None:
    start = {("disk", "nvme0n1"): 10 * GB, ("nfs", "/mnt/models"): 5 * GB, ("zfs", "tank"): 9 * GB}
    end = {("disk", "nvme0n1"): 110 * GB, ("nfs", "/mnt/models"): 5 * GB, ("zfs", "tank"): GB,
           ("disk", "sdb"): 3 * GB}  # fmt: skip
    assert storage_reads(start, end) == (
        StorageRead("disk", "nvme0n1", 100 * GB),
        StorageRead("nfs", "/mnt/models", 0),
    )  # tank's counter went back, sdb had none at the start: neither is guessed
    assert storage_reads(None, end) is None
    # Counters from before the storage was described share nothing with the end's: unknown.
    assert storage_reads({}, end) is None and storage_reads({("disk", "sda"): GB}, end) is None
    assert storage_reads({}, {}) == ()  # no storage counted at all: nothing read from any
    reads = storage_reads(start, end)
    assert report(load(T0, 500.0), NO_BASELINE, reads).storage_reads == reads


def test_a_slow_start_up_says_what_it_read_of_its_environment(history: HistoryStore) -> None:
    """Issue 26: SGLang's first start after its environment left the page cache spent 25 s more
    in its imports; the report says what start-up read from storage, and why it was slow."""
    slow = replace(load(T0 + 7200, WEIGHTS / 240e6, starting=400.0), startup_read_bytes=int(6.1e9))
    result = explained(history, slow)
    assert result.reason == (
        "start-up took 20.0x its cold median: it read 6.1 GB of its environment (packages,"
        " libraries) from storage before its first weight file"
    )
    assert result.startup_storage_bytes == int(6.1e9)
    quick = explained(history, replace(load(T0 + 9000, WEIGHTS / 240e6), startup_read_bytes=0))
    assert quick.reason is None and quick.startup_storage_bytes == 0
    assert quick.environment_bytes is None


@pytest.mark.parametrize(("total", "resident", "said"), [
    (int(9.8e9), int(1.2e9), "9.8 GB environment, 12% cached at its start"),
    (int(4.1e9), 0, "4.1 GB environment, 0% cached at its start"),
])  # fmt: skip
def test_a_slow_start_up_says_how_much_of_its_environment_was_cached(
    history: HistoryStore, total: int, resident: int, said: str
) -> None:
    slow = replace(
        load(T0 + 7200, WEIGHTS / 240e6, starting=600.0),
        startup_read_bytes=int(2.5e9),
        environment_bytes=total,
        environment_resident_bytes=resident,
    )
    result = report(slow, baseline(history, "kimi", slow.cache), None, "ignored: it is known")
    assert result.reason is not None and result.reason.endswith(f"first weight file ({said})")
    assert (result.environment_bytes, result.environment_resident_bytes) == (total, resident)
    assert result.environment_unknown is None
    unknown = report(load(T0, 500.0), NO_BASELINE, None, "not learned yet")
    assert unknown.environment_bytes is None and unknown.environment_unknown == "not learned yet"
