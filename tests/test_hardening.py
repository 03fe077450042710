"""Issue 9, item by item: each test reproduces one numbered finding against the real exporter.

Most drive `python -m exporter` as a subprocess (real sockets, signals, TLS made by openssl), so
they ran unchanged against the code before the fix and failed there; the report lists how.
"""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml
from helpers.hostile import (
    REPO,
    ExporterProcess,
    IdleClients,
    TrickleServer,
    fill,
    https_get,
    make_tls,
    tiny_tmpfs,
    tls_client,
)
from helpers.processes import cold_checkpoint
from helpers.support import ModelServer, free_port, metrics_when, sample_value, wait_for
from test_pagecache import NOBODY, nobody_python

GOOD_TARGET = {"name": "m", "endpoint": {"url": "http://127.0.0.1:1", "timeout": "1s"}}


def write_config(path: Path, targets: list[dict[str, Any]], **top: Any) -> Path:
    path.write_text(yaml.safe_dump({"sample_interval": "200ms", **top, "targets": targets}))
    return path


def one_line_error(stderr: str) -> None:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr


def check_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", "--config.check", *args],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip


@pytest.fixture
def exporters() -> Iterator[list[ExporterProcess]]:
    started: list[ExporterProcess] = []
    yield started
    for exporter in started:
        exporter.close()


def bcrypt_hash(password: bytes, rounds: int = 4) -> str:
    return bcrypt.hashpw(password, bcrypt.gensalt(rounds=rounds)).decode()


# -- 1. an idle TLS client blocks every HTTPS request and SIGTERM --------------------------------


@pytest.mark.system
def test_1_idle_tls_clients_block_neither_scrapes_nor_sigterm(
    tmp_path: Path, model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    tls = make_tls(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {
                    "cert_file": str(tls["tls.crt"]),
                    "key_file": str(tls["tls.key"]),
                }
            }
        )
    )
    exporter = ExporterProcess(
        ["--target", "m", "--endpoint", model_server.url, "--history.path=",
         "--sample.interval=200ms", f"--web.config.file={web}"],
        scheme="https",
    )  # fmt: skip
    exporters.append(exporter)
    exporter.wait_listening()
    context = tls_client(tls["ca.crt"])
    assert https_get(exporter.port, "/-/healthy", context) == 200
    silent = IdleClients(exporter.port, 3)  # connected, never start the handshake
    try:
        for _ in range(3):
            assert https_get(exporter.port, "/metrics", context, timeout=3) == 200
        started = time.monotonic()
        exporter.send(signal.SIGTERM)
        assert exporter.proc.wait(timeout=5) == 0
        assert time.monotonic() - started < 3
    finally:
        silent.close()


# -- 2. a reload with a config that is not UTF-8 or has a malformed URL kills the exporter -------


BAD_FILES = {
    "not-utf8": b"targets: [{name: \xff\xfe}]\n",
    "malformed-url": b"targets: [{name: a, endpoint: {url: 'http://[::1:19201'}}]\n",
}


