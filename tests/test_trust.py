"""Issue 20, row by row: no other user can steer, blind or read through the exporter.

The exporter runs as root with no config (discovery on), a real subprocess; what it discovers
are real processes of `nobody` whose command lines say they are model servers
(tests/helpers/fakeservers.py), with real root-only files, a real FIFO, a real symlink to
/dev/zero and a real network namespace. Each test is named after a row of the issue's tables
and failed before its fix (the report says how); the HTTP rows drive the same subprocess.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.fakeservers import SYSTEM_PYTHON, FakeServers, world_dir
from helpers.hostile import REPO, ExporterProcess, Listener, discovering_exporter
from helpers.support import free_port, metrics_when, sample_value, wait_for
from helpers.users import NOBODY

from exporter.trust.asprocess import Actor, Rights, own_rights

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv")]

SECRET = "sk-root-only-0a1b2c3d"


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A directory only root may enter, holding weight files (a config with a secret, later)."""
    path = world_dir("root-only-")
    path.chmod(0o700)
    (path / "hidden-00001-of-00001.safetensors").write_bytes(b"\0" * 8192)
    (path / "known.safetensors").write_bytes(b"\0" * 4096)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory of nobody's own."""
    path = world_dir("nobody-")
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[ExporterProcess]:
    with discovering_exporter(tmp_path) as running:
        yield running


def targets(exporter: ExporterProcess) -> dict[int, dict[str, Any]]:
    """Discovered targets by the pid of their server process."""
    status = exporter.get("/api/v1/status").json()
    return {t["discovered"]["pid"]: t for t in status["targets"] if "discovered" in t}


def found(exporter: ExporterProcess, pid: int, timeout: float = 10) -> dict[str, Any]:
    return dict(wait_for(lambda: targets(exporter).get(pid), timeout=timeout))


def refused(exporter: ExporterProcess, reason: str) -> float:
    text = exporter.get("/metrics").text
    return sample_value(text, "model_load_discovery_refused_total", reason=reason) or 0.0


def fake_weights(directory: Path, name: str, size: int) -> Path:
    """A model directory of nobody's with one weight file of `size` bytes."""
    model = directory / name
    model.mkdir()
    (model / "model-00001-of-00001.safetensors").write_bytes(b"\1" * size)
    for path in (model, *model.iterdir()):
        os.chown(path, NOBODY, NOBODY)
    return model


def socket_owned_by(pid: int, peer: tuple[str, int]) -> bool:
    """Whether process `pid` holds the TCP socket connected from `peer` (this host is shared:
    other exporters with discovery on probe our fake servers too, and must not count)."""
    port = f"{peer[1]:04X}"
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[1].endswith(f":{port}"):
                inodes.add(f"socket:[{fields[9]}]")
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") in inodes:
                return True
        except OSError:
            continue
    return False


class Recorder(Listener):
    """A loopback listener that keeps every request head the exporter under test sends it (a
    user's own listener)."""

    def __init__(self, exporter: ExporterProcess) -> None:
        self.heads: list[bytes] = []
        self._pid = exporter.pid
        super().__init__()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2)
            try:
                peer = conn.getpeername()
                head = conn.recv(65536)
                if socket_owned_by(self._pid, peer):
                    self.heads.append(head)
                conn.sendall(b"HTTP/1.1 503 Loading\r\nContent-Length: 0\r\n\r\n")
            except OSError:
                return


def a_later_server_is_found(exporter: ExporterProcess) -> None:
    """Discovery still works: a server started now is found within a few passes."""
    later = FakeServers([["vllm", "serve", "later", "--port", str(free_port())]])
    try:
        found(exporter, later.pids[0], timeout=5)
    finally:
        later.stop()


# -- table 1, row 1: a root-only config names the key and the port ------------------------------


