"""An HTTP/1.1 server for the exporter's WSGI app that no client can stall.

Chosen by measurement over wsgiref (what the exporter had), cheroot, waitress, uvicorn and
hypercorn: `bench/http_load.py` prints the comparison, docs/costs.md quotes it. The
maintained servers each miss one thing an exporter on every GPU host needs: cheroot runs the TLS
handshake in its accept loop (one silent client delays every connection by its timeout) and
reads request heads on pool threads (slowloris holds them); waitress has no TLS; uvicorn starts
no timer on a connection until it has answered one request (an idle or trickling client is held
forever) and answers 503 at its connection limit; hypercorn has every timeout but no bound on
connections, and six dependencies. This is asyncio's TLS and stream machinery (part of CPython,
maintained with it) plus the limits below, in one module; request framing (request line, header
syntax, Content-Length) is h11's, the sans-I/O HTTP/1.1 parser under httpcore and hypercorn, so
malformed framing (a non-ASCII digit in Content-Length, a header name ending in a newline) is a
400 from a well-kept parser rather than a traceback from one written here.

One event loop thread owns every socket, so an idle, slow or malicious client costs a file
descriptor and a few KB, never a thread. The app runs on a small pool of worker threads, and
bcrypt checks on one thread of their own, so a flood of wrong passwords cannot take the workers.

Limits (`Limits`): the TLS handshake must finish within 5 s, the request head (from the first
byte of a request to its blank line, however slowly it trickles) within 10 s, a kept-alive
connection may idle 120 s; heads over 64 KiB are answered 431, bodies over 64 KiB 413. Every
answer carries `X-Content-Type-Options: nosniff`; with `allowed_hosts` a request whose `Host` is
not one of them is 421, before authentication (a DNS-rebinding page gets nothing). The
listen backlog is the kernel's somaxconn (at least 128), and no more than the connection bound,
which a low fd limit lowers. At most `max_connections` connections are held: at the bound, the
one that has been idle (or handshaking, or sending its head) the longest is closed to admit the
new one, so a scraper always gets in and the exporter never runs out of file descriptors.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import re
import resource
import socket
import ssl
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import Enum
from http import HTTPStatus
from typing import Any
from urllib.parse import unquote_to_bytes

import h11

from exporter.exposition.http.webconfig import BasicAuth

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

_MAX_HEADERS = 100
_READ_BYTES = 65536
_HEAD_KEPT = 256
# A request line naming an HTTP version h11 does not speak: 505, not 400.
_OTHER_VERSION_RE = re.compile(rb"[^ ]+ [^ ]+ HTTP/(?!1\.[01]\r?\n)\d(?:\.\d)?\r?\n")
NOSNIFF = ("X-Content-Type-Options", "nosniff")
# File descriptors kept for everything but HTTP: sources, history, NVML, logs.
_RESERVED_FDS = 256


def somaxconn(default: int = 4096) -> int:
    """The kernel's cap on a listen backlog; listen() silently truncates to it."""
    try:
        with open("/proc/sys/net/core/somaxconn") as f:
            return max(128, int(f.read()))
    except (OSError, ValueError):
        return default