@pytest.mark.parametrize("case", BAD_FILES)
def test_2_a_bad_file_at_start_is_one_line(tmp_path: Path, case: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_bytes(BAD_FILES[case])
    result = check_config(f"--config.file={config}")
    assert result.returncode == 1
    one_line_error(result.stderr)


@pytest.mark.system
def test_2_sighup_and_post_reload_with_bad_files_never_exit(
    tmp_path: Path, model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    good = {"name": "a", "endpoint": {"url": model_server.url, "timeout": "2s"}}
    config = write_config(tmp_path / "config.yaml", [good])
    exporter = ExporterProcess([f"--config.file={config}", "--history.path="])
    exporters.append(exporter)
    metrics_when(exporter.url, lambda t: sample_value(t, "model_load_endpoint_up", target="a") == 1)
    for case, content in BAD_FILES.items():
        config.write_bytes(content)
        exporter.send(signal.SIGHUP)
        metrics_when(
            exporter.url,
            lambda t: sample_value(t, "model_load_config_last_reload_successful") == 0,
        )
        assert exporter.proc.poll() is None, case
        write_config(config, [good])
        exporter.send(signal.SIGHUP)
        metrics_when(
            exporter.url,
            lambda t: sample_value(t, "model_load_config_last_reload_successful") == 1,
        )
    config.write_bytes(BAD_FILES["malformed-url"])
    answer = requests.post(exporter.url + "/-/reload", timeout=30)
    assert answer.status_code == 500 and "malformed URL" in answer.text
    write_config(config, [good])
    assert requests.post(exporter.url + "/-/reload", timeout=30).status_code == 200
    assert requests.get(exporter.url + "/-/reload", timeout=5).status_code == 405
    assert exporter.stop() == 0
    stderr = exporter.stderr()
    assert "Traceback" not in stderr
    assert stderr.count("config reload failed, keeping the running config") == 3


# -- 3. no timeouts: idle and slowloris clients each hold a thread, fds run out ------------------


@pytest.mark.system
def test_3_a_thousand_idle_and_slowloris_clients_delay_no_scrape(
    model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    exporter = ExporterProcess(
        ["--target", "m", "--endpoint", model_server.url, "--history.path=",
         "--sample.interval=200ms"],
        nofile=1024,  # systemd's default for a service
    )  # fmt: skip
    exporters.append(exporter)
    metrics_when(exporter.url, lambda t: "model_load_source_up" in t)
    baseline = exporter.threads()
    idle = IdleClients(exporter.port, 1000)
    slow = IdleClients(exporter.port, 200, trickle=b"GET /metrics HTTP/1.1\r\nX-Slow: aaaa")
    try:
        time.sleep(1.5)
        for _ in range(5):
            response = exporter.get("/metrics", timeout=5)
            assert response.status_code == 200
            assert sample_value(response.text, "model_load_source_up", source="memory") == 1
        assert exporter.threads() <= baseline + 6, exporter.thread_names()
    finally:
        idle.close()
        slow.close()
    assert exporter.proc.poll() is None


@pytest.mark.system
def test_3_under_128_open_files_it_neither_spins_nor_stops_answering(
    model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    """Before: out of fds, accept() failed in a loop at 100 % CPU."""
    exporter = ExporterProcess(
        ["--target", "m", "--endpoint", model_server.url, "--history.path=",
         "--sample.interval=200ms"],
        nofile=128,
    )  # fmt: skip
    exporters.append(exporter)
    metrics_when(exporter.url, lambda t: "model_load_source_up" in t)
    idle = IdleClients(exporter.port, 300)
    try:
        time.sleep(0.5)
        cpu, started = exporter.cpu_seconds(), time.monotonic()
        time.sleep(2.0)
        share = (exporter.cpu_seconds() - cpu) / (time.monotonic() - started)
        response = exporter.get("/metrics", timeout=5)
        assert response.status_code == 200
        assert sample_value(response.text, "model_load_source_up", source="memory") == 1
    finally:
        idle.close()
    assert share < 0.5, f"{share:.2f} of a core with 300 idle connections"


# -- 4. the probe timeout is not enforced while headers trickle; reloads leak prober threads -----


@pytest.mark.system
def test_4_a_trickling_endpoint_times_out_and_reloads_leak_no_thread(
    tmp_path: Path, exporters: list[ExporterProcess]
) -> None:
    server = TrickleServer()
    server.ready = True
    target = {"name": "t", "endpoint": {"url": server.url, "timeout": "1500ms"}}
    config = write_config(tmp_path / "config.yaml", [target])
    exporter = ExporterProcess([f"--config.file={config}", "--history.path="])
    exporters.append(exporter)
    try:
        metrics_when(
            exporter.url, lambda t: sample_value(t, "model_load_endpoint_up", target="t") == 1
        )
        server.ready = False  # from now on: status line, then one byte a second
        text = metrics_when(
            exporter.url,
            lambda t: (
                (
                    sample_value(
                        t, "model_load_endpoint_probes_total", target="t", result="timeout"
                    )
                    or 0
                )
                >= 2
            ),
            timeout=10,
        )
        assert sample_value(text, "model_load_endpoint_up", target="t") == 0
        baseline = exporter.threads()
        for i in range(20):
            exporter.send(signal.SIGHUP)
            wait_for(lambda n=i + 1: exporter.stderr().count("config reloaded") >= n, timeout=20)
        wait_for(lambda: exporter.threads() <= baseline, timeout=10)
    finally:
        server.close()


# -- 5. listen backlog of 5 ----------------------------------------------------------------------


def listen_backlog(port: int) -> int:
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout
    return int(out.split()[2])  # Send-Q of a listening socket is its backlog


@pytest.mark.system
@pytest.mark.requires("ss")
def test_5_a_real_backlog_and_a_burst_of_200_connections(
    model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    exporter = ExporterProcess(["--target", "m", "--endpoint", model_server.url, "--history.path="])
    exporters.append(exporter)
    metrics_when(exporter.url, lambda t: "model_load_source_up" in t)
    assert listen_backlog(exporter.port) >= 128
    codes: list[int] = []

    def scrape() -> None:
        try:
            codes.append(requests.get(exporter.url + "/metrics", timeout=10).status_code)
        except requests.RequestException as exc:
            codes.append(type(exc).__name__)  # type: ignore[arg-type]

    threads = [threading.Thread(target=scrape) for _ in range(200)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert codes == [200] * 200


# -- 6. bcrypt: malformed hashes, 72-byte passwords, no bound and no cache -----------------------


def test_6_a_malformed_bcrypt_hash_fails_the_check(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"prometheus": "$2y$10$tooshort"}}))
    result = check_config("--target=m", "--endpoint=http://127.0.0.1:1", f"--web.config.file={web}")
    assert result.returncode == 1
    one_line_error(result.stderr)
    assert "basic_auth_users.prometheus" in result.stderr


@pytest.mark.system
def test_6_long_passwords_are_401_for_every_user_and_wrong_ones_take_one_core_at_most(
    tmp_path: Path, model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"prom": bcrypt_hash(b"good", rounds=10)}}))
    exporter = ExporterProcess(
        ["--target", "m", "--endpoint", model_server.url, "--history.path=",
         f"--web.config.file={web}"]
    )  # fmt: skip
    exporters.append(exporter)
    exporter.wait_listening()
    long = "x" * 100
    for user in ("prom", "nobody-like-this"):
        assert exporter.get("/metrics", auth=(user, long)).status_code == 401
    assert exporter.get("/metrics", auth=("prom", "good")).status_code == 200
    stop = threading.Event()

    def flood(n: int) -> None:
        with requests.Session() as session:
            while not stop.is_set():
                session.get(
                    exporter.url + "/metrics",
                    auth=("prom", f"wrong-{n}-{time.monotonic()}"),
                    timeout=30,
                )

    attackers = [threading.Thread(target=flood, args=(n,)) for n in range(16)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.5)
        cpu0, wall0 = exporter.cpu_seconds(), time.monotonic()
        for _ in range(5):  # the good password was checked once and is cached
            assert exporter.get("/metrics", auth=("prom", "good"), timeout=5).status_code == 200
            time.sleep(0.3)
        share = (exporter.cpu_seconds() - cpu0) / (time.monotonic() - wall0)
    finally:
        stop.set()
        for t in attackers:
            t.join()
    assert share < 1.4, f"wrong passwords took {share:.2f} cores"
    assert "Traceback" not in exporter.stderr()


