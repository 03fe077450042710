"""Command line: a table of subcommands, each imported only when it is the one being run.

Flags follow Prometheus conventions (`--config.file`, `--web.listen-address`), and `serve` is the
default subcommand so `model-load-exporter --config.file=...` works like every other exporter.
Importing lazily keeps `serve` free of the simulator and of `rich`: an exporter on a GPU host
loads only what it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import NoReturn

from exporter import __version__

# name -> (module with add_arguments(parser) and run(args) -> int, one-line help, the extra of
# pyproject.toml that brings what the module imports beyond `serve`'s dependencies, if any)
COMMANDS: dict[str, tuple[str, str, str | None]] = {
    "serve": ("exporter.commands.serve", "run the exporter (default)", None),
    "simulate": ("exporter.sim.simulate", "run a stand-in model server", "sim"),
    "demo": ("exporter.sim.demo", "watch the simulator load real files", "sim"),
    "wait": (
        "exporter.commands.wait",
        "block until a target is ready (0), failed (1) or timed out (124)",
        "client",
    ),
    "status": (
        "exporter.commands.status",
        "one table of every target of a running exporter",
        "client",
    ),
    "prewarm": (
        "exporter.commands.prewarm",
        "pull weight files into the page cache (or --evict them)",
        "client",
    ),
    "history": (
        "exporter.commands.history",
        "past loads from a running exporter or its SQLite file",
        "client",
    ),
    "mcp": ("exporter.commands.mcp", "a Model Context Protocol server (stdio) for agents", "mcp"),
}
EXIT_MISSING_EXTRA = 2  # like a usage error: the command cannot run as installed


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser(command: str) -> argparse.ArgumentParser:
    """The parser with every subcommand listed and the flags of `command` alone."""
    parser = _Parser(
        prog="model-load-exporter",
        description="Prometheus exporter for large-model server loads.",
        epilog="Without a COMMAND it serves: see `model-load-exporter serve --help` for its flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    for name, (module_name, help_text, extra) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == command:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as e:
                if extra is None or (e.name or "").startswith("exporter"):
                    raise
                parser.exit(
                    EXIT_MISSING_EXTRA,
                    f"model-load-exporter {name}: needs {e.name!r}, which is not installed;"
                    f" install the command's extra: pip install 'model-load-exporter[{extra}]'\n",
                )
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (
        args_list[0] not in COMMANDS and args_list[0] not in ("-h", "--help", "--version")
    ):
        args_list.insert(0, "serve")
    args = build_parser(args_list[0]).parse_args(args_list)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
