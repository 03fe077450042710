"""Probe a model server's HTTP endpoint the way operators do, and classify what came back.

"Connection refused" means the server is not up yet, a 503 means it is up but still loading,
and only a real answer of the configured kind means ready; the difference is the whole point
of the exporter, so every failure is classified rather than collapsed into "down".
"""

from __future__ import annotations

import errno
import http.client
import json
import socket
import ssl
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3.exceptions

from exporter.config import EndpointConfig
from exporter.vocabulary import ProbeKind, ProbeResult, ServerKind

MAX_BODY_BYTES = 1024 * 1024  # a 1-token completion or a model list is far smaller
_READ_CHUNK = 64 * 1024
# `owned_by` values in /v1/models answers that name the server.
_KNOWN_OWNERS = frozenset({ServerKind.SGLANG, ServerKind.VLLM, ServerKind.LLAMACPP})


@dataclass(frozen=True)
class ProbeSample:
    result: ProbeResult
    duration_seconds: float
    status_code: int | None
    detail: str
    server: ServerKind  # the kind the responses have shown so far; UNKNOWN until one does
    totals: Mapping[ProbeResult, int]  # probes by result since the prober was made


class _Outcome(Exception):
    """Raised inside a probe to finish it with a classified result."""

    def __init__(
        self,
        result: ProbeResult,
        detail: str,
        status_code: int | None = None,
        server: ServerKind | None = None,
    ) -> None:
        super().__init__(detail)
        self.result = result
        self.detail = detail
        self.status_code = status_code
        self.server = server


