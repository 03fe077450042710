"""Which HTTP server the exporter should use: each candidate measured on the same app, beside
node_exporter, in one run.

    .venv/bin/python bench/http_load.py [--seconds 10] [--servers ours,wsgiref,...]

The candidates need installing first (they are not dependencies of the exporter):
`.venv/bin/pip install cheroot waitress uvicorn hypercorn`; node_exporter is Debian's
`prometheus-node-exporter`. Missing ones are reported and skipped.

Every candidate serves the exporter's real WSGI app (4 targets, 1-s sampling) in its own process,
started the way it is meant to be used, with the open-files limit systemd gives a service (1024).
Measured, one scenario after another:

* scrapers: 20 and 50 closed-loop clients, a new connection per scrape, `Accept-Encoding: gzip`
  as Prometheus sends it: p50, p99, requests/s, errors (10 s timeout);
* 1,000 idle connections held open, then 20 scrapes one after another, and how many of the 1,000
  the server still holds 15 s later;
* slowloris: 200 connections sending their request head one byte a second, then 20 scrapes, the
  server's thread count meanwhile, and how many it still holds 15 s later;
* one idle client inside the TLS handshake (connected, silent), then 5 HTTPS scrapes;
* SIGTERM latency with those clients still connected;
* peak RSS and thread count over the whole run.

Measured on the 2-core VM this project runs on (see docs/costs.md for the numbers and
exporter/exposition/http/server.py for why they chose the asyncio server).
"""

from __future__ import annotations

import argparse
import asyncio
import builtins
import contextlib
import functools
import multiprocessing
import os
import resource
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = ("ours", "wsgiref", "cheroot", "waitress", "uvicorn", "hypercorn", "node_exporter")
REQUEST = (
    b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nAccept-Encoding: gzip\r\n"
    b"User-Agent: bench\r\nConnection: close\r\n\r\n"
)
TIMEOUT = 10.0
NOFILE = 1024  # systemd's default soft and hard limit for a service
HELD_FOR = 15.0  # hostile connections are counted again after this long: did the server close them?


# -- the candidates, each serving the exporter's app in its own process ------------------------


