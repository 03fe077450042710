"""Module sizes and the import graph of the `exporter` package, any import circle in it, and any
import that goes up the layers.

Every import counts, at module level, inside a function or under `if TYPE_CHECKING:`: a circle
broken only by a type-only or a late import is still a circle a reader must hold in mind, and a
type-only import of a higher layer still makes the lower one know the higher.

    python scripts/module_graph.py            one line a module: lines, imports, imported by
    python scripts/module_graph.py --check    exit 1 on a circle or an upward import (the tests
                                              run this)
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

PACKAGE = "exporter"
ROOT = Path(__file__).resolve().parents[1]

# The product's layers, lowest first (docs/development.md, "Layout", says why in this order): a
# module imports its own layer and those below, never one above. A top-level module is named
# alone, a package stands for every module in it; a module in no layer is an error, so a new
# package must be given its place here.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("exporter", "exporter.vocabulary", "exporter.units", "exporter.logsetup"),  # shared words
    ("exporter.load",),  # the load model: pure, so it imports nothing but the shared words
    ("exporter.trust",),
    ("exporter.servers",),
    ("exporter.config",),
    ("exporter.storage",),
    ("exporter.logs",),
    ("exporter.sources",),
    ("exporter.discovery",),
    ("exporter.history",),
    ("exporter.runtime",),
    ("exporter.exposition",),
    ("exporter.commands",),
    ("exporter.cli", "exporter.__main__"),
)
# Tools beside the product (the simulator, the demo): they may import any layer, and no module of
# the product imports them (`serve` never loads them).
BESIDE = "exporter.sim"


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package by its __init__)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _imported(tree: ast.AST, here: str, is_package: bool, known: Mapping[str, Path]) -> set[str]:
    """The package's modules that `tree` imports (`from a import b` names a.b when b is one)."""
    base = here if is_package else here.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            parent = node.module or ""
            if node.level:
                anchor = base.rsplit(".", node.level - 1)[0] if node.level > 1 else base
                parent = f"{anchor}.{parent}" if parent else anchor
            names = [parent, *(f"{parent}.{alias.name}" for alias in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:  # `import a.b.c` depends on the deepest module
                name = name.rpartition(".")[0]
            if name and name != here:
                out.add(name)
    return out


def graph(found: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports. A package's __init__ is left out of its own
    submodules' edges: importing exporter.sources.disk runs exporter/sources/__init__.py, but
    that is Python's doing, not a dependency the code chose."""
    edges = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        edges[name] = _imported(tree, name, path.name == "__init__.py", found)
    return edges


def circles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """Each strongly connected set of two or more modules (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(edges)))
    for node in sorted(edges):
        if node not in index:
            visit(node)
    return sorted(found)


def _within(module: str, name: str) -> bool:
    """`module` is `name` or in the package `name` (the top package stands for itself alone)."""
    return module == name or (name != PACKAGE and module.startswith(f"{name}."))


def layer_of(module: str, layers: Sequence[Sequence[str]] = LAYERS) -> int | None:
    """The index of the layer `module` belongs to (the deepest name that holds it), or None."""
    found, depth = None, -1
    for index, names in enumerate(layers):
        for name in names:
            if _within(module, name) and name.count(".") > depth:
                found, depth = index, name.count(".")
    return found


def upward(
    edges: Mapping[str, set[str]],
    layers: Sequence[Sequence[str]] = LAYERS,
    beside: str = BESIDE,
) -> list[str]:
    """One line per import that breaks the layers: of a higher layer, of the tools beside the
    product, or by a module in no layer at all."""
    found = []
    for module in sorted(edges):
        if _within(module, beside):
            continue
        mine = layer_of(module, layers)
        if mine is None:
            found.append(f"{module} is in no layer (scripts/module_graph.py: LAYERS)")
            continue
        for target in sorted(edges[module]):
            theirs = layer_of(target, layers)
            if _within(target, beside):
                found.append(f"{module} imports {target}, a tool beside the product")
            elif theirs is not None and theirs > mine:
                found.append(
                    f"{module} imports {target}, a higher layer "
                    f"({', '.join(layers[mine])} < {', '.join(layers[theirs])})"
                )
    return found


def table(found: Mapping[str, Path], edges: Mapping[str, set[str]]) -> Iterator[str]:
    importers: dict[str, int] = dict.fromkeys(found, 0)
    for targets in edges.values():
        for target in targets:
            importers[target] += 1
    yield f"{'module':<40} {'lines':>6} {'imports':>8} {'imported by':>12}"
    for name, path in found.items():
        lines = len(path.read_text(encoding="utf-8").splitlines())
        yield f"{name:<40} {lines:>6} {len(edges[name]):>8} {importers[name]:>12}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check", action="store_true", help="exit 1 on an import circle or an upward import"
    )
    args = parser.parse_args(argv)
    found = modules()
    edges = graph(found)
    loops = circles(edges)
    breaks = upward(edges)
    if not args.check:
        for line in table(found, edges):
            print(line)
    for loop in loops:
        print(f"import circle: {' <-> '.join(loop)}", file=sys.stderr)
    for line in breaks:
        print(f"layer broken: {line}", file=sys.stderr)
    if args.check and not loops and not breaks:
        print(f"{len(found)} modules in {len(LAYERS)} layers, no upward import, no import circle")
    return 1 if loops or breaks else 0


if __name__ == "__main__":
    sys.exit(main())
