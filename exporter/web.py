"""HTTP side: /metrics, /api/v1/status, /api/v1/loads, landing page, health and reload.

The exporter's routes in front of prometheus_client's WSGI app (which does the OpenMetrics content
negotiation and gzip for us), served by exporter/httpserver.py: an asyncio server with handshake,
header and idle timeouts and a bound on connections, so no client can stall a scrape.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry, make_wsgi_app

from exporter import livepage
from exporter.collector import ExporterCollector
from exporter.httpserver import Limits, Server, somaxconn
from exporter.runtime import Runtime
from exporter.sampler import Reading
from exporter.snapshot import Snapshot, TargetView
from exporter.sources import DISK, LOGS, NVML, PAGECACHE, STORAGE, WEIGHT_FILES
from exporter.sources.gpu import pcie_rx_since
from exporter.sources.storage import StorageDescription
from exporter.sources.weightfiles import WeightFilesSample
from exporter.tracker import LoadRecord
from exporter.untrusted import clean
from exporter.webconfig import WebConfig

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
MAX_LOADS = 1000
_WHOLE_NUMBER = re.compile(r"[0-9]{1,4}\Z")  # ASCII digits only: "²".isdigit() is True


def _json_default(value: object) -> object:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, tuple | set | frozenset):
        return list(value)
    return str(value)


def record_json(record: LoadRecord) -> dict[str, Any]:
    data = dataclasses.asdict(record)
    data["duration_seconds"] = record.duration_seconds
    return data


def _note(reading: Reading[Any]) -> str | None:
    """What a source says about a sample that succeeded but is incomplete (its `note`)."""
    return getattr(reading.value, "note", None)


def _gpu_pcie(snap: Snapshot, view: TargetView) -> list[dict[str, Any]]:
    """Per GPU of the target (its configured `gpus`, else those its tree holds memory on): the
    PCIe RX counter, and the bytes received since the current (or last) load began."""
    reading = snap.host_reading(NVML)
    gpu = reading.good if reading is not None else None
    if reading is None or gpu is None:  # no GPU reading: nothing to show, not zeros
        return []
    wanted = view.gpu_memory if view.config.gpus == "auto" else view.config.gpus
    entries = []
    for device in gpu.devices:
        if device.index not in wanted:
            continue
        mark = view.pcie_at_start.get((device.index, device.uuid))
        entries.append(
            {
                "gpu": device.index,
                "uuid": device.uuid,
                "pcie_rx_bytes": device.pcie_rx_bytes,
                "pcie_rx_bytes_since_load_start": pcie_rx_since(mark, device, reading.finished_at),
                "pcie_rx_counted_since": mark.read_at if mark is not None else None,
            }
        )
    return entries


def _operator_view(snap: Snapshot, view: TargetView) -> dict[str, Any]:
    """What `status`, `wait` and the live page show beside the state: GPU memory the target holds
    per device, PCIe bytes per GPU in this load, and what history expects of a load at each cache
    temperature."""
    gpu = snap.host_value(NVML)
    devices = {d.index: d for d in gpu.devices} if gpu is not None else {}
    gpu_memory = []
    for index, used in sorted(view.gpu_memory.items()):
        device = devices.get(index)
        gpu_memory.append(
            {
                "gpu": index,
                "name": device.name if device else None,
                "used_bytes": used,
                "total_bytes": device.memory_total_bytes if device else None,
            }
        )
    return {
        "gpu_memory": gpu_memory,
        "gpu_pcie": _gpu_pcie(snap, view),
        "expected_duration_seconds": {
            str(cache): seconds
            for (target, cache), seconds in snap.expected_durations.items()
            if target == view.name
        },
        "last_duration_seconds": snap.last_durations.get(view.name),
    }


def _weight_files(sample: WeightFilesSample) -> dict[str, Any]:
    """What the server's tree has done with its weight files: the files it holds in full, the
    ones it is done with as a count (a checkpoint may have hundreds of shards)."""
    return {
        "visible": sample.visible,
        "reason": sample.reason,
        "first_open_at": sample.first_open_at,
        "idle_since": sample.idle_since,
        "consumed_bytes": sample.consumed_bytes,
        "total_bytes": sample.total_bytes,
        "files_total": sample.files_total,
        "files_seen": len(sample.files),
        "files_done": sum(1 for f in sample.files if f.consumed_bytes >= f.size_bytes),
        "held": [dataclasses.asdict(f) for f in sample.files if f.held],
    }


def _log_json(view: TargetView) -> dict[str, Any]:
    """Which log is followed and why: configured, found from the server's process (how), or
    none (why not); the reading's fields follow once it has been sampled."""
    finding = view.log_finding
    if view.config.log is not None:
        return {"source": None, "found_by": "configured"}
    if finding is None:
        why = "no server process seen yet" if view.config.process else "no process matching"
        return {"source": None, "found_by": None, "not_found": why}
    if finding.config is None:
        return {"source": None, "found_by": None, "not_found": finding.why}
    return {"source": None, "found_by": finding.why}


