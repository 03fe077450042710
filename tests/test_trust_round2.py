"""Issue 27, second trust round, row by row: no other user borrows the exporter's rights.

The exporter runs as root; the attacker is `nobody` with real processes (setpriv), a real user
namespace (`unshare -Ur`), a real setuid-root program, a real cgroup made in the layout systemd
delegates to a user. Each test is named after its row and failed on the code before its fix.
(Rows 4 and 5, log CPU and marking server text, are tested elsewhere.)
"""

from __future__ import annotations

import base64
import os
import secrets
import shutil
import socket
import stat
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from helpers.cgroups import cgroups, hierarchies, joining
from helpers.fakeservers import SYSTEM_PYTHON, FakeServers, world_dir
from helpers.hostile import ExporterProcess, discovering_exporter
from helpers.pagecache_io import MIB, read_all, write_cold_file
from helpers.processes import cli
from helpers.support import free_port, sample_value, wait_for
from helpers.users import NOBODY, SETPRIV, as_nobody
from test_trust import found, refused, targets

from exporter.history.store import HistoryStore
from exporter.trust.asprocess import Borrowed, rights_of

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv")]


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory of nobody's own."""
    path = world_dir("nobody-")
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A root-owned directory every user may enter (pytest's tmp_path is 0700: no test there)."""
    path = world_dir("round2-")
    yield path
    shutil.rmtree(path)


SECRET = "DB_PASSWORD=hunter2-root-only"


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """A directory only root may enter: a weight file and a log with a secret in it."""
    path = world_dir("root-only-")
    path.chmod(0o700)
    (path / "hidden-00001-of-00001.safetensors").write_bytes(b"\0" * 8192)
    log = path / "app.log"
    log.write_text(
        "(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1] vLLM API server version 0.32\n"
        f"RuntimeError: Engine core initialization failed. {SECRET}\n"
    )
    log.chmod(0o600)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def exporter(tmp_path: Path) -> Iterator[ExporterProcess]:
    with discovering_exporter(tmp_path) as running:
        yield running


def log_of(exporter: ExporterProcess, pid: int) -> dict[str, Any]:
    return dict((targets(exporter).get(pid) or {}).get("log") or {})


def nobody_reads(path: Path) -> bool:
    done = as_nobody("/bin/dd", f"if={path}", "of=/dev/null", "status=none")
    return done.returncode == 0


# -- row 6: history.sqlite was 0644 in a 0755 directory ---------------------------------------


def test_row6_the_history_file_is_0600_in_a_0700_directory(shared_dir: Path) -> None:
    path = shared_dir / "var" / "lib" / "mle" / "history.sqlite"
    store = HistoryStore(str(path))
    assert store.enabled, store.problem
    store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert not nobody_reads(path)


def test_row6_an_older_versions_open_history_is_tightened(shared_dir: Path) -> None:
    dedicated = shared_dir / "mle"
    dedicated.mkdir(mode=0o755)
    dedicated.chmod(0o755)
    path = dedicated / "history.sqlite"
    HistoryStore(str(path)).close()
    for loose in (path, Path(f"{path}-journal")):
        loose.touch()
        loose.chmod(0o644)
    dedicated.chmod(0o755)
    assert nobody_reads(path)  # as an older version left it
    store = HistoryStore(str(path))
    assert store.enabled, store.problem
    store.close()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(Path(f"{path}-journal").stat().st_mode) == 0o600
    assert stat.S_IMODE(dedicated.stat().st_mode) == 0o700
    assert not nobody_reads(path)


def test_row6_a_shared_directory_is_left_as_it_is_and_the_file_alone_private(
    shared_dir: Path,
) -> None:
    (shared_dir / "other-things").write_text("not the history's")
    path = shared_dir / "history.sqlite"
    HistoryStore(str(path)).close()
    assert stat.S_IMODE(shared_dir.stat().st_mode) == 0o755  # /var/lib stays 0755
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert not nobody_reads(path)


def test_row6_a_planted_file_symlink_or_open_directory_is_refused(
    shared_dir: Path, user_dir: Path
) -> None:
    planted = user_dir / "history.sqlite"  # nobody made it first, to read what is written
    planted.touch()
    os.chown(planted, NOBODY, NOBODY)
    linked = shared_dir / "history.sqlite"
    linked.symlink_to(shared_dir / "elsewhere.sqlite")
    open_dir = shared_dir / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    for path, why in (
        (planted, f"belongs to uid {NOBODY}"),
        (linked, "cannot open"),
        (open_dir / "history.sqlite", "writable by other users"),
    ):
        store = HistoryStore(str(path))
        assert not store.enabled and store.problem is not None and why in store.problem, path
    assert not (shared_dir / "elsewhere.sqlite").exists()
    assert planted.stat().st_size == 0


# -- row 9: no Cache-Control: no-store behind basic auth; nosniff twice on / ------------------


@pytest.fixture
def authed_exporter(tmp_path: Path) -> Iterator[ExporterProcess]:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web = tmp_path / "web.yml"
    web.write_text(yaml.safe_dump({"basic_auth_users": {"prom": hashed}}))
    running = ExporterProcess(
        ["--target", "m", "--endpoint", "http://127.0.0.1:1", "--history.path=",
         f"--web.config.file={web}"]
    )  # fmt: skip
    running.wait_listening()
    yield running
    running.close()


def head_lines(port: int, path: str, authorization: str | None) -> list[tuple[str, str]]:
    """The response's header lines as sent, repeats kept (requests would join them)."""
    auth = f"Authorization: {authorization}\r\n" if authorization else ""
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Connection: close\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request.encode())
        answer = b""
        while b"\r\n\r\n" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
    head = answer.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")[1:]
    return [(k.lower(), v.strip()) for k, _, v in (line.partition(":") for line in head)]


