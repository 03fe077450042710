"""Issue 27, second trust round, row by row: no other user borrows the exporter's rights.

The exporter runs as root; the attacker is `nobody` with real processes (setpriv), a real user
namespace (`unshare -Ur`), a real setuid-root program, a real cgroup made in the layout systemd
delegates to a user. Each test is named after its row and failed on the code before its fix.
(Rows 4 and 5, log CPU and marking server text, are tested elsewhere.)
"""

from __future__ import annotations

import base64
import os
import shutil
import socket
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest
import yaml
from helpers.fakeservers import world_dir
from helpers.hostile import ExporterProcess
from helpers.users import NOBODY, as_nobody

from exporter.history import HistoryStore

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
