"""`serve` runs on what `pip install .` brings; every other command says which extra it needs.

The extras' packages are hidden from a fresh interpreter by a meta-path hook, as in a venv where
only `pip install .` ran: an import of one anywhere on serve's path fails the test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import requests
from helpers.support import free_port, wait_for

# What pyproject's extras bring beyond the dependencies (client, sim, mcp, dashboards).
EXTRAS_ONLY = (
    "requests",
    "rich",
    "numpy",
    "safetensors",
    "mcp",
    "pydantic",
    "grafana_foundation_sdk",
)
HIDE = textwrap.dedent(
    f"""
    import sys
    class Hide:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in {EXTRAS_ONLY!r}:
                raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
            return None
    sys.meta_path.insert(0, Hide())
    from exporter.cli import main
    sys.exit(main(sys.argv[1:]))
    """
)


def run_without_extras(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", HIDE, *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.system
def test_serve_runs_on_the_core_dependencies(tmp_path: Path) -> None:
    """A real exporter on the core dependencies alone answers /metrics with its target's series."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", HIDE, "serve", "--target", "m", "--endpoint", "http://127.0.0.1:9",
         "--history.path", "", "--web.listen-address", f"127.0.0.1:{port}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        metrics = wait_for(lambda: _metrics(port, proc), 30)
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
    assert "model_load_phase{" in metrics and 'target="m"' in metrics, metrics[:500]
    assert "No module named" not in out, out


def _metrics(port: int, proc: subprocess.Popen[str]) -> str | None:
    assert proc.poll() is None, proc.communicate()[0]
    try:
        text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except requests.ConnectionError:
        return None
    return text if 'target="m"' in text else None


@pytest.mark.parametrize(
    ("command", "extra"),
    [("status", "client"), ("wait", "client"), ("history", "client"), ("prewarm", "client"),
     ("simulate", "sim"), ("demo", "sim"), ("mcp", "mcp")],
)  # fmt: skip
def test_a_command_without_its_extra_names_it_in_one_line(command: str, extra: str) -> None:
    done = run_without_extras(command, "--help")
    assert done.returncode == 2, done
    [line] = done.stderr.splitlines()
    assert line.startswith(f"model-load-exporter {command}: needs "), line
    assert f"pip install 'model-load-exporter[{extra}]'" in line, line
    assert "Traceback" not in done.stderr


def test_serve_help_needs_no_extra() -> None:
    done = run_without_extras("serve", "--help")
    assert done.returncode == 0, done.stderr
    assert "--web.listen-address" in done.stdout