def test_row9_authenticated_answers_are_not_stored_and_each_header_is_sent_once(
    authed_exporter: ExporterProcess,
) -> None:
    good = "Basic " + base64.b64encode(b"prom:s3cret").decode()
    for path in ("/metrics", "/api/v1/status", "/api/v1/loads", "/", "/-/healthy"):
        lines = head_lines(authed_exporter.port, path, good)
        names = [name for name, _ in lines]
        assert len(names) == len(set(names)), (path, lines)
        assert dict(lines)["cache-control"] == "no-store", path
        assert dict(lines)["x-content-type-options"] == "nosniff", path
    page = dict(head_lines(authed_exporter.port, "/", good))
    assert "content-security-policy" in page  # the page's own headers are kept


def test_row9_without_auth_the_page_still_sends_nosniff_once(tmp_path: Path) -> None:
    running = ExporterProcess(["--target", "m", "--endpoint", "http://127.0.0.1:1",
                               "--history.path="])  # fmt: skip
    try:
        running.wait_listening()
        lines = head_lines(running.port, "/", None)
        assert [n for n, _ in lines].count("x-content-type-options") == 1, lines
        assert dict(lines)["cache-control"] == "no-cache"  # a page of no one's data
    finally:
        running.close()


# -- row 1: a fake server in its own user namespace (unshare -Ur) ------------------------------


def test_row1_capabilities_in_a_user_namespace_give_nothing(
    exporter: ExporterProcess, root_dir: Path, user_dir: Path
) -> None:
    weights = root_dir / "hidden-00001-of-00001.safetensors"
    log = user_dir / "server.log"
    log.write_text("(APIServer pid=1) INFO 12-01 10:00:00 [api_server.py:1] vLLM API server\n")
    os.chown(log, NOBODY, NOBODY)
    argv = ["vllm", "serve", str(weights), "--port", str(free_port())]
    fakes = FakeServers([argv], wrap=["unshare", "-Ur"], stderr=log)
    try:
        [pid] = fakes.pids
        assert "CapEff:\t000001ff" in Path(f"/proc/{pid}/status").read_text()  # a full set, there
        target = found(exporter, pid)
        wait_for(lambda: "server.log" in (log_of(exporter, pid).get("found_by") or ""))
        # Then its standard error's path is swapped for a symlink to root's log.
        log.rename(user_dir / "server.log.1")
        log.symlink_to(root_dir / "app.log")
        os.lchown(log, NOBODY, NOBODY)
        reason = wait_for(lambda: log_of(exporter, pid).get("reason"), timeout=10)
        assert "Permission denied" in reason, reason
        time.sleep(1.0)  # residency passes and log samples have run
        text, status = exporter.get("/metrics").text, exporter.get("/api/v1/status").text
        assert target["discovered"]["weights"] == []
        name = target["target"]
        assert sample_value(text, "model_load_weights_bytes", target=name) is None
        assert SECRET not in status, log_of(exporter, pid)
        assert log_of(exporter, pid)["fatal"] is None
    finally:
        fakes.stop()


