"""Command line: argparse subcommands -> functions. No logic lives here.

Flags follow Prometheus conventions (`--config.file`, `--web.listen-address`), and `serve` is the
default subcommand so `model-load-exporter --config.file=...` works like every other exporter.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from exporter import __version__, demo, simulate
from exporter.logsetup import LEVELS
from exporter.serve import run_serve

# Operator commands, imported only when chosen: `serve` must not pay for (or import) rich.
CLIENT_COMMANDS = {
    "wait": ("exporter.wait", "block until a target is ready (0), failed (1) or timed out (124)"),
    "status": ("exporter.status", "one table of every target of a running exporter"),
    "prewarm": ("exporter.prewarm", "pull weight files into the page cache (or --evict them)"),
    "history": ("exporter.history_cmd", "past loads from a running exporter or its SQLite file"),
}
SUBCOMMANDS = ("serve", "simulate", "demo", *CLIENT_COMMANDS)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (and exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config.file", dest="config_file", metavar="PATH", help="YAML config")
    p.add_argument(
        "--config.check",
        dest="config_check",
        action="store_true",
        help="validate the config, print a summary and exit 0/1",
    )
    p.add_argument(
        "--web.listen-address",
        dest="web_listen_address",
        default=":9847",
        metavar="HOST:PORT",
        help="address to serve /metrics on (default :9847)",
    )
    p.add_argument(
        "--web.config.file",
        dest="web_config_file",
        metavar="PATH",
        help="TLS and basic auth, exporter-toolkit format",
    )
    single = p.add_argument_group("one target without a config file")
    single.add_argument("--target", help="target name (label value)")
    single.add_argument("--endpoint", metavar="URL", help="server base URL")
    single.add_argument(
        "--probe",
        choices=("completion", "health", "models", "tcp"),
        default="completion",
        help="readiness probe (default completion)",
    )
    single.add_argument("--model", help="model name sent in the completion probe")
    single.add_argument(
        "--weights", action="append", metavar="PATH", help="weights file or directory (repeatable)"
    )
    single.add_argument("--unit", metavar="SYSTEMD_UNIT", help="find the server by systemd unit")
    single.add_argument("--pidfile", metavar="PATH", help="find the server by pidfile")
    single.add_argument("--cmdline", metavar="REGEX", help="find the server by command line")
    single.add_argument(
        "--log.source", dest="log_source", metavar="journald:UNIT|file:PATH", help="server log"
    )
    single.add_argument("--stall.after", dest="stall_after", metavar="DURATION", help="default 5m")
    p.add_argument(
        "--sample.interval", dest="sample_interval", metavar="DURATION", help="default 1s"
    )
    p.add_argument(
        "--history.path", dest="history_path", metavar="PATH", help='SQLite file; "" disables'
    )
    p.add_argument("--log.level", dest="log_level", choices=LEVELS, default="info")
    p.add_argument("--log.format", dest="log_format", choices=("logfmt", "json"), default="logfmt")


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="model-load-exporter",
        description="Prometheus exporter for large-model server loads.",
        epilog="Without a COMMAND it serves: see `model-load-exporter serve --help` for its flags.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")
    commands: list[tuple[str, str, Callable[[argparse.ArgumentParser], None], Callable]] = [
        ("serve", "run the exporter (default)", _serve_arguments, run_serve),
        ("simulate", "run a stand-in model server", simulate.add_arguments, simulate.run),
        ("demo", "watch the simulator load real files", demo.add_arguments, demo.run),
    ]
    for name, help_text, add, run in commands:
        p = sub.add_parser(name, help=help_text, description=help_text)
        add(p)
        p.set_defaults(func=run)
    for name, (module_name, help_text) in CLIENT_COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            module = importlib.import_module(module_name)
            module.add_arguments(p)
            p.set_defaults(func=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or (
        args_list[0] not in SUBCOMMANDS and args_list[0] not in ("-h", "--help", "--version")
    ):
        args_list.insert(0, "serve")
    args = build_parser(args_list[0]).parse_args(args_list)
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130
