"""What the real servers of these tests share once started: the log their output goes to,
their session (each starts in a session of its own, so the session is the tree it made, any of
it a crash orphaned, and any child that made a process group of its own) and how they are
stopped: SIGTERM to the server, SIGKILL after a grace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil

STOP_GRACE = 30.0  # SIGTERM to SIGKILL


def first_answer(
    proc: subprocess.Popen[bytes],
    answered: Callable[[], bool],
    *,
    name: str,
    tail: Callable[[], str],
    timeout: float,
    every: float,
) -> float:
    """Ask `answered` every `every` seconds until it says yes: the unix time it did. Fails at
    once if the server (`name` in the failure) exits, with the tail of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if answered():
            return time.time()
        if proc.poll() is not None:
            raise AssertionError(f"{name} exited with {proc.returncode}:\n{tail()}")
        time.sleep(every)
    raise AssertionError(f"{name} did not answer within {timeout:.0f} s:\n{tail()}")


def tail(log: Path, lines: int = 30) -> str:
    """The last `lines` lines of a server's log, for an assertion's message."""
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def group(pid: int) -> list[psutil.Process]:
    """The processes of the session `pid` leads, itself included."""
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(process.pid) == pid:
                found.append(process)
    return found


def stop(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, SIGKILL after STOP_GRACE; the exit status (the process is reaped here)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        return proc.wait(STOP_GRACE)
    proc.kill()
    return proc.wait(10)


def stop_group(proc: subprocess.Popen[bytes]) -> list[psutil.Process]:
    """SIGTERM to the server (it stops the processes it started), SIGKILL to whatever of its
    session is left after STOP_GRACE; the processes still alive after that (none, or a bug)."""
    others = [p for p in group(proc.pid) if p.pid != proc.pid]
    deadline = time.monotonic() + STOP_GRACE
    stop(proc)
    _, alive = psutil.wait_procs(others, timeout=max(1.0, deadline - time.monotonic()))
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=10)
    return [p for p in others if _running(p)]


def _running(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
