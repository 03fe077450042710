"""Where each model would start warm: its hosts ranked by the share of its weights in their page
cache, then by their own restart forecast (docs/placement.md).

Each exporter knows its own host only, so the fleet's answer is Prometheus's: the placement
recording rules (prometheus/rules/model-load.yml) join every host's residency and forecast per
model, and `status --placement --prometheus URL` and the MCP tool `where_to_start` read them
back. Without a Prometheus the answer is the one host's whose exporter is asked, and says so:
one host's numbers are no ranking of the fleet, and an agent choosing a host must not take them
for one.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from exporter.commands import terminal
from exporter.commands.client import (
    ClientError,
    ExporterClient,
    JsonClient,
    Service,
    client_from_args,
)
from exporter.commands.exits import Exit
from exporter.exposition import api
from exporter.load.progress import WARM_SHARE
from exporter.trust.untrusted import clean

PROMETHEUS = Service("--prometheus", "MODEL_LOAD_PROMETHEUS_PASSWORD", "Prometheus")
REQUEST_TIMEOUT_SECONDS = 10.0
# The recorded series (one per host and model) this reads from Prometheus.
CACHED = "model_instance:model_load_weights_cached:ratio"
FORECAST = "model_instance:model_load_restart_forecast_seconds:min"
SHOWN_MODELS = 10  # models named in the error for one that no host reports
MAX_ERROR = 200  # characters of Prometheus's error message quoted
COLUMNS = ("MODEL", "HOST", "WEIGHTS CACHED", "RESTART FORECAST")
Scope = Literal["fleet", "host"]


@dataclass(frozen=True)
class Place:
    """One host as a place to start one model: what a restart there would find."""

    model: str
    host: str  # Prometheus's `instance`, or the exporter's host:port
    cached_share: float | None  # of the model's weights in the host's page cache, 0..1
    forecast_seconds: float | None  # the host's own restart forecast; None: no basis there

    @property
    def warm(self) -> bool:
        """Enough of the weights cached for the load to count as warm (the tracker's rule)."""
        return self.cached_share is not None and self.cached_share >= WARM_SHARE

    def rank(self) -> tuple[str, float, float, str]:
        """Per model: the larger share first, then the shorter forecast; unknowns last."""
        share = -1.0 if self.cached_share is None else self.cached_share
        forecast = math.inf if self.forecast_seconds is None else self.forecast_seconds
        return (self.model, -share, forecast, self.host)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "host": self.host,
            "cached_share": self.cached_share,
            "forecast_seconds": self.forecast_seconds,
            "warm": self.warm,
        }


@dataclass(frozen=True)
class Placement:
    """Every place known, ranked, and whose knowledge it is."""

    scope: Scope  # fleet: every host Prometheus records; host: the asked exporter's only
    source: str  # the URL asked
    places: tuple[Place, ...]

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(p.model for p in self.places))

    def where(self) -> str:
        if self.scope == "fleet":
            return f"every host, as Prometheus at {self.source} records them"
        return (
            f"this host only (the exporter at {self.source}); "
            f"{PROMETHEUS.flag} URL ranks every host"
        )

    def nothing(self) -> str:
        """Why there is no place at all."""
        if self.scope == "fleet":
            return (
                f"Prometheus at {self.source} records no placement: it scrapes no exporter "
                "that watches a target, or prometheus/rules/model-load.yml is not in its "
                "rule_files"
            )
        return f"the exporter at {self.source} watches no target yet"

    def to_json(self) -> dict[str, Any]:
        return {
            "scope": self.scope,
            "source": self.source,
            "hosts": [p.to_json() for p in self.places],
        }

    def summary(self) -> str:
        """One line per model, joined: where it would start best, and on how many hosts warm."""
        parts = []
        for model in self.models:
            places = [p for p in self.places if p.model == model]
            best = places[0]
            warm = sum(p.warm for p in places)
            said = f"{model}: warm on {warm} of {len(places)} host{'s' if len(places) != 1 else ''}"
            said += f", best {best.host} ({terminal.percent(best.cached_share)} cached"
            if best.forecast_seconds is not None:
                said += (
                    f", a restart there ready in about {terminal.duration(best.forecast_seconds)}"
                )
            parts.append(said + ")")
        if not parts:
            return self.nothing()
        scope = "the fleet" if self.scope == "fleet" else "this host only"
        return f"{'; '.join(parts)} [{scope}: {self.source}]"


def ranked(places: Iterable[Place]) -> tuple[Place, ...]:
    return tuple(sorted(places, key=Place.rank))


def chosen(placement: Placement, model: str | None) -> Placement:
    """Only `model`'s places; ClientError when no host reports it."""
    if model is None:
        return placement
    places = tuple(p for p in placement.places if p.model == model)
    if not places:
        known = placement.models
        named = ", ".join(known[:SHOWN_MODELS]) + (", ..." if len(known) > SHOWN_MODELS else "")
        raise ClientError(f"no host reports model {model!r} (known: {named or 'none'})")
    return Placement(placement.scope, placement.source, places)


