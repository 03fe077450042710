"""`model-load-exporter mcp`: a Model Context Protocol server over stdio for agents.

The MCP SDK is an optional extra (`pip install 'model-load-exporter[mcp]'`), so this module only
checks that it is there and that the exporter flags make sense; mcp_server.py beside it holds
the tools. Stdout is the protocol channel: every message of ours goes to stderr.
"""

from __future__ import annotations

import argparse
import functools

from exporter.commands import placement, terminal
from exporter.commands.client import ClientError, add_exporter_arguments, client_from_args
from exporter.commands.exits import Exit
from exporter.logsetup import LEVELS, setup_logging

INSTALL_HINT = "pip install 'model-load-exporter[mcp]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_exporter_arguments(parser)
    placement.add_arguments(parser)
    parser.add_argument(
        "--log.level", dest="log_level", choices=LEVELS, default="warn", help="on stderr"
    )


def run(args: argparse.Namespace) -> int:
    # A bad URL, CA file or missing password: said before the SDK's seconds of imports.
    try:
        client_from_args(args)
        placement.prometheus_from_args(args)
    except ClientError as exc:
        terminal.fail("mcp", str(exc))
        return Exit.USAGE
    try:
        from exporter.commands import mcp_server
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").partition(".")[0]
        if missing == "exporter":
            raise
        terminal.fail("mcp", f"the MCP SDK is not installed (no module {missing}): {INSTALL_HINT}")
        return Exit.FAILED
    setup_logging(args.log_level)
    # A client per tool call: calls run on worker threads, and a requests session is not shared.
    mcp_server.build(
        functools.partial(client_from_args, args),
        functools.partial(placement.prometheus_from_args, args),
    ).run("stdio")
    return Exit.OK
