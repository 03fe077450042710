"""The exporter as a real subprocess, and the clients and servers that try to break it.

Used by tests/test_hardening.py and tests/test_faults.py: idle and trickling clients, a model
server that trickles its answer, TLS material made by openssl, thread and memory readings from
/proc.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import requests
import yaml

from helpers.support import free_port, wait_for

REPO = Path(__file__).resolve().parents[2]


class ExporterProcess:
    """`python -m exporter ARGS` on a free loopback port; stderr goes to a file we can read."""

    def __init__(
        self,
        args: list[str],
        *,
        nofile: int | None = None,
        scheme: str = "http",
        env: dict[str, str] | None = None,
        code: Path = REPO,
    ) -> None:
        """`code`: the checkout whose exporter runs (a benchmark's older commit)."""
        self.port = free_port()
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self._stderr = tempfile.NamedTemporaryFile(prefix="exporter-stderr-", delete=False)  # noqa: SIM115
        limit = nofile

        def limits() -> None:
            if limit is not None:  # what systemd gives a service by default: 1024 open files
                resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))

        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                *args,
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            preexec_fn=limits,
            cwd=code,
            env={**os.environ, "PYTHONPATH": str(code), **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_listening(self, timeout: float = 30.0) -> None:
        def listening() -> bool:
            assert self.proc.poll() is None, f"exporter exited: {self.stderr()}"
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return True
            except OSError:
                return False

        wait_for(listening, timeout)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        kwargs.setdefault("timeout", 10)
        return requests.get(self.url + path, **kwargs)

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.pid}/task"))

    def thread_names(self) -> list[str]:
        names = []
        for task in os.listdir(f"/proc/{self.pid}/task"):
            try:
                names.append(Path(f"/proc/{self.pid}/task/{task}/comm").read_text().strip())
            except OSError:
                continue
        return sorted(names)

    def rss_bytes(self) -> int:
        for line in Path(f"/proc/{self.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def send(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def stderr(self) -> str:
        return Path(self._stderr.name).read_text(errors="replace")

    def stop(self, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)

    def close(self) -> None:
        self.stop()
        Path(self._stderr.name).unlink(missing_ok=True)


@contextlib.contextmanager
def discovering_exporter(tmp_path: Path, **discovery: Any) -> Iterator[ExporterProcess]:
    """The exporter as root with discovery on and no target configured, as on a GPU host,
    listening; `discovery` adds to its discovery section (users, ...)."""
    config = tmp_path / "config.yaml"
    settings = {
        "sample_interval": "200ms",
        "history_path": str(tmp_path / "history.sqlite"),
        "discovery": {"interval": "300ms", **discovery},
    }
    config.write_text(yaml.safe_dump(settings))
    running = ExporterProcess([f"--config.file={config}"])
    try:
        running.wait_listening()
        yield running
    finally:
        running.close()


class IdleClients:
    """`count` TCP connections that connect and then say nothing (or trickle, if asked)."""

    def __init__(self, port: int, count: int, trickle: bytes | None = None) -> None:
        self.socks: list[socket.socket] = []
        self._stop = threading.Event()
        for _ in range(count):
            try:
                self.socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            except OSError:
                break  # out of file descriptors in the test process: enough of them
        self._thread: threading.Thread | None = None
        if trickle is not None:
            self._thread = threading.Thread(target=self._trickle, args=(trickle,), daemon=True)
            self._thread.start()

    def _trickle(self, head: bytes) -> None:
        """One byte per second on every connection, never finishing the head (slowloris)."""
        for i in range(10_000):
            if self._stop.wait(1.0):
                return
            byte = head[i % len(head) : i % len(head) + 1]
            for sock in self.socks:
                with contextlib.suppress(OSError):
                    sock.send(byte)

    def open_count(self) -> int:
        """Connections the server has not closed yet (a closed one reads EOF or errors)."""
        alive = 0
        for sock in self.socks:
            sock.setblocking(False)
            try:
                alive += sock.recv(1, socket.MSG_PEEK) != b""
            except BlockingIOError:
                alive += 1
            except OSError:
                pass
        return alive

    def close(self) -> None:
        self._stop.set()
        for sock in self.socks:
            sock.close()


CONNECTION_THREAD = "listener-connection"  # the name of each connection's thread


class Listener:
    """A loopback TCP server that hands each connection to `_serve` on a thread of its own."""

    def __init__(self, backlog: int = 64) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0), backlog=backlog)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            # Named, so that a test counting threads can leave these short-lived ones out.
            threading.Thread(
                target=self._serve, args=(conn,), daemon=True, name=CONNECTION_THREAD
            ).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._stop.set()
        self.sock.close()


class TrickleServer(Listener):
    """A model server that accepts, sends `HTTP/1.1 200 OK\\r\\n`, then one byte a second.

    `ready` switches it to answer a proper completion instead, as a healthy server would.
    """

    def __init__(self) -> None:
        self.ready = False
        self.requests = 0
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                conn.recv(65536)
                self.requests += 1
                if self.ready:
                    body = b'{"choices":[{"text":"."}]}'
                    conn.sendall(
                        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    return
                conn.sendall(b"HTTP/1.1 200 OK\r\n")
                while not self._stop.wait(1.0):
                    conn.sendall(b"X")
            except OSError:
                return


def make_tls(directory: Path) -> dict[str, Path]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both CA-signed."""

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)

    paths = {
        n: directory / n
        for n in ("ca.crt", "ca.key", "tls.crt", "tls.key", "client.crt", "client.key")
    }
    curve = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    run("req", "-x509", *curve, "-days", "1", "-subj", "/CN=test-ca",
        "-keyout", str(paths["ca.key"]), "-out", str(paths["ca.crt"]))  # fmt: skip
    for name, subject, ext in (
        ("tls", "/CN=127.0.0.1", "subjectAltName=IP:127.0.0.1"),
        ("client", "/CN=prometheus", "extendedKeyUsage=clientAuth"),
    ):
        csr = directory / f"{name}.csr"
        extfile = directory / f"{name}.ext"
        extfile.write_text(ext + "\n")
        run("req", *curve, "-subj", subject, "-keyout", str(paths[f"{name}.key"]), "-out", str(csr))
        run("x509", "-req", "-in", str(csr), "-CA", str(paths["ca.crt"]),
            "-CAkey", str(paths["ca.key"]), "-CAcreateserial", "-days", "1",
            "-extfile", str(extfile), "-out", str(paths[f"{name}.crt"]))  # fmt: skip
    return paths


def tls_client(
    ca: Path,
    cert: tuple[Path, Path] | None = None,
    max_version: ssl.TLSVersion | None = None,
) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        context.load_cert_chain(str(cert[0]), str(cert[1]))
    if max_version is not None:
        context.maximum_version = max_version
    return context


def https_get(port: int, path: str, context: ssl.SSLContext, timeout: float = 5.0) -> int:
    """Status of one HTTPS GET with a given client context (requests cannot pin TLS versions)."""
    import http.client

    connection = http.client.HTTPSConnection("127.0.0.1", port, context=context, timeout=timeout)
    try:
        connection.request("GET", path)
        return connection.getresponse().status
    finally:
        connection.close()


@contextlib.contextmanager
def tiny_tmpfs(mount: Path, size: str = "256k") -> Iterator[Path]:
    """A small tmpfs to fill up (a full disk); skips the test where mounting is not allowed."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(directory: Path) -> Path:
    """Take every free byte of the filesystem; delete the returned file to give them back."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)
    return filler


def timed(fn: Callable[[], object]) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started