def test_row_a_root_only_config_never_sends_its_key_to_the_users_listener(
    exporter: ExporterProcess, root_dir: Path, user_dir: Path
) -> None:
    listener = Recorder(exporter)
    port = listener.port
    config = root_dir / "vllm.yaml"
    config.write_text(f"api-key: {SECRET}\nport: {port}\n")
    config.chmod(0o600)
    model = fake_weights(user_dir, "Tiny", 4096)
    fakes = FakeServers([["vllm", "serve", str(model), "--config", str(config)]])
    try:
        [pid] = fakes.pids
        target = found(exporter, pid)
        time.sleep(1.5)  # several probe intervals: the listener would have heard by now
        assert not any(SECRET.encode() in head for head in listener.heads), listener.heads
        assert listener.heads == []  # not even a probe: the port came from the unread file
        assert f":{port}" not in target["endpoint"]
        why = {(e["what"], e["value"]) for e in target["discovered"]["why"]}
        assert ("config_file", str(config)) in why  # said, as the user wrote it: not readable
        assert refused(exporter, "unreadable") >= 1
    finally:
        fakes.stop()
        listener.close()


# -- row 2: paths the user cannot read: sizes, counts, residency, names ------------------------


def test_row_files_the_user_cannot_read_are_neither_measured_counted_nor_named(
    exporter: ExporterProcess, root_dir: Path, user_dir: Path
) -> None:
    own = fake_weights(user_dir, "Mixed", 12288)
    # Symlinks in the user's own directory pointing at root's files.
    (own / "stolen.safetensors").symlink_to(root_dir / "hidden-00001-of-00001.safetensors")
    (own / "shadow.safetensors").symlink_to("/etc/shadow")
    ports = [free_port() for _ in range(5)]
    argvs = [
        ["vllm", "serve", "/etc/shadow", "--port", str(ports[0])],
        ["python3", "-m", "sglang.launch_server", "--model-path", str(root_dir),
         "--port", str(ports[1])],
        ["vllm", "serve", str(own), "--port", str(ports[2])],
        ["vllm", "serve", f"{root_dir}/known.safetensors", "--port", str(ports[3])],
        ["vllm", "serve", f"{root_dir}/absent.safetensors", "--port", str(ports[4])],
    ]  # fmt: skip
    fakes = FakeServers(argvs)
    try:
        shadow, root_tree, mixed, present, absent = (found(exporter, p) for p in fakes.pids)
        time.sleep(1.0)  # residency passes and disk lookups have run
        text = exporter.get("/metrics").text
        status = exporter.get("/api/v1/status").text
        for target in (shadow, root_tree, present, absent):
            name = target["target"]
            assert target["discovered"]["weights"] == [], name
            assert "residency" not in target, name
            for metric in ("weights_bytes", "weights_files", "weights_resident_bytes"):
                assert sample_value(text, f"model_load_{metric}", target=name) is None, name
        # Only the user's own file counts: not root's file, not /etc/shadow behind symlinks.
        assert sample_value(text, "model_load_weights_files", target=mixed["target"]) == 1
        assert sample_value(text, "model_load_weights_bytes", target=mixed["target"]) == 12288
        # What only root can list is named nowhere (what the user wrote is theirs to see). Other
        # tests' servers on this host may name that file in their own command lines: only this
        # test's targets are judged.
        ours = {t["target"] for t in (shadow, root_tree, mixed, present, absent)}
        lines = [line for line in text.splitlines() if any(f'"{n}"' in line for n in ours)]
        documents = [t for t in json.loads(status)["targets"] if t["target"] in ours]
        assert lines and "hidden-00001" not in "\n".join(lines)
        assert len(documents) == len(ours) and "hidden-00001" not in json.dumps(documents)

        # A missing path and an existing one look the same to the user, and so here.
        def weights_why(target: dict[str, Any]) -> list[tuple[str, str]]:
            return [(e["value"], e["source"]) for e in target["discovered"]["why"]
                    if e["what"] == "weights"]  # fmt: skip

        assert weights_why(present) == weights_why(absent)
    finally:
        fakes.stop()


