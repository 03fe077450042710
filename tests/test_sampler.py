"""The sampling loops: each follows its pace, wakes, runs soon, and files what it read."""

from __future__ import annotations

import threading
import time

from exporter.runtime.sampler import Periodic, Sampler
from exporter.sources import MEMORY


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


def test_a_sample_that_ends_after_its_source_was_let_go_is_not_stored() -> None:
    """The runtime discards an older process's log source while a sample of it may be running:
    that sample's reading must not come back once the source is gone, nor over its successor."""
    sampler = Sampler(0.05)
    inside, release = threading.Event(), threading.Event()

    def slow() -> str:
        inside.set()
        release.wait(2.0)
        return "older"

    sampler.add(MEMORY, "t", slow)
    sampler.start()
    try:
        assert inside.wait(2.0)
        sampler.discard(MEMORY, "t")
        release.set()
        time.sleep(0.2)
        assert sampler.latest(MEMORY, "t") is None
        inside.clear()
        release.clear()
        sampler.add(MEMORY, "t", slow)
        assert inside.wait(2.0)
        sampler.add(MEMORY, "t", lambda: "newer")  # replaced while the older one samples
        release.set()
        time.sleep(0.2)
        reading = sampler.latest(MEMORY, "t")
        assert reading is not None and reading.value == "newer"
    finally:
        release.set()
        sampler.stop()
    assert sampler.run_once(MEMORY, "", lambda: "by hand").value == "by hand"
    assert sampler.latest(MEMORY) is not None  # a sample by hand, no loop: stored