class EndpointProber:
    """One probe per `sample()`; never raises for network trouble, classifies it instead.

    Keeps what outlives one probe: the count of probes per result (a counter for Prometheus) and
    the server kind, which only some answers reveal (a 503 from llama.cpp, /v1/models' owner).
    Not thread-safe: one sampler thread owns it.
    """

    def __init__(
        self,
        config: EndpointConfig,
        session: requests.Session | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config
        if session is None:
            session = requests.Session()
            # No proxies or ~/.netrc from the environment: the probe must reach the server
            # directly and must not pick up credentials nobody configured.
            session.trust_env = False
        self._session = session
        self._clock = clock
        self._totals: Counter[ProbeResult] = Counter()
        self._server = ServerKind.UNKNOWN

    def __repr__(self) -> str:
        return f"EndpointProber(url={self._config.probe_url!r}, probe={self._config.probe!r})"

    def sample(self) -> ProbeSample:
        start = self._clock()
        deadline = start + self._config.timeout
        try:
            if self._config.probe == ProbeKind.TCP:
                outcome = self._probe_tcp()
            else:
                outcome = self._probe_http(deadline)
        except _Outcome as done:
            outcome = done
        except (
            requests.RequestException,
            urllib3.exceptions.HTTPError,
            http.client.HTTPException,
            OSError,
            ValueError,  # e.g. a header value that HTTP cannot carry
        ) as exc:
            outcome = _classify_exception(exc, self._config.timeout)
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

    def _probe_tcp(self) -> _Outcome:
        parts = urlsplit(self._config.url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
        host = parts.hostname or ""
        with socket.create_connection((host, port), timeout=self._config.timeout):
            pass
        return _Outcome(ProbeResult.READY, f"connected to port {port}")

    def _probe_http(self, deadline: float) -> _Outcome:
        config = self._config
        timeout = config.timeout
        kwargs: dict[str, Any] = {
            "headers": dict(config.headers),
            "timeout": (timeout, timeout),
            "allow_redirects": False,
            "stream": True,
        }
        if config.probe == ProbeKind.COMPLETION:
            body: dict[str, Any] = {"prompt": "ping", "max_tokens": 1, "temperature": 0}
            if config.model is not None:
                body = {"model": config.model, **body}
            response = self._session.post(config.probe_url, json=body, **kwargs)
        else:
            response = self._session.get(config.probe_url, **kwargs)
        with response:
            raw = self._read_body(response, deadline)
        status = response.status_code
        document = _parse_json(raw)
        server = detect_server(response.headers, document, raw)
        if not 200 <= status < 300:
            raise _Outcome(ProbeResult.HTTP_ERROR, f"HTTP {status}", status, server)
        problem = _check_body(config.probe, raw, document)
        if problem is not None:
            raise _Outcome(ProbeResult.BAD_RESPONSE, problem, status, server)
        return _Outcome(ProbeResult.READY, f"HTTP {status}", status, server)

    def _read_body(self, response: requests.Response, deadline: float) -> bytes:
        """Read at most MAX_BODY_BYTES before `deadline`, so a slow drip cannot hold the probe."""
        chunks: list[bytes] = []
        size = 0
        while size <= MAX_BODY_BYTES:
            remaining = deadline - self._clock()
            if remaining <= 0:
                raise self._body_timeout(response)
            _shorten_socket_timeout(response, remaining)
            try:
                chunk = response.raw.read1(_READ_CHUNK, decode_content=True)
            except (urllib3.exceptions.TimeoutError, TimeoutError):
                raise self._body_timeout(response) from None
            except urllib3.exceptions.DecodeError:
                raise _Outcome(
                    ProbeResult.BAD_RESPONSE,
                    "response body does not match its Content-Encoding",
                    response.status_code,
                ) from None
            except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError):
                raise _Outcome(
                    ProbeResult.ERROR,
                    "connection broken while reading the response body",
                    response.status_code,
                ) from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def _body_timeout(self, response: requests.Response) -> _Outcome:
        return _Outcome(
            ProbeResult.TIMEOUT,
            f"response body not complete within {self._config.timeout:g}s",
            response.status_code,
        )


def _shorten_socket_timeout(response: requests.Response, remaining: float) -> None:
    """Bound the next socket read by what is left of the probe's budget."""
    connection = getattr(response.raw, "connection", None)
    sock = getattr(connection, "sock", None)
    if sock is not None:
        sock.settimeout(remaining)


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


def detect_server(
    headers: requests.structures.CaseInsensitiveDict[str], document: object, raw: bytes
) -> ServerKind | None:
    """The server kind, from evidence each server is known to put in its responses."""
    if "llama.cpp" in headers.get("Server", ""):
        return ServerKind.LLAMACPP
    if isinstance(document, dict):
        data = document.get("data")
        if isinstance(data, list):
            for item in data:
                owner = item.get("owned_by") if isinstance(item, dict) else None
                if isinstance(owner, str) and owner in _KNOWN_OWNERS:
                    return ServerKind(owner)
        error = document.get("error")
        if (
            isinstance(error, dict)
            and error.get("type") == "unavailable_error"
            and error.get("message") == "Loading model"
        ):
            return ServerKind.LLAMACPP
        if isinstance(error, str) and isinstance(document.get("error_type"), str):
            return ServerKind.TGI
    if "x-compute-type" in headers and "x-compute-time" in headers:
        return ServerKind.TGI
    if b"Loading model" in raw and b"unavailable_error" in raw:
        return ServerKind.LLAMACPP
    return None


def _causes(exc: BaseException) -> Iterator[BaseException]:
    """The exception and everything it wraps (requests and urllib3 nest them several deep)."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        nested = [current.__cause__, current.__context__, getattr(current, "reason", None)]
        nested.extend(arg for arg in current.args if isinstance(arg, BaseException))
        stack.extend(e for e in nested if isinstance(e, BaseException))


def _classify_exception(exc: Exception, timeout: float) -> _Outcome:
    """Map a transport failure to a result; details name the cause, never headers or URLs."""
    causes = list(_causes(exc))
    for cause in causes:
        if isinstance(cause, ConnectionRefusedError):
            return _Outcome(ProbeResult.REFUSED, "connection refused")
    if any(isinstance(c, requests.exceptions.ConnectTimeout) for c in causes):
        return _Outcome(ProbeResult.TIMEOUT, f"connect timed out after {timeout:g}s")
    if any(
        isinstance(c, requests.exceptions.Timeout | urllib3.exceptions.TimeoutError | TimeoutError)
        for c in causes
    ):
        return _Outcome(ProbeResult.TIMEOUT, f"no response within {timeout:g}s")
    for cause in causes:
        if isinstance(cause, http.client.RemoteDisconnected):
            return _Outcome(ProbeResult.REFUSED, "connection closed without a response")
        if isinstance(cause, ConnectionResetError):
            return _Outcome(ProbeResult.REFUSED, "connection reset")
    for cause in causes:
        if isinstance(cause, socket.gaierror | urllib3.exceptions.NameResolutionError):
            return _Outcome(ProbeResult.ERROR, "host name lookup failed")
        if isinstance(cause, ssl.SSLError | requests.exceptions.SSLError):
            return _Outcome(ProbeResult.ERROR, "TLS error")
        if isinstance(cause, http.client.HTTPException | urllib3.exceptions.ProtocolError):
            return _Outcome(ProbeResult.ERROR, "malformed or broken HTTP response")
    for cause in causes:
        if isinstance(cause, OSError) and cause.errno is not None:
            name = errno.errorcode.get(cause.errno, str(cause.errno))
            return _Outcome(ProbeResult.ERROR, f"{name}: {cause.strerror}")
    return _Outcome(ProbeResult.ERROR, type(exc).__name__)
