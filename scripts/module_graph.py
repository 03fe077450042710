"""Module sizes and the import graph of the `exporter` package, and any import circle in it.

Every import counts, at module level, inside a function or under `if TYPE_CHECKING:`: a circle
broken only by a type-only or a late import is still a circle a reader must hold in mind.

    python scripts/module_graph.py            one line a module: lines, imports, imported by
    python scripts/module_graph.py --check    exit 1 if there is a circle (the tests run this)
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = "exporter"
ROOT = Path(__file__).resolve().parents[1]


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
    parser.add_argument("--check", action="store_true", help="exit 1 if there is an import circle")
    args = parser.parse_args(argv)
    found = modules()
    edges = graph(found)
    loops = circles(edges)
    if not args.check:
        for line in table(found, edges):
            print(line)
    for loop in loops:
        print(f"import circle: {' <-> '.join(loop)}", file=sys.stderr)
    if args.check and not loops:
        print(f"{len(found)} modules, no import circle")
    return 1 if loops else 0


if __name__ == "__main__":
    sys.exit(main())
