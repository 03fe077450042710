"""/api/v1 documents for stand-in exporters and for the commands' views, built with the classes
the exporter writes them with (exporter/exposition/api.py): a stand-in speaks the exporter's schema,
so a key it lacked would fail the client here as it would against a real exporter."""

from __future__ import annotations

import dataclasses
from typing import Any

from exporter.exposition import api

IN_PROGRESS = ("starting", "loading_weights", "initializing")


def _nothing_measured(document: type[api.Document], **fields: Any) -> dict[str, Any]:
    """Every field of `document` None, but for those given."""
    return dict.fromkeys(f.name for f in dataclasses.fields(document)) | fields


def load(target: str, started_at: float, ended_at: float, **fields: Any) -> api.Load:
    """A finished load: ready, cache unknown, nothing else measured, unless `fields` say."""
    base = _nothing_measured(
        api.Load, outcome="ready", partial=False, phase_seconds={}, seen_late=False
    )
    return api.Load(
        **base | {"target": target, "started_at": started_at, "ended_at": ended_at} | fields
    )


def target(
    name: str, phase: str, restart_forecast: api.RestartForecast | None = None, **state: Any
) -> api.Target:
    """A configured target in `phase` with nothing measured, but for the `state` fields given."""
    base = _nothing_measured(
        api.LoadState,
        phase=phase,
        in_progress=phase in IN_PROGRESS,
        elapsed_seconds=0.0,
        stalled=False,
        partial=False,
        seen_late=False,
        signals={},
        failed_probes=0,
        hung=False,
    )
    return api.Target(
        target=name,
        endpoint="http://127.0.0.1:30000",
        server="sglang",
        sources={},
        state=api.LoadState(**base | state),
        restart_forecast=restart_forecast,
    )


def status(time: float, *targets: api.Target, version: str = "9.9.9") -> dict[str, Any]:
    """/api/v1/status of an exporter sampling every second, without history, at `time`."""
    history = api.History(enabled=False, up=None, problem=None)
    return api.Status(time, version, 1.0, targets, {}, history).to_json()
