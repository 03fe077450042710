"""HTTP side: /metrics, /api/v1/status, /api/v1/loads, landing page, health and reload.

The exporter's routes, served by exporter/exposition/http/server.py: an asyncio server with
handshake, header and idle timeouts and a bound on connections, so no client can stall a scrape.
/metrics is encoded by exporter/exposition/http/metricspage.py (prometheus_client's content
negotiation and encoders, a family encoded again only when it changed).
"""

from __future__ import annotations

import json
import logging
import re
import socket
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import parse_qs, urlsplit

from prometheus_client import CollectorRegistry

from exporter.exposition import api, liveness
from exporter.exposition.api_build import load_document, loads_document, status_document
from exporter.exposition.collector import ExporterCollector
from exporter.exposition.http import livepage, protobuf
from exporter.exposition.http.metricspage import MetricsPage
from exporter.exposition.http.server import Limits, Server, somaxconn
from exporter.exposition.http.webconfig import WebConfig
from exporter.exposition.liveness import Question
from exporter.runtime.wiring import Runtime

log = logging.getLogger(__name__)

StartResponse = Callable[..., Any]
_WHOLE_NUMBER = re.compile(r"[0-9]{1,4}\Z")  # ASCII digits only: "²".isdigit() is True
_LOAD_ID = re.compile(r"[0-9]{1,18}\Z")  # a history row id (SQLite's are 64-bit)
LOAD_PREFIX = "/api/v1/loads/"
MAX_UNKNOWN_NAMES = 64  # probed names not watched that are logged (each once)
NO_STORE = ("Cache-Control", "no-store")


class WebApp:
    """The WSGI application over whichever runtime is current (a reload swaps it).

    TLS and basic auth are the server's (exporter/exposition/http/server.py), so they cover every
    path and a bcrypt check never holds a worker; the app checks basic auth again (from the cache)
    for when another WSGI server hosts it. GET paths also answer HEAD (the server drops the body);
    any other method is 405 with an Allow header.
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
        self._metrics = MetricsPage(registry)
        self._get: dict[str, Callable[[dict[str, Any], StartResponse], Iterable[bytes]]] = {
            "/metrics": self._metrics_page,
            "/": self._landing,
            "/-/healthy": self._healthy,
            "/-/ready": self._ready,
            "/api/v1/status": self._status,
            "/api/v1/loads": self._loads,
            "/probe/alive": lambda environ, reply: self._probe(Question.ALIVE, environ, reply),
            "/probe/ready": lambda environ, reply: self._probe(Question.READY, environ, reply),
        }
        self._unknown_names: set[str] = set()  # probed names not watched, logged once each

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
        if self.web.auth.enabled:
            start_response = _not_stored(start_response)
        path = environ.get("PATH_INFO", "/")
        method = environ.get("REQUEST_METHOD", "GET")
        if path == "/-/reload":
            if method != "POST":
                return self._not_allowed(start_response, "POST")
            if not same_origin(environ):
                return _reply(start_response, "403 Forbidden", b"Cross-origin request refused\n")
            return self._reload_page(start_response)
        handler = self._get.get(path)
        if handler is None and path.startswith(LOAD_PREFIX):
            handler = self._load
        if handler is None:
            return _reply(start_response, "404 Not Found", b"Not found\n")
        if method not in ("GET", "HEAD"):
            return self._not_allowed(start_response, "GET, HEAD")
        return handler(environ, start_response)

    def _metrics_page(
        self, environ: dict[str, Any], start_response: StartResponse
    ) -> Iterable[bytes]:
        if self.runtime.config.metrics.native_histograms and protobuf.wants_protobuf(
            environ.get("HTTP_ACCEPT", "")
        ):
            snapshot = self.runtime.snapshot()
            body = protobuf.render(ExporterCollector(lambda: snapshot, native=True).collect())
            return _reply(start_response, "200 OK", body, protobuf.CONTENT_TYPE)
        body, headers = self._metrics.render(
            environ.get("HTTP_ACCEPT", ""), environ.get("HTTP_ACCEPT_ENCODING", "")
        )
        start_response("200 OK", headers)
        return [body]

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
        status = status_document(runtime.snapshot(), runtime.config.sample_interval)
        return _json(start_response, status.to_json())

    def _probe(
        self, question: Question, environ: dict[str, Any], start_response: StartResponse
    ) -> Iterable[bytes]:
        """/probe/alive and /probe/ready (exporter/exposition/liveness.py): a kubelet's httpGet
        probe; the body is the one line `kubectl describe` shows."""
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        name = query.get("target", [None])[0]
        runtime = self.runtime
        snap = runtime.snapshot()
        verdict, unknown = liveness.answer(
            question, snap.targets, name, snap.time, runtime.config.sample_interval
        )
        seen = self._unknown_names
        if unknown and name is not None and name not in seen and len(seen) < MAX_UNKNOWN_NAMES:
            seen.add(name)
            log.warning("probe for a target not watched: %s", verdict.line)
        return _reply(start_response, verdict.status, f"{verdict.line}\n".encode())

    def _loads(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        query = parse_qs(environ.get("QUERY_STRING", ""), keep_blank_values=True)
        target = query.get("target", [None])[0]
        text = query.get("limit", ["100"])[0]
        if not _WHOLE_NUMBER.match(text) or not 1 <= int(text) <= api.MAX_LOADS:
            message = f"limit must be a whole number from 1 to {api.MAX_LOADS}\n".encode()
            return _reply(start_response, "400 Bad Request", message)
        records = self.runtime.loads(target, int(text))
        return _json(start_response, loads_document(records).to_json())

    def _load(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        """One finished load with its report, by the `id` /api/v1/loads gives it."""
        text = environ.get("PATH_INFO", "").removeprefix(LOAD_PREFIX)
        if not _LOAD_ID.match(text):
            return _reply(start_response, "404 Not Found", b"Not found\n")
        record = self.runtime.load(int(text))
        if record is None:
            message = f"no load {int(text)} in history\n".encode()
            return _reply(start_response, "404 Not Found", message)
        return _json(start_response, load_document(record))

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


def _not_stored(start_response: StartResponse) -> StartResponse:
    """An answer behind basic auth is for its one client: no browser or proxy may keep it
    (`Cache-Control: no-store` in place of whatever the route said)."""

    def start(status: str, headers: list[tuple[str, str]], *args: Any) -> Any:
        kept = [(k, v) for k, v in headers if k.lower() != "cache-control"]
        return start_response(status, [*kept, NO_STORE], *args)

    return start


def _json(start_response: StartResponse, data: object) -> Iterable[bytes]:
    body = json.dumps(data, indent=2).encode()
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
    """The exporter's listening socket and its server (exporter/exposition/http/server.py)."""

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
