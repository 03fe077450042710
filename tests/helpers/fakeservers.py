"""Processes that only look like model servers, started as another user (`nobody`).

What discovery believes is a process's command line, so a hostile user needs no model server at
all: any process whose argv says `vllm serve ...` will do. One small Python parent, run with the
user's ids (setpriv), forks one child per command line; each child writes that command line over
its own argv area through /proc/self/mem (as setproctitle does), so /proc/PID/cmdline shows it,
and then sleeps. Thousands cost a few MB, and every one is a real process of that user.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from helpers.support import wait_for
from helpers.users import NOBODY, SETPRIV

SYSTEM_PYTHON = "/usr/bin/python3"  # a venv under /root is out of nobody's reach
_AREA = 4096  # bytes of argv each child may write; the parent's placeholder reserves them

_CHILD = r"""
import os, signal, sys
lines = sys.stdin.buffer.read().split(b"\n")
fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end (fields 48, 49)
for line in filter(None, lines):
    argv = bytes.fromhex(line.decode())
    pid = os.fork()
    if pid == 0:
        with open("/proc/self/mem", "r+b", buffering=0) as mem:
            mem.seek(start)
            mem.write(argv + b"\0" * (end - start - len(argv)))
        signal.pause()
        os._exit(0)
    print(pid, flush=True)
with open("/proc/self/mem", "r+b", buffering=0) as mem:  # the parent itself is no server
    mem.seek(start)
    mem.write(b"fake-server-parent\0" + b"\0" * (end - start - 19))
signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
while True:
    try:
        os.wait()
    except ChildProcessError:
        signal.pause()
"""


def world_dir(prefix: str = "trust-") -> Path:
    """A directory `nobody` may enter (pytest's tmp_path is root's, mode 0700)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


class FakeServers:
    """Child processes of one parent run as `uid`, each showing one of `argvs` as its cmdline."""

    def __init__(
        self,
        argvs: Sequence[Sequence[str | bytes]],
        *,
        uid: int = NOBODY,
        env: dict[str, str] | None = None,
        cwd: Path = Path("/"),
        prefix: Sequence[str] = (),
        wrap: Sequence[str] = (),
        stderr: Path | None = None,
    ) -> None:
        """`prefix` runs as root before the user's ids are taken, `wrap` as the user after
        (`unshare -Ur`: a user namespace of the user's own making); `stderr`: a file every
        process gets as its standard error (appended to)."""
        encoded = []
        for argv in argvs:
            raw = b"\0".join(os.fsencode(a) for a in argv)
            assert len(raw) < _AREA, "command line longer than the reserved argv area"
            encoded.append(raw.hex())
        ids = [f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
        errors = stderr.open("ab") if stderr is not None else None
        self.proc = subprocess.Popen(
            [*prefix, SETPRIV[0], *ids, *wrap, SYSTEM_PYTHON, "-c", _CHILD, "x" * _AREA],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors if errors is not None else subprocess.DEVNULL,
            env={"PATH": os.defpath, **(env or {})},
            cwd=cwd,
            start_new_session=True,
        )
        if errors is not None:
            errors.close()
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("\n".join(encoded).encode() + b"\n")
        self.proc.stdin.close()
        self.pids = [int(self.proc.stdout.readline()) for _ in encoded]
        wait_for(lambda: all(_shows(pid) for pid in self.pids), timeout=10)

    def stop(self) -> None:
        """End the parent and every child (one process group), and reap the parent."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        assert self.proc.stdout is not None
        self.proc.stdout.close()


def _shows(pid: int) -> bool:
    """The child rewrote its command line (before that it shows the parent's)."""
    try:
        return not Path(f"/proc/{pid}/cmdline").read_bytes().startswith(SYSTEM_PYTHON.encode())
    except OSError:
        return False