def test_a_found_log_is_read_with_the_servers_rights(
    exporter: ExporterProcess, user_dir: Path
) -> None:
    # The server's standard error is its user's file, but one its user may only write: read as
    # root, it would give the exporter the server's markers; read as the server, nothing.
    log_file = user_dir / "server.log"
    log_file.write_text(
        "(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.32\n"
        "(Worker pid=2) INFO 12-01 10:00:01 [cpu_model_runner.py:68] Starting to load model m...\n"
    )
    os.chown(log_file, NOBODY, NOBODY)
    log_file.chmod(0o200)
    fakes = FakeServers([["vllm", "serve", "m", "--port", str(free_port())]], stderr=log_file)
    try:
        target = found(exporter, fakes.pids[0])

        def log_state() -> dict[str, Any] | None:
            entry = targets(exporter).get(fakes.pids[0]) or {}
            state = entry.get("log") or {}
            return state if state.get("reason") else None

        state = wait_for(log_state, timeout=10)
        assert "server.log" in state["found_by"]
        assert "Permission denied" in state["reason"], state
        assert state["format"] is None and state["lines"] == 0, target["target"]
    finally:
        fakes.stop()


# -- row 3: a FIFO as the config file ------------------------------------------------------------


def test_row_a_fifo_as_config_blocks_no_pass(exporter: ExporterProcess, user_dir: Path) -> None:
    fifo = user_dir / "vllm.yaml"
    os.mkfifo(fifo)
    os.chown(fifo, NOBODY, NOBODY)
    blocking = FakeServers([["vllm", "serve", "m", "--config", str(fifo)]])
    try:
        found(exporter, blocking.pids[0])
        a_later_server_is_found(exporter)
        assert refused(exporter, "not_regular") >= 1
    finally:
        blocking.stop()


# -- row 4: refs/main is a symlink to /dev/zero ------------------------------------------------


def test_row_refs_main_to_dev_zero_costs_no_memory_and_no_core(
    exporter: ExporterProcess, user_dir: Path
) -> None:
    repo = user_dir / "hub" / "models--acme--Zero"
    (repo / "refs").mkdir(parents=True)
    (repo / "snapshots").mkdir()
    (repo / "refs" / "main").symlink_to("/dev/zero")
    for path in (user_dir / "hub", repo, repo / "refs", repo / "snapshots"):
        os.chown(path, NOBODY, NOBODY)
    zero = FakeServers(
        [["vllm", "serve", "acme/Zero", "--port", str(free_port())]],
        env={"HF_HUB_CACHE": str(user_dir / "hub")},
    )
    try:
        found(exporter, zero.pids[0])
        cpu, rss = exporter.cpu_seconds(), exporter.rss_bytes()
        a_later_server_is_found(exporter)
        time.sleep(2.0)
        used = exporter.cpu_seconds() - cpu
        assert used < 0.5, f"{used:.2f}s of CPU in 2 s beside a /dev/zero ref"
        assert exporter.rss_bytes() < rss + (32 << 20)
        assert refused(exporter, "not_regular") >= 1
    finally:
        zero.stop()


# -- row 5: a served model name that is not UTF-8 -----------------------------------------------


def test_row_a_served_model_name_that_is_not_utf8_breaks_no_scrape(
    exporter: ExporterProcess, user_dir: Path
) -> None:
    port = free_port()
    fakes = FakeServers(
        [
            [
                b"vllm",
                b"serve",
                b"m",
                b"--served-model-name",
                b"caf\xe9\x1b[2J\xff",
                b"--port",
                str(port).encode(),
            ]
        ]
    )
    try:
        target = found(exporter, fakes.pids[0])
        response = exporter.get("/metrics")
        assert response.status_code == 200
        info = sample_value(response.text, "model_load_target_info", target=target["target"])
        assert info == 1
        assert 'model="caf\ufffd[2J\ufffd"' in response.text  # replaced, escape dropped
    finally:
        fakes.stop()
    # Gone, kept for keep_for: every scrape meanwhile still answers.
    time.sleep(0.6)
    assert exporter.get("/metrics").status_code == 200
    assert exporter.get("/api/v1/status").status_code == 200


# -- row 6: a flood of fake servers, gone, then another --------------------------------------------