class _Stub(BaseHTTPRequestHandler):
    """A ready model server for the 4 targets to probe."""

    def log_message(self, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = b'{"choices":[{"text":"."}]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def _app() -> Any:
    sys.path.insert(0, str(REPO))
    from exporter.config.reader import parse_config
    from exporter.exposition.http.app import WebApp
    from exporter.runtime.wiring import Runtime

    stub = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    stub.daemon_threads = True
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{stub.server_address[1]}"
    targets = [{"name": f"model-{i}", "endpoint": {"url": url}} for i in range(4)]
    runtime = Runtime(parse_config({"history_path": "", "targets": targets}))
    runtime.start()
    return WebApp(runtime)


def _serve_ours(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    from exporter.exposition.http.app import HttpServer
    from exporter.exposition.http.webconfig import TlsConfig, WebConfig

    app.web = WebConfig(tls=TlsConfig(*tls)) if tls else WebConfig()
    server = HttpServer(app, f"127.0.0.1:{port}")
    server.start()
    return server.stop


def _serve_wsgiref(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    """The exporter's server before issue 9, as it was."""
    from socketserver import ThreadingMixIn
    from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

    class Server(ThreadingMixIn, WSGIServer):
        daemon_threads = True
        allow_reuse_address = True

    class Quiet(WSGIRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    httpd = make_server("127.0.0.1", port, app, server_class=Server, handler_class=Quiet)
    if tls:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls)
        httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    return stop


def _serve_cheroot(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    from cheroot import wsgi
    from cheroot.ssl.builtin import BuiltinSSLAdapter

    server = wsgi.Server(("127.0.0.1", port), app)
    if tls:
        server.ssl_adapter = BuiltinSSLAdapter(*tls)
    server.prepare()
    threading.Thread(target=server.serve, daemon=True).start()
    return server.stop


def _serve_waitress(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    if tls:
        raise NotImplementedError("waitress has no TLS")
    from waitress.server import create_server

    server = create_server(app, host="127.0.0.1", port=port, threads=4)
    threading.Thread(target=server.run, daemon=True).start()
    return server.close


def _serve_uvicorn(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    import uvicorn

    extra: dict[str, Any] = {"ssl_certfile": tls[0], "ssl_keyfile": tls[1]} if tls else {}
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, interface="wsgi", log_level="error", **extra
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)

    def stop() -> None:
        server.should_exit = True
        thread.join()

    return stop


def _serve_hypercorn(app: Any, port: int, tls: tuple[str, str] | None) -> Callable[[], None]:
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.loglevel = "ERROR"
    if tls:
        config.certfile, config.keyfile = tls
    loop = asyncio.new_event_loop()
    done = asyncio.Event()

    def run() -> None:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(serve(app, config, mode="wsgi", shutdown_trigger=done.wait))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def stop() -> None:
        loop.call_soon_threadsafe(done.set)
        thread.join()

    return stop


SERVERS: dict[str, Callable[[Any, int, tuple[str, str] | None], Callable[[], None]]] = {
    "ours": _serve_ours,
    "wsgiref": _serve_wsgiref,
    "cheroot": _serve_cheroot,
    "waitress": _serve_waitress,
    "uvicorn": _serve_uvicorn,
    "hypercorn": _serve_hypercorn,
}


def serve_main(name: str, port: int, tls: tuple[str, str] | None) -> None:
    """Child process: serve until SIGTERM, then stop the server and exit."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    stop = SERVERS[name](_app(), port, tls)
    print("READY", flush=True)
    signal.sigwait({signal.SIGTERM})
    stop()
    os._exit(0)


# -- the client side ---------------------------------------------------------------------------


async def _scrape(port: int, context: ssl.SSLContext | None) -> float | None:
    """Seconds for one scrape on a new connection, or None on an error or timeout."""
    started = time.perf_counter()
    try:
        async with asyncio.timeout(TIMEOUT):
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.write(REQUEST)
            data = await reader.read(-1)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    except (OSError, TimeoutError, ssl.SSLError):
        return None
    return time.perf_counter() - started if data[9:12] == b"200" else None


async def _load(port: int, clients: int, seconds: float) -> list[float | None]:
    results: list[float | None] = []
    deadline = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < deadline:
            results.append(await _scrape(port, None))

    await asyncio.gather(*(client() for _ in range(clients)))
    return results


def _load_worker(args: tuple[int, int, float]) -> list[float | None]:
    return asyncio.run(_load(*args))


def scrapers(port: int, clients: int, seconds: float) -> list[float | None]:
    """`clients` closed-loop scrapers spread over two processes (two cores to drive them)."""
    procs = 2 if clients >= 2 else 1
    shares = [clients // procs + (i < clients % procs) for i in range(procs)]
    with multiprocessing.get_context("fork").Pool(procs) as pool:
        parts = pool.map(_load_worker, [(port, n, seconds) for n in shares])
    return [r for part in parts for r in part]


def sequential(port: int, count: int, context: ssl.SSLContext | None = None) -> list[float | None]:
    """`count` scrapes one after another; after 3 failures in a row the rest count as failed
    (each failure is a 10 s timeout: a blocked server would take minutes to say the same)."""

    async def run() -> list[float | None]:
        results: list[float | None] = []
        while len(results) < count:
            results.append(await _scrape(port, context))
            if results[-3:] == [None, None, None]:
                results += [None] * (count - len(results))
        return results

    return asyncio.run(run())


class Held:
    """Connections held open: idle, or trickling a request head one byte a second."""

    def __init__(self, port: int, count: int, trickle: bool = False) -> None:
        self.socks: list[socket.socket] = []
        for _ in range(count):
            try:
                self.socks.append(socket.create_connection(("127.0.0.1", port), timeout=2))
            except OSError:
                break
        self._stop = threading.Event()
        if trickle:
            threading.Thread(target=self._trickle, daemon=True).start()

    def _trickle(self) -> None:
        head = b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"a" * 10_000
        i = 0
        while not self._stop.wait(1.0):
            for sock in self.socks:
                with contextlib.suppress(OSError):
                    sock.send(head[i : i + 1])
            i += 1

    def still_open(self) -> int:
        """How many the server has not closed (a closed one reads EOF or an error)."""
        count = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                count += sock.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                count += 1
            except OSError:
                pass
        return count

    def close(self) -> None:
        self._stop.set()
        for sock in self.socks:
            sock.close()


# -- one candidate, every scenario ---------------------------------------------------------------


@dataclass
class Result:
    name: str
    load: dict[int, list[float | None]] = field(default_factory=dict)
    idle: list[float | None] = field(default_factory=list)
    idle_open_after: int = 0  # of the 1000 idle connections, still open after HELD_FOR s
    slowloris: list[float | None] = field(default_factory=list)
    slowloris_threads: int = 0
    slowloris_open_after: int = 0
    tls_idle: list[float | None] | None = None
    sigterm_seconds: float | None = None
    rss_mb: float = 0.0
    threads: int = 0
    note: str = ""


class Process:
    """A candidate's process, with its peak RSS and thread count watched every 0.2 s."""

    def __init__(self, argv: list[str], port: int, ready_line: bool) -> None:
        def limit() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))

        self.port = port
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=limit, text=True
        )
        if ready_line:
            line = self.proc.stdout.readline() if self.proc.stdout else ""
            if "READY" not in line:
                raise RuntimeError(f"{argv[-1]} did not start")
        self._wait_listening()
        self.rss_mb = 0.0
        self.threads = 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True).start()

    def _wait_listening(self) -> None:
        for _ in range(300):
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port)):
                return
            time.sleep(0.05)
        raise RuntimeError("not listening")

    def _watch(self) -> None:
        while not self._stop.wait(0.2):
            rss, threads = self.stats()
            self.rss_mb, self.threads = max(self.rss_mb, rss), max(self.threads, threads)

    def stats(self) -> tuple[float, int]:
        rss, threads = 0.0, 0
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("Threads:"):
                    threads = int(line.split()[1])
        return rss, threads

    def sigterm(self, cap: float = 10.0) -> float | None:
        started = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(cap)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return None
        finally:
            self._stop.set()
        return time.monotonic() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start(name: str, tls: tuple[str, str] | None, workdir: Path) -> Process:
    port = free_port()
    if name == "node_exporter":
        argv = ["prometheus-node-exporter", f"--web.listen-address=127.0.0.1:{port}"]
        if tls:
            web = workdir / "node-web.yml"
            web.write_text(f"tls_server_config:\n  cert_file: {tls[0]}\n  key_file: {tls[1]}\n")
            argv.append(f"--web.config.file={web}")
        return Process(argv, port, ready_line=False)
    argv = [sys.executable, __file__, "--serve", name, "--port", str(port)]
    if tls:
        argv += ["--tls", *tls]
    return Process(argv, port, ready_line=True)


