"""Running code as the unprivileged user `nobody`, to test what an exporter without root sees."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
NOBODY = 65534
SETPRIV = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]


def as_nobody(*argv: str, cwd: Path = Path("/")) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*SETPRIV, *argv],
        cwd=cwd,
        env={"PYTHONPATH": _pythonpath(), "PYTHONDONTWRITEBYTECODE": "1", "PATH": os.defpath},
        capture_output=True,
        text=True,
        timeout=30,
    )


def _pythonpath() -> str:
    """The checkout first, then whatever this run was given (packages outside a venv)."""
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(REPO), *extra])


@functools.cache
def nobody_python() -> str | None:
    """A Python `nobody` can run the exporter with (a venv under /root is out of its reach)."""
    for python in (sys.executable, "/usr/bin/python3"):
        if as_nobody(python, "-c", "import exporter.runtime.wiring").returncode == 0:
            return python
    return None
