"""The simulator (`model-load-exporter simulate`) as a child process of a test, with its report."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from helpers.support import wait_for


class Simulator:
    """One run of `model-load-exporter simulate` as a child process."""

    def __init__(self, tmp_path: Path, weights: Path, port: int, *extra: str) -> None:
        self.report = tmp_path / f"report-{time.monotonic_ns()}.json"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter", "simulate", "--port", str(port),
             "--weights", str(weights), "--pidfile", str(tmp_path / "server.pid"),
             "--report", str(self.report), "--read-rate", "40MB/s", "--init-seconds", "1.5",
             "--startup-seconds", "1", "--log-file", str(tmp_path / "server.log"), *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    def result(self) -> dict[str, Any]:
        return dict(json.loads(wait_for(lambda: self.report.exists() and self.report.read_text())))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout=10)