def measure(name: str, seconds: float, tls: tuple[str, str], workdir: Path) -> Result:
    result = Result(name)
    proc = start(name, None, workdir)
    try:
        time.sleep(1.5)  # a first sample of every source
        for clients in (20, 50):
            result.load[clients] = scrapers(proc.port, clients, seconds)
        held = Held(proc.port, 1000)
        opened = time.monotonic()
        time.sleep(0.5)
        result.idle = sequential(proc.port, 20)
        time.sleep(max(0.0, opened + HELD_FOR - time.monotonic()))
        result.idle_open_after = held.still_open()
        held.close()
        slow = Held(proc.port, 200, trickle=True)
        opened = time.monotonic()
        time.sleep(2.5)
        result.slowloris = sequential(proc.port, 20)
        result.slowloris_threads = proc.stats()[1]
        time.sleep(max(0.0, opened + HELD_FOR - time.monotonic()))
        result.slowloris_open_after = slow.still_open()
        slow.close()
    finally:
        result.rss_mb, result.threads = proc.rss_mb, proc.threads
        proc.sigterm()
    try:
        proc = start(name, tls, workdir)
    except (RuntimeError, OSError) as exc:
        result.note = f"no TLS ({exc})"
        return result
    context = ssl.create_default_context(cafile=tls[0])
    held = Held(proc.port, 1)  # connected, never says a word: inside the TLS handshake
    idle = Held(proc.port, 100)
    time.sleep(0.5)
    result.tls_idle = sequential(proc.port, 5, context)
    result.sigterm_seconds = proc.sigterm()
    held.close()
    idle.close()
    return result