def storage_json(description: StorageDescription) -> dict[str, Any]:
    """What holds the weights, what can be measured there (each fact with its reason), and the
    rule the load's cache label follows."""
    fixed = description.fixed_cache()
    return {
        "kinds": list(description.kinds),
        "cache_label": {
            "fixed": str(fixed) if fixed is not None else None,
            "never_cold": description.in_memory,
            "residency_is_temperature": description.residency_is_temperature,
            "bypass": description.bypass,
            "reason": description.reason,
        },
        "mounts": [dataclasses.asdict(m) for m in description.mounts],
        "unplaced": list(description.unplaced),
    }


def status_json(snap: Snapshot, sample_interval: float) -> dict[str, Any]:
    """The JSON of /api/v1/status: one entry per target with its state and the evidence."""
    disk = snap.host_value(DISK)
    targets = []
    for view in snap.targets:
        name = view.name
        sources = {
            r.source: {
                "up": r.ok,
                "error": r.error,
                "note": _note(r),
                "duration_seconds": round(r.duration_seconds, 6),
                "age_seconds": round(snap.time - r.finished_at, 3),
            }
            for r in (view.readings[source] for source in sorted(view.readings))
        }
        entry: dict[str, Any] = {
            "target": name,
            "endpoint": view.config.endpoint.display_url,
            "server": view.server,
            "sources": sources,
        }
        if view.state is not None:
            entry.update(dataclasses.asdict(view.state))
        pagecache = view.reading(PAGECACHE)
        if pagecache is not None and pagecache.value is not None:
            value = pagecache.value
            entry["residency"] = {
                "files": value.files,
                "total_bytes": value.total_bytes,
                "resident_bytes": value.resident_bytes,
                "method": value.method,
                "last_full_pass_age_seconds": round(snap.time - value.measured_at, 3),
                "last_full_pass_cpu_seconds": value.pass_cpu_seconds,
                "reason": value.reason,
                "measured_on": value.where,
            }
        storage = view.value(STORAGE)
        if storage is not None:
            entry["storage"] = storage_json(storage)
        entry.update(_operator_view(snap, view))
        if view.forecast is not None:
            entry["restart_forecast"] = {
                "seconds": view.forecast.seconds,
                "resident_share": view.forecast.resident_share,
                "reason": view.forecast.reason,
            }
        files = view.reading(WEIGHT_FILES)
        if files is not None and files.value is not None:
            entry["weight_files"] = _weight_files(files.value)
        entry["log"] = _log_json(view)
        logs = view.reading(LOGS)
        if logs is not None and logs.value is not None:
            sample = logs.value
            entry["log"] = {
                **entry["log"],
                "source": sample.source,
                "up": sample.up,
                "reason": sample.reason,
                "format": sample.format,
                "format_reason": sample.format_reason,
                "step": sample.step,
                "step_since": sample.step_since,
                "weights_shards": sample.weights,
                "cuda_graphs": sample.cuda_graphs,
                "fatal": sample.fatal,
                "lines": sample.lines_total,
                "last_line_at": sample.last_line_at,
            }
        if view.discovered is not None:
            found = view.discovered
            entry["discovered"] = {
                "pid": found.pid,
                "kind": found.kind,
                "weights": [clean(path, 4096) for path in found.weights],
                "why": [dataclasses.asdict(e) for e in found.evidence],
            }
        if disk is not None:
            entry["block_devices"] = list(disk.devices_by_target.get(name, ()))
            lower = list(disk.lower_devices_by_target.get(name, ()))
            if lower:
                entry["lower_block_devices"] = lower
            unbacked = list(disk.unbacked_by_target.get(name, ()))
            if unbacked:
                entry["unbacked_weight_paths"] = unbacked
                entry["unbacked_note"] = (
                    "no block device behind these paths (network or memory filesystem): "
                    "disk read rate cannot be measured for them"
                )
        targets.append(entry)
    host = {
        r.source: {
            "up": r.ok,
            "error": r.error,
            "note": _note(r),
            "duration_seconds": round(r.duration_seconds, 6),
        }
        for r in (snap.host[source] for source in sorted(snap.host))
    }
    return {
        "time": snap.time,
        "version": snap.build["version"],
        "sample_interval_seconds": sample_interval,
        "targets": targets,
        "host_sources": host,
        "history": {
            "enabled": snap.history_enabled,
            "up": snap.history_up,
            "problem": snap.history_problem,
        },
    }


