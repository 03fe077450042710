"""What a target's past loads say, in one view: read from history once per finished load (or new
target), not once per scrape, and handed to each snapshot as it stands.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.history.forecast import NO_RATES, Rates, rates
from exporter.history.startupwindow import ADVICE_LOADS, StartupAdvice, advise
from exporter.history.store import EXPECTATION_LOADS, HistoryStore
from exporter.vocabulary import Cache

# Every temperature, unknown too: where residency cannot be measured all loads are unknown.
EXPECTED_CACHES = tuple(Cache)


@dataclass(frozen=True)
class PastLoads:
    """One target's past loads as the snapshot shows them; empty before history was read."""

    expected: Mapping[Cache, float] = field(default_factory=dict)  # median duration per cache
    last: float | None = None  # the last load's duration
    slower: str | None = None  # why the last load was slower than expected, when it was
    rates: Rates = NO_RATES  # what past loads measured, for a restart's forecast
    advice: StartupAdvice | None = None  # the startupProbe window its loads would need


def past_loads_of(store: HistoryStore, name: str) -> PastLoads:
    """The view of one target's loads that `store` holds now."""
    recent = store.loads(name, EXPECTATION_LOADS)
    newest = recent[0].report if recent else None
    expected = {}
    for cache in EXPECTED_CACHES:
        value = store.expected_duration(name, cache)
        if value is not None:
            expected[cache] = value
    return PastLoads(
        expected=expected,
        last=store.last_duration(name),
        slower=newest.reason if newest is not None else None,
        rates=rates(recent),
        advice=advise(store.loads(name, ADVICE_LOADS)),
    )
