"""Probe a model server's HTTP endpoint the way operators do, and classify what came back.

"Connection refused" means the server is not up yet, a 503 means it is up but still loading,
and only a real answer of the configured kind means ready; the difference is the whole point
of the exporter, so every failure is classified rather than collapsed into "down".

A probe has one deadline, `endpoint.timeout`, for the whole request: connect, TLS handshake,
sending, the status line, headers and body. Socket timeouts bound one operation each, so a
server that trickles one byte a second would never trip them; here every socket operation is
given what is left of the budget instead (`_DeadlineSocket`), and `close()` shuts the socket in
flight down, so a probe never outlives its timeout nor a reload.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import http.client
import json
import socket
import ssl
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from exporter import __version__
from exporter.config.schema import EndpointConfig
from exporter.servers import SERVERS
from exporter.sources.sample import Sample
from exporter.vocabulary import ProbeKind, ProbeResult, ServerKind

MAX_BODY_BYTES = 1024 * 1024  # a 1-token completion or a model list is far smaller
_READ_CHUNK = 64 * 1024
_DEFAULT_PORTS = {"http": 80, "https": 443, "tcp": 80}
_DECODERS: Mapping[str, int] = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS}


@dataclass(frozen=True)
class ProbeSample(Sample):
    result: ProbeResult
    duration_seconds: float
    status_code: int | None
    detail: str
    server: str  # the server kind the responses have shown so far; UNKNOWN until one does
    totals: Mapping[ProbeResult, int]  # probes by result since the prober was made


class _Outcome(Exception):
    """Raised inside a probe to finish it with a classified result."""

    def __init__(
        self,
        result: ProbeResult,
        detail: str,
        status_code: int | None = None,
        server: str | None = None,
    ) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail
        self.status_code = status_code
        self.server = server


class _Deadline:
    """What is left of one probe's budget; every socket operation gets at most that."""

    def __init__(self, at: float, clock: Callable[[], float]) -> None:
        self.at = at
        self._clock = clock

    def remaining(self) -> float:
        left = self.at - self._clock()
        if left <= 0:
            raise TimeoutError("probe deadline passed")
        return left


