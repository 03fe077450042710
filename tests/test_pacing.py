"""How often each loop runs, replayed on a fake clock: a whole load, a quiet spell, an exit.

`Replay` models the sampler exactly where pacing matters: each loop runs, then asks its `every`
for the delay to its next run; `wake_all` makes every loop ask again at once. The runtime's
state (phase, whether the target is settled, whether a source fails) is scripted, and what each
loop did is counted per window of time.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from exporter.runtime.pacing import (
    EVICTION_LOOK_SECONDS,
    FILE_LOOKS_PER_INTERVAL,
    QUIET_INTERVAL,
    Pacing,
    ProbeCadence,
)
from exporter.vocabulary import Phase, ProbeResult

INTERVAL = 1.0
READY_INTERVAL = 10.0


@dataclass
class Target:
    """What the runtime would hand the pacing rules for one target."""

    phase: Phase = Phase.DOWN
    watched: bool = False  # its exit watched through a pidfd
    failing: bool = False  # its residency source's last sample failed
    answer: ProbeResult | None = None

    @property
    def settled(self) -> bool:
        return self.phase is Phase.READY and self.watched


@dataclass
class Replay:
    pacing: Pacing = field(default_factory=lambda: Pacing(INTERVAL, QUIET_INTERVAL))
    target: Target = field(default_factory=Target)
    now: float = 0.0
    runs: dict[str, list[float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.cadence = ProbeCadence(INTERVAL, READY_INTERVAL, process_matching=True)
        t, p = self.target, self.pacing
        self.loops: dict[str, Callable[[], float]] = {
            "tracker": p.loop,
            "probe": lambda: self.cadence.delay(t.answer),
            "residency": lambda: p.source(t.settled, t.failing),
            "weight_files": lambda: p.weight_files(self.cadence.phase, t.settled, False),
            "disk": lambda: p.host_source(False),
            "memory": lambda: p.memory(False),
        }
        self.due = {name: 0.0 for name in self.loops}

    def set(self, **changes: object) -> None:
        """The tick saw this: the cadence and quiet mode follow, loops woken if they must."""
        for name, value in changes.items():
            setattr(self.target, name, value)
        moved = self.cadence.set_phase(self.target.phase)
        if self.pacing.note([self.target.settled], moved):
            self.due = {name: self.now for name in self.loops}

    def run(self, seconds: float) -> dict[str, int]:
        """Advance the fake clock; how many times each loop ran meanwhile."""
        end, counts = self.now + seconds, dict.fromkeys(self.loops, 0)
        while True:
            name = min(self.due, key=lambda n: self.due[n])
            if self.due[name] >= end:
                self.now = end
                return counts
            self.now = self.due[name]
            counts[name] += 1
            self.runs.setdefault(name, []).append(self.now)
            self.due[name] = self.now + self.loops[name]()


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
    # A model loaded into a running server: it answers throughout and ends the load in one
    # answer, which is seen within a quarter interval from the start of that load on.
    cadence.set_phase(Phase.READY)
    assert cadence.set_phase(Phase.STARTING, in_server=True) is True
    assert cadence.delay(ProbeResult.HTTP_ERROR) == 0.25
    cadence.set_phase(Phase.LOADING_WEIGHTS, in_server=True)
    assert cadence.delay(ProbeResult.HTTP_ERROR) == 0.25
    cadence.set_phase(Phase.READY, in_server=True)  # done: the ready pace again
    assert cadence.delay(ProbeResult.READY) == 10.0


def test_a_whole_load_then_a_quiet_spell_then_an_exit() -> None:
    replay = Replay()
    replay.set(phase=Phase.STARTING)
    starting = replay.run(10)
    assert starting["tracker"] == starting["probe"] == starting["residency"] == 10
    assert starting["weight_files"] == 10 * FILE_LOOKS_PER_INTERVAL  # shards between two looks
    replay.set(phase=Phase.LOADING_WEIGHTS)
    assert replay.run(10)["weight_files"] == 10 * FILE_LOOKS_PER_INTERVAL
    replay.set(phase=Phase.INITIALIZING)
    initializing = replay.run(5)
    assert initializing["probe"] == 20  # the first answer seen within a quarter interval
    assert initializing["weight_files"] == initializing["tracker"] == 5
    replay.set(phase=Phase.READY, answer=ProbeResult.READY)
    assert replay.run(5)["probe"] == 1  # ready: every ready_interval
    # Ready, but its exit not yet watched: not quiet.
    assert replay.run(30)["residency"] == 30 and not replay.pacing.quiet
    replay.set(watched=True)
    assert replay.pacing.quiet
    quiet = replay.run(300)
    assert quiet["tracker"] == quiet["residency"] == quiet["disk"] == quiet["weight_files"] == 10
    assert quiet["probe"] == 30
    # Host memory tells of evictions: looked at often enough for the 60-s eviction alert.
    assert quiet["memory"] == 300 / EVICTION_LOOK_SECONDS
    assert EVICTION_LOOK_SECONDS < QUIET_INTERVAL
    # The exit: a new process, starting; every loop asks again at once and runs fast again.
    replay.set(phase=Phase.STARTING, watched=False, answer=ProbeResult.REFUSED)
    assert not replay.pacing.quiet
    after = replay.run(2)
    assert after["tracker"] == after["disk"] == after["residency"] == after["probe"] == 2
    assert after["memory"] == 2
    assert after["weight_files"] == 2 * FILE_LOOKS_PER_INTERVAL
    assert replay.runs["tracker"][-2] == pytest.approx(
        replay.now - 2, abs=1e-3
    )  # at once, not in 30 s


def test_a_failing_source_of_a_quiet_exporter_retries_every_interval() -> None:
    replay = Replay()
    replay.set(phase=Phase.READY, watched=True, answer=ProbeResult.READY)
    replay.run(QUIET_INTERVAL)
    replay.set(failing=True)
    replay.run(QUIET_INTERVAL)  # the source re-asks after its next run, then every interval
    failing = replay.run(QUIET_INTERVAL)
    assert failing["residency"] == QUIET_INTERVAL and failing["tracker"] == 1  # the rest: quiet
    replay.set(failing=False)
    replay.run(INTERVAL)
    assert replay.run(60)["residency"] == 2


def test_a_failed_probe_while_ready_probes_every_interval_at_once() -> None:
    replay = Replay()
    replay.set(phase=Phase.READY, watched=True, answer=ProbeResult.READY)
    replay.run(30)
    replay.set(answer=ProbeResult.TIMEOUT)
    replay.run(READY_INTERVAL)  # the probe already planned runs, fails, and asks again
    assert replay.run(10)["probe"] == 10


def test_storage_is_described_seldom_unless_a_path_is_not_placed_yet() -> None:
    pacing = Pacing(INTERVAL)
    assert pacing.storage(unsettled=False) == 30.0
    assert pacing.storage(unsettled=True) == INTERVAL
