"""The README stays short and its reference in docs/ stays reachable.

The README is what a newcomer reads whole, so it is held to 300 lines and the reference lives in
docs/; that only works if every page there is linked from the README and no link, or the heading
it points to, goes stale when a file or a section moves.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 300
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#*$")
# `module.NAME`: the constant NAME of exporter/module.py, as docs/how-it-decides.md cites a rule.
CONSTANT = re.compile(r"`((?:[a-z_]+\.)+)([A-Z][A-Z0-9_]*)`")


def pages() -> list[Path]:
    """Every markdown page a reader reaches from the README, the README included."""
    return [README, *sorted(DOCS.glob("*.md")), REPO / "bench" / "README.md"]


def prose(path: Path) -> list[str]:
    """The page's lines outside fenced code blocks (a `#` there is a shell comment)."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered."""
    seen: dict[str, int] = {}
    for line in prose(path):
        match = HEADING.match(line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
    return {slug if i == 0 else f"{slug}-{i}" for slug, n in seen.items() for i in range(n + 1)}


def local_links(path: Path) -> list[str]:
    """Targets of the page's links that are files of this repository, not web addresses."""
    targets = [t for line in prose(path) for t in LINK.findall(line)]
    return [t for t in targets if not re.match(r"[a-z]+:", t)]


def broken(path: Path, target: str) -> str | None:
    """Why a link from path to target leads nowhere, or None when it resolves."""
    file, _, anchor = target.partition("#")
    resolved = (path.parent / file).resolve() if file else path
    if not resolved.is_relative_to(REPO) or not resolved.exists():
        return f"{path.relative_to(REPO)}: {target}: no such file"
    if anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
        return f"{path.relative_to(REPO)}: {target}: no such heading"
    return None


def test_readme_stays_within_300_lines() -> None:
    lines = len(README.read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines: move reference into docs/"


def test_every_local_link_and_its_heading_resolve() -> None:
    problems = [p for page in pages() for t in local_links(page) if (p := broken(page, t))]
    assert not problems, "\n".join(problems)


def test_the_readme_links_every_page_in_docs() -> None:
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in local_links(README)}
    unlinked = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert list(DOCS.glob("*.md")), "docs/ holds no page"
    assert not unlinked, f"docs/ pages the README does not link: {unlinked}"


def test_a_missing_file_or_heading_is_reported() -> None:
    assert broken(README, "docs/metrics.md#metrics") is None
    assert broken(README, "docs/metrics.md#metric") == (
        "README.md: docs/metrics.md#metric: no such heading"
    )
    assert broken(README, "docs/metric.md") == "README.md: docs/metric.md: no such file"
    assert broken(README, "../outside.md") == "README.md: ../outside.md: no such file"


def test_anchors_follow_githubs_rule(tmp_path: Path) -> None:
    """The link check is only as good as its anchors: held to headings GitHub renders."""
    page = tmp_path / "page.md"
    page.write_text(
        "# Waiting for a load: `wait`, `status`\n## The server's own log\n## Notes\n## Notes\n"
        "```sh\n# not a heading\n```\n"
    )
    assert anchors(page) == {
        "waiting-for-a-load-wait-status",
        "the-servers-own-log",
        "notes",
        "notes-1",
    }


def test_every_rule_constant_the_docs_cite_exists() -> None:
    """how-it-decides.md cites each threshold by name (`tracker.DONE_RATIO`), so a reader finds
    the rule and its reason in the code; a renamed or removed constant must not leave it pointing
    at nothing."""
    page = DOCS / "how-it-decides.md"
    cited = {m.groups() for line in prose(page) for m in CONSTANT.finditer(line)}
    missing = [
        f"{module}{name}"
        for module, name in sorted(cited)
        if not hasattr(importlib.import_module(f"exporter.{module.rstrip('.')}"), name)
    ]
    assert len(cited) >= 10, f"how-it-decides.md cites only {len(cited)} constants"
    assert not missing, f"how-it-decides.md cites constants that do not exist: {missing}"


def test_the_layout_names_every_package_and_top_level_module() -> None:
    """docs/development.md's layout is where a newcomer finds which room a change belongs in: a
    package or a top-level module it leaves out is one they cannot place."""
    page = (DOCS / "development.md").read_text()
    layout = page[page.index("## Layout") : page.index("\n## ", page.index("## Layout") + 1)]
    package = REPO / "exporter"
    names = [f"{p.parent.name}/" for p in sorted(package.glob("*/__init__.py"))]
    names += [p.name for p in sorted(package.glob("*.py"))]
    missing = [name for name in names if not re.search(rf"(?<![\w/]){re.escape(name)}", layout)]
    assert len(names) >= 17, names
    assert not missing, f"docs/development.md's layout leaves out {missing}"
