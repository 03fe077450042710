"""Which of a load's signals still move and for how long each has been quiet.

The tracker's stall rule asks one question (did anything move?); a person looking at a stall
asks which things stopped: bytes and logs quiet while the CPU spins reads as a compile or a
hung collective, everything quiet with the tree waiting on storage as a dead mount. Each
signal's quiet time counts from its last move, or from when it was first measured: never a
number the exporter was not there to see.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from exporter.vocabulary import Activity

# A byte signal moved once it changed this much since its last move (the tracker's stall rule
# too): above the noise of an idle tree (log writes, metadata reads), below any weight shard.
MOVE_BYTES = 1 << 20
CPU_BUSY_SHARE = 0.05  # a tick during which the tree used this share of one core moved the CPU
CPU_WINDOW_SECONDS = 10.0  # the CPU share shown is over this window


@dataclass
class _Track:
    base: float  # the value at the last move (a level or a counter)
    moved_at: float  # the last move, or when first measured
    value: float
    at: float


class ActivityWatch:
    """Follows each signal's value tick by tick; feed it in time order."""

    def __init__(self) -> None:
        self._tracks: dict[Activity, _Track] = {}
        self._cpu: deque[tuple[float, float]] = deque()

    def update(self, now: float, values: Mapping[Activity, float | None]) -> None:
        """One tick's values; None: not measured now (the signal is dropped until it is)."""
        for signal, value in values.items():
            track = self._tracks.get(signal)
            if value is None:
                self._tracks.pop(signal, None)
                if signal is Activity.CPU:
                    self._cpu.clear()
                continue
            if track is None:
                self._tracks[signal] = _Track(value, now, value, now)
            else:
                self._advance(signal, track, now, value)
            if signal is Activity.CPU:
                self._cpu.append((now, value))
                while len(self._cpu) > 2 and self._cpu[1][0] <= now - CPU_WINDOW_SECONDS:
                    self._cpu.popleft()

    @staticmethod
    def _advance(signal: Activity, track: _Track, now: float, value: float) -> None:
        if signal is Activity.CPU:
            spent, elapsed = value - track.value, now - track.at
            moved = elapsed > 0 and spent >= CPU_BUSY_SHARE * elapsed
        elif signal is Activity.LOG_LINES:
            moved = value != track.base
        elif signal is Activity.GPU_MEMORY:
            moved = abs(value - track.base) >= MOVE_BYTES
        else:
            moved = value - track.base >= MOVE_BYTES
        if value < track.value and signal is not Activity.GPU_MEMORY:
            track.base = value  # a counter that restarted (a new process): not a move
        if moved:
            track.base, track.moved_at = value, now
        track.value, track.at = value, now

    def quiet_seconds(self, now: float) -> dict[str, float]:
        """Seconds since each measured signal last moved (or was first measured)."""
        return {
            str(signal): round(max(0.0, now - track.moved_at), 3)
            for signal in Activity
            if (track := self._tracks.get(signal)) is not None
        }

    def cpu_share(self) -> float | None:
        """The tree's CPU time over the last window as a share of one core; None: unmeasured."""
        if len(self._cpu) < 2:
            return None
        (t0, c0), (t1, c1) = self._cpu[0], self._cpu[-1]
        return max(0.0, c1 - c0) / (t1 - t0) if t1 > t0 else None