# -- report --------------------------------------------------------------------------------------


def _ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(values: list[float | None]) -> str:
    good = [v for v in values if v is not None]
    errors = len(values) - len(good)
    if not good:
        return f"all {errors} failed"
    text = f"p50 {_ms(good, 0.5):.0f} / max {1000 * max(good):.0f} ms"
    return text + (f", {errors} failed" if errors else "")


def report(results: list[Result], seconds: float, out: Any = None) -> None:
    print = functools.partial(builtins.print, file=out or sys.stdout)
    print(f"\n/metrics under closed-loop scrapers ({seconds:g} s each, new connection per scrape)")
    print(f"{'server':<14} {'clients':>7} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>7} {'errors':>7}")
    node = next((r for r in results if r.name == "node_exporter"), None)
    for r in results:
        for clients, values in r.load.items():
            good = [v for v in values if v is not None]
            p50 = _ms(good, 0.5) if good else float("nan")
            p99 = _ms(good, 0.99) if good else float("nan")
            ratio = ""
            if node is not None and r is not node and clients in node.load:
                node_good = [v for v in node.load[clients] if v is not None]
                if node_good and good:
                    ratio = f"  p99 {p99 / _ms(node_good, 0.99):.2f}x node_exporter's"
            print(
                f"{r.name:<14} {clients:>7} {p50:>8.1f} {p99:>8.1f} {len(good) / seconds:>7.0f}"
                f" {len(values) - len(good):>7}{ratio}"
            )
    print("\nHostile clients (20 scrapes one after another while they are connected)")
    for r in results:
        tls = _summary(r.tls_idle) if r.tls_idle is not None else r.note or "n/a"
        sigterm = f"{r.sigterm_seconds:.2f} s" if r.sigterm_seconds is not None else "> 10 s"
        if r.tls_idle is None:
            sigterm = "n/a"
        print(f"{r.name}:")
        print(
            f"  1000 idle connections:      {_summary(r.idle)}; "
            f"{r.idle_open_after} still open after {HELD_FOR:g} s"
        )
        print(
            f"  200 slowloris clients:      {_summary(r.slowloris)}; {r.slowloris_threads} "
            f"threads; {r.slowloris_open_after} still open after {HELD_FOR:g} s"
        )
        print(f"  1 idle client in TLS hello: {tls}")
        print(f"  SIGTERM to exit (TLS idle): {sigterm}")
        print(f"  peak RSS {r.rss_mb:.0f} MB, peak threads {r.threads}")


def make_cert(directory: Path) -> tuple[str, str]:
    cert, key = directory / "tls.crt", directory / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1", "-addext",
         "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    return str(cert), str(key)


def available(name: str) -> bool:
    if name == "node_exporter":
        return shutil.which("prometheus-node-exporter") is not None
    module = {"ours": "exporter", "wsgiref": "wsgiref"}.get(name, name)
    probe = [sys.executable, "-c", f"import {module}"]
    return subprocess.run(probe, capture_output=True, cwd=REPO).returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per load level")
    parser.add_argument("--servers", default=",".join(CANDIDATES))
    parser.add_argument("--serve", choices=tuple(SERVERS), help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--tls", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve_main(args.serve, args.port, tuple(args.tls) if args.tls else None)
        return 0
    results = []
    with tempfile.TemporaryDirectory(prefix="http-load-") as tmp:
        tls = make_cert(Path(tmp))
        for name in args.servers.split(","):
            if not available(name):
                print(f"{name}: not installed, skipped", file=sys.stderr)
                continue
            print(f"measuring {name} ...", file=sys.stderr, flush=True)
            results.append(measure(name, args.seconds, tls, Path(tmp)))
            report(results[-1:], args.seconds, out=sys.stderr)  # progress, for long runs
    report(results, args.seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
