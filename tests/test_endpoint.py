"""EndpointProber against real HTTP and TCP servers on 127.0.0.1, one per test."""

from __future__ import annotations

import gzip
import json
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from helpers.hostile import make_tls

from exporter.config.schema import EndpointConfig
from exporter.sources.endpoint import EndpointProber
from exporter.vocabulary import ProbeResult, ServerKind

SECRET = "Bearer sk-very-secret-0123456789"
LLAMACPP_LOADING = b'{"error":{"code":503,"message":"Loading model","type":"unavailable_error"}}'
COMPLETION = {
    "id": "cmpl-1",
    "object": "text_completion",
    "choices": [{"index": 0, "text": "!", "finish_reason": "length"}],
}


@dataclass(frozen=True)
class Reply:
    status: int = 200
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class FakeServer:
    """A real HTTP server whose replies are set per path by the test."""

    def __init__(self) -> None:
        self.replies: dict[str, Reply] = {}
        self.requests: list[Recorded] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                self._answer(b"")

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                self._answer(self.rfile.read(length))

            def _answer(self, body: bytes) -> None:
                outer.requests.append(
                    Recorded(self.command, self.path, dict(self.headers.items()), body)
                )
                reply = outer.replies.get(self.path, Reply(404, b'{"detail":"Not Found"}'))
                self.send_response(reply.status)
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.send_header("Content-Length", str(len(reply.body)))
                self.end_headers()
                self.wfile.write(reply.body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


class RawServer:
    """A TCP listener whose per-connection behaviour is a function of the accepted socket."""

    def __init__(
        self,
        behaviour: Callable[[socket.socket, threading.Event], None],
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.tls = tls
        self.stop = threading.Event()
        self.behaviour = behaviour
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.05)
        while not self.stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            if self.tls is not None:
                conn.settimeout(5)
                conn = self.tls.wrap_socket(conn, server_side=True)
            with conn:
                self.behaviour(conn, self.stop)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def hang(conn: socket.socket, stop: threading.Event) -> None:
    stop.wait(10)


def drip(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(65536)
    conn.sendall(
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n"
    )
    while not stop.wait(0.05):
        try:
            conn.sendall(b" ")
        except OSError:
            return


def trickle_headers(conn: socket.socket, stop: threading.Event) -> None:
    """A status line, then one header byte every 100 ms: each read is quick, the whole never."""
    conn.recv(65536)
    conn.sendall(b"HTTP/1.1 200 OK\r\n")
    while not stop.wait(0.1):
        try:
            conn.sendall(b"X")
        except OSError:
            return


def reset(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(65536)
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))


def read_request(conn: socket.socket) -> None:
    """Read a whole request, body too: closing with unread bytes would send a reset instead."""
    data = b""
    while b"\r\n\r\n" not in data and (chunk := conn.recv(65536)):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        (int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
         if line.lower().startswith(b"content-length:")), 0,
    )  # fmt: skip
    while len(body) < length and (chunk := conn.recv(65536)):
        body += chunk


def close_silently(conn: socket.socket, stop: threading.Event) -> None:
    read_request(conn)


def speak_garbage(conn: socket.socket, stop: threading.Event) -> None:
    conn.recv(65536)
    conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")


@pytest.fixture
def server() -> Iterator[FakeServer]:
    srv = FakeServer()
    yield srv
    srv.close()


@pytest.fixture
def raw_server() -> Iterator[Callable[..., RawServer]]:
    started: list[RawServer] = []

    def start(
        behaviour: Callable[[socket.socket, threading.Event], None],
        tls: ssl.SSLContext | None = None,
    ) -> RawServer:
        srv = RawServer(behaviour, tls)
        started.append(srv)
        return srv

    yield start
    for srv in started:
        srv.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prober(url: str, probe: str = "completion", **kwargs: object) -> EndpointProber:
    paths = {"completion": "/v1/completions", "health": "/health", "models": "/v1/models"}
    kwargs.setdefault("path", paths.get(probe, ""))
    return EndpointProber(EndpointConfig(url=url, probe=probe, **kwargs))  # type: ignore[arg-type]


def json_reply(document: object, status: int = 200, **headers: str) -> Reply:
    return Reply(
        status, json.dumps(document).encode(), {"Content-Type": "application/json", **headers}
    )


def test_refused_when_nobody_listens() -> None:
    sample = prober(f"http://127.0.0.1:{free_port()}").sample()
    assert sample.result is ProbeResult.REFUSED
    assert sample.status_code is None
    assert sample.detail == "connection refused"


def test_llamacpp_loading_is_http_error_and_detected(server: FakeServer) -> None:
    server.replies["/v1/completions"] = Reply(503, LLAMACPP_LOADING, {"Server": "llama.cpp"})
    sample = prober(server.url).sample()
    assert sample.result is ProbeResult.HTTP_ERROR
    assert sample.status_code == 503
    assert sample.detail == "HTTP 503"
    assert sample.server == "llamacpp"


