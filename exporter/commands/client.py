"""Talk to a running exporter from the command line: its JSON API in, typed views out.

`wait`, `status` and `history` are clients of the same `/api/v1/*` contract that dashboards and
scripts use (its documents are exporter/exposition/api.py's, read back with the classes the exporter
wrote them with), so they work against a remote exporter, behind TLS and basic auth, exactly as they
do on the GPU host itself. Every failure becomes one `ClientError` line that names the exporter
(never its password) and says what to check.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import requests

from exporter.exposition import api

DEFAULT_EXPORTER = "http://127.0.0.1:9847"
PASSWORD_ENV = "MODEL_LOAD_EXPORTER_PASSWORD"
REQUEST_TIMEOUT_SECONDS = 5.0
D = TypeVar("D", bound=api.Document)


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


@dataclass(frozen=True)
class Service:
    """Whom a client asks, as its messages name it: the flag that gives its URL, the variable
    that holds its password, and what it is."""

    flag: str
    password_env: str
    what: str


EXPORTER = Service("--exporter", PASSWORD_ENV, "the exporter")


class JsonClient:
    """GET JSON objects from one HTTP API (an exporter's, or Prometheus's): TLS with an optional
    CA file, basic auth with the password from the environment, every failure one ClientError
    line that names the service by its URL (never its password)."""

    def __init__(
        self,
        url: str,
        ca_file: str | None = None,
        env: Mapping[str, str] | None = None,
        service: Service = EXPORTER,
    ) -> None:
        env = os.environ if env is None else env
        self.service = service
        flag, secret = service.flag, service.password_env
        parts = urlsplit(url)
        try:
            port = parts.port
        except ValueError:
            raise ClientError(f"{flag}: invalid port in {url!r}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ClientError(f"{flag}: expected an http or https URL, got {url!r}")
        host = parts.hostname if ":" not in parts.hostname else f"[{parts.hostname}]"
        netloc = host if port is None else f"{host}:{port}"
        # Shown in every message and used for requests: without user and password.
        self.url = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.address = netloc  # host:port, as Prometheus names a target it scrapes there
        self._auth: tuple[str, str] | None = None
        if parts.username is not None:
            password = parts.password if parts.password is not None else env.get(secret)
            if password is None:
                raise ClientError(f"{flag} names user {parts.username!r}: set ${secret}")
            self._auth = (parts.username, password)
        if ca_file is not None and not os.path.isfile(ca_file):
            raise ClientError(f"{flag}.ca-file: {ca_file} does not exist")
        self._verify: bool | str = ca_file or True
        self._session = requests.Session()
        self._session.trust_env = False  # no proxies or ~/.netrc picked up from the environment

    def _get(self, path: str, params: dict[str, str], timeout: float) -> dict[str, Any]:
        url = self.url + path
        what, flag = self.service.what, self.service.flag
        try:
            response = self._session.get(
                url, params=params, auth=self._auth, verify=self._verify, timeout=timeout
            )
        except requests.RequestException as exc:
            raise ClientError(f"cannot reach {what} at {self.url}: {_why(exc, flag)}") from None
        if response.status_code == 401:
            raise ClientError(
                f"{url}: 401 Unauthorized: pass {flag} https://USER@host:port "
                f"with the password in ${self.service.password_env}"
            )
        if response.status_code != 200:
            raise ClientError(f"{url}: HTTP {response.status_code}")
        try:
            document = response.json()
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise ClientError(f"{url}: the answer is not a JSON object (is this {what}?)")
        return document


class ExporterClient(JsonClient):
    """GET /api/v1/status and /api/v1/loads of one exporter."""

    def status(self, timeout: float = REQUEST_TIMEOUT_SECONDS) -> api.Status:
        return self._document("/api/v1/status", {}, timeout, api.Status)[1]

    def status_json(self, timeout: float = REQUEST_TIMEOUT_SECONDS) -> dict[str, Any]:
        """/api/v1/status as the exporter wrote it (a newer one's extra keys kept), once it
        reads as a status document."""
        return self._document("/api/v1/status", {}, timeout, api.Status)[0]

    def loads(
        self, target: str | None = None, limit: int = 100, timeout: float = REQUEST_TIMEOUT_SECONDS
    ) -> list[dict[str, Any]]:
        """The newest `limit` loads as the exporter wrote them (each with whatever fields it
        keeps), once they read as loads; an unknown target is an error, one with no loads yet is
        not."""
        params: dict[str, str] = {"limit": str(limit)}
        if target is not None:
            params["target"] = target
        answer, loads = self._document("/api/v1/loads", params, timeout, api.Loads)
        if target is not None and not loads.loads:
            find_target(self.status(timeout), target)
        records: list[dict[str, Any]] = answer["loads"]
        return records

    def _document(
        self, path: str, params: dict[str, str], timeout: float, kind: type[D]
    ) -> tuple[dict[str, Any], D]:
        """The answer to GET `path`, and the document it holds."""
        answer = self._get(path, params, timeout)
        try:
            return answer, kind.from_json(answer)
        except api.DocumentError as exc:
            raise ClientError(
                f"{self.url}{path}: not the document this client reads ({exc})"
            ) from None


def _why(exc: BaseException, flag: str) -> str:
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
            return f"TLS certificate not trusted ({cause.verify_message}); see {flag}.ca-file"
        nested = [cause.__cause__, cause.__context__, *cause.args]
        stack.extend(n for n in nested if isinstance(n, BaseException))
    if isinstance(exc, requests.Timeout):
        return "no answer in time"
    if isinstance(exc, requests.exceptions.SSLError):
        return "TLS error"
    return type(exc).__name__


# --- what the commands show -------------------------------------------------------------------


@dataclass(frozen=True)
class ShownTarget:
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
    gpu_memory: tuple[api.GpuMemory, ...] = ()
    expected_seconds: Mapping[str, float] | None = None
    last_load: api.Load | None = None
    fatal: str | None = None  # why the last load failed, in the server's own words (its log)
    # None when the exporter publishes no forecast at all (one older than the forecast).
    restart_forecast: api.RestartForecast | None = None
    detail: str | None = None  # e.g. the probe's answer, or why the exporter is not answering
    storage: api.Storage | None = None
    probes: api.Probes | None = None  # what /probe/alive and /probe/ready answer now
    startup_probe: api.StartupProbe | None = None  # the fixed window its cold loads need

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
    def from_status(cls, entry: api.Target) -> ShownTarget:
        residency = entry.residency
        shown = cls(
            target=entry.target,
            phase="unknown",  # until the exporter's tracker has ticked
            endpoint=entry.endpoint,
            server=entry.server,
            weights_bytes=residency.total_bytes if residency is not None else None,
            resident_bytes=residency.resident_bytes if residency is not None else None,
            gpu_memory=entry.gpu_memory,
            expected_seconds=entry.expected_duration_seconds,
            restart_forecast=entry.restart_forecast,
            storage=entry.storage,
            probes=entry.probes,
            startup_probe=entry.startup_probe,
        )
        state = entry.state
        if state is None:
            return shown
        return dataclasses.replace(
            shown,
            phase=state.phase,
            in_progress=state.in_progress,
            stalled=state.stalled,
            progress_ratio=state.progress_ratio,
            throughput_bytes_per_second=state.throughput_bytes_per_second,
            eta_seconds=state.eta_seconds,
            weights_eta_seconds=state.weights_eta_seconds,
            elapsed_seconds=state.elapsed_seconds,
            seconds_since_progress=state.seconds_since_progress,
            cache=state.cache,
            last_load=state.last_record,
            fatal=state.fatal,
        )


def find_target(status: api.Status, name: str | None) -> api.Target:
    """The status entry of `name`; without a name, the only target. ClientError otherwise."""
    entries = status.targets
    names = [e.target for e in entries]
    if name is None:
        if len(entries) == 1:
            return entries[0]
        known = ", ".join(names) or "none"
        raise ClientError(f"the exporter watches {len(entries)} targets ({known}): pass --target")
    for entry in entries:
        if entry.target == name:
            return entry
    raise ClientError(
        f"unknown target {name!r} (the exporter watches: {', '.join(names) or 'none'})"
    )
