"""Talk to a running exporter from the command line: its JSON API in, typed views out.

`wait`, `status` and `history` are clients of the same `/api/v1/*` contract that dashboards and
scripts use, so they work against a remote exporter, behind TLS and basic auth, exactly as they
do on the GPU host itself. Every failure becomes one `ClientError` line that names the exporter
(never its password) and says what to check.
"""

from __future__ import annotations

import argparse
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests

DEFAULT_EXPORTER = "http://127.0.0.1:9847"
PASSWORD_ENV = "MODEL_LOAD_EXPORTER_PASSWORD"
REQUEST_TIMEOUT_SECONDS = 5.0
MAX_LOADS = 1000  # the most /api/v1/loads answers at once


class ClientError(Exception):
    """The exporter could not be asked, or its answer makes no sense: one line for the user."""


def add_exporter_arguments(parser: argparse.ArgumentParser) -> None:
    """`--exporter URL` and `--exporter.ca-file PATH`, the same for every client command."""
    parser.add_argument(
        "--exporter",
        metavar="URL",
        help=f"a running exporter (default {DEFAULT_EXPORTER}); basic auth as "
        f"https://USER@host:port with the password in ${PASSWORD_ENV}",
    )
    parser.add_argument(
        "--exporter.ca-file",
        dest="exporter_ca_file",
        metavar="PATH",
        help="CA (or self-signed certificate) to verify the exporter's TLS certificate with",
    )


def client_from_args(args: argparse.Namespace) -> ExporterClient:
    return ExporterClient(args.exporter or DEFAULT_EXPORTER, ca_file=args.exporter_ca_file)


