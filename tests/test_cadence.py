"""The probe cadence rule and the sampling loop that follows it."""

from __future__ import annotations

import threading
import time

from exporter.cadence import ProbeCadence
from exporter.sampler import Periodic, Sampler
from exporter.sources import MEMORY
from exporter.vocabulary import Phase, ProbeResult


def test_cadence_by_phase_and_process_matching() -> None:
    cadence = ProbeCadence(interval=1.0, ready_interval=10.0, process_matching=True)
    assert cadence.delay(None) == 1.0  # nothing known yet
    cadence.set_phase(Phase.READY)
    assert cadence.delay(ProbeResult.READY) == 10.0
    assert cadence.delay(ProbeResult.TIMEOUT) == 1.0  # the first failure: fast again at once
    assert cadence.set_phase(Phase.STARTING) is True  # sooner than planned: wake the prober
    assert cadence.delay(ProbeResult.READY) == 1.0
    assert cadence.set_phase(Phase.INITIALIZING) is True
    assert cadence.delay(ProbeResult.HTTP_ERROR) == 0.25
    assert cadence.set_phase(Phase.READY) is False  # slower: no need to wake anyone
    endpoint_only = ProbeCadence(interval=1.0, ready_interval=10.0, process_matching=False)
    endpoint_only.set_phase(Phase.READY)
    assert endpoint_only.delay(ProbeResult.READY) == 1.0  # restarts show only as failed probes
    fast = ProbeCadence(interval=0.1, ready_interval=10.0, process_matching=True)
    fast.set_phase(Phase.INITIALIZING)
    assert fast.delay(None) == 0.05  # never closer than 50 ms


def test_periodic_follows_its_pace_wakes_and_runs_soon() -> None:
    calls: list[float] = []
    pace = [5.0]
    loop = Periodic("t", lambda: pace[0], lambda: calls.append(time.monotonic()))
    loop.start()
    try:
        time.sleep(0.2)
        assert len(calls) == 1  # the first call at once, the next due in 5 s
        pace[0] = 0.05
        loop.wake()  # asks the pace again: now due already
        time.sleep(0.3)
        assert len(calls) >= 4
        pace[0] = 60.0
        time.sleep(0.1)
        count = len(calls)
        loop.run_soon()
        time.sleep(0.1)
        assert len(calls) == count + 1
    finally:
        started = time.monotonic()
        loop.stop()
        loop.join(2.0)
        assert not loop.alive and time.monotonic() - started < 0.5


def test_sampler_after_hook_sees_the_stored_reading() -> None:
    sampler = Sampler(0.05)
    seen: list[object] = []
    stored = threading.Event()

    def after(reading: object) -> None:
        seen.append(sampler.latest(MEMORY) is reading)
        stored.set()

    sampler.add(MEMORY, "", lambda: "sample", after=after)
    sampler.start()
    try:
        assert stored.wait(2.0)
    finally:
        sampler.stop()
    assert seen and all(seen)