class PrometheusClient(JsonClient):
    """Instant queries to a Prometheus's HTTP API."""

    def __init__(self, url: str, ca_file: str | None = None) -> None:
        super().__init__(url, ca_file, service=PROMETHEUS)

    def vector(self, query: str) -> list[tuple[Mapping[str, str], float]]:
        """The instant vector `query` gives now: (labels, value) per series."""
        answer = self._get("/api/v1/query", {"query": query}, REQUEST_TIMEOUT_SECONDS)
        if answer.get("status") == "error":
            error = clean(str(answer.get("error") or "no error given"), MAX_ERROR)
            raise ClientError(f"{self.url}: Prometheus refused {query!r}: {error}")
        data = answer.get("data")
        result = data.get("result") if isinstance(data, dict) else None
        if (
            not isinstance(data, dict)
            or data.get("resultType") != "vector"
            or not isinstance(result, list)
        ):
            raise ClientError(f"{self.url}: not a Prometheus query answer (is this Prometheus?)")
        try:
            return [(dict(s["metric"]), float(s["value"][1])) for s in result]
        except (KeyError, IndexError, TypeError, ValueError):
            raise ClientError(
                f"{self.url}: not a Prometheus query answer (a malformed sample)"
            ) from None


def from_prometheus(client: PrometheusClient) -> Placement:
    """Every host and model the placement rules recorded."""
    shares = _by_place(client.vector(CACHED))
    forecasts = _by_place(client.vector(FORECAST))
    places = (
        Place(model, host, shares.get((model, host)), forecasts.get((model, host)))
        for model, host in {**shares, **forecasts}
    )
    return Placement("fleet", client.url, ranked(places))


def _by_place(vector: Iterable[tuple[Mapping[str, str], float]]) -> dict[tuple[str, str], float]:
    """By (model, instance), the finite values; labels cleaned (a model name may be a server's
    own words)."""
    return {
        (clean(labels.get("model", ""), None), clean(labels.get("instance", ""), None)): value
        for labels, value in vector
        if math.isfinite(value)
    }


def from_status(status: api.Status, host: str, source: str) -> Placement:
    """The exporter's own host, as the rules would record it: per model the best share and
    forecast of its targets there, a loader that bypasses the page cache counted as none."""
    best: dict[str, tuple[float | None, float | None]] = {}
    for target in status.targets:
        model = target.model or target.target
        known = target.restart_forecast
        share = _share(target)
        seconds = known.seconds if known is not None else None
        before_share, before_seconds = best.get(model, (None, None))
        best[model] = (_pick(max, before_share, share), _pick(min, before_seconds, seconds))
    places = (Place(model, host, share, seconds) for model, (share, seconds) in best.items())
    return Placement("host", source, ranked(places))


def _share(target: api.Target) -> float | None:
    residency = target.residency
    if residency is None or residency.resident_bytes is None or not residency.total_bytes:
        return None
    if target.state is not None and target.state.cache == "bypass":
        return None
    return min(1.0, residency.resident_bytes / residency.total_bytes)


def _pick(choose: Callable[[list[float]], float], a: float | None, b: float | None) -> float | None:
    """`choose` (max or min) of the two where known."""
    known = [v for v in (a, b) if v is not None]
    return choose(known) if known else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`--prometheus URL` and `--prometheus.ca-file PATH`, for status and mcp."""
    parser.add_argument(
        PROMETHEUS.flag,
        dest="prometheus",
        metavar="URL",
        help="the Prometheus that scrapes the fleet's exporters with the shipped rules: the "
        f"placement of every host (basic auth: password in ${PROMETHEUS.password_env})",
    )
    parser.add_argument(
        f"{PROMETHEUS.flag}.ca-file",
        dest="prometheus_ca_file",
        metavar="PATH",
        help="CA (or self-signed certificate) to verify Prometheus's TLS certificate with",
    )


def prometheus_from_args(args: argparse.Namespace) -> PrometheusClient | None:
    if args.prometheus is None:
        if args.prometheus_ca_file is not None:
            raise ClientError(f"{PROMETHEUS.flag}.ca-file needs {PROMETHEUS.flag}")
        return None
    return PrometheusClient(args.prometheus, ca_file=args.prometheus_ca_file)


def ask(
    prometheus: PrometheusClient | None, exporter: ExporterClient, model: str | None
) -> Placement:
    """The fleet's placement from Prometheus, else the exporter's host's own."""
    if prometheus is not None:
        return chosen(from_prometheus(prometheus), model)
    status = exporter.status()
    return chosen(from_status(status, exporter.address, exporter.url), model)


def rows(placement: Placement) -> list[list[str]]:
    return [
        [p.model, p.host, terminal.percent(p.cached_share), terminal.duration(p.forecast_seconds)]
        for p in placement.places
    ]


def show(args: argparse.Namespace) -> int:
    """`status --placement`: the table (or its JSON), or one line saying why not."""
    try:
        placement = ask(prometheus_from_args(args), client_from_args(args), args.model)
    except ClientError as exc:
        terminal.fail("status", str(exc))
        return Exit.USAGE
    if args.json:
        print(json.dumps(placement.to_json(), indent=2))
        return Exit.OK
    print(f"where each model would start warm: {placement.where()}")
    if not placement.places:
        print(placement.nothing())
        return Exit.OK
    terminal.show(terminal.table(COLUMNS, rows(placement), phase_column=None))
    return Exit.OK