def test_row_a_flood_of_fake_servers_stays_within_the_bounds(
    exporter: ExporterProcess, user_dir: Path
) -> None:
    """Two waves of 60 (the 2,000-process flood is bench/trust_flood.py): at most the per-user
    share of targets, threads and memory bounded, scrapes fast; what was refused is counted."""
    metrics_when(exporter.url, lambda t: "model_load_discovery_refused_total" in t)
    threads, rss = exporter.threads(), exporter.rss_bytes()
    for wave in range(2):
        ports = [free_port() for _ in range(60)]
        fakes = FakeServers([["vllm", "serve", f"fake-{wave}", "--port", str(p)] for p in ports])
        expected = (wave + 1) * 44
        try:
            wait_for(lambda n=expected: refused(exporter, "user_share") >= n, timeout=15)
            ours = [pid for pid in targets(exporter) if pid in fakes.pids]
            assert len(ours) == 16  # discovery.max_targets_per_user: gone ones made room
        finally:
            fakes.stop()
        wait_for(lambda f=fakes: all_gone(exporter, f.pids), timeout=10)
    started = time.monotonic()
    assert exporter.get("/metrics").status_code == 200
    scrape = time.monotonic() - started
    print(f"\nthreads {threads} -> {exporter.threads()}, RSS {rss >> 20} -> "
          f"{exporter.rss_bytes() >> 20} MiB, scrape {scrape * 1000:.0f} ms")  # fmt: skip
    assert len(targets(exporter)) <= 32
    assert exporter.threads() <= threads + 16 * 5
    assert exporter.rss_bytes() < rss + (64 << 20)
    assert scrape < 1.0


def all_gone(exporter: ExporterProcess, pids: list[int]) -> bool:
    """Every target of these pids seen gone (its load failed), before the next wave comes."""
    return all(t["phase"] in ("failed", "down") for p, t in targets(exporter).items() if p in pids)


# -- row 7: vllm serve /proc ---------------------------------------------------------------


def test_row_proc_as_the_model_walks_nothing(exporter: ExporterProcess, user_dir: Path) -> None:
    (user_dir / "model").symlink_to("/proc")
    os.lchown(user_dir / "model", NOBODY, NOBODY)
    fakes = FakeServers(
        [
            ["vllm", "serve", "/proc", "--port", str(free_port())],
            ["vllm", "serve", str(user_dir / "model"), "--port", str(free_port())],
            ["vllm", "serve", "/sys/../proc/1/root", "--port", str(free_port())],
        ]
    )
    try:
        cpu = exporter.cpu_seconds()
        seen = [found(exporter, pid) for pid in fakes.pids]
        time.sleep(1.5)
        assert all(t["discovered"]["weights"] == [] for t in seen)
        assert exporter.cpu_seconds() - cpu < 0.5
        assert refused(exporter, "pseudo_filesystem") >= 3
    finally:
        fakes.stop()


# -- row 8: hosts from a command line: metadata, another host, another namespace's loopback --


def test_row_probes_go_only_where_the_server_is(exporter: ExporterProcess) -> None:
    listener = Recorder(exporter)
    port = listener.port
    outside = [
        ["vllm", "serve", "meta", "--host", "169.254.169.254", "--port", "80"],
        ["vllm", "serve", "scan", "--host", "192.0.2.7", "--port", "22"],
    ]
    fakes = FakeServers(outside)
    contained: FakeServers | None = None
    try:
        # From a network namespace of its own, the host's loopback spelled IPv4-mapped.
        contained = FakeServers(
            [["vllm", "serve", "mapped", "--host", "::ffff:127.0.0.1", "--port", str(port)]],
            prefix=["unshare", "-n"],
        )
        wait_for(lambda: refused(exporter, "unreachable") >= 3, timeout=10)
        time.sleep(1.0)
        watched = targets(exporter)
        assert not {*fakes.pids, *contained.pids} & watched.keys()
        assert listener.heads == []  # the host's loopback was never probed for it
    finally:
        fakes.stop()
        if contained is not None:
            contained.stop()
        listener.close()


# -- the HTTP table ----------------------------------------------------------------------------