# -- 7. unknown tls_server_config keys ignored: typos turn mutual TLS off ------------------------


def test_7_an_unknown_tls_key_names_itself(tmp_path: Path) -> None:
    tls = make_tls(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {
        "cert_file": str(tls["tls.crt"]), "key_file": str(tls["tls.key"]),
        "client_ca_fle": str(tls["ca.crt"]),
    }}))  # fmt: skip
    result = check_config("--target=m", "--endpoint=http://127.0.0.1:1", f"--web.config.file={web}")
    assert result.returncode == 1
    one_line_error(result.stderr)
    assert "client_ca_fle" in result.stderr


@pytest.mark.system
def test_7_client_auth_type_and_min_version_are_applied(
    tmp_path: Path, model_server: ModelServer, exporters: list[ExporterProcess]
) -> None:
    tls = make_tls(tmp_path)
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"tls_server_config": {
        "cert_file": str(tls["tls.crt"]), "key_file": str(tls["tls.key"]),
        "client_ca_file": str(tls["ca.crt"]), "client_auth_type": "RequireAndVerifyClientCert",
        "min_version": "TLS13",
    }}))  # fmt: skip
    exporter = ExporterProcess(
        ["--target", "m", "--endpoint", model_server.url, "--history.path=",
         f"--web.config.file={web}"],
        scheme="https",
    )  # fmt: skip
    exporters.append(exporter)
    exporter.wait_listening()
    client = (tls["client.crt"], tls["client.key"])
    assert https_get(exporter.port, "/metrics", tls_client(tls["ca.crt"], client)) == 200
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(exporter.port, "/metrics", tls_client(tls["ca.crt"]))  # no client certificate
    with pytest.raises((ssl.SSLError, ConnectionError)):
        https_get(
            exporter.port, "/metrics", tls_client(tls["ca.crt"], client, ssl.TLSVersion.TLSv1_2)
        )


