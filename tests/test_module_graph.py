"""The package has no import circle and no import up its layers, type-only or late imports counted
(scripts/module_graph.py), and the check finds each where there is one."""

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


def test_an_import_of_a_higher_layer_fails_the_check(tmp_path: Path) -> None:
    """The script run as `make test` runs it, over a tree where the load model imports the
    runtime under TYPE_CHECKING only: still an upward import, and the check exits 1 naming it."""
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "module_graph.py").write_text(SCRIPT.read_text())
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/vocabulary.py": "",
        "exporter/load/__init__.py": "",
        "exporter/load/tracker.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                    "    from exporter.runtime.wiring import Runtime\n",
        "exporter/runtime/__init__.py": "",
        "exporter/runtime/wiring.py": "from exporter import vocabulary\n",
    })  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(tmp_path / "scripts" / "module_graph.py"), "--check"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 1, done.stdout
    assert done.stderr == (
        "layer broken: exporter.load.tracker imports exporter.runtime.wiring, a higher layer "
        "(exporter.load < exporter.runtime)\n"
    )


def test_the_load_model_imports_only_the_shared_words(tmp_path: Path) -> None:
    """The tracker's package sits just above vocabulary and units: trust, the lowest layer of
    the rest, is already above it."""
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/units.py": "",
        "exporter/load/__init__.py": "",
        "exporter/load/eta.py": "from exporter import units\n",
        "exporter/load/tracker.py": "from exporter.load import eta\n"
                                    "from exporter.trust.safeio import open_checked\n",
        "exporter/trust/__init__.py": "",
        "exporter/trust/safeio.py": "from exporter.load.eta import rate\n",
    })  # fmt: skip
    edges = module_graph.graph(module_graph.modules(tmp_path))
    assert module_graph.upward(edges) == [
        "exporter.load.tracker imports exporter.trust.safeio, a higher layer "
        "(exporter.load < exporter.trust)"
    ]


def test_the_product_never_imports_the_tools_beside_it(tmp_path: Path) -> None:
    """The simulator may import any layer; a late import of it from `serve` is still found."""
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/commands/__init__.py": "",
        "exporter/commands/serve.py": "def demo():\n    from exporter.sim.demo import run\n",
        "exporter/sim/__init__.py": "",
        "exporter/sim/demo.py": "from exporter.commands import serve\n",
    })  # fmt: skip
    edges = module_graph.graph(module_graph.modules(tmp_path))
    assert module_graph.upward(edges) == [
        "exporter.commands.serve imports exporter.sim.demo, a tool beside the product"
    ]


def test_a_package_in_no_layer_is_found(tmp_path: Path) -> None:
    """A new package must be given its place in LAYERS before it passes."""
    write(tmp_path, {
        "exporter/__init__.py": "",
        "exporter/vocabulary.py": "",
        "exporter/gadgets/__init__.py": "",
        "exporter/gadgets/widget.py": "from exporter import vocabulary\n",
    })  # fmt: skip
    edges = module_graph.graph(module_graph.modules(tmp_path))
    assert module_graph.upward(edges) == [
        "exporter.gadgets is in no layer (scripts/module_graph.py: LAYERS)",
        "exporter.gadgets.widget is in no layer (scripts/module_graph.py: LAYERS)",
    ]