def test_llamacpp_detected_from_body_alone(server: FakeServer) -> None:
    server.replies["/health"] = Reply(503, LLAMACPP_LOADING)
    sample = prober(server.url, "health").sample()
    assert (sample.result, sample.server) == (ProbeResult.HTTP_ERROR, "llamacpp")


def test_prober_counts_results_and_remembers_the_server_kind(server: FakeServer) -> None:
    """Only some answers name the server (llama.cpp's 503); a plain 200 after it must not forget."""
    server.replies["/health"] = Reply(503, LLAMACPP_LOADING)
    once = prober(server.url, "health")
    assert once.sample().server == ServerKind.LLAMACPP
    server.replies["/health"] = Reply(200, b"ok")
    sample = once.sample()
    assert (sample.result, sample.server) == (ProbeResult.READY, ServerKind.LLAMACPP)
    sample = once.sample()
    assert sample.totals == {ProbeResult.HTTP_ERROR: 1, ProbeResult.READY: 2}
    assert prober(server.url, "health").sample().totals == {ProbeResult.READY: 1}


def test_tgi_unhealthy_is_detected(server: FakeServer) -> None:
    server.replies["/health"] = json_reply({"error": "unhealthy", "error_type": "healthcheck"}, 503)
    sample = prober(server.url, "health").sample()
    assert (sample.result, sample.status_code, sample.server) == (
        ProbeResult.HTTP_ERROR,
        503,
        "tgi",
    )


