"""/api/v1 documents for stand-in exporters and for the commands' views, built with the classes
the exporter writes them with (exporter/api.py): a stand-in speaks the exporter's schema, so a
key it lacked would fail the client here as it would against a real exporter."""

from __future__ import annotations

from typing import Any

from exporter import api

IN_PROGRESS = ("starting", "loading_weights", "initializing")


def load(target: str, started_at: float, ended_at: float, **fields: Any) -> api.Load:
    """A finished load: ready, cache unknown, nothing else measured, unless `fields` say."""
    base: dict[str, Any] = {
        "outcome": "ready",
        "cache": None,
        "partial": False,
        "phase_seconds": {},
        "weights_bytes": None,
        "bytes_read": None,
        "gpu_bytes_at_weights_end": None,
        "seen_late": False,
        "fatal": None,
    }
    return api.Load(target, started_at, ended_at, **(base | fields))


def target(
    name: str, phase: str, restart_forecast: api.RestartForecast | None = None, **state: Any
) -> api.Target:
    """A configured target in `phase` with nothing measured, but for the `state` fields given."""
    base: dict[str, Any] = {
        "in_progress": phase in IN_PROGRESS,
        "started_at": None,
        "elapsed_seconds": 0.0,
        "progress_ratio": None,
        "throughput_bytes_per_second": None,
        "weights_eta_seconds": None,
        "eta_seconds": None,
        "seconds_since_progress": None,
        "stalled": False,
        "cache": None,
        "partial": False,
        "seen_late": False,
        "progress_source": None,
        "signals": {},
        "last_record": None,
        "step": None,
        "fatal": None,
    }
    return api.Target(
        target=name,
        endpoint="http://127.0.0.1:30000",
        server="sglang",
        sources={},
        state=api.LoadState(phase, **(base | state)),
        restart_forecast=restart_forecast,
    )


def status(time: float, *targets: api.Target, version: str = "9.9.9") -> dict[str, Any]:
    """/api/v1/status of an exporter sampling every second, without history, at `time`."""
    history = api.History(enabled=False, up=None, problem=None)
    return api.Status(time, version, 1.0, targets, {}, history).to_json()
