"""`model-load-exporter status`: every target of a running exporter in one table (or its JSON)."""

from __future__ import annotations

import argparse
import json

from exporter import terminal
from exporter.client import ClientError, TargetView, add_exporter_arguments, client_from_args

EXIT_OK, EXIT_USAGE = 0, 2


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_exporter_arguments(parser)
    parser.add_argument("--json", action="store_true", help="the exporter's /api/v1/status JSON")


def run(args: argparse.Namespace) -> int:
    try:
        status = client_from_args(args).status()
    except ClientError as exc:
        terminal.fail("status", str(exc))
        return EXIT_USAGE
    if args.json:
        print(json.dumps(status, indent=2))
        return EXIT_OK
    views = [TargetView.from_status(e) for e in status["targets"] if isinstance(e, dict)]
    if not views:
        print("no targets: the exporter has none configured or discovered yet")
        return EXIT_OK
    now = float(status.get("time") or 0.0)
    rows = terminal.status_rows(views, now)
    terminal.show(terminal.table(terminal.STATUS_COLUMNS, rows, phase_column=1))
    storage = [line for view in views for line in terminal.storage_lines(view)]
    if storage:
        print()
        print("\n".join(storage))
    return EXIT_OK