# -- row 2: a setuid-root program under a server's name ------------------------------------------


@pytest.fixture
def setuid_sleep() -> Iterator[Path]:
    """A setuid-root and a setgid-root copy of sleep, where nobody may run them."""
    directory = world_dir("setuid-")
    for name, mode in (("suid-sleep", 0o4755), ("sgid-sleep", 0o2755)):
        shutil.copy("/bin/sleep", directory / name)
        (directory / name).chmod(mode)
    yield directory
    shutil.rmtree(directory)


def as_server(argv0: str, program: str, *args: str) -> subprocess.Popen[bytes]:
    """`exec -a argv0 program args` as nobody, its stdin a pipe nobody writes to."""
    return subprocess.Popen(
        [*SETPRIV, "/bin/bash", "-c", f'exec -a {argv0} "$@"', "bash", program, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def test_row2_a_setuid_program_is_no_server_read_for(
    exporter: ExporterProcess, setuid_sleep: Path
) -> None:
    servers = [
        as_server("llama-server", "/usr/bin/su", "root"),  # at its password prompt
        as_server("llama-server", str(setuid_sleep / "suid-sleep"), "120"),
        as_server("llama-server", str(setuid_sleep / "sgid-sleep"), "120"),
    ]
    plain = FakeServers([["llama-server", "--port", str(free_port())]])
    try:
        wait_for(lambda: all(Path(f"/proc/{p.pid}/cmdline").read_bytes().startswith(b"llama-")
                             for p in servers))  # fmt: skip
        found(exporter, plain.pids[0])  # a plain one of nobody's is a server
        time.sleep(1.5)  # more passes: none becomes a target, each is said once
        assert not {p.pid for p in servers} & targets(exporter).keys()
        assert refused(exporter, "borrowed_rights") == len(servers)
        said = exporter.stderr()
        for server in servers:
            assert said.count(f"pid {server.pid}: ") == 1, said[-2000:]
    finally:
        plain.stop()
        for server in servers:
            server.kill()
            server.wait()


_UNDUMPABLE = (
    "import ctypes, sys, time\n"
    "ctypes.CDLL(None).prctl(4, 0)\n"  # PR_SET_DUMPABLE 0
    "print('ready', flush=True)\n"
    "time.sleep(60)\n"
)


def test_row2_a_process_that_is_not_dumpable_or_in_another_namespace_lends_nothing() -> None:
    """rights_of on real processes of nobody's: not dumpable is refused; a user namespace's
    full capability set counts for nothing here; a plain process keeps its own."""
    undumpable = subprocess.Popen(
        [*SETPRIV, SYSTEM_PYTHON, "-c", _UNDUMPABLE], stdout=subprocess.PIPE
    )
    namespaced = subprocess.Popen([*SETPRIV, "unshare", "-Ur", "sleep", "60"])
    try:
        assert undumpable.stdout is not None and undumpable.stdout.readline() == b"ready\n"
        with pytest.raises(Borrowed, match="not dumpable"):
            rights_of(undumpable.pid)
        wait_for(lambda: Path(f"/proc/{namespaced.pid}/cmdline").read_bytes() == b"sleep\x0060\x00")
        rights = rights_of(namespaced.pid)
        assert (rights.uid, rights.gid, rights.capabilities) == (NOBODY, NOBODY, 0)
        assert rights_of(os.getpid()).capabilities != 0  # root here, in this namespace
    finally:
        for proc in (undumpable, namespaced):
            proc.kill()
            proc.wait()


# -- row 3: a system.slice/X.service of the user's own, under user@UID.service ---------------


@pytest.fixture
def delegated() -> Iterator[list[Path]]:
    """user@65534.service as systemd makes it for nobody: a cgroup delegated to that user (the
    directory and its cgroup.procs are theirs), in every cgroup hierarchy of this host."""
    relative = f"user.slice/user-{NOBODY}.slice/user@{NOBODY}.service"
    with cgroups(relative, hierarchies()) as dirs:
        for directory in dirs:
            for path in (directory, *directory.iterdir()):
                if path.name in ("", directory.name, "cgroup.procs", "cgroup.threads",
                                 "cgroup.subtree_control", "tasks"):  # fmt: skip
                    os.chown(path, NOBODY, NOBODY)
        yield dirs


def test_row3_a_unit_made_below_the_users_own_manager_is_no_unit(
    exporter: ExporterProcess, delegated: list[Path]
) -> None:
    unit = f"mle-evil-{secrets.token_hex(4)}.service"
    made = [d / "system.slice" / unit for d in delegated]
    # As nobody, inside its delegated subtree: make system.slice/UNIT and move itself there.
    moves = "".join(f"mkdir -p {m} && echo $$ > {m}/cgroup.procs && " for m in made)
    wrap = ["sh", "-c", f'{moves}exec "$@"', "sh"]
    fakes = FakeServers(
        [["vllm", "serve", "m", "--port", str(free_port())]],
        prefix=joining(delegated, []),
        wrap=wrap,
    )
    try:
        [pid] = fakes.pids
        assert (
            f"user@{NOBODY}.service/system.slice/{unit}" in Path(f"/proc/{pid}/cgroup").read_text()
        )
        found(exporter, pid)
        state = wait_for(lambda: unit in (log_of(exporter, pid).get("not_found") or "")
                         and log_of(exporter, pid))  # fmt: skip
        assert unit in state["not_found"] and "no systemd service" in state["not_found"]
        assert state.get("source") is None
        assert not journalctl_children(exporter)
    finally:
        fakes.stop()
        for m in reversed(made):
            wait_for(lambda m=m: _rmdir(m), timeout=10)


@pytest.mark.usefixtures("journald")  # a journal whose files exist, as on any systemd host
def test_row3_a_system_units_journal_is_read_with_its_processs_rights(
    exporter: ExporterProcess,
) -> None:
    unit = f"mle-ok-{secrets.token_hex(4)}.service"
    with cgroups(f"system.slice/{unit}", hierarchies()) as dirs:
        # As systemd starts a service with User=nobody: placed by root, then nobody's.
        fakes = FakeServers(
            [["vllm", "serve", "m", "--port", str(free_port())]], prefix=joining(dirs, [])
        )
        try:
            [pid] = fakes.pids
            found(exporter, pid)
            state = wait_for(lambda: log_of(exporter, pid).get("reason") and log_of(exporter, pid))
            assert state["source"] == f"journald:{unit}"
            # journalctl ran as nobody, who may not read the system journal: it says so.
            assert "insufficient permissions" in state["reason"], state
        finally:
            fakes.stop()


def journalctl_children(exporter: ExporterProcess) -> list[int]:
    """journalctl processes the exporter started, now."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat_line = (entry / "stat").read_text()
        except (OSError, NotADirectoryError):
            continue
        fields = stat_line.rsplit(")", 1)[-1].split()
        if int(fields[1]) == exporter.pid and "(journalctl)" in stat_line:
            found.append(int(entry.name))
    return found


def _rmdir(path: Path) -> bool:
    try:
        path.rmdir()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return True


@pytest.mark.parametrize(
    "path",
    [
        f"/user.slice/user-{NOBODY}.slice/user@{NOBODY}.service/system.slice/sshd.service",
        f"/user.slice/user-{NOBODY}.slice/user@{NOBODY}.service",
        "/system.slice/ssh*.service",
        "/system.slice/[a-z]*.service",
        "/system.slice/a b.service",
        "/../system.slice/x.service",
        f"/system.slice/{'a' * 250}.service",
    ],
)
def test_row3_only_a_valid_unit_from_the_root_is_a_unit(path: str) -> None:
    from exporter.logs.find import cgroup_owner

    assert cgroup_owner(path) is None


def test_row3_the_unit_is_matched_literally() -> None:
    from exporter.logs.journal import journalctl_command

    command = journalctl_command("vllm.service", 0.0, None, literal=True)
    assert "_SYSTEMD_UNIT=vllm.service" in command
    assert not any(arg.startswith("--unit") for arg in command)


# -- row 8: root runs prewarm on a directory the user controls ----------------------------------


def fincore(path: Path) -> int:
    """Resident bytes per util-linux's fincore (the kernel's mincore, as root)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


@pytest.fixture
def secret_weights() -> Iterator[Path]:
    """Root's own weights, 0600 in a 0700 directory, cold."""
    path = world_dir("root-weights-")
    path.chmod(0o700)
    write_cold_file(path / "secret.safetensors", 4 * MIB).chmod(0o600)
    yield path
    shutil.rmtree(path)


def users_model(user_dir: Path) -> Path:
    """nobody's model directory, one cold shard of its own."""
    model = user_dir / "model"
    model.mkdir()
    write_cold_file(model / "own.safetensors", 4 * MIB)
    for path in (model, model / "own.safetensors"):
        os.chown(path, NOBODY, NOBODY)
    return model


def link(path: Path, target: Path) -> None:
    path.symlink_to(target)
    os.lchown(path, NOBODY, NOBODY)


@pytest.mark.requires("fincore")
@pytest.mark.parametrize("how", ["file symlink", "directory symlink"])
def test_row8_prewarm_reads_nothing_of_roots_through_a_users_symlink(
    user_dir: Path, secret_weights: Path, how: str
) -> None:
    model = users_model(user_dir)
    secret = secret_weights / "secret.safetensors"
    if how == "file symlink":
        link(model / "stolen.safetensors", secret)
    else:
        link(model / "sub", secret_weights)
    done = cli("prewarm", str(model))
    assert done.returncode == 1, done.stdout
    assert "refusing" in done.stderr and "not readable by uid 65534" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert fincore(secret) == 0
    assert fincore(model / "own.safetensors") == 0  # refused before reading anything


@pytest.mark.requires("fincore")
def test_row8_evict_drops_nothing_of_roots_through_a_users_symlink(
    user_dir: Path, secret_weights: Path
) -> None:
    model = users_model(user_dir)
    secret = secret_weights / "secret.safetensors"
    link(model / "stolen.safetensors", secret)
    read_all(secret)
    resident = fincore(secret)
    assert resident > 0
    done = cli("prewarm", "--evict", str(model))
    assert done.returncode == 1 and "refusing" in done.stderr, done.stderr
    assert fincore(secret) >= resident - 16 * os.sysconf("SC_PAGE_SIZE")  # the VM's slow drift


@pytest.mark.requires("fincore")
def test_row8_a_users_own_files_are_read_with_their_rights(user_dir: Path) -> None:
    model = users_model(user_dir)
    done = cli("prewarm", str(model))
    assert done.returncode == 0, done.stderr
    assert fincore(model / "own.safetensors") > 0
    # A file of root's, 0600, in the user's directory: the user could not read it, nor does this.
    write_cold_file(model / "roots.safetensors", MIB).chmod(0o600)
    done = cli("prewarm", str(model))
    assert done.returncode == 1 and "roots.safetensors" in done.stderr, done.stderr
    assert fincore(model / "roots.safetensors") == 0


def test_row8_a_fifo_swapped_in_after_the_listing_hangs_nothing(user_dir: Path) -> None:
    from exporter.commands.prewarm import find_files
    from exporter.storage.cachectl import evict, prewarm_files
    from exporter.storage.ownedfiles import OwnedFiles
    from exporter.trust.safeio import Refused

    model = users_model(user_dir)
    files = find_files([str(model)], ["*.safetensors"])
    shard = model / "own.safetensors"
    shard.unlink()
    os.mkfifo(shard)  # no writer ever comes: a blocking open would wait forever
    os.chown(shard, NOBODY, NOBODY)
    owned = OwnedFiles(files)
    outcome: list[BaseException | int] = []

    def attempt() -> None:
        for call in (
            lambda: prewarm_files([(str(shard), 4 * MIB)], 1, opener=owned.open),
            lambda: evict(str(shard), owned.open),
        ):
            try:
                outcome.append(call())
            except BaseException as exc:  # what it raised is the answer
                outcome.append(exc)

    worker = threading.Thread(target=attempt, daemon=True)
    worker.start()
    worker.join(10)
    owned.close()
    assert not worker.is_alive(), "prewarm hung on a FIFO"
    assert all(isinstance(o, Refused) and o.reason == "not_regular" for o in outcome), outcome