def test_hang_times_out_within_the_budget(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    srv = raw_server(hang)
    began = time.monotonic()
    sample = prober(srv.url, timeout=0.5).sample()
    elapsed = time.monotonic() - began
    assert sample.result is ProbeResult.TIMEOUT
    assert 0.45 <= sample.duration_seconds <= elapsed
    assert elapsed < 0.5 + 1.0


def test_slow_drip_body_times_out_within_the_budget(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    srv = raw_server(drip)
    began = time.monotonic()
    sample = prober(srv.url, timeout=0.5).sample()
    elapsed = time.monotonic() - began
    assert sample.result is ProbeResult.TIMEOUT
    assert sample.status_code == 200
    assert elapsed < 0.5 + 1.0


@pytest.mark.parametrize("tls", [False, True], ids=["http", "https"])
def test_trickling_headers_time_out_at_the_probe_deadline(
    raw_server: Callable[..., RawServer],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    tls: bool,
) -> None:
    """Over TLS, reads go through SSLSocket's own methods: the deadline must sit before them too."""
    context = None
    if tls:
        material = make_tls(tmp_path)
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(material["tls.crt"], material["tls.key"])
        monkeypatch.setenv("SSL_CERT_FILE", str(material["ca.crt"]))  # the prober trusts it
    srv = raw_server(trickle_headers, tls=context)
    began = time.monotonic()
    sample = prober(srv.url, timeout=0.5).sample()
    elapsed = time.monotonic() - began
    assert (sample.result, sample.detail) == (ProbeResult.TIMEOUT, "no response within 0.5s")
    assert 0.45 <= elapsed < 1.0


def test_close_aborts_a_probe_in_flight(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    """A reload retires the prober: its probe must end now, not at its 30 s timeout."""
    probe = prober(raw_server(hang).url, timeout=30)
    samples = []
    thread = threading.Thread(target=lambda: samples.append(probe.sample()))
    thread.start()
    time.sleep(0.3)
    began = time.monotonic()
    probe.close()
    thread.join(5)
    assert not thread.is_alive() and time.monotonic() - began < 1.0
    assert (samples[0].result, samples[0].detail) == (ProbeResult.ERROR, "prober closed")
    assert probe.sample().detail == "prober closed"  # and it takes no new probe


def test_credentials_in_the_url_are_basic_auth_and_never_shown(server: FakeServer) -> None:
    server.replies["/health"] = Reply(200)
    probe = prober(server.url.replace("http://", "http://us%40er:p%3Ass@"), "health")
    assert probe.sample().result is ProbeResult.READY
    assert server.requests[0].headers["Authorization"] == "Basic dXNAZXI6cDpzcw=="  # us@er:p:ss
    assert "p:ss" not in repr(probe) and "p%3Ass" not in repr(probe)


def test_reset_before_response_is_refused(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    sample = prober(raw_server(reset).url, "health").sample()
    assert sample.result is ProbeResult.REFUSED
    assert sample.detail == "connection reset"


def test_close_without_response_is_refused(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    sample = prober(raw_server(close_silently).url).sample()
    assert sample.result is ProbeResult.REFUSED
    assert sample.detail == "connection closed without a response"


@pytest.mark.parametrize(
    ("reply", "detail"),
    [
        (Reply(200, b"<html>hello</html>"), "response is not a JSON object"),
        (json_reply({"id": "x"}), "no 'choices' in JSON"),
        (json_reply({"choices": []}), "empty 'choices' in JSON"),
        (json_reply([1, 2]), "response is not a JSON object"),
    ],
    ids=["html", "no-choices", "empty-choices", "json-list"],
)
def test_garbage_200_is_bad_response(server: FakeServer, reply: Reply, detail: str) -> None:
    server.replies["/v1/completions"] = reply
    sample = prober(server.url).sample()
    assert sample.result is ProbeResult.BAD_RESPONSE
    assert sample.status_code == 200
    assert sample.detail == detail


def test_proper_completion_is_ready_and_sends_the_operator_request(server: FakeServer) -> None:
    server.replies["/v1/completions"] = json_reply(COMPLETION)
    sample = prober(server.url, model="/models/Kimi-K2").sample()
    assert sample.result is ProbeResult.READY
    assert sample.status_code == 200
    assert sample.duration_seconds > 0
    (request,) = server.requests
    assert request.method == "POST"
    assert json.loads(request.body) == {
        "model": "/models/Kimi-K2",
        "prompt": "ping",
        "max_tokens": 1,
        "temperature": 0,
    }


def test_completion_without_model_omits_the_key(server: FakeServer) -> None:
    server.replies["/v1/completions"] = json_reply(COMPLETION)
    assert prober(server.url).sample().result is ProbeResult.READY
    assert "model" not in json.loads(server.requests[0].body)


def test_gzip_encoded_completion_is_ready(server: FakeServer) -> None:
    body = gzip.compress(json.dumps(COMPLETION).encode())
    server.replies["/v1/completions"] = Reply(200, body, {"Content-Encoding": "gzip"})
    assert prober(server.url).sample().result is ProbeResult.READY


@pytest.mark.parametrize(
    ("status", "result"), [(200, "ready"), (204, "ready"), (503, "http_error")]
)
def test_health(server: FakeServer, status: int, result: str) -> None:
    server.replies["/health"] = Reply(status)
    sample = prober(server.url, "health").sample()
    assert sample.result == result
    assert sample.status_code == status
    assert server.requests[0].method == "GET"


@pytest.mark.parametrize("owner", ["sglang", "vllm", "llamacpp"])
def test_models_ready_and_server_detected(server: FakeServer, owner: str) -> None:
    server.replies["/v1/models"] = json_reply(
        {"object": "list", "data": [{"id": "m", "object": "model", "owned_by": owner}]}
    )
    sample = prober(server.url, "models").sample()
    assert (sample.result, sample.server) == (ProbeResult.READY, owner)


def test_models_unknown_owner_and_missing_data(server: FakeServer) -> None:
    server.replies["/v1/models"] = json_reply({"data": [{"id": "m", "owned_by": "someone"}]})
    sample = prober(server.url, "models").sample()
    assert (sample.result, sample.server) == (ProbeResult.READY, ServerKind.UNKNOWN)
    server.replies["/v1/models"] = json_reply({"models": []})
    sample = prober(server.url, "models").sample()
    assert (sample.result, sample.detail) == (ProbeResult.BAD_RESPONSE, "no 'data' list in JSON")


def test_redirect_is_not_followed(server: FakeServer) -> None:
    server.replies["/health"] = Reply(302, b"", {"Location": "http://example.invalid/health"})
    sample = prober(server.url, "health").sample()
    assert (sample.result, sample.status_code) == (ProbeResult.HTTP_ERROR, 302)
    assert len(server.requests) == 1


def test_tcp_open_and_closed(server: FakeServer) -> None:
    assert prober(server.url, "tcp").sample().result is ProbeResult.READY
    assert prober(f"tcp://127.0.0.1:{server.port}", "tcp").sample().result is ProbeResult.READY
    closed = prober(f"tcp://127.0.0.1:{free_port()}", "tcp").sample()
    assert (closed.result, closed.detail) == (ProbeResult.REFUSED, "connection refused")
    assert server.requests == []


def test_non_http_answer_is_error(
    raw_server: Callable[[Callable[[socket.socket, threading.Event], None]], RawServer],
) -> None:
    sample = prober(raw_server(speak_garbage).url).sample()
    assert sample.result is ProbeResult.ERROR
    assert sample.status_code is None


def test_headers_are_sent_but_never_shown(server: FakeServer) -> None:
    server.replies["/v1/completions"] = json_reply({"error": "bad key"}, 401)
    probe = prober(server.url, headers={"Authorization": SECRET, "X-Team": "infra"})
    sample = probe.sample()
    assert sample.result is ProbeResult.HTTP_ERROR
    assert server.requests[0].headers["Authorization"] == SECRET
    assert server.requests[0].headers["X-Team"] == "infra"
    for text in (sample.detail, repr(sample), repr(probe), str(probe)):
        assert "very-secret" not in text


def test_environment_proxy_is_ignored(server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")
    monkeypatch.setenv("NO_PROXY", "")
    server.replies["/health"] = Reply(200)
    assert prober(server.url, "health").sample().result is ProbeResult.READY


def test_unsendable_header_is_an_error_without_the_value(server: FakeServer) -> None:
    server.replies["/health"] = Reply(200)
    sample = prober(server.url, "health", headers={"Authorization": "Bearer ключ-secret"}).sample()
    assert sample.result is ProbeResult.ERROR
    assert "secret" not in sample.detail and "ключ" not in sample.detail
