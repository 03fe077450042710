"""HTTP side: /metrics, /api/v1/status, /api/v1/loads, landing page and health endpoints.

A plain threaded WSGI server, as prometheus_client's own `start_http_server` uses, with the
exporter's routes in front of prometheus_client's WSGI app (which does the OpenMetrics content
negotiation and gzip for us).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from urllib.parse import parse_qs
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from exporter import livepage
from exporter.collector import ExporterCollector
from exporter.runtime import Runtime
from exporter.sampler import Reading
from exporter.snapshot import Snapshot, TargetView
from exporter.sources import DISK, LOGS, NVML, PAGECACHE
from exporter.tracker import LoadRecord
from exporter.webconfig import WebConfig

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]


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


def _operator_view(snap: Snapshot, view: TargetView) -> dict[str, Any]:
    """What `status`, `wait` and the live page show beside the state: GPU memory the target holds
    per device, and what history expects of a load at each cache temperature."""
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
        "expected_duration_seconds": {
            str(cache): seconds
            for (target, cache), seconds in snap.expected_durations.items()
            if target == view.name
        },
        "last_duration_seconds": snap.last_durations.get(view.name),
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
            "endpoint": view.config.endpoint.url,
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
            }
        entry.update(_operator_view(snap, view))
        logs = view.reading(LOGS)
        if logs is not None and logs.value is not None:
            sample = logs.value
            entry["log"] = {
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
                "weights": list(found.weights),
                "why": [dataclasses.asdict(e) for e in found.evidence],
            }
        if disk is not None:
            entry["block_devices"] = list(disk.devices_by_target.get(name, ()))
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
        "history": {"enabled": snap.history_enabled, "problem": snap.history_problem},
    }


class WebApp:
    """The WSGI application over whichever runtime is current (a reload swaps it)."""

    def __init__(self, runtime: Runtime, web: WebConfig | None = None) -> None:
        self.runtime = runtime
        self.web = web or WebConfig()
        registry = CollectorRegistry(auto_describe=False)
        # Through self.runtime, not a bound method: a config reload swaps the runtime.
        registry.register(ExporterCollector(lambda: self.runtime.snapshot()))
        self._metrics = make_wsgi_app(registry)

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        if not self.web.authorized(environ.get("HTTP_AUTHORIZATION")):
            return self._reply(
                start_response,
                "401 Unauthorized",
                b"Unauthorized\n",
                "text/plain",
                [("WWW-Authenticate", 'Basic realm="model-load-exporter"')],
            )
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            return self._metrics(environ, start_response)
        if path == "/":
            body, headers = livepage.page()
            return self._reply(start_response, "200 OK", body, livepage.CONTENT_TYPE, headers)
        if path == "/-/healthy":
            return self._reply(start_response, "200 OK", b"Healthy\n", "text/plain")
        if path == "/-/ready":
            if self.runtime.ready:
                return self._reply(start_response, "200 OK", b"Ready\n", "text/plain")
            return self._reply(
                start_response, "503 Service Unavailable", b"Not ready\n", "text/plain"
            )
        if path == "/api/v1/status":
            snapshot = self.runtime.snapshot()
            interval = self.runtime.config.sample_interval
            return self._json(start_response, status_json(snapshot, interval))
        if path == "/api/v1/loads":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            target = query.get("target", [None])[0]
            try:
                limit = max(1, min(1000, int(query.get("limit", ["100"])[0])))
            except ValueError:
                return self._reply(start_response, "400 Bad Request", b"bad limit\n", "text/plain")
            loads = [record_json(r) for r in self.runtime.loads(target, limit)]
            return self._json(start_response, {"loads": loads})
        return self._reply(start_response, "404 Not Found", b"Not found\n", "text/plain")

    @staticmethod
    def _json(start_response: StartResponse, data: object) -> Iterable[bytes]:
        body = json.dumps(data, default=_json_default, indent=2).encode()
        return WebApp._reply(start_response, "200 OK", body, "application/json")

    @staticmethod
    def _reply(
        start_response: StartResponse,
        status: str,
        body: bytes,
        content_type: str,
        extra: list[tuple[str, str]] | None = None,
    ) -> Iterable[bytes]:
        headers = [("Content-Type", content_type), ("Content-Length", str(len(body)))]
        start_response(status, headers + (extra or []))
        return [body]


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    allow_reuse_address = True


class _IPv6ThreadingServer(_ThreadingServer):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s - %s", self.address_string(), format % args)


def parse_listen_address(address: str) -> tuple[str, int]:
    """`:9847`, `0.0.0.0:9847`, `[::1]:9847` -> (host, port); ValueError with a clear message."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"--web.listen-address: expected HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


class HttpServer:
    """The exporter's listening socket and serving thread."""

    def __init__(self, app: WebApp, address: str) -> None:
        host, port = parse_listen_address(address)
        server_class = _IPv6ThreadingServer if ":" in host else _ThreadingServer
        self.server = make_server(
            host or "0.0.0.0", port, app, server_class=server_class, handler_class=_QuietHandler
        )
        tls = app.web.ssl_context()
        if tls is not None:
            self.server.socket = tls.wrap_socket(self.server.socket, server_side=True)
        self.scheme = "https" if tls is not None else "http"
        self._thread = threading.Thread(target=self.server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