class _DeadlineSocket(socket.socket):
    """A socket whose every send and receive is bounded by the probe's remaining budget."""

    deadline: _Deadline | None = None

    def _arm(self) -> None:
        if self.deadline is not None:
            self.settimeout(self.deadline.remaining())

    def recv_into(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().recv_into(*args, **kwargs)

    def recv(self, *args: Any, **kwargs: Any) -> bytes:
        self._arm()
        return super().recv(*args, **kwargs)

    def sendall(self, *args: Any, **kwargs: Any) -> None:
        self._arm()
        super().sendall(*args, **kwargs)

    def send(self, *args: Any, **kwargs: Any) -> int:
        self._arm()
        return super().send(*args, **kwargs)


class _DeadlineSSLSocket(_DeadlineSocket, ssl.SSLSocket):
    """The same for TLS: `SSLContext.wrap_socket` makes one of these (sslsocket_class). The
    method order puts the deadline before SSLSocket's own reads and writes."""


def _tls_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.sslsocket_class = _DeadlineSSLSocket
    return context


class EndpointProber:
    """One probe per `sample()`; never raises for network trouble, classifies it instead.

    Keeps what outlives one probe: the count of probes per result (a counter for Prometheus) and
    the server kind, which only some answers reveal (a 503 from llama.cpp, /v1/models' owner).
    One sampler thread owns it; `close()` may be called from any thread. Credentials in the URL
    (`http://user:pw@host`) are sent as basic auth unless a configured header says otherwise.
    No proxy settings or ~/.netrc from the environment: the probe reaches the server directly.
    """

    def __init__(self, config: EndpointConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._totals: Counter[ProbeResult] = Counter()
        self._server: str = ServerKind.UNKNOWN
        parts = urlsplit(config.probe_url)
        self._scheme = parts.scheme
        self._host = parts.hostname or ""
        self._port = parts.port or _DEFAULT_PORTS.get(parts.scheme, 80)
        self._target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self._headers = self._request_headers(config)
        self._tls = _tls_context() if parts.scheme == "https" else None
        self._lock = threading.Lock()
        self._inflight: socket.socket | None = None
        self._closed = False

    def __repr__(self) -> str:
        probe_url = self._config.display_url.rstrip("/") + self._config.path
        return f"EndpointProber(url={probe_url!r}, probe={self._config.probe!r})"

    @staticmethod
    def _request_headers(config: EndpointConfig) -> dict[str, str]:
        headers = {"User-Agent": f"model-load-exporter/{__version__}", "Accept": "*/*"}
        credentials = config.credentials
        if credentials is not None:
            token = base64.b64encode(":".join(credentials).encode()).decode()
            headers["Authorization"] = f"Basic {token}"
        headers.update(config.headers)
        return headers

    def close(self) -> None:
        """Abort the probe in flight, if any, and refuse further ones (a reload retires us)."""
        with self._lock:
            self._closed = True
            sock = self._inflight
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed by the probe itself
                sock.shutdown(socket.SHUT_RDWR)

    def sample(self) -> ProbeSample:
        start = self._clock()
        deadline = _Deadline(start + self._config.timeout, self._clock)
        phase = ["connect"]
        try:
            if self._config.probe == ProbeKind.TCP:
                self._connect(deadline).close()
                outcome = _Outcome(ProbeResult.READY, f"connected to port {self._port}")
            else:
                outcome = self._probe_http(deadline, phase)
        except _Outcome as done:
            outcome = done
        except (http.client.HTTPException, OSError, ValueError) as exc:
            outcome = _classify_exception(exc, self._config.timeout, phase[0])
        finally:
            with self._lock:
                self._inflight = None
                closed = self._closed
        if closed:  # whatever the aborted socket said, it was not the server's answer
            outcome = _Outcome(ProbeResult.ERROR, "prober closed")
        self._totals[outcome.result] += 1
        if outcome.server is not None:
            self._server = outcome.server
        return ProbeSample(
            result=outcome.result,
            duration_seconds=max(0.0, self._clock() - start),
            status_code=outcome.status_code,
            detail=outcome.detail,
            server=self._server,
            totals=dict(self._totals),
        )

    def _connect(self, deadline: _Deadline) -> socket.socket:
        """A connected socket (TLS done for https) bounded by the deadline, or OSError."""
        last: OSError = ConnectionRefusedError(errno.ECONNREFUSED, "connection refused")
        # Name resolution is bounded by the resolver's own timeouts (resolv.conf), not ours.
        for family, kind, proto, _, address in socket.getaddrinfo(
            self._host, self._port, type=socket.SOCK_STREAM
        ):
            sock = _DeadlineSocket(family, kind, proto)
            if not self._track(sock):
                sock.close()
                raise _Outcome(ProbeResult.ERROR, "prober closed")
            try:
                sock.settimeout(deadline.remaining())
                sock.connect(address)
            except OSError as exc:
                sock.close()
                last = exc
                continue
            sock.deadline = deadline
            if self._tls is None:
                return sock
            try:
                sock.settimeout(deadline.remaining())
                wrapped = self._tls.wrap_socket(sock, server_hostname=self._host)
            except BaseException:
                sock.close()
                raise
            assert isinstance(wrapped, _DeadlineSSLSocket)
            wrapped.deadline = deadline
            self._track(wrapped)
            return wrapped
        raise last

    def _track(self, sock: socket.socket) -> bool:
        with self._lock:
            if self._closed:
                return False
            self._inflight = sock
            return True

    def _probe_http(self, deadline: _Deadline, phase: list[str]) -> _Outcome:
        config = self._config
        sock = self._connect(deadline)
        phase[0] = "response"
        connection = http.client.HTTPConnection(self._host, self._port)
        connection.sock = sock
        try:
            headers = dict(self._headers)
            if config.probe == ProbeKind.COMPLETION:
                document: dict[str, Any] = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
                if config.model is not None:
                    document = {"model": config.model, **document}
                body: bytes | None = json.dumps(document).encode()
                headers["Content-Type"] = "application/json"
                method = "POST"
            else:
                body, method = None, "GET"
            try:
                connection.request(method, self._target, body=body, headers=headers)
            except (UnicodeEncodeError, ValueError):
                raise _Outcome(
                    ProbeResult.ERROR, "a configured header value cannot be sent in HTTP"
                ) from None
            response = connection.getresponse()
            status = response.status
            phase[0] = "body"
            raw = self._read_body(response, status)
        finally:
            connection.close()
        response_headers = {k.lower(): v for k, v in response.getheaders()}
        raw = _decode(raw, response_headers.get("content-encoding", ""), status)
        parsed = _parse_json(raw)
        server = detect_server(response_headers, parsed, raw)
        if not 200 <= status < 300:
            raise _Outcome(ProbeResult.HTTP_ERROR, f"HTTP {status}", status, server)
        problem = _check_body(config.probe, raw, parsed)
        if problem is not None:
            raise _Outcome(ProbeResult.BAD_RESPONSE, problem, status, server)
        return _Outcome(ProbeResult.READY, f"HTTP {status}", status, server)

    def _read_body(self, response: http.client.HTTPResponse, status: int) -> bytes:
        """At most MAX_BODY_BYTES + 1 bytes, within the deadline the socket enforces."""
        chunks: list[bytes] = []
        size = 0
        try:
            while size <= MAX_BODY_BYTES:
                chunk = response.read1(_READ_CHUNK)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        except TimeoutError:
            raise _Outcome(
                ProbeResult.TIMEOUT,
                f"response body not complete within {self._config.timeout:g}s",
                status,
            ) from None
        except (http.client.HTTPException, OSError):
            raise _Outcome(
                ProbeResult.ERROR, "connection broken while reading the response body", status
            ) from None
        return b"".join(chunks)


def _decode(raw: bytes, encoding: str, status: int) -> bytes:
    """Undo gzip/deflate, never inflating past MAX_BODY_BYTES + 1 (a small bomb stays small)."""
    encoding = encoding.strip().lower()
    if encoding in ("", "identity"):
        return raw
    wbits = _DECODERS.get(encoding, zlib.MAX_WBITS if encoding == "deflate" else None)
    if wbits is None:
        raise _Outcome(
            ProbeResult.BAD_RESPONSE, f"unsupported Content-Encoding {encoding[:20]!r}", status
        )
    try:
        return zlib.decompressobj(wbits).decompress(raw, MAX_BODY_BYTES + 1)
    except zlib.error:
        raise _Outcome(
            ProbeResult.BAD_RESPONSE, "response body does not match its Content-Encoding", status
        ) from None


def _parse_json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _check_body(probe: ProbeKind, raw: bytes, document: object) -> str | None:
    """Why a 2xx body does not satisfy the probe kind, or None when it does."""
    if probe == ProbeKind.HEALTH:
        return None
    if len(raw) > MAX_BODY_BYTES:
        return f"response body larger than {MAX_BODY_BYTES} bytes"
    if not isinstance(document, dict):
        return "response is not a JSON object"
    if probe == ProbeKind.COMPLETION:
        choices = document.get("choices")
        if not isinstance(choices, list):
            return "no 'choices' in JSON"
        if not choices:
            return "empty 'choices' in JSON"
        return None
    if not isinstance(document.get("data"), list):
        return "no 'data' list in JSON"
    return None


def detect_server(headers: Mapping[str, str], document: object, raw: bytes) -> str | None:
    """The server kind, from what each server is known to put in its answers (its `Answers`
    in exporter/servers): the strongest kind of evidence first, across all servers.

    `headers` has lower-case names.
    """
    answers = [(kind, server.answers) for kind, server in SERVERS.items()]
    header = headers.get("server", "")
    for kind, said in answers:
        if said.server_header is not None and said.server_header in header:
            return kind
    if isinstance(document, dict):
        data = document.get("data")
        if isinstance(data, list):
            owners = {said.owned_by: kind for kind, said in answers if said.owned_by}
            for item in data:
                owner = item.get("owned_by") if isinstance(item, dict) else None
                if isinstance(owner, str) and owner in owners:
                    return owners[owner]
        for kind, said in answers:
            if said.error is not None and said.error(document):
                return kind
    for kind, said in answers:
        if said.headers and all(name in headers for name in said.headers):
            return kind
    for kind, said in answers:
        if said.body and all(word in raw for word in said.body):
            return kind
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and what it wraps (an SSL error may wrap the OSError that caused it)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        nested = [current.__cause__, current.__context__]
        stack.extend(e for e in nested if isinstance(e, BaseException))


def _classify_exception(exc: Exception, timeout: float, phase: str) -> _Outcome:
    """Map a transport failure to a result; details name the cause, never headers or URLs."""
    causes = list(_causes(exc))
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError):
            return _Outcome(ProbeResult.REFUSED, "connection refused")
    if any(isinstance(c, TimeoutError) for c in causes):
        if phase == "connect":
            return _Outcome(ProbeResult.TIMEOUT, f"connect timed out after {timeout:g}s")
        return _Outcome(ProbeResult.TIMEOUT, f"no response within {timeout:g}s")
    for cause in causes:
        if isinstance(cause, http.client.RemoteDisconnected):
            return _Outcome(ProbeResult.REFUSED, "connection closed without a response")
        if isinstance(cause, ConnectionResetError):
            return _Outcome(ProbeResult.REFUSED, "connection reset")
    for cause in causes:
        if isinstance(cause, socket.gaierror):
            return _Outcome(ProbeResult.ERROR, "host name lookup failed")
        if isinstance(cause, ssl.SSLError | ssl.CertificateError):
            return _Outcome(ProbeResult.ERROR, "TLS error")
        if isinstance(cause, http.client.HTTPException):
            return _Outcome(ProbeResult.ERROR, "malformed or broken HTTP response")
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            name = errno.errorcode.get(cause.errno, str(cause.errno))
            return _Outcome(ProbeResult.ERROR, f"{name}: {cause.strerror}")
    return _Outcome(ProbeResult.ERROR, type(exc).__name__)