class ExporterClient:
    """GET /api/v1/status and /api/v1/loads of one exporter."""

    def __init__(
        self,
        url: str,
        ca_file: str | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        env = os.environ if env is None else env
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ClientError(f"--exporter: invalid port in {url!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"--exporter: expected an http or https URL, got {url!r}")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        netloc = host if port is None else f"{host}:{port}"
        # Shown in every message and used for requests: without user and password.
        self.url = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self._auth: tuple[str, str] | None = None
        if parts.username is not None:
            password = parts.password if parts.password is not None else env.get(PASSWORD_ENV)
            if password is None:
                raise ClientError(f"--exporter names user {parts.username!r}: set ${PASSWORD_ENV}")
            self._auth = (parts.username, password)
        if ca_file is not None and not os.path.isfile(ca_file):
            raise ClientError(f"--exporter.ca-file: {ca_file} does not exist")
        self._verify: bool | str = ca_file or True
        self._session = requests.Session()
        self._session.trust_env = False  # no proxies or ~/.netrc picked up from the environment

    def status(self, timeout: float = REQUEST_TIMEOUT_SECONDS) -> dict[str, Any]:
        document = self._get("/api/v1/status", {}, timeout)
        if not isinstance(document.get("targets"), list):
            raise ClientError(f"{self.url}/api/v1/status: no 'targets' list in the answer")
        return document

    def loads(
        self, target: str | None = None, limit: int = 100, timeout: float = REQUEST_TIMEOUT_SECONDS
    ) -> list[dict[str, Any]]:
        """The newest `limit` loads; an unknown target is an error, one with no loads yet is not."""
        params: dict[str, str] = {"limit": str(limit)}
        if target is not None:
            params["target"] = target
        loads = self._get("/api/v1/loads", params, timeout).get("loads")
        if not isinstance(loads, list):
            raise ClientError(f"{self.url}/api/v1/loads: no 'loads' list in the answer")
        if target is not None and not loads:
            find_target(self.status(timeout), target)
        return [load for load in loads if isinstance(load, dict)]

    def _get(self, path: str, params: dict[str, str], timeout: float) -> dict[str, Any]:
        url = self.url + path
        try:
            response = self._session.get(
                url, params=params, auth=self._auth, verify=self._verify, timeout=timeout
            )
        except requests.RequestException as exc:
            raise ClientError(f"cannot reach the exporter at {self.url}: {_why(exc)}") from None
        if response.status_code == 401:
            raise ClientError(
                f"{url}: 401 Unauthorized: pass --exporter https://USER@host:port "
                f"with the password in ${PASSWORD_ENV}"
            )
        if response.status_code != 200:
            raise ClientError(f"{url}: HTTP {response.status_code}")
        try:
            document = response.json()
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise ClientError(f"{url}: the answer is not a JSON object (is this the exporter?)")
        return document


def _why(exc: BaseException) -> str:
    """The root cause of a requests failure in a few words."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        cause = stack.pop()
        if id(cause) in seen:
            continue
        seen.add(id(cause))
        if isinstance(cause, ConnectionRefusedError):
            return "connection refused"
        if isinstance(cause, socket.gaierror):
            return "host name lookup failed"
        if isinstance(cause, ssl.SSLCertVerificationError):
            return f"TLS certificate not trusted ({cause.verify_message}); see --exporter.ca-file"
        nested = [cause.__cause__, cause.__context__, *cause.args]
        stack.extend(n for n in nested if isinstance(n, BaseException))
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLS error"
    return type(exc).__name__


# --- the JSON, typed ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadView:
    """One finished load, from /api/v1/loads or a target's last_record."""

    target: str
    started_at: float
    ended_at: float
    outcome: str
    cache: str | None
    partial: bool
    phase_seconds: Mapping[str, float]

    @property
    def duration_seconds(self) -> float:
        return self.ended_at - self.started_at

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LoadView:
        started = _number(data, "started_at") or 0.0
        phases = data.get("phase_seconds")
        return cls(
            target=str(data.get("target", "")),
            started_at=started,
            ended_at=_number(data, "ended_at") or started,
            outcome=str(data.get("outcome", "unknown")),
            cache=_text(data, "cache"),
            partial=bool(data.get("partial", False)),
            phase_seconds=(
                {str(k): float(v) for k, v in phases.items() if _is_number(v)}
                if isinstance(phases, dict)
                else {}
            ),
        )


@dataclass(frozen=True)
class RestartForecast:
    """How long a restart begun now would take to be ready, as the exporter forecasts it."""

    seconds: float | None  # None: no basis, and `reason` says why
    resident_share: float | None  # share of the weights in page cache now, 0..1
    reason: str | None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RestartForecast:
        return cls(_number(data, "seconds"), _number(data, "resident_share"), _text(data, "reason"))


@dataclass(frozen=True)
class GpuUse:
    gpu: int
    used_bytes: int
    total_bytes: int | None


FACTS = (("reads", "read_rate"), ("residency", "residency"), ("page cache", "page_cache"),
         ("bypass", "bypass"))  # fmt: skip


@dataclass(frozen=True)
class MountView:
    """One filesystem under a target's weights, as `status` prints it."""

    summary: str
    facts: tuple[tuple[str, bool | None, str], ...]  # (what, holds, why), in FACTS order
    notes: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> MountView:
        facts = []
        for name, key in FACTS:
            fact = _mapping(data, key)
            value = fact.get("value")
            facts.append((name, value if isinstance(value, bool) else None,
                          _text(fact, "reason") or ""))  # fmt: skip
        notes = data.get("notes")
        return cls(
            summary=_text(data, "summary") or "?",
            facts=tuple(facts),
            notes=tuple(n for n in notes if isinstance(n, str)) if isinstance(notes, list) else (),
        )


@dataclass(frozen=True)
class StorageView:
    """What holds a target's weights and the rule its cache label follows."""

    mounts: tuple[MountView, ...]
    label: str  # "bypass", "unknown", "never cold" or "from residency"
    reason: str | None
    unplaced: tuple[str, ...]

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> StorageView:
        rule = _mapping(data, "cache_label")
        label = _text(rule, "fixed") or ("never cold" if rule.get("never_cold") is True else "")
        mounts = data.get("mounts")
        unplaced = data.get("unplaced")
        return cls(
            mounts=tuple(
                MountView.from_json(m)
                for m in (mounts if isinstance(mounts, list) else ())
                if isinstance(m, dict)
            ),
            label=label or "from residency",
            reason=_text(rule, "reason"),
            unplaced=tuple(u for u in unplaced if isinstance(u, str))
            if isinstance(unplaced, list)
            else (),
        )


@dataclass(frozen=True)
class TargetView:
    """What the commands show of one target: an entry of /api/v1/status, or an endpoint probe."""

    target: str
    phase: str
    in_progress: bool = False
    stalled: bool = False
    progress_ratio: float | None = None
    throughput_bytes_per_second: float | None = None
    eta_seconds: float | None = None
    weights_eta_seconds: float | None = None
    elapsed_seconds: float | None = None
    seconds_since_progress: float | None = None
    cache: str | None = None
    endpoint: str | None = None
    server: str | None = None
    weights_bytes: int | None = None
    resident_bytes: int | None = None
    gpu_memory: tuple[GpuUse, ...] = ()
    expected_seconds: Mapping[str, float] | None = None
    last_load: LoadView | None = None
    fatal: str | None = None  # why the last load failed, in the server's own words (its log)
    # None when the exporter publishes no forecast at all (one older than the forecast).
    restart_forecast: RestartForecast | None = None
    detail: str | None = None  # e.g. the probe's answer, or why the exporter is not answering
    storage: StorageView | None = None

    @property
    def resident_ratio(self) -> float | None:
        if self.resident_bytes is None or not self.weights_bytes:
            return None
        return self.resident_bytes / self.weights_bytes

    @property
    def gpu_bytes(self) -> int | None:
        return sum(g.used_bytes for g in self.gpu_memory) if self.gpu_memory else None

    @property
    def expected_duration(self) -> float | None:
        """Median of past loads at this load's cache temperature, when history has one."""
        if not self.expected_seconds or self.cache is None:
            return None
        return self.expected_seconds.get(self.cache)

    @classmethod
    def from_status(cls, entry: Mapping[str, Any]) -> TargetView:
        residency = _mapping(entry, "residency")
        last = entry.get("last_record")
        expected = entry.get("expected_duration_seconds")
        gpus = entry.get("gpu_memory")
        forecast = entry.get("restart_forecast")
        storage = entry.get("storage")
        return cls(
            target=str(entry.get("target", "")),
            phase=str(entry.get("phase") or "unknown"),
            in_progress=bool(entry.get("in_progress", False)),
            stalled=bool(entry.get("stalled", False)),
            progress_ratio=_number(entry, "progress_ratio"),
            throughput_bytes_per_second=_number(entry, "throughput_bytes_per_second"),
            eta_seconds=_number(entry, "eta_seconds"),
            weights_eta_seconds=_number(entry, "weights_eta_seconds"),
            elapsed_seconds=_number(entry, "elapsed_seconds"),
            seconds_since_progress=_number(entry, "seconds_since_progress"),
            cache=_text(entry, "cache"),
            endpoint=_text(entry, "endpoint"),
            server=_text(entry, "server"),
            weights_bytes=_integer(residency, "total_bytes"),
            resident_bytes=_integer(residency, "resident_bytes"),
            gpu_memory=tuple(
                GpuUse(int(g["gpu"]), int(g["used_bytes"]), _integer(g, "total_bytes"))
                for g in (gpus if isinstance(gpus, list) else ())
                if isinstance(g, dict)
                and _is_number(g.get("gpu"))
                and _is_number(g.get("used_bytes"))
            ),
            expected_seconds=(
                {str(k): float(v) for k, v in expected.items() if _is_number(v)}
                if isinstance(expected, dict)
                else None
            ),
            last_load=LoadView.from_json(last) if isinstance(last, dict) else None,
            fatal=_text(entry, "fatal"),
            restart_forecast=(
                RestartForecast.from_json(forecast) if isinstance(forecast, dict) else None
            ),
            storage=StorageView.from_json(storage) if isinstance(storage, dict) else None,
        )


def find_target(status: Mapping[str, Any], name: str | None) -> Mapping[str, Any]:
    """The status entry of `name`; without a name, the only target. ClientError otherwise."""
    entries = [e for e in status.get("targets", []) if isinstance(e, dict)]
    names = [str(e.get("target")) for e in entries]
    if name is None:
        if len(entries) == 1:
            return entries[0]
        known = ", ".join(names) or "none"
        raise ClientError(f"the exporter watches {len(entries)} targets ({known}): pass --target")
    for entry in entries:
        if entry.get("target") == name:
            return entry
    raise ClientError(
        f"unknown target {name!r} (the exporter watches: {', '.join(names) or 'none'})"
    )


def _mapping(data: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = data.get(key)
    return value if isinstance(value, dict) else {}


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _number(data: Mapping[str, Any], key: str) -> float | None:
    value = data.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _integer(data: Mapping[str, Any], key: str) -> int | None:
    value = _number(data, key)
    return None if value is None else int(value)


def _text(data: Mapping[str, Any], key: str) -> str | None:
    value = data.get(key)
    return value if isinstance(value, str) and value else None
