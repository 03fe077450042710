"""How often the endpoint is probed: DESIGN's probe cadence, as one small rule.

Probing a serving instance costs it work (the default probe is a 1-token completion), and
probing a loading one is how its end is seen. So:

* while `initializing` (weights in, endpoint not ready yet): several probes per sample interval
  (every interval / 4, at least 50 ms apart), so the load's end is seen within a fraction of a
  second of the server's first answer; that phase is short, the extra probes cost nothing;
* while `ready`, with process matching, and the last probe said ready: every
  `endpoint.ready_interval` (default 10 s). A restart or an exit is seen at once regardless (the
  runtime watches the process through a pidfd), and it moves the phase, which brings the fast
  pace back at once;
* otherwise, and from the first failed probe on: every sample interval.

Without process matching a restart shows only as failing probes, so the endpoint is then probed
every sample interval even while ready.
"""

from __future__ import annotations

from exporter.vocabulary import Phase, ProbeResult

INITIALIZING_PROBES_PER_INTERVAL = 4
MIN_PROBE_GAP = 0.05


class ProbeCadence:
    """The tracker tick sets the phase; the endpoint's sampling loop asks for the next delay."""

    def __init__(self, interval: float, ready_interval: float, process_matching: bool) -> None:
        self.interval = interval
        self.ready_interval = ready_interval
        self.process_matching = process_matching
        self.initializing_interval = min(
            interval, max(MIN_PROBE_GAP, interval / INITIALIZING_PROBES_PER_INTERVAL)
        )
        self._phase: Phase | None = None

    @property
    def phase(self) -> Phase | None:
        return self._phase

    def delay(self, last: ProbeResult | None) -> float:
        """Seconds from one probe to the next, given the last probe's result."""
        phase = self._phase
        if phase is Phase.INITIALIZING:
            return self.initializing_interval
        if phase is Phase.READY and self.process_matching and last is ProbeResult.READY:
            return self.ready_interval
        return self.interval

    def set_phase(self, phase: Phase) -> bool:
        """Record the tracker's phase; True when the next probe is now due sooner than planned
        (the caller wakes the probing loop so the faster pace starts at once)."""
        before = self.delay(ProbeResult.READY)
        self._phase = phase
        return self.delay(ProbeResult.READY) < before
