"""An exporter without root in front of a root-owned server: found, but its reads unknown.

/proc/PID/io is readable only by the process's owner and root (a ptrace-mode check), so a
`nobody` exporter sees the server's process table entry but not its read counters. Those must
then be absent and said so, never 0: a load would read as all page cache (warm) otherwise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
from helpers.support import free_port, metrics_when, sample_value
from helpers.users import NOBODY, REPO, SETPRIV, as_nobody, nobody_python

from exporter.config.schema import ProcessConfig
from exporter.sources.process import ProcessFinder

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv", "nobody_python")]

# The server: reads a file (so its counters are not zero), says so, then idles.
SERVER = (
    "import sys, time\nopen(sys.argv[1], 'rb').read()\nprint('read', flush=True)\ntime.sleep(120)\n"
)
FINDER = (
    "import dataclasses, json, sys\n"
    "from exporter.config.schema import ProcessConfig\n"
    "from exporter.sources.process import ProcessFinder\n"
    "sample = ProcessFinder(ProcessConfig(pidfile=sys.argv[1])).sample()\n"
    "print(json.dumps(dataclasses.asdict(sample)))\n"
)


@pytest.fixture
def root_server() -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A root-owned server and its pidfile, in a directory `nobody` can read."""
    directory = Path(tempfile.mkdtemp(prefix="unprivileged-", dir="/tmp"))
    directory.chmod(0o755)
    data = directory / "weights.bin"
    data.write_bytes(os.urandom(1 << 20))
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER, str(data)], stdout=subprocess.PIPE, text=True
    )
    assert server.stdout is not None and server.stdout.readline() == "read\n"
    pidfile = directory / "server.pid"
    pidfile.write_text(str(server.pid))
    pidfile.chmod(0o644)
    try:
        yield server, pidfile
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(directory)


def test_unprivileged_finder_finds_the_server_but_not_its_reads(
    root_server: tuple[subprocess.Popen[str], Path],
) -> None:
    server, pidfile = root_server
    python = nobody_python()
    assert python is not None
    as_root = ProcessFinder(ProcessConfig(pidfile=str(pidfile))).sample()
    assert as_root.read_chars is not None and as_root.read_chars >= 1 << 20  # there is a truth

    done = as_nobody(python, "-c", FINDER, str(pidfile))
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["found"] is True
    assert seen["root_pid"] == server.pid and server.pid in seen["pids"]
    assert seen["start_time"] == pytest.approx(as_root.start_time, abs=0.02)
    assert (seen["read_bytes"], seen["read_chars"]) == (None, None)
    assert f"not readable as uid {NOBODY}" in seen["read_problem"]
    assert f"pid {server.pid}" in seen["read_problem"]
    assert as_root.read_problem is None


def test_unprivileged_exporter_exports_no_read_counter_and_says_why(
    root_server: tuple[subprocess.Popen[str], Path],
) -> None:
    server, pidfile = root_server
    python = nobody_python()
    assert python is not None
    port = free_port()
    exporter = subprocess.Popen(
        [*SETPRIV, python, "-m", "exporter", "--target", "m",
         "--endpoint", f"http://127.0.0.1:{free_port()}", "--pidfile", str(pidfile),
         "--history.path=", "--sample.interval=200ms", f"--web.listen-address=127.0.0.1:{port}"],
        cwd=pidfile.parent, env={"PYTHONPATH": str(REPO), "PATH": os.defpath},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        text = metrics_when(
            url, lambda t: sample_value(t, "model_load_process_up", target="m") == 1, timeout=30
        )
        status = requests.get(f"{url}/api/v1/status", timeout=10).json()
    finally:
        exporter.terminate()
        _, stderr = exporter.communicate(timeout=10)
    assert "Traceback" not in stderr
    assert sample_value(text, "model_load_process_start_time_seconds", target="m") is not None
    assert sample_value(text, "model_load_process_read_bytes_total", target="m") is None
    process = status["targets"][0]["sources"]["process"]
    assert process["up"] is True
    assert "read counters unknown" in process["note"]
    assert f"pid {server.pid}" in process["note"]
