"""`model-load-exporter status`: every target of a running exporter in one table (or its JSON)."""

from __future__ import annotations

import argparse
import json

from exporter.commands import placement, terminal
from exporter.commands.client import (
    ClientError,
    ShownTarget,
    add_exporter_arguments,
    client_from_args,
)
from exporter.commands.exits import Exit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_exporter_arguments(parser)
    parser.add_argument("--json", action="store_true", help="the exporter's /api/v1/status JSON")
    parser.add_argument(
        "--placement",
        action="store_true",
        help="where each model would start warm: hosts by cached share, then restart forecast "
        "(this host's, or every host's with --prometheus)",
    )
    parser.add_argument("--model", metavar="NAME", help="with --placement: only this model")
    placement.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    if args.placement:
        return placement.show(args)
    if args.model is not None or args.prometheus is not None:
        terminal.fail("status", "--model and --prometheus go with --placement")
        return Exit.USAGE
    try:
        client = client_from_args(args)
        if args.json:
            print(json.dumps(client.status_json(), indent=2))
            return Exit.OK
        status = client.status()
    except ClientError as exc:
        terminal.fail("status", str(exc))
        return Exit.USAGE
    views = [ShownTarget.from_status(e) for e in status.targets]
    if not views:
        print("no targets: the exporter has none configured or discovered yet")
        return Exit.OK
    rows = terminal.status_rows(views, status.time)
    terminal.show(terminal.table(terminal.STATUS_COLUMNS, rows, phase_column=1))
    forecasts = [line for line in map(terminal.forecast_line, views) if line is not None]
    storage = [line for view in views for line in terminal.storage_lines(view)]
    probes = [line for view in views for line in terminal.probe_lines(view)]
    for block in (forecasts, probes, storage):
        if block:
            print()
            print("\n".join(block))
    return Exit.OK