# -- 8. credentials in an endpoint URL are exported -----------------------------------------------


class RecordingServer:
    """A ready model server that remembers the Authorization headers it was sent."""

    def __init__(self) -> None:
        self.authorizations: list[str | None] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                outer.authorizations.append(self.headers.get("Authorization"))
                body = b'{"choices":[{"text":"."}]}'
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.system
def test_8_endpoint_credentials_are_redacted_and_sent_as_basic_auth(
    exporters: list[ExporterProcess],
) -> None:
    server = RecordingServer()
    try:
        url = f"http://admin:hunter2-secret@127.0.0.1:{server.port}"
        exporter = ExporterProcess(
            ["--target", "m", "--endpoint", url, "--history.path=", "--sample.interval=200ms"]
        )
        exporters.append(exporter)
        text = metrics_when(
            exporter.url, lambda t: sample_value(t, "model_load_endpoint_up", target="m") == 1
        )
        status = exporter.get("/api/v1/status").text
    finally:
        server.close()
    assert f'endpoint="http://admin:***@127.0.0.1:{server.port}"' in text
    for shown in (text, status, exporter.stderr()):
        assert "hunter2-secret" not in shown
    expected = "Basic " + base64.b64encode(b"admin:hunter2-secret").decode()
    assert server.authorizations and set(server.authorizations) == {expected}


# -- 9. configs that pass the check and break at run time (or are a traceback in it) -------------


def weights_dir() -> str:
    return tempfile.mkdtemp(prefix="hardening-weights-")


