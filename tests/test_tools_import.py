"""Every benchmark (bench/) and script (scripts/) imports: they run on demand, not in CI, so a
rename in exporter/ or in the test helpers that breaks one would otherwise go unnoticed until
someone needs it (bench/prewarm.py and scripts/check_image.py once imported a function that had
moved). `make lint` type-checks them too (pyproject's mypy `files`)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
TOOLS = sorted([*(REPO / "bench").glob("*.py"), *(REPO / "scripts").glob("*.py")])


def test_every_tool_is_found() -> None:
    names = {f"{p.parent.name}/{p.name}" for p in TOOLS}
    assert {"bench/prewarm.py", "scripts/check_image.py", "bench/fleet.py"} <= names


@pytest.mark.parametrize("path", TOOLS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_tool_imports(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # As `python bench/x.py` runs it: its own folder first on the path (bench's siblings).
    monkeypatch.syspath_prepend(str(path.parent))
    monkeypatch.setattr(sys, "path", list(sys.path))  # what a tool inserts goes with the test
    spec = importlib.util.spec_from_file_location(f"tool_{path.parent.name}_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)  # its main() runs only under __main__
    assert callable(getattr(module, "main", None)), f"{path} has no main()"