def connection_bound(wanted: int = 4096) -> int:
    """Connections to hold at most: `wanted`, or fewer when the fd limit is low."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - _RESERVED_FDS))


@dataclass(frozen=True)
class Limits:
    handshake_timeout: float = 5.0
    header_timeout: float = 10.0
    idle_timeout: float = 120.0
    write_timeout: float = 30.0
    max_head_bytes: int = 64 * 1024
    max_body_bytes: int = 64 * 1024
    max_connections: int = 4096  # further capped by the fd limit (connection_bound)
    workers: int = 4


class _State(Enum):
    HANDSHAKE = "handshake"
    HEAD = "head"  # waiting for or reading a request head
    BUSY = "busy"  # a request is being answered: never evicted
    IDLE = "idle"


class _Conn:
    __slots__ = ("since", "state", "transport")

    def __init__(self, transport: asyncio.WriteTransport) -> None:
        self.transport = transport
        self.state = _State.HEAD
        self.since = time.monotonic()

    def enter(self, state: _State) -> None:
        self.state, self.since = state, time.monotonic()


class _Reply(Exception):
    """Answer with this status and close: the request cannot be served."""

    def __init__(self, status: HTTPStatus) -> None:
        super().__init__(status.phrase)
        self.status = status


@dataclass
class _Request:
    method: str
    target: str
    version: str
    headers: dict[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes = b""

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        return self.version == "HTTP/1.1" and "close" not in tokens


class Server:
    """Serves `app` on an already bound socket from one event-loop thread.

    `tls`, `auth` and `headers` may be replaced while running (a reload): new connections get
    the new TLS context, every request the current users and headers.
    """

    def __init__(
        self,
        app: WsgiApp,
        sock: socket.socket,
        *,
        tls: ssl.SSLContext | None = None,
        auth: BasicAuth | None = None,
        headers: Iterable[tuple[str, str]] = (),
        limits: Limits | None = None,
        allowed_hosts: Iterable[str] = (),
    ) -> None:
        self.app = app
        self.tls = tls
        self.auth = auth
        self.headers = list(headers)
        self.allowed_hosts = frozenset(h.lower() for h in allowed_hosts)
        self.limits = limits or Limits()
        self.max_connections = connection_bound(self.limits.max_connections)
        # asyncio accepts up to `backlog` connections per wake-up, each an fd before admission:
        # under a low fd limit the backlog must not outrun the bound, or a burst of connections
        # takes the fds the sources need (/proc/meminfo, the probe's socket) for a moment.
        self.backlog = min(somaxconn(), max(self.max_connections, 16))
        self._sock = sock
        self._scheme = "https" if tls is not None else "http"
        host, port = sock.getsockname()[:2]
        self._server_name, self._server_port = str(host), str(port)
        self._conns: dict[asyncio.WriteTransport, _Conn] = {}
        self._workers = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="http-worker")
        self._bcrypt = ThreadPoolExecutor(1, thread_name_prefix="http-auth")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="http", daemon=True)
        self.evicted = 0  # connections closed to make room (for tests and debugging)

    # -- lifecycle (called from other threads) -------------------------------------------------

    def start(self) -> None:
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    def stop(self, timeout: float = 2.0) -> None:
        """Close the listener and every connection; in-flight requests are abandoned."""
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(self._shutdown)
        self._thread.join(timeout)
        self._workers.shutdown(wait=False, cancel_futures=True)
        self._bcrypt.shutdown(wait=False, cancel_futures=True)
        with contextlib.suppress(OSError):
            self._sock.close()

    @property
    def headers(self) -> list[tuple[str, str]]:
        """Added to every answer: the web config's, and nosniff unless it set that already."""
        return self._headers

    @headers.setter
    def headers(self, headers: Iterable[tuple[str, str]]) -> None:
        self._headers = _with_nosniff(headers)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        self._loop = loop
        try:
            self._server = loop.run_until_complete(
                asyncio.start_server(
                    self._client,
                    sock=self._sock,
                    limit=self.limits.max_head_bytes,
                    backlog=self.backlog,
                )
            )
        except BaseException as exc:  # reported to start()'s caller
            self._error = exc
            self._started.set()
            loop.close()
            return
        self._started.set()
        try:
            loop.run_forever()
        finally:
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            if tasks:
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        for transport in list(self._conns):
            transport.abort()
        assert self._loop is not None
        self._loop.stop()

    # -- connections --------------------------------------------------------------------------

    def _admit(self, transport: asyncio.WriteTransport) -> _Conn | None:
        """Register a connection, closing the longest-waiting non-busy one if at the bound."""
        if len(self._conns) >= self.max_connections:
            victims = [c for c in self._conns.values() if c.state is not _State.BUSY]
            if not victims:
                transport.abort()
                return None
            victim = min(victims, key=lambda c: c.since)
            self.evicted += 1
            victim.transport.abort()
            self._conns.pop(victim.transport, None)
        conn = _Conn(transport)
        self._conns[transport] = conn
        return conn

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self._admit(writer.transport)
        if conn is None:
            return
        try:
            if self.tls is not None:
                conn.enter(_State.HANDSHAKE)
                await writer.start_tls(
                    self.tls, ssl_handshake_timeout=self.limits.handshake_timeout
                )
                self._conns.pop(conn.transport, None)
                conn.transport = writer.transport
                self._conns[conn.transport] = conn
            await self._requests(conn, reader, writer)
        except (OSError, ssl.SSLError, EOFError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the client went away, timed out or spoke no TLS: nothing to answer
        except asyncio.CancelledError:
            pass  # shutting down; ending normally keeps asyncio 3.11 from logging each one
        finally:
            self._conns.pop(conn.transport, None)
            self._conns.pop(writer.transport, None)
            writer.transport.abort()

    async def _requests(
        self, conn: _Conn, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        peer = writer.get_extra_info("peername") or ("", 0)
        buffered = b""  # bytes of the next request already read (pipelining)
        first = True
        while True:
            if first or buffered:
                conn.enter(_State.HEAD)
            else:
                conn.enter(_State.IDLE)
                async with asyncio.timeout(self.limits.idle_timeout):
                    buffered = await reader.read(_READ_BYTES)
                if not buffered:
                    return
                conn.enter(_State.HEAD)
            parsed = await self._read_request(reader, writer, buffered)
            if parsed is None:
                return
            request, buffered = parsed
            conn.enter(_State.BUSY)
            keep = await self._answer(request, writer, peer)
            if not keep:
                return
            first = False

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: bytes
    ) -> tuple[_Request, bytes] | None:
        """The next request and what followed it, or None after answering an error (the
        connection then closes) or when the client closed mid-request."""
        h = h11.Connection(h11.SERVER, max_incomplete_event_size=self.limits.max_head_bytes)
        head = bytearray(start)  # the first bytes, to tell an unknown version from garbage
        if start:
            h.receive_data(start)  # b"" would tell h11 the client closed
        try:
            async with asyncio.timeout(self.limits.header_timeout):
                event = await _next_event(h, reader, head)
                if not isinstance(event, h11.Request):
                    return None  # closed before a whole request head
                request = _request(event, self.limits.max_head_bytes)
                if "transfer-encoding" in request.headers:
                    raise _Reply(HTTPStatus.LENGTH_REQUIRED)  # no chunked bodies: none needed
                length = int(request.headers.get("content-length") or 0)
                if length > self.limits.max_body_bytes:
                    raise _Reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
                body = bytearray()
                while not isinstance(event := await _next_event(h, reader), h11.EndOfMessage):
                    if not isinstance(event, h11.Data):
                        return None  # closed mid-body
                    body += event.data
                request.body = bytes(body)
                return request, h.trailing_data[0]
        except h11.RemoteProtocolError as exc:
            status = (
                HTTPStatus.HTTP_VERSION_NOT_SUPPORTED
                if _OTHER_VERSION_RE.match(bytes(head).lstrip(b"\r\n"))
                else HTTPStatus(exc.error_status_hint)
            )
            await self._send(writer, _error_response(status, self.headers))
        except _Reply as reply:
            await self._send(writer, _error_response(reply.status, self.headers))
        return None

    async def _answer(
        self, request: _Request, writer: asyncio.StreamWriter, peer: tuple[Any, ...]
    ) -> bool:
        """Authorize, run the app on a worker, write the response; whether to keep alive."""
        loop = asyncio.get_running_loop()
        if self.allowed_hosts and not _host_allowed(request, self.allowed_hosts):
            await self._send(writer, _error_response(HTTPStatus.MISDIRECTED_REQUEST, self.headers))
            return False
        auth = self.auth
        if auth is not None and auth.enabled:
            header = request.headers.get("authorization")
            allowed = auth.cached(header)
            if allowed is None:
                allowed = await loop.run_in_executor(self._bcrypt, auth.check, header)
            if not allowed:
                response = _response(
                    HTTPStatus.UNAUTHORIZED,
                    [
                        ("Content-Type", "text/plain; charset=utf-8"),
                        ("WWW-Authenticate", 'Basic realm="model-load-exporter"'),
                    ],
                    b"Unauthorized\n",
                    self.headers,
                    request.method == "HEAD",
                    request.keep_alive,
                )
                await self._send(writer, response)
                return request.keep_alive
        environ = self._environ(request, peer)
        status, headers, body = await loop.run_in_executor(self._workers, self._call, environ)
        response = _response(
            status, headers, body, self.headers, request.method == "HEAD", request.keep_alive
        )
        await self._send(writer, response)
        return request.keep_alive

    async def _send(self, writer: asyncio.StreamWriter, data: bytes) -> None:
        writer.write(data)
        async with asyncio.timeout(self.limits.write_timeout):
            await writer.drain()

    def _environ(self, request: _Request, peer: tuple[Any, ...]) -> dict[str, Any]:
        path, _, query = request.target.partition("?")
        environ: dict[str, Any] = {
            "REQUEST_METHOD": request.method,
            "SCRIPT_NAME": "",
            "PATH_INFO": unquote_to_bytes(path).decode("latin-1"),
            "QUERY_STRING": query,
            "SERVER_NAME": self._server_name,
            "SERVER_PORT": self._server_port,
            "SERVER_PROTOCOL": request.version,
            "REMOTE_ADDR": str(peer[0]),
            "wsgi.version": (1, 0),
            "wsgi.url_scheme": self._scheme,
            "wsgi.input": io.BytesIO(request.body),
            "wsgi.errors": sys.stderr,
            "wsgi.multithread": True,
            "wsgi.multiprocess": False,
            "wsgi.run_once": False,
            "CONTENT_LENGTH": str(len(request.body)) if request.body else "",
            "CONTENT_TYPE": request.headers.get("content-type", ""),
        }
        for name, value in request.headers.items():
            key = "HTTP_" + name.upper().replace("-", "_")
            if key not in ("HTTP_CONTENT_LENGTH", "HTTP_CONTENT_TYPE"):
                environ[key] = value
        return environ

    def _call(self, environ: dict[str, Any]) -> tuple[HTTPStatus, list[tuple[str, str]], bytes]:
        """Run the WSGI app on a worker thread; a bug in it is a 500, never a dead server."""
        started: list[Any] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Any:
            started[:] = [status, headers]
            return lambda data: None

        try:
            chunks = self.app(environ, start_response)
            try:
                body = b"".join(chunks)
            finally:
                close = getattr(chunks, "close", None)
                if close is not None:
                    close()
            status = HTTPStatus(int(started[0].split(" ", 1)[0]))
            return status, list(started[1]), body
        except Exception:
            log.exception("error answering %s %s", environ["REQUEST_METHOD"], environ["PATH_INFO"])
            return (
                HTTPStatus.INTERNAL_SERVER_ERROR,
                [("Content-Type", "text/plain; charset=utf-8")],
                b"Internal Server Error\n",
            )


async def _next_event(
    h: h11.Connection, reader: asyncio.StreamReader, head: bytearray | None = None
) -> object:
    """h11's next event, reading from the client while it needs data (EOF included); the
    first bytes read also go to `head`."""
    while (event := h.next_event()) is h11.NEED_DATA:
        data = await reader.read(_READ_BYTES)
        if head is not None and len(head) < _HEAD_KEPT:
            head += data[:_HEAD_KEPT]
        h.receive_data(data)
    return event


def _request(event: h11.Request, max_head_bytes: int) -> _Request:
    """h11's request as the server's: lower-case names, repeated headers joined with ", "."""
    size = len(event.target) + sum(len(name) + len(value) + 4 for name, value in event.headers)
    if len(event.headers) > _MAX_HEADERS or size > max_head_bytes:
        raise _Reply(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)  # arrived whole, still too big
    if event.http_version not in (b"1.0", b"1.1"):
        raise _Reply(HTTPStatus.HTTP_VERSION_NOT_SUPPORTED)
    headers: dict[str, str] = {}
    for raw_name, raw_value in event.headers:
        name, value = raw_name.decode("ascii"), raw_value.decode("latin-1")
        headers[name] = f"{headers[name]}, {value}" if name in headers else value
    if "," in headers.get("content-length", ""):
        raise _Reply(HTTPStatus.BAD_REQUEST)  # "5, 5": h11 accepts equal repeats; none needed
    return _Request(
        event.method.decode("ascii"),
        event.target.decode("latin-1"),
        f"HTTP/{event.http_version.decode('ascii')}",
        headers,
    )


def _host_allowed(request: _Request, allowed: frozenset[str]) -> bool:
    """`Host` (with or without its port) is one of the allowed names."""
    host = request.headers.get("host", "").strip().lower()
    if host in allowed:
        return True
    name, sep, port = host.rpartition(":")
    return bool(sep) and port.isdigit() and port.isascii() and name.strip("[]") in allowed


def _with_nosniff(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The configured response headers, and nosniff unless the web config set it already."""
    extra = list(headers)
    if not any(name.lower() == NOSNIFF[0].lower() for name, _ in extra):
        extra.append(NOSNIFF)
    return extra


def _response(
    status: HTTPStatus,
    headers: list[tuple[str, str]],
    body: bytes,
    extra: list[tuple[str, str]],
    head: bool,
    keep_alive: bool,
) -> bytes:
    """Serialize; HEAD gets the GET headers and no body, whatever the app returned.

    Each header once: one the server adds to every answer (the web config's, nosniff) replaces
    the app's of the same name, and the server writes Content-Length and Connection itself.
    """
    lines = [f"HTTP/1.1 {status.value} {status.phrase}"]
    own = {k.lower() for k, _ in extra} | {"content-length", "connection"}
    lines.extend(f"{k}: {v}" for k, v in headers if k.lower() not in own)
    lines.extend(f"{k}: {v}" for k, v in extra)
    lines.append(f"Content-Length: {len(body)}")
    if not keep_alive:
        lines.append("Connection: close")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return data if head else data + body


def _error_response(status: HTTPStatus, extra: list[tuple[str, str]]) -> bytes:
    body = f"{status.value} {status.phrase}\n".encode()
    return _response(
        status, [("Content-Type", "text/plain; charset=utf-8")], body, extra, False, False
    )
