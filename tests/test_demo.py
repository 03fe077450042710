"""The README's main command: the exporter watching the simulator load real files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.support import free_port

pytestmark = pytest.mark.system  # child processes, servers


def test_demo_shows_a_cold_then_a_warm_load(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "demo", "--dir", str(tmp_path), "--cycles", "2",
         "--shards", "2", "--shard-size", "16MiB", "--read-rate", "40MB/s",
         "--init-seconds", "1", "--serve-seconds", "3", "--startup-seconds", "0.5",
         "--web.listen-address", f"127.0.0.1:{free_port()}", "--sim-port", str(free_port())],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    loads = [line for line in result.stdout.splitlines() if line.startswith("load ready")]
    assert len(loads) == 2, result.stdout
    assert "(cold cache)" in loads[0] and "(warm cache)" in loads[1]
    assert (tmp_path / "history.sqlite").stat().st_size > 0
    assert "Traceback" not in result.stderr