BAD_CONFIGS = {
    "huge-interval": "sample_interval: 99999999999h\ntargets: [{name: a, endpoint: {url: 'http://h:1'}}]\n",
    "400-digits": "sample_interval: "
    + "9" * 400
    + "s\ntargets: [{name: a, endpoint: {url: 'http://h:1'}}]\n",
    "header-crlf": "targets: [{name: a, endpoint: {url: 'http://h:1', headers: {X-Key: \"a\\r\\nEvil: 1\"}}}]\n",
    "duplicate-key": "targets: [{name: a, endpoint: {url: 'http://h:1'}, stall_after: 5m, stall_after: 1m}]\n",
    "glob-unclosed": "targets: [{name: a, endpoint: {url: 'http://h:1'}, weights: {paths: [WEIGHTS], include: ['[unclosed']}}]\n",
    "huge-timeout": "targets: [{name: a, endpoint: {url: 'http://h:1', timeout: 99999999999h}}]\n",
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_9_bad_values_fail_the_check_in_one_line(tmp_path: Path, case: str) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(BAD_CONFIGS[case].replace("WEIGHTS", str(tmp_path)))
    result = check_config(f"--config.file={config}")
    assert result.returncode == 1, result.stdout
    one_line_error(result.stderr)


def test_9_a_huge_interval_flag_is_one_line() -> None:
    result = check_config("--target=m", "--endpoint=http://h:1", "--sample.interval=99999999999h")
    assert result.returncode == 1
    one_line_error(result.stderr)


# -- 10. unreadable and vanishing weights; a failed history write hides history -----------------


@pytest.mark.system
@pytest.mark.requires("root", "setpriv", "nobody_python")
def test_10_a_weight_file_it_may_not_read_still_counts_and_says_why(
    model_server: ModelServer,
) -> None:
    python = nobody_python()
    assert python is not None
    directory = Path(tempfile.mkdtemp(prefix="weights-unreadable-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        readable, secret = directory / "a.safetensors", directory / "b.safetensors"
        readable.write_bytes(b"\0" * 8192)
        secret.write_bytes(b"\0" * 4096)
        os.chown(readable, NOBODY, NOBODY)  # its own file: residency measurable
        secret.chmod(0o600)  # root's: nobody may stat it (the directory is open), not read it
        port = free_port()
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             python, "-m", "exporter", "--target", "m", "--endpoint", model_server.url,
             "--weights", str(directory), "--history.path=", "--sample.interval=200ms",
             f"--web.listen-address=127.0.0.1:{port}"],
            cwd=directory, env={"PYTHONPATH": str(REPO), "PATH": os.defpath},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            url = f"http://127.0.0.1:{port}"
            text = metrics_when(url, lambda t: "model_load_weights_files{" in t, timeout=30)
            status = requests.get(url + "/api/v1/status", timeout=10).json()
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=10)
    finally:
        shutil.rmtree(directory)
    assert sample_value(text, "model_load_weights_files", target="m") == 2
    assert sample_value(text, "model_load_weights_bytes", target="m") == 8192 + 4096
    assert sample_value(text, "model_load_source_up", source="pagecache", target="m") == 0
    assert "b.safetensors" in status["targets"][0]["sources"]["pagecache"]["error"]
    assert "Traceback" not in stderr


def test_10_weights_deleted_mid_run_are_down_with_a_reason_and_come_back(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "a.safetensors").write_bytes(b"\0" * 65536)
    running = start_exporter(
        {"targets": [{"name": "m", "endpoint": {"url": model_server.url},
                      "weights": {"paths": [str(weights)]}}]}
    )  # fmt: skip

    def pagecache_up() -> float | None:
        return sample_value(
            running.metrics(), "model_load_source_up", source="pagecache", target="m"
        )

    wait_for(lambda: pagecache_up() == 1)
    shutil.rmtree(weights)
    wait_for(lambda: pagecache_up() == 0, timeout=10)
    error = running.status()["targets"][0]["sources"]["pagecache"]["error"]
    assert "no weight files" in error
    weights.mkdir()
    (weights / "a.safetensors").write_bytes(b"\0" * 65536)
    wait_for(lambda: pagecache_up() == 1, timeout=10)


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    with tiny_tmpfs(tmp_path / "tiny") as mount:
        yield mount


def test_10_a_full_disk_keeps_history_readable_and_says_so(tiny_fs: Path) -> None:
    from exporter.history.store import HistoryStore
    from exporter.load.records import LoadRecord
    from exporter.vocabulary import Cache, Outcome

    def record(at: float) -> LoadRecord:
        phases = {"starting": 1.0, "loading_weights": 30.0, "initializing": 9.0}
        return LoadRecord("m", at, at + 40, Outcome.READY, Cache.COLD, False, phases, 1, 1, 1)

    store = HistoryStore(str(tiny_fs / "history.sqlite"))
    store.add(record(1000.0))
    filler = fill(tiny_fs)
    for i in range(50):  # pages fill up: some insert fails with "database or disk is full"
        store.add(record(2000.0 + i * 100))
        if not store.up:
            break
    assert not store.up and "full" in (store.write_problem or "")
    assert store.loads("m")  # what is stored stays readable
    assert store.expected_duration("m", Cache.COLD) == 40.0
    filler.unlink()
    store.retry()
    assert store.up and store.write_problem is None


# -- 11. HEAD, other methods, limit=-1, Server header --------------------------------------------


GET_PATHS = ("/metrics", "/", "/-/healthy", "/-/ready", "/api/v1/status", "/api/v1/loads")


def test_11_methods_limits_and_no_server_header(
    start_exporter: Any, model_server: ModelServer
) -> None:
    running = start_exporter({"targets": [{"name": "m", "endpoint": {"url": model_server.url}}]})
    wait_for(lambda: running.runtime.ready)
    for path in GET_PATHS:
        got = requests.get(running.url + path, timeout=5)
        head = requests.head(running.url + path, timeout=5)
        assert head.status_code == got.status_code == 200, path
        assert head.content == b"" and int(head.headers["Content-Length"]) > 0, path
        for method in ("POST", "PUT", "DELETE", "PATCH"):
            answer = requests.request(method, running.url + path, timeout=5)
            assert answer.status_code == 405 and "GET" in answer.headers["Allow"], (method, path)
        assert "Server" not in got.headers, got.headers
    for bad in ("-1", "0", "abc", "1001", ""):
        answer = requests.get(running.url + f"/api/v1/loads?limit={bad}", timeout=5)
        assert answer.status_code == 400, bad


# -- 12. a server frozen while ready ----------------------------------------------------------


def settled_ready(url: str, target: str, hold: float = 1.0) -> None:
    """Wait until the target has been ready, with its process seen, for `hold` seconds.

    A probe may say ready before the process source has run; the process's first sighting
    then starts a load of its own, which ends only with the next ready probe.
    """

    def ready() -> bool:
        text = requests.get(url + "/metrics", timeout=5).text
        return (
            sample_value(text, "model_load_process_up", target=target) == 1
            and sample_value(text, "model_load_phase", target=target, phase="ready") == 1
        )

    since: list[float] = []

    def held() -> bool:
        if not ready():
            since.clear()
            return False
        since[:1] = since[:1] or [time.monotonic()]
        return time.monotonic() - since[0] >= hold

    wait_for(held, timeout=30)


@pytest.mark.system
def test_12_a_hung_ready_server_stays_ready_with_endpoint_down_and_is_logged_once(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server_process = subprocess.Popen(["sleep", "60"])
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(f"{server_process.pid}\n")
    try:
        running = start_exporter(
            {"targets": [{"name": "m", "endpoint": {"url": model_server.url, "timeout": "300ms",
                                                    "ready_interval": "200ms"},
                          "process": {"pidfile": str(pidfile)}}]}
        )  # fmt: skip
        settled_ready(running.url, "m")
        caplog.clear()
        caplog.set_level(logging.INFO, logger="exporter.runtime.reactions")
        model_server.mode = "hang"
        wait_for(lambda: any("hung?" in r.getMessage() for r in caplog.records), timeout=15)
        text = running.metrics()
        assert sample_value(text, "model_load_phase", target="m", phase="ready") == 1
        assert sample_value(text, "model_load_in_progress", target="m") == 0
        assert sample_value(text, "model_load_endpoint_up", target="m") == 0
        assert sample_value(text, "model_load_process_up", target="m") == 1
        time.sleep(1.0)  # more failed probes: still one warning
        assert sum("hung?" in r.getMessage() for r in caplog.records) == 1
        model_server.mode = "ready"
        model_server.release.set()
        wait_for(lambda: any("answers again" in r.getMessage() for r in caplog.records), timeout=15)
    finally:
        server_process.kill()
        server_process.wait()


# -- the probe cadence of DESIGN ----------------------------------------------------------------


class CountingServer(ModelServer):
    """ModelServer that counts the probes it answers."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        handler = self.httpd.RequestHandlerClass
        original = handler._answer  # type: ignore[attr-defined]
        outer = self

        def counted(this: Any) -> None:
            outer.count += 1
            original(this)

        handler._answer = counted  # type: ignore[attr-defined]


@pytest.mark.system
def test_a_ready_server_is_probed_every_ready_interval_and_a_failure_speeds_up_at_once(
    start_exporter: Any, tmp_path: Path
) -> None:
    server = CountingServer()
    server_process = subprocess.Popen(["sleep", "60"])
    pidfile = tmp_path / "server.pid"
    pidfile.write_text(f"{server_process.pid}\n")
    try:
        running = start_exporter(
            {"sample_interval": "100ms",
             "targets": [{"name": "m", "endpoint": {"url": server.url, "ready_interval": "1s"},
                          "process": {"pidfile": str(pidfile)}}]}
        )  # fmt: skip
        settled_ready(running.url, "m")
        time.sleep(0.5)
        before = server.count
        time.sleep(3.0)
        assert server.count - before <= 4  # every 1 s, not every 100 ms (30)
        server.mode = "503"
        wait_for(lambda: server.count - before >= 12, timeout=5)  # back to every 100 ms
    finally:
        server_process.kill()
        server_process.wait()
        server.close()


@pytest.mark.system
def test_readiness_is_seen_within_a_fraction_of_the_sample_interval(tmp_path: Path) -> None:
    """Probes every interval / 4 while initializing, and the load ends at the ready probe."""
    weights = cold_checkpoint(tmp_path / "model", 2, 4 << 20)
    port, exporter_port = free_port(), free_port()
    report, pidfile = tmp_path / "report.json", tmp_path / "server.pid"
    simulator = subprocess.Popen(
        [sys.executable, "-m", "exporter", "simulate", "--port", str(port),
         "--weights", str(weights), "--pidfile", str(pidfile), "--report", str(report),
         "--startup-seconds", "1", "--init-seconds", "2.5", "--read-rate", "20MB/s",
         "--port-style", "503",
         "--log-file", str(tmp_path / "server.log")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    exporter = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--target", "m",
         "--endpoint", f"http://127.0.0.1:{port}", "--weights", str(weights),
         "--pidfile", str(pidfile), f"--history.path={tmp_path / 'h.sqlite'}", "--sample.interval=1s",
         f"--web.listen-address=127.0.0.1:{exporter_port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        wait_for(lambda: report.exists() and report.read_text(), timeout=60)
        ready_at = json.loads(report.read_text())["ready_at"]

        def loads() -> list[dict[str, Any]]:
            try:
                url = f"http://127.0.0.1:{exporter_port}/api/v1/loads"
                return list(requests.get(url, timeout=5).json()["loads"])
            except requests.RequestException:
                return []

        (load,) = wait_for(loads, timeout=20)
        url = f"http://127.0.0.1:{exporter_port}/metrics"
        text = requests.get(url, timeout=5).text
    finally:
        for proc in (exporter, simulator):
            proc.terminate()
            proc.wait(timeout=10)
    assert load["outcome"] == "ready"
    # 503s answered: 1/s while starting and loading, 4/s once the tracker's tick (1 s apart) has
    # seen initializing, so at least (2.5 - 1) s x 4 = 6 fast ones. At the sample interval alone
    # the whole 503 window (1 s start-up, 0.4 s of weights, 2.5 s initializing) holds at most 4.
    answered_503 = sample_value(
        text, "model_load_endpoint_probes_total", target="m", result="http_error"
    )
    assert answered_503 is not None and answered_503 >= 6, answered_503
    assert 0 <= load["ended_at"] - ready_at < 0.4, (
        load["ended_at"],
        ready_at,
    )  # probes 0.25 s apart