def raw(exporter: ExporterProcess, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", exporter.port), timeout=5) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


def test_row_a_non_ascii_digit_in_content_length_is_a_400_without_a_traceback(
    exporter: ExporterProcess,
) -> None:
    before = len(exporter.stderr())
    for digit in ("²".encode("latin-1"), "²".encode(), "٣".encode()):  # 0xB2, then UTF-8
        request = b"POST /-/reload HTTP/1.1\r\nHost: a\r\nContent-Length: " + digit + b"\r\n\r\n"
        for _ in range(100):
            assert raw(exporter, request).startswith(b"HTTP/1.1 400 "), digit
    logged = exporter.stderr()[before:]
    assert "Traceback" not in logged and "level=error" not in logged, logged[:2000]


def test_row_a_header_name_ending_in_a_newline_is_refused(exporter: ExporterProcess) -> None:
    answer = raw(exporter, b"GET /metrics HTTP/1.1\r\nHost: a\r\nX-Evil\n: 1\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 400 ")


def test_row_a_non_ascii_limit_is_a_400(exporter: ExporterProcess) -> None:
    for limit in ("²", "٣", "1e3", " 5", "0", "1001"):
        response = exporter.get("/api/v1/loads", params={"limit": limit})
        assert response.status_code == 400, limit
    assert exporter.get("/api/v1/loads", params={"limit": "5"}).status_code == 200
    assert "Traceback" not in exporter.stderr()


def test_row_a_cross_origin_form_post_to_reload_is_refused(exporter: ExporterProcess) -> None:
    form = {"Content-Type": "application/x-www-form-urlencoded"}
    for headers in (
        {**form, "Origin": "http://evil.example"},
        {**form, "Origin": "null"},
        {**form, "Sec-Fetch-Site": "cross-site"},
    ):
        answer = requests.post(exporter.url + "/-/reload", headers=headers, data="a=1", timeout=30)
        assert answer.status_code == 403, headers
    assert "config reloaded" not in exporter.stderr()
    same = {"Origin": exporter.url, "Sec-Fetch-Site": "same-origin"}
    assert requests.post(exporter.url + "/-/reload", headers=same, timeout=30).status_code == 200
    assert requests.post(exporter.url + "/-/reload", timeout=30).status_code == 200  # curl


def test_row_any_host_is_refused_with_allowed_hosts(tmp_path: Path) -> None:
    running = ExporterProcess(
        ["--target", "m", "--endpoint", "http://127.0.0.1:1", "--history.path=",
         "--web.allowed-hosts=127.0.0.1,gpu-7.example"]
    )  # fmt: skip
    try:
        running.wait_listening()
        assert running.get("/-/healthy", headers={"Host": "evil.example"}).status_code == 421
        assert running.get("/-/healthy", headers={"Host": "gpu-7.example:9847"}).status_code == 200
        for path, status in (("/-/healthy", 200), ("/nothing", 404), ("/-/reload", 405)):
            response = running.get(path)
            assert response.status_code == status
            assert response.headers["X-Content-Type-Options"] == "nosniff"
    finally:
        running.close()


# -- acting with a process's rights, proven on real threads and capabilities ------------------


def _status_of(tid: int) -> dict[str, list[str]]:
    text = Path(f"/proc/self/task/{tid}/status").read_text()
    return {line.split(":")[0]: line.split(":", 1)[1].split() for line in text.splitlines()}


def test_other_threads_keep_roots_rights_while_a_worker_acts_as_nobody(root_dir: Path) -> None:
    secret = root_dir / "vllm.yaml"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    actor = Actor()
    inside, release = threading.Event(), threading.Event()

    def as_nobody() -> tuple[int, str]:
        tid = threading.get_native_id()
        inside.set()
        release.wait(5)
        try:
            secret.read_text()
        except PermissionError as exc:
            return tid, exc.strerror or "denied"
        return tid, "read"

    result: list[tuple[int, str]] = []
    worker = threading.Thread(
        target=lambda: result.append(actor.call(Rights(NOBODY, NOBODY, ()), as_nobody))
    )
    worker.start()
    try:
        assert inside.wait(5)
        # While the worker holds nobody's rights, this thread (and the process) keeps root's.
        assert secret.read_text() == SECRET
        assert _status_of(threading.get_native_id())["Uid"] == ["0", "0", "0", "0"]
        mine = own_rights()
        assert mine.uid == 0 and mine.capabilities != 0
    finally:
        release.set()
        worker.join(5)
        actor.close()
    [(tid, outcome)] = result
    assert outcome == "Permission denied"
    assert tid != threading.get_native_id()


_UNPRIVILEGED_CHECK = r"""
import sys
sys.path.insert(0, sys.argv[1])
from exporter.trust.asprocess import Actor, Rights
path = sys.argv[2]
direct = open(path).read()  # CAP_DAC_READ_SEARCH lets this uid read root's 0600 file
try:
    Actor().call(Rights(65534, 65534, ()), lambda: open(path).read())
    print("read as nobody")
except PermissionError:
    print("refused as nobody")
"""


def test_an_unprivileged_exporter_keeps_no_capability_while_acting_for_a_user(
    root_dir: Path,
) -> None:
    """fsuid 65533 -> 65534 does not clear the file-system capabilities (only a change from
    fsuid 0 does, capabilities(7)): the worker must drop them itself, which this shows."""
    secret = root_dir / "vllm.yaml"
    secret.write_text(SECRET)
    secret.chmod(0o600)
    caps = "+dac_read_search,+setuid,+setgid"
    done = subprocess.run(
        ["setpriv", "--reuid=65533", "--regid=65533", "--clear-groups", f"--inh-caps={caps}",
         f"--ambient-caps={caps}", SYSTEM_PYTHON, "-c", _UNPRIVILEGED_CHECK, str(REPO),
         str(secret)],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "refused as nobody"


def test_a_file_opened_for_the_log_finder_is_opened_with_the_process_rights(
    root_dir: Path, user_dir: Path
) -> None:
    """log_opener: how a found log is opened, with its process's rights as on_behalf_of takes
    them for a configured target's process."""
    from exporter.runtime.admission import on_behalf_of
    from exporter.runtime.logfollow import log_opener

    log = user_dir / "server.log"
    log.write_text("ready\n")
    os.chown(log, NOBODY, NOBODY)
    fakes = FakeServers([["vllm", "serve", "m", "--port", str(free_port())]])
    actor = Actor()
    try:
        [pid] = fakes.pids
        open_as = log_opener(on_behalf_of(actor, "/proc", pid))
        fd = open_as(str(log))
        try:
            assert os.read(fd, 100) == b"ready\n"
        finally:
            os.close(fd)
        with pytest.raises(PermissionError):
            open_as(str(root_dir / "known.safetensors"))
        with pytest.raises(OSError) as refused_fifo:
            fifo = user_dir / "fifo"
            os.mkfifo(fifo)
            open_as(str(fifo))
        assert getattr(refused_fifo.value, "reason", None) == "not_regular"
        assert stat.S_ISFIFO(os.stat(user_dir / "fifo").st_mode)
    finally:
        actor.close()
        fakes.stop()


def test_a_hung_file_access_is_given_up_and_its_worker_replaced() -> None:
    """A hung NFS or FUSE mount must not hold discovery: the call times out, a new worker takes
    the next call, and past MAX_STUCK hung workers calls are refused at once."""
    from exporter.trust.asprocess import MAX_STUCK

    actor = Actor(timeout=0.2)
    release = threading.Event()
    try:
        for _ in range(MAX_STUCK):
            with pytest.raises(TimeoutError):
                actor.call(own_rights(), lambda: release.wait(30))
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="refusing more"):
            actor.call(own_rights(), lambda: "never run")
        assert time.monotonic() - started < 0.1
        release.set()  # the hung accesses come back: their workers serve again
        assert wait_for(lambda: _answers(actor), timeout=5) == "served"
    finally:
        release.set()
        actor.close()


def _answers(actor: Actor) -> str | None:
    try:
        return actor.call(own_rights(), lambda: "served")
    except TimeoutError:
        return None
