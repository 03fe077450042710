"""The package has no import circle, type-only or late imports counted (scripts/module_graph.py),
and the check finds one where there is one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "module_graph.py"
sys.path.insert(0, str(SCRIPT.parent))

import module_graph  # noqa: E402


def test_the_exporter_package_has_no_import_circle() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.endswith("no import circle\n"), done.stdout


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_circle_through_a_type_only_import_is_found(tmp_path: Path) -> None:
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/a.py": "from exporter.b import B\n",
        "exporter/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                         "    from exporter.c import C\nB = 1\n",
        "exporter/c.py": "def late():\n    from exporter import a\n",
        "exporter/d.py": "from exporter.a import B\n",
    })  # fmt: skip
    found = module_graph.modules(tmp_path)
    assert module_graph.circles(module_graph.graph(found)) == [
        ["exporter.a", "exporter.b", "exporter.c"]
    ]


def test_a_package_and_a_module_of_it_importing_each_other_is_a_circle(tmp_path: Path) -> None:
    """The shape the sources package had: its __init__ names its modules' types, each module
    imports the package's base classes."""
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/sources/__init__.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                        "    from exporter.sources.disk import DiskSample\n",
        "exporter/sources/disk.py": "from exporter.sources import Sample\n",
    })  # fmt: skip
    edges = module_graph.graph(module_graph.modules(tmp_path))
    assert module_graph.circles(edges) == [["exporter.sources", "exporter.sources.disk"]]
