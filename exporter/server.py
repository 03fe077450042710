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
from exporter.app import Exporter, Snapshot
from exporter.collector import ExporterCollector
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


def _operator_view(snap: Snapshot, name: str) -> dict[str, Any]:
    """What `status`, `wait` and the live page show beside the state: GPU memory the target holds
    per device, and what history expects of a load at each cache temperature."""
    gpu = snap.value("nvml")
    devices = {d.index: d for d in getattr(gpu, "devices", ())}
    gpu_memory = []
    for index, used in sorted(snap.process_gpu_bytes.get(name, {}).items()):
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
            cache: seconds for (t, cache), seconds in snap.expected_durations.items() if t == name
        },
        "last_duration_seconds": snap.last_durations.get(name),
    }


def status_json(snap: Snapshot) -> dict[str, Any]:
    """The JSON of /api/v1/status: one entry per target with its state and the evidence."""
    targets = []
    for target in snap.config.targets:
        name = target.name
        state = snap.states.get(name)
        sources = {
            source: {
                "up": r.ok,
                "error": r.error,
                "duration_seconds": round(r.duration_seconds, 6),
                "age_seconds": round(snap.time - r.finished_at, 3),
            }
            for (source, t), r in sorted(snap.readings.items())
            if t == name
        }
        entry: dict[str, Any] = {
            "target": name,
            "endpoint": target.endpoint.url,
            "server": snap.servers.get(name, "unknown"),
            "sources": sources,
        }
        if state is not None:
            entry.update(dataclasses.asdict(state))
        residency = snap.reading("pagecache", name)
        if residency is not None and residency.value is not None:
            value = residency.value
            entry["residency"] = {
                "files": value.files,
                "total_bytes": value.total_bytes,
                "resident_bytes": value.resident_bytes,
                "method": value.method,
                "last_full_pass_age_seconds": round(snap.time - value.measured_at, 3),
                "last_full_pass_cpu_seconds": value.pass_cpu_seconds,
                "reason": value.reason,
            }
        entry.update(_operator_view(snap, name))
        disk = snap.value("disk")
        if disk is not None:
            entry["block_devices"] = list(getattr(disk, "devices_by_target", {}).get(name, ()))
            unbacked = list(getattr(disk, "unbacked_by_target", {}).get(name, ()))
            if unbacked:
                entry["unbacked_weight_paths"] = unbacked
                entry["unbacked_note"] = (
                    "no block device behind these paths (network or memory filesystem): "
                    "disk read rate cannot be measured for them"
                )
        targets.append(entry)
    host = {
        source: {"up": r.ok, "error": r.error, "duration_seconds": round(r.duration_seconds, 6)}
        for (source, t), r in sorted(snap.readings.items())
        if not t
    }
    return {
        "time": snap.time,
        "version": snap.build["version"],
        "sample_interval_seconds": snap.config.sample_interval,
        "targets": targets,
        "host_sources": host,
        "history": {"enabled": snap.history_enabled, "problem": snap.history_problem},
    }


class ExporterApp:
    """The WSGI application."""

    def __init__(self, exporter: Exporter, web: WebConfig | None = None) -> None:
        self.exporter = exporter
        self.web = web or WebConfig()
        registry = CollectorRegistry(auto_describe=False)
        # Through self.exporter, not a bound method: a config reload swaps the exporter.
        registry.register(ExporterCollector(lambda: self.exporter.snapshot()))
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
            if self.exporter.ready:
                return self._reply(start_response, "200 OK", b"Ready\n", "text/plain")
            return self._reply(
                start_response, "503 Service Unavailable", b"Not ready\n", "text/plain"
            )
        if path == "/api/v1/status":
            return self._json(start_response, status_json(self.exporter.snapshot()))
        if path == "/api/v1/loads":
            query = parse_qs(environ.get("QUERY_STRING", ""))
            target = query.get("target", [None])[0]
            try:
                limit = max(1, min(1000, int(query.get("limit", ["100"])[0])))
            except ValueError:
                return self._reply(start_response, "400 Bad Request", b"bad limit\n", "text/plain")
            loads = [record_json(r) for r in self.exporter.loads(target, limit)]
            return self._json(start_response, {"loads": loads})
        return self._reply(start_response, "404 Not Found", b"Not found\n", "text/plain")

    @staticmethod
    def _json(start_response: StartResponse, data: object) -> Iterable[bytes]:
        body = json.dumps(data, default=_json_default, indent=2).encode()
        return ExporterApp._reply(start_response, "200 OK", body, "application/json")

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

    def __init__(self, app: ExporterApp, address: str) -> None:
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
