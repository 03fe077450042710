"""Filing a finished load: its report against the loads before it, its environment as it
began, history and this run's histograms; and what history says of each target, read once per
finished load (or new target), not once per scrape. The snapshot's restart forecast comes from
that and the latest residency.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from exporter.history.explain import baseline, report, storage_reads
from exporter.history.forecast import Environment, Forecast, forecast
from exporter.history.histograms import Histograms
from exporter.history.pastloads import PastLoads, past_loads_of
from exporter.history.store import HistoryStore
from exporter.load.records import LoadRecord
from exporter.runtime.observe import Marked
from exporter.runtime.sampler import Reading
from exporter.runtime.target import WatchedTarget
from exporter.runtime.targetnames import uid_of
from exporter.sources import ENVIRONMENT, PAGECACHE
from exporter.sources.environment import EnvironmentSource
from exporter.vocabulary import Cache

log = logging.getLogger(__name__)


class Filing:
    """Files finished loads (on the tracker loop's thread) and keeps each target's `past`;
    `lock` guards the targets against the snapshot, `targets` names them now."""

    def __init__(
        self,
        history: HistoryStore,
        lock: threading.Lock,
        targets: Callable[[], Mapping[str, WatchedTarget]],
    ) -> None:
        self.history = history
        self.load_durations = Histograms()
        self.phase_durations = Histograms()
        self._lock = lock
        self._targets = targets

    def file(self, target: WatchedTarget, record: LoadRecord, reads: Marked | None) -> LoadRecord:
        """File a finished load with its report, built against history before it."""
        during = storage_reads(target.reads_at_start, reads.counters) if reads else None
        base = baseline(self.history, record.target, record.cache)
        if target.discovered is not None:  # filed as its user's (exporter/runtime/targetnames.py)
            record = replace(record, owner=uid_of(target.discovered))
        record, unknown = _environment_at_start(target.environment, record)
        record = replace(record, report=report(record, base, during, unknown))
        log.info(
            "target %s: load %s after %.1fs (cache=%s%s)%s",
            record.target,
            record.outcome,
            record.duration_seconds,
            record.cache or Cache.UNKNOWN,
            ", partial" if record.partial else "",
            f": {record.fatal}" if record.fatal else "",
        )
        if record.report is not None and record.report.reason is not None:
            log.info("target %s: slower than expected: %s", record.target, record.report.reason)
        self.history.add(record)
        if not record.partial:
            cache = record.cache or Cache.UNKNOWN
            self.load_durations.observe(
                (record.target, cache, record.outcome), record.duration_seconds
            )
            for phase, seconds in record.phase_seconds.items():
                self.phase_durations.observe((record.target, phase), seconds)
        self.read_past_loads()
        reason = record.report.reason if record.report is not None else None
        with self._lock:  # this load's, whether or not history could keep it
            target.past = replace(target.past, slower=reason)
        return record

    def read_past_loads(self) -> None:
        """Read history once per finished load (or new target), not once per scrape."""
        with self._lock:
            targets = list(self._targets().values())
        past = [past_loads_of(self.history, target.config.name) for target in targets]
        with self._lock:
            for target, view in zip(targets, past, strict=True):
                target.past = view

    def past_owner(self, name: str) -> int | None:
        """The user whose load history filed last under `name`."""
        return self.history.owner(name)


def restart_forecast(past: PastLoads, readings: Mapping[str, Reading[Any]]) -> Forecast:
    """A restart begun now, from the residency the snapshot shows and what past loads
    measured."""
    reading = readings.get(PAGECACHE.name)
    residency = reading.good if reading is not None else None
    env_reading = readings.get(ENVIRONMENT.name)
    env = env_reading.good if env_reading is not None else None
    environment = (
        Environment(env.warm_bytes, min(env.resident_bytes, env.warm_bytes))
        if env is not None and env.resident_bytes is not None and env.warm_bytes is not None
        else None
    )
    if residency is None:
        return forecast(past.rates, None, None, environment)
    return forecast(past.rates, residency.total_bytes, residency.resident_bytes, environment)


def _environment_at_start(
    environment: EnvironmentSource | None, record: LoadRecord
) -> tuple[LoadRecord, str | None]:
    """The load with its environment's residency as it began (the last pass before its start),
    or as it was and why that is not known."""
    if environment is None:
        return record, "no server process is matched: its files cannot be seen"
    if record.partial:
        return record, "its start is not known"
    if record.seen_late:
        return record, "the exporter started after the server: nothing was measured before"
    found = environment.before(record.started_at)
    if found is None or found.resident_bytes is None or found.warm_bytes is None:
        why = found.reason if found is not None else None
        return record, why or (
            "no measurement before its start: its files are learned from the server's own "
            "mappings, at its first load"
        )
    return replace(
        record,
        environment_bytes=found.warm_bytes,
        environment_resident_bytes=min(found.resident_bytes, found.warm_bytes),
    ), None
