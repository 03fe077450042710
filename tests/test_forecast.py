"""The restart forecast from past loads: rates and medians in, seconds (or why not) out."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from exporter.history.forecast import NO_RATES, Environment, forecast, rates
from exporter.load.records import LoadRecord
from exporter.vocabulary import Cache, Outcome

GB = 10**9
WEIGHTS = 100 * GB
STORAGE, CACHE = 250e6, 4e9  # bytes/s


def load(
    resident: int | None,
    weights_seconds: float,
    starting: float = 20.0,
    initializing: float = 100.0,
    outcome: Outcome = Outcome.READY,
    cache: Cache = Cache.COLD,
) -> LoadRecord:
    phases = {"starting": starting, "loading_weights": weights_seconds}
    phases["initializing"] = initializing
    return LoadRecord(
        target="kimi",
        started_at=0.0,
        ended_at=sum(phases.values()),
        outcome=outcome,
        cache=cache,
        partial=False,
        phase_seconds=phases,
        weights_bytes=WEIGHTS,
        bytes_read=None,
        gpu_bytes_at_weights_end=None,
        resident_bytes_at_start=resident,
    )


def cold() -> LoadRecord:
    return load(0, WEIGHTS / STORAGE, starting=22.0)


def warm() -> LoadRecord:
    return load(WEIGHTS, WEIGHTS / CACHE, starting=18.0, cache=Cache.WARM)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_a_restart_is_starting_plus_weights_at_each_rate_plus_initializing(share: float) -> None:
    known = rates([warm(), cold()])
    assert known.storage_bytes_per_second == pytest.approx(STORAGE)
    assert known.cache_bytes_per_second == pytest.approx(CACHE)
    resident = int(share * WEIGHTS)
    result = forecast(known, WEIGHTS, resident)
    weights = (WEIGHTS - resident) / STORAGE + resident / CACHE
    assert result.reason is None and result.resident_share == share
    # Starting from the loads of the restart's temperature (cold 22 s, warm 18 s), a mixed one
    # from all (20 s); initializing 100 s in both.
    starting = {0.0: 22.0, 0.5: 20.0, 1.0: 18.0}[share]
    assert result.seconds == pytest.approx(starting + weights + 100.0)


def test_a_mostly_cold_load_measures_storage_once_the_cache_rate_is_known() -> None:
    cached = int(0.08 * WEIGHTS)  # 8 % cached: still cold, its time holds some cache reads
    seconds = (WEIGHTS - cached) / STORAGE + cached / CACHE
    known = rates([load(cached, seconds), warm()])
    assert known.storage_bytes_per_second == pytest.approx(STORAGE)


def test_no_basis_means_no_forecast_and_says_why() -> None:
    only_cold = rates([cold()])
    assert forecast(only_cold, WEIGHTS, 0).seconds is not None
    half = forecast(only_cold, WEIGHTS, WEIGHTS // 2)
    assert half.seconds is None and half.reason is not None and "page cache" in half.reason
    assert forecast(only_cold, WEIGHTS, WEIGHTS // 200).seconds is not None  # 0.5 %: negligible
    assert "no finished load" in (forecast(NO_RATES, WEIGHTS, 0).reason or "")
    assert "not measured" in (forecast(only_cold, WEIGHTS, None).reason or "")
    failed_only = rates([load(0, 400.0, outcome=Outcome.FAILED)])
    assert failed_only.loads == 0 and forecast(failed_only, WEIGHTS, 0).seconds is None


def test_a_load_whose_residency_at_its_start_is_unknown_gives_no_rate() -> None:
    known = rates([load(None, 400.0)])
    assert known.loads == 1 and known.storage_bytes_per_second is None
    assert forecast(known, WEIGHTS, 0).seconds is None


def test_a_warm_load_whose_weights_were_in_before_they_could_be_timed_costs_them_nothing() -> None:
    """llama.cpp maps a cached GGUF between two looks: its weights phase is timed at 0 s."""
    instant = load(WEIGHTS, 0.0, starting=1.0, initializing=0.2, cache=Cache.WARM)
    known = rates([instant, load(0, WEIGHTS / STORAGE, starting=1.0, initializing=0.2)])
    assert known.cache_bytes_per_second == math.inf
    assert known.storage_bytes_per_second == pytest.approx(STORAGE)
    assert forecast(known, WEIGHTS, WEIGHTS).seconds == pytest.approx(1.2)
    half = forecast(known, WEIGHTS, WEIGHTS // 2).seconds
    assert half == pytest.approx(1.2 + WEIGHTS / 2 / STORAGE)
    # Storage too: a small model on a fast disk may be in between two looks.
    assert rates([load(0, 0.0)]).storage_bytes_per_second == math.inf


def test_a_cold_restart_is_not_forecast_with_imports_that_read_the_environment_from_disk() -> None:
    """Issue 26, real SGLang: the first (cold) start read 6 GB of its environment from storage
    and spent 88 s starting; the warm one after it, its environment cached, 66 s. The next cold
    restart starts as the warm one did: its environment was read by the run before it."""
    first = replace(load(0, WEIGHTS / STORAGE, starting=88.0), startup_read_bytes=6_000_000_000)
    second = replace(
        load(WEIGHTS, WEIGHTS / CACHE, starting=66.0, cache=Cache.WARM),
        startup_read_bytes=20_000_000,
    )
    known = rates([second, first])
    assert known.starting_cached_environment == 66.0
    cold_restart = forecast(known, WEIGHTS, 0)
    assert cold_restart.seconds == pytest.approx(66.0 + WEIGHTS / STORAGE + 100.0)
    # Without start-up's reads (an older history), or when none read much, as before.
    for older in ([second, replace(first, startup_read_bytes=None)],
                  [second, replace(first, startup_read_bytes=30_000_000)]):  # fmt: skip
        assert forecast(rates(older), WEIGHTS, 0).seconds == pytest.approx(
            88.0 + WEIGHTS / STORAGE + 100.0
        )


ENV = 4 * GB  # the server's environment: the files its tree maps


def with_environment(record: LoadRecord, uncached: int, total: int = ENV) -> LoadRecord:
    """The load as begun with `uncached` bytes of its environment out of the page cache."""
    return replace(record, environment_bytes=total, environment_resident_bytes=total - uncached)


@pytest.mark.parametrize(
    ("uncached_now", "expected_starting"),
    [
        (0, 20.0),  # all cached: as the cached starts
        (ENV // 20, 20.0),  # 5 % out: within ENVIRONMENT_CACHED_SHARE, cached
        (ENV // 2, 20.0 + 0.5 * 40.0),  # half out: half the cold start's extra 40 s
        (ENV, 60.0),  # all out: as the cold start
    ],
)
def test_start_up_is_scaled_by_the_environment_out_of_the_page_cache_now(
    uncached_now: int, expected_starting: float
) -> None:
    """Issue 26: a cold environment costs start-up seconds per byte that must be read again,
    whatever the weights' temperature; the loads before timed it (60 s from all out, 18 and
    22 s from cached)."""
    loads = [
        with_environment(load(0, WEIGHTS / STORAGE, starting=60.0), ENV),
        with_environment(load(WEIGHTS, WEIGHTS / CACHE, starting=18.0, cache=Cache.WARM), 0),
        with_environment(load(0, WEIGHTS / STORAGE, starting=22.0), 10 << 20),
    ]
    known = rates(loads)
    assert known.starting_cached_environment == 20.0
    assert known.starting_seconds_per_uncached_byte == pytest.approx(40.0 / ENV)
    environment = Environment(ENV, ENV - uncached_now)
    for resident in (0, WEIGHTS):  # cold or warm weights: start-up is the environment's
        result = forecast(known, WEIGHTS, resident, environment)
        assert result.starting_seconds == pytest.approx(expected_starting)
        assert result.environment_resident_share == pytest.approx(1 - uncached_now / ENV)
        weights = WEIGHTS / CACHE if resident else WEIGHTS / STORAGE
        assert result.seconds == pytest.approx(expected_starting + weights + 100.0)


def test_environments_of_other_sizes_and_half_measured_histories() -> None:
    """The rate is per byte: a 1 GB environment half out costs what its own bytes cost; loads
    without the measurement fall back on start-up's reads; the environment unmeasured now, or
    no load that began with it out, leaves start-up at the cached median (not foreseen)."""
    small = 1 * GB
    loads = [
        with_environment(load(0, WEIGHTS / STORAGE, starting=30.0), small // 2, total=small),
        replace(load(WEIGHTS, WEIGHTS / CACHE, starting=10.0, cache=Cache.WARM),
                startup_read_bytes=5_000_000),  # unmeasured, read little: found it cached
        replace(load(0, WEIGHTS / STORAGE, starting=70.0), startup_read_bytes=3_000_000_000),
    ]  # fmt: skip
    known = rates(loads)
    assert known.starting_cached_environment == 10.0  # the measured one was not cached
    assert known.starting_seconds_per_uncached_byte == pytest.approx(20.0 / (small // 2))
    now = forecast(known, WEIGHTS, WEIGHTS, Environment(small, 0))
    assert now.starting_seconds == pytest.approx(10.0 + small * 20.0 / (small // 2))
    assert forecast(known, WEIGHTS, WEIGHTS, None).starting_seconds == 10.0
    unscaled = rates([with_environment(load(0, WEIGHTS / STORAGE, starting=25.0), 0)])
    assert unscaled.starting_seconds_per_uncached_byte is None
    result = forecast(unscaled, WEIGHTS, 0, Environment(ENV, 0))
    assert result.starting_seconds == 25.0 and result.environment_resident_share == 0.0
    # No forecast still says how much of the environment is cached.
    quarter = forecast(NO_RATES, WEIGHTS, 0, Environment(ENV, ENV // 4))
    assert quarter.environment_resident_share == 0.25
