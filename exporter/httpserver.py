"""An HTTP/1.1 server for the exporter's WSGI app that no client can stall.

Chosen by measurement over wsgiref (what the exporter had), cheroot, waitress, uvicorn and
hypercorn: `bench/http_load.py` prints the comparison, the README's cost section quotes it. The
maintained servers each miss one thing an exporter on every GPU host needs: cheroot runs the TLS
handshake in its accept loop (one silent client delays every connection by its timeout) and
reads request heads on pool threads (slowloris holds them); waitress has no TLS; uvicorn starts
no timer on a connection until it has answered one request (an idle or trickling client is held
forever) and answers 503 at its connection limit; hypercorn has every timeout but no bound on
connections, and six dependencies. This is asyncio's TLS and stream machinery (part of CPython,
maintained with it) plus the limits below, in one module.

One event loop thread owns every socket, so an idle, slow or malicious client costs a file
descriptor and a few KB, never a thread. The app runs on a small pool of worker threads, and
bcrypt checks on one thread of their own, so a flood of wrong passwords cannot take the workers.

Limits (`Limits`): the TLS handshake must finish within 5 s, the request head (from the first
byte of a request to its blank line, however slowly it trickles) within 10 s, a kept-alive
connection may idle 120 s; heads over 64 KiB are answered 431, bodies over 64 KiB 413. The
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

from exporter.webconfig import BasicAuth

log = logging.getLogger(__name__)

WsgiApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]

_TOKEN_RE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_MAX_HEADERS = 100
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
    ) -> None:
        self.app = app
        self.tls = tls
        self.auth = auth
        self.headers = list(headers)
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
    def connections(self) -> int:
        return len(self._conns)

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
        first = True
        while True:
            if first:
                conn.enter(_State.HEAD)
                request = await self._read_request(reader, writer, None)
            else:
                conn.enter(_State.IDLE)
                async with asyncio.timeout(self.limits.idle_timeout):
                    start = await reader.read(1)
                if not start:
                    return
                conn.enter(_State.HEAD)
                request = await self._read_request(reader, writer, start)
            if request is None:
                return
            conn.enter(_State.BUSY)
            keep = await self._answer(request, writer, peer)
            if not keep:
                return
            first = False

    async def _read_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, start: bytes | None
    ) -> _Request | None:
        """The next request, or None after answering an error (the connection then closes)."""
        try:
            async with asyncio.timeout(self.limits.header_timeout):
                try:
                    head = (start or b"") + await reader.readuntil(b"\r\n\r\n")
                except asyncio.LimitOverrunError:
                    raise _Reply(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE) from None
                except asyncio.IncompleteReadError:
                    return None  # closed mid-head
                request = _parse_head(head)
                length = _content_length(request.headers)
                if length > self.limits.max_body_bytes:
                    raise _Reply(HTTPStatus.REQUEST_ENTITY_TOO_LARGE)
                if length:
                    request.body = await reader.readexactly(length)
                return request
        except _Reply as reply:
            await self._send(writer, _error_response(reply.status, self.headers))
            return None

    async def _answer(
        self, request: _Request, writer: asyncio.StreamWriter, peer: tuple[Any, ...]
    ) -> bool:
        """Authorize, run the app on a worker, write the response; whether to keep alive."""
        loop = asyncio.get_running_loop()
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


def _parse_head(head: bytes) -> _Request:
    """Request line and headers; _Reply(400/431/505) when they are not HTTP/1.x."""
    lines = head.split(b"\r\n")
    while lines and not lines[0]:
        lines.pop(0)  # RFC 9112: ignore empty lines before the request line
    if not lines:
        raise _Reply(HTTPStatus.BAD_REQUEST)
    parts = lines[0].split(b" ")
    if len(parts) != 3 or not _TOKEN_RE.match(parts[0]) or not parts[1]:
        raise _Reply(HTTPStatus.BAD_REQUEST)
    method, target, version = (p.decode("latin-1") for p in parts)
    if version not in ("HTTP/1.1", "HTTP/1.0"):
        raise _Reply(
            HTTPStatus.HTTP_VERSION_NOT_SUPPORTED
            if version.startswith("HTTP/")
            else HTTPStatus.BAD_REQUEST
        )
    headers: dict[str, str] = {}
    fields = [line for line in lines[1:] if line]
    if len(fields) > _MAX_HEADERS:
        raise _Reply(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
    for line in fields:
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN_RE.match(name):  # also refuses obsolete line folding
            raise _Reply(HTTPStatus.BAD_REQUEST)
        key = name.decode("ascii").lower()
        text = value.strip(b" \t").decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return _Request(method, target, version, headers)


def _content_length(headers: dict[str, str]) -> int:
    if "transfer-encoding" in headers:
        raise _Reply(HTTPStatus.LENGTH_REQUIRED)  # no chunked request bodies: none needed
    value = headers.get("content-length")
    if value is None:
        return 0
    if not value.isdigit() or len(value) > 18:
        raise _Reply(HTTPStatus.BAD_REQUEST)  # also "5, 5": a repeated header
    return int(value)


def _response(
    status: HTTPStatus,
    headers: list[tuple[str, str]],
    body: bytes,
    extra: list[tuple[str, str]],
    head: bool,
    keep_alive: bool,
) -> bytes:
    """Serialize; HEAD gets the GET headers and no body, whatever the app returned."""
    lines = [f"HTTP/1.1 {status.value} {status.phrase}"]
    lines.extend(
        f"{k}: {v}" for k, v in headers if k.lower() not in ("content-length", "connection")
    )
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