class WebApp:
    """The WSGI application over whichever runtime is current (a reload swaps it).

    TLS and basic auth are the server's (exporter/httpserver.py), so they cover every path and a
    bcrypt check never holds a worker; the app checks basic auth again (from the cache) for when
    another WSGI server hosts it. GET paths also answer HEAD (the server drops the body); any
    other method is 405 with an Allow header.
    """

    def __init__(
        self,
        runtime: Runtime,
        web: WebConfig | None = None,
        reload: Callable[[], str | None] | None = None,
    ) -> None:
        self.runtime = runtime
        self.web = web or WebConfig()
        self._reload = reload
        registry = CollectorRegistry(auto_describe=False)
        # Through self.runtime, not a bound method: a config reload swaps the runtime.
        registry.register(ExporterCollector(lambda: self.runtime.snapshot()))
        self._metrics = make_wsgi_app(registry)
        self._get: dict[str, Callable[[dict[str, Any], StartResponse], Iterable[bytes]]] = {
            "/metrics": self._metrics_page,
            "/": self._landing,
            "/-/healthy": self._healthy,
            "/-/ready": self._ready,
            "/api/v1/status": self._status,
            "/api/v1/loads": self._loads,
        }

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        # The server checked already (and cached the answer); this covers the app when another
        # WSGI server hosts it, e.g. mounted under a path prefix.
        if not self.web.authorized(environ.get("HTTP_AUTHORIZATION")):
            return _reply(
                start_response,
                "401 Unauthorized",
                b"Unauthorized\n",
                extra=[("WWW-Authenticate", 'Basic realm="model-load-exporter"')],
            )
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/-/reload":
            if method != "POST":
                return self._not_allowed(start_response, "POST")
            if not same_origin(environ):
                return _reply(start_response, "403 Forbidden", b"Cross-origin request refused\n")
            return self._reload_page(start_response)
        handler = self._get.get(path)
        if handler is None:
            return _reply(start_response, "404 Not Found", b"Not found\n")
        if method not in ("GET", "HEAD"):
            return self._not_allowed(start_response, "GET, HEAD")
        return handler(environ, start_response)

    def _metrics_page(
        self, environ: dict[str, Any], start_response: StartResponse
    ) -> Iterable[bytes]:
        # prometheus_client's app refuses HEAD; the server drops the body of a HEAD answer.
        return self._metrics({**environ, "REQUEST_METHOD": "GET"}, start_response)

    @staticmethod
    def _landing(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        body, headers = livepage.page()
        return _reply(start_response, "200 OK", body, livepage.CONTENT_TYPE, headers)

    @staticmethod
    def _healthy(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        return _reply(start_response, "200 OK", b"Healthy\n")

    def _ready(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if self.runtime.ready:
            return _reply(start_response, "200 OK", b"Ready\n")
        return _reply(start_response, "503 Service Unavailable", b"Not ready\n")

    def _status(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        runtime = self.runtime
        return _json(
            start_response, status_json(runtime.snapshot(), runtime.config.sample_interval)
        )

    def _loads(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        target = query.get("target", [None])[0]
        text = query.get("limit", ["100"])[0]
        if not _WHOLE_NUMBER.match(text) or not 1 <= int(text) <= MAX_LOADS:
            message = f"limit must be a whole number from 1 to {MAX_LOADS}\n".encode()
            return _reply(start_response, "400 Bad Request", message)
        loads = [record_json(r) for r in self.runtime.loads(target, int(text))]
        return _json(start_response, {"loads": loads})

    def _reload_page(self, start_response: StartResponse) -> Iterable[bytes]:
        if self._reload is None:
            return _reply(start_response, "404 Not Found", b"Not found\n")
        error = self._reload()
        if error is not None:
            return _reply(start_response, "500 Internal Server Error", f"{error}\n".encode())
        return _reply(start_response, "200 OK", b"Reloaded\n")

    @staticmethod
    def _not_allowed(start_response: StartResponse, allow: str) -> Iterable[bytes]:
        return _reply(
            start_response,
            "405 Method Not Allowed",
            b"Method not allowed\n",
            extra=[("Allow", allow)],
        )


def same_origin(environ: dict[str, Any]) -> bool:
    """Whether a request that changes state comes from this exporter's own origin, or from no
    browser page at all (curl, Prometheus tooling send neither header).

    A form on any web page can POST to the exporter from the operator's browser; the browser
    then says so in `Sec-Fetch-Site` (cross-site, same-site) and `Origin`.
    """
    site = environ.get("HTTP_SEC_FETCH_SITE")
    if site is not None and site not in ("same-origin", "none"):
        return False
    origin = environ.get("HTTP_ORIGIN")
    if origin is None:
        return True
    try:
        parts = urlsplit(origin)
    except ValueError:
        return False
    host = environ.get("HTTP_HOST", "").lower()
    return parts.scheme == environ.get("wsgi.url_scheme") and bool(host) and parts.netloc == host


def _json(start_response: StartResponse, data: object) -> Iterable[bytes]:
    body = json.dumps(data, default=_json_default, indent=2).encode()
    return _reply(start_response, "200 OK", body, "application/json")


def _reply(
    start_response: StartResponse,
    status: str,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    extra: list[tuple[str, str]] | None = None,
) -> Iterable[bytes]:
    headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
    start_response(status, headers + (extra or []))
    return [body]


def parse_listen_address(address: str) -> tuple[str, int]:
    """`:9847`, `0.0.0.0:9847`, `[::1]:9847` -> (host, port); ValueError with a clear message."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--web.listen-address: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class HttpServer:
    """The exporter's listening socket and its server (exporter/httpserver.py)."""

    def __init__(self, app: WebApp, address: str, limits: Limits | None = None) -> None:
        host, port = parse_listen_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host or "0.0.0.0", port), family=family, backlog=somaxconn())
        try:
            tls = app.web.ssl_context()
        except BaseException:
            sock.close()
            raise
        self.server = Server(
            app,
            sock,
            tls=tls,
            auth=app.web.auth,
            headers=app.web.headers.items(),
            limits=limits,
            allowed_hosts=app.web.allowed_hosts,
        )
        self.scheme = "https" if tls is not None else "http"
        self._port = int(sock.getsockname()[1])

    @property
    def port(self) -> int:
        return self._port

    def configure(self, web: WebConfig) -> None:
        """Apply a reloaded web config: certificates, users and headers, without re-listening."""
        tls = web.ssl_context()
        if (tls is not None) != (self.scheme == "https"):
            raise ValueError("turning TLS on or off needs a restart")
        self.server.tls, self.server.auth, self.server.headers = (
            tls,
            web.auth,
            list(web.headers.items()),
        )
        self.server.allowed_hosts = frozenset(h.lower() for h in web.allowed_hosts)

    def start(self) -> None:
        self.server.start()

    def stop(self) -> None:
        self.server.stop()
