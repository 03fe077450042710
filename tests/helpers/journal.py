"""A journald to write to and read from: the host's, or one started here (no systemd as PID 1
in this sandbox), so that the journal's files exist and `journalctl` answers as on a host."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from helpers.require import require

JOURNALD = "/lib/systemd/systemd-journald"
JOURNAL_SOCKET = Path("/run/systemd/journal/socket")  # datagrams: journal fields
JOURNAL_STDOUT = Path("/run/systemd/journal/stdout")  # streams: systemd-cat, a unit's stdout


def _journald_listening() -> bool:
    """Both of journald's sockets answer: a stale socket file left by a journald another test
    run stopped refuses connections, and systemd-cat writes to the stream one."""
    for path, kind in ((JOURNAL_SOCKET, socket.SOCK_DGRAM), (JOURNAL_STDOUT, socket.SOCK_STREAM)):
        with socket.socket(socket.AF_UNIX, kind) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
    return True


@pytest.fixture(scope="module")
def journald() -> Iterator[None]:
    """The host's journald, or one started here (no systemd as PID 1 in this sandbox)."""
    require(os.geteuid() == 0, "needs root: journald and a unit's cgroup")
    require(
        bool(shutil.which("systemd-cat") and shutil.which("journalctl")),
        "systemd-cat or journalctl missing",
    )
    started = None
    if not _journald_listening():
        require(os.access(JOURNALD, os.X_OK), f"no journald running and no {JOURNALD}")
        JOURNAL_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        started = subprocess.Popen([JOURNALD], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 10
        while not _journald_listening():
            assert started.poll() is None, started.stderr.read() if started.stderr else b""
            assert time.monotonic() < deadline, "journald did not open its socket"
            time.sleep(0.05)
    yield
    if started is not None:
        started.terminate()
        started.wait(10)
