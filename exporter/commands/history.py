"""`model-load-exporter history`: past loads, from a running exporter or straight from its SQLite
file (the exporter may be down, which is often when someone asks how long loads used to take)."""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

from exporter.commands import terminal
from exporter.commands.client import ClientError, add_exporter_arguments, client_from_args
from exporter.commands.exits import Exit, UsageError
from exporter.exposition import api
from exporter.exposition.api import MAX_LOADS
from exporter.exposition.api_build import loads_document
from exporter.history.store import HistoryStore

DEFAULT_LIMIT = 20
COLUMNS = ("STARTED", "TARGET", "DURATION", "OUTCOME", "CACHE", "PHASES")


def _limit(text: str) -> int:
    try:
        limit = int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_LOADS:
        raise argparse.ArgumentTypeError(
            f"expected a number of loads from 1 to {MAX_LOADS}, got {text!r}"
        )
    return limit


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_exporter_arguments(parser)
    parser.add_argument(
        "--history.path",
        dest="history_path",
        metavar="PATH",
        help="read the exporter's SQLite history file instead of asking the exporter",
    )
    parser.add_argument("--target", metavar="NAME", help="only this target's loads")
    parser.add_argument(
        "--limit", type=_limit, default=DEFAULT_LIMIT, metavar="N", help="newest N loads (20)"
    )
    parser.add_argument("--json", action="store_true", help="the loads as /api/v1/loads JSON")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="each load's report: its phases against their medians, where its bytes came from, "
        "its read rate, and why it was slower than expected when it was",
    )


def from_exporter(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The exporter's /api/v1/loads records as it wrote them."""
    try:
        loads = client_from_args(args).loads(args.target, args.limit)
    except ClientError as exc:
        raise UsageError(str(exc)) from None
    return loads


def from_file(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The file's loads in the shape of /api/v1/loads, so scripts read either source alike."""
    path = args.history_path
    if not os.path.isfile(path):
        raise UsageError(f"--history.path: {path} does not exist")
    logging.getLogger("exporter").addHandler(logging.NullHandler())  # the problem comes back below
    store = HistoryStore(path, private=False)
    try:
        if not store.enabled:
            raise UsageError(f"--history.path: {store.problem}")
        records = store.loads(args.target, args.limit)
        if args.target is not None and not records:
            known = sorted({r.target for r in store.loads(None, MAX_LOADS)})
            if args.target not in known:
                raise UsageError(
                    f"no loads of target {args.target!r} in {path} "
                    f"(targets there: {', '.join(known) or 'none'})"
                )
    finally:
        store.close()
    loads: list[dict[str, Any]] = loads_document(records).to_json()["loads"]
    return loads


def run(args: argparse.Namespace) -> int:
    try:
        if args.history_path is not None and args.exporter is not None:
            raise UsageError("pass --exporter or --history.path, not both")
        loads = from_file(args) if args.history_path is not None else from_exporter(args)
    except UsageError as exc:
        terminal.fail("history", str(exc))
        return Exit.USAGE
    if args.json:
        print(json.dumps({"loads": loads}, indent=2))
        return Exit.OK
    if not loads:
        print("no finished loads yet")
        return Exit.OK
    parsed = api.Loads.from_json({"loads": loads}).loads
    if args.explain:
        print("\n\n".join("\n".join(explained(load)) for load in parsed))
        return Exit.OK
    rows = []
    for load in parsed:
        outcome = load.outcome + (" (partial)" if load.partial else "")
        rows.append(
            [
                terminal.local_time(load.started_at),
                load.target,
                terminal.duration(load.duration_seconds),
                outcome,
                load.cache or "unknown",
                terminal.phases(load),
            ]
        )
    terminal.show(terminal.table(COLUMNS, rows, phase_column=3))
    return Exit.OK


def environment_line(report: api.LoadReport) -> str:
    """ "9.8 GB, 97 % cached at start", or why that is not known."""
    total, resident = report.environment_bytes, report.environment_resident_bytes
    if total is None or resident is None:
        return f"not measured: {report.environment_unknown or 'by an exporter that did not'}"
    share = f", {resident / total:.0%} cached at start" if total else ", no file seen"
    return f"{terminal.size(total)}{share}"


def explained(load: api.Load) -> list[str]:
    """A load and its report as plain lines: the load first, then its report, indented."""
    name = f"load {load.id}: " if load.id is not None else ""
    started = terminal.local_time(load.started_at)
    lines = [f"{name}{load.target}, started {started}: {terminal.load_summary(load)}"]
    report = load.report
    if report is None:
        return [*lines, "  no report (kept by an exporter that wrote none)"]
    if report.reason is not None:
        lines.append(f"  slower than expected: {report.reason}")
    if report.expected_seconds is not None:
        which = f"{load.cache} " if load.cache else ""
        lines.append(f"  expected {terminal.duration(report.expected_seconds)} "
                     f"(median of the earlier {which}loads)")  # fmt: skip
    for part in report.phases:
        phase = terminal.PHASE_ABBREVIATIONS.get(part.phase, part.phase)
        median = part.median_seconds
        against = "no median yet" if median is None else f"median {terminal.duration(median)}"
        ratio = f", {part.seconds / median:.1f}x" if median else ""
        lines.append(f"  {phase:<10} {terminal.duration(part.seconds):>7}  {against}{ratio}")
    sources = [
        f"{terminal.size(count)} from {where}"
        for count, where in ((report.storage_bytes, "storage"),
                             (report.page_cache_bytes, "the page cache"))
        if count is not None
    ]  # fmt: skip
    if sources:
        lines.append(f"  read       {', '.join(sources)}")
    if report.startup_storage_bytes is not None:
        lines.append(f"  start-up   read {terminal.size(report.startup_storage_bytes)} of the "
                     "environment from storage")  # fmt: skip
    lines.append(f"  environment {environment_line(report)}")
    for device in report.storage_reads or ():
        lines.append(f"  {device.kind} {device.name}: {terminal.size(device.read_bytes)} read "
                     "meanwhile (host-wide)")  # fmt: skip
    rate = report.read_rate
    if rate is not None:
        where = "storage" if rate.source == "storage" else "the page cache"
        best = rate.best_before_bytes_per_second
        before = f", best before {terminal.rate(best)}" if best else ", none before"
        lines.append(f"  rate       {terminal.rate(rate.bytes_per_second)} from {where}{before}")
    return lines
