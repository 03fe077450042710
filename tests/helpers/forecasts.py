"""The restart forecast against the truth, shared by the simulator's test (tests/
test_forecast_truth.py) and llama.cpp's (tests/servers/test_forecast_on_llamacpp.py): read the
forecast once it is made from the page cache the test just prepared, then compare it with how
long the restart then took."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from helpers.support import wait_for

TOLERANCE = 0.2  # the bar: each forecast within 20 % of the restart's duration


@dataclass(frozen=True)
class Restart:
    cache: str  # what the test made of the page cache before it
    forecast_seconds: float
    resident_share: float
    truth_seconds: float

    @property
    def error(self) -> float:
        return (self.forecast_seconds - self.truth_seconds) / self.truth_seconds

    def within(self, floor_seconds: float = 0.0) -> bool:
        """Within TOLERANCE of the truth, or within `floor_seconds` of it: what a restart of a
        second or two varies by itself, whatever the forecast."""
        off = abs(self.forecast_seconds - self.truth_seconds)
        return abs(self.error) <= TOLERANCE or off <= floor_seconds


def table(restarts: list[Restart]) -> str:
    """One row per restart, for the test's output and the closing note."""
    rows = ["restart  cached  forecast    truth   error"]
    rows += [
        f"{r.cache:7s}  {r.resident_share:5.0%}  {r.forecast_seconds:7.2f}s "
        f"{r.truth_seconds:7.2f}s {r.error:+6.1%}"
        for r in restarts
    ]
    return "\n".join(rows)


def forecast_at(
    entry: Callable[[], dict[str, Any]], share: float, *, made: bool = True
) -> dict[str, Any]:
    """The target's restart_forecast (from `entry()`, its /api/v1/status entry) once it is made
    from a residency of about `share`: a pass after the test changed the page cache. Not `made`:
    once that residency is measured, with or without a forecast (none before history has one)."""

    seen: list[dict[str, Any]] = []

    def current() -> bool:
        seen.append(entry().get("restart_forecast") or {})
        measured = seen[-1].get("resident_share")
        ok = measured is not None and abs(measured - share) < 0.05
        return ok and (bool(seen[-1]["seconds"]) or not made)

    try:
        wait_for(current, timeout=15, interval=0.1)
    except AssertionError:
        raise AssertionError(f"no forecast from {share:.0%} cached; the last: {seen[-1]}") from None
    return seen[-1]
