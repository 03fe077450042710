"""exporter/exposition/http/server.py with its limits made small: real sockets on loopback, real
TLS."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import psutil
import pytest
import requests
from helpers.hostile import make_tls

from exporter.exposition.http.server import Limits, Server
from exporter.exposition.http.webconfig import BasicAuth

SMALL = Limits(handshake_timeout=0.5, header_timeout=0.5, idle_timeout=0.5, write_timeout=2.0)


def hello(environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
    if environ["PATH_INFO"] == "/boom":
        raise RuntimeError("a bug in the app")
    body = f"{environ['REQUEST_METHOD']} {environ['PATH_INFO']}\n".encode()
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [body]


@pytest.fixture
def serve() -> Iterator[Callable[..., Server]]:
    servers: list[Server] = []

    def start(limits: Limits = SMALL, **kwargs: Any) -> Server:
        sock = socket.create_server(("127.0.0.1", 0))
        server = Server(hello, sock, limits=limits, **kwargs)
        server.start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.stop()


def url(server: Server, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{server._sock.getsockname()[1]}"


def connect(server: Server) -> socket.socket:
    return socket.create_connection(server._sock.getsockname()[:2], timeout=5)


def open_connections(server: Server) -> int:
    """The connections the server holds open, as the kernel sees them: its accepted sockets
    (the listening port's, established)."""
    port = server._sock.getsockname()[1]
    return sum(
        1
        for c in psutil.net_connections(kind="tcp4")
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_ESTABLISHED
    )


def closed_within(sock: socket.socket, seconds: float) -> float | None:
    """Seconds until the peer closed the connection, or None if it stayed open."""
    started = time.monotonic()
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return None
    except OSError:
        pass
    return time.monotonic() - started


def test_a_silent_connection_is_closed_at_the_header_timeout(serve: Any) -> None:
    server = serve()
    with connect(server) as sock:
        elapsed = closed_within(sock, 3.0)
    assert elapsed is not None and 0.3 < elapsed < 1.5


def test_a_trickling_head_is_closed_at_the_header_deadline(serve: Any) -> None:
    """Slowloris: a byte every 100 ms keeps every per-read timeout happy, not the deadline."""
    server = serve()
    with connect(server) as sock:
        started = time.monotonic()
        head = b"GET / HTTP/1.1\r\nX-Slow: " + b"a" * 100
        try:
            for byte in head:
                sock.send(bytes([byte]))
                time.sleep(0.1)
        except OSError:
            pass
        assert time.monotonic() - started < 2.0, "still reading the head after 2 s"


def test_an_idle_kept_alive_connection_is_closed_at_the_idle_timeout(serve: Any) -> None:
    server = serve()
    with connect(server) as sock:
        sock.sendall(b"GET /a HTTP/1.1\r\nHost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200 OK")
        elapsed = closed_within(sock, 3.0)
    assert elapsed is not None and elapsed < 1.5


def test_keep_alive_serves_several_requests_and_head_has_no_body(serve: Any) -> None:
    server = serve()
    with requests.Session() as session:
        for path in ("/a", "/b"):
            assert session.get(url(server) + path, timeout=5).text == f"GET {path}\n"
        head = session.head(url(server) + "/a", timeout=5)
    assert head.content == b"" and head.headers["Content-Length"] == str(len("HEAD /a\n"))
    assert "Server" not in head.headers


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET / HTTP/1.1\r\nHost: a\r\nX: " + b"a" * (70 << 10) + b"\r\n\r\n", 431),
        (b"POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 100000\r\n\r\n", 413),
        (b"GET / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n", 411),
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"GET / HTTP/2.0\r\n\r\n", 505),
        (b"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: a\r\nContent-Length: -1\r\n\r\n", 400),
    ],
    ids=["head-too-large", "body-too-large", "chunked", "garbage", "http2", "bad-header", "length"],
)
def test_malformed_requests_get_a_status_and_a_close(
    serve: Any, request_bytes: bytes, status: int
) -> None:
    server = serve()
    with connect(server) as sock:
        sock.sendall(request_bytes)
        answer = sock.recv(65536)
    assert answer.startswith(f"HTTP/1.1 {status} ".encode()), answer[:80]
    assert b"Connection: close" in answer


def test_an_app_bug_is_a_500_and_the_server_goes_on(serve: Any) -> None:
    server = serve()
    assert requests.get(url(server) + "/boom", timeout=5).status_code == 500
    assert requests.get(url(server) + "/ok", timeout=5).status_code == 200


def test_at_the_bound_the_longest_idle_connection_makes_room(serve: Any) -> None:
    server = serve(Limits(header_timeout=30, max_connections=16))
    assert server.max_connections == 16
    idle = [connect(server) for _ in range(40)]
    try:
        assert requests.get(url(server) + "/a", timeout=5).status_code == 200
        assert server.evicted >= 40 + 1 - 16
        assert open_connections(server) <= 16
        assert closed_within(idle[0], 1.0) is not None  # the oldest went first
    finally:
        for sock in idle:
            sock.close()


def test_idle_clients_hold_no_threads(serve: Any) -> None:
    server = serve(Limits(header_timeout=30))
    before = threading.active_count()
    idle = [connect(server) for _ in range(300)]
    try:
        time.sleep(0.3)
        assert requests.get(url(server) + "/a", timeout=5).status_code == 200
        assert threading.active_count() <= before + server.limits.workers
    finally:
        for sock in idle:
            sock.close()


def test_a_silent_tls_client_delays_no_one_and_is_dropped(serve: Any, tmp_path: Path) -> None:
    tls = make_tls(tmp_path)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(tls["tls.crt"], tls["tls.key"])
    server = serve(tls=context)
    silent = connect(server)
    try:
        for _ in range(3):
            started = time.monotonic()
            response = requests.get(
                url(server, "https") + "/a", verify=str(tls["ca.crt"]), timeout=5
            )
            assert response.status_code == 200 and time.monotonic() - started < 1.0
        assert closed_within(silent, 3.0) is not None
    finally:
        silent.close()


def test_basic_auth_runs_one_bcrypt_at_a_time_and_caches_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed = bcrypt.hashpw(b"good", bcrypt.gensalt(rounds=4))
    auth = BasicAuth({"prom": hashed})
    running, peak = 0, 0
    lock = threading.Lock()
    real = bcrypt.checkpw

    def slow_checkpw(password: bytes, stored: bytes) -> bool:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.02)
        try:
            return real(password, stored)
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(bcrypt, "checkpw", slow_checkpw)

    def header(user: str, password: str) -> str:
        import base64

        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    threads = [
        threading.Thread(target=auth.check, args=(header("prom", f"wrong-{i}"),)) for i in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert peak == 1 and auth.bcrypt_checks == 8
    assert auth.check(header("prom", "good")) and auth.check(header("prom", "good"))
    assert auth.bcrypt_checks == 9  # the second good check came from the cache
    assert not auth.check(header("prom", "wrong-0")) and auth.bcrypt_checks == 9
    assert not auth.check(header("someone", "x"))  # unknown user: a real (dummy) comparison
    assert auth.bcrypt_checks == 10
    for user in ("prom", "someone"):  # longer than bcrypt reads: refused alike, no bcrypt
        assert not auth.check(header(user, "x" * 73))
    assert auth.bcrypt_checks == 10
    for bad in (None, "", "Bearer x", "Basic !!!", "Basic " + "eA=="):
        assert not auth.check(bad)
