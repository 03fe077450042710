"""`model-load-exporter prewarm`: pull weight files into the page cache before a restart.

A warm restart reads weights at memory speed instead of disk speed (minutes saved on a large
checkpoint), but only if the pages are still there: reading more than fits evicts what was read
first and everything else the host had cached. So the command measures before it reads (with the
exporter's own residency code), refuses with the numbers when the bytes still to read exceed
MemAvailable (exit 1; `--force` reads anyway), and measures again after, so its last line says
what is resident now rather than what was attempted. `--evict` does the opposite, for drills.

Where the page cache is not what the next load reads from, prewarming would claim a warm restart
it cannot give, so it refuses with the reason (exit 1, whatever `--force`): reads that bypass the
page cache (a FUSE mount in direct-I/O mode), a cache that is not the page cache (ZFS's ARC), a
FUSE mount whose every open drops the cache. Through an overlay or a FUSE passthrough it reads
and measures the real file below (exporter/sources/storage.py).

Every file is opened with the rights of the user who owns the names leading to it, never
through a symlink swapped in after the listing, and only when it is the regular file listed
(exporter/storage/ownedfiles.py): root prewarming a user's directory reads nothing the user could
not.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from exporter.commands import terminal
from exporter.commands.exits import Exit, UsageError
from exporter.config.schema import WeightsConfig
from exporter.servers.server import DEFAULT_INCLUDE
from exporter.sources.memory import read_meminfo
from exporter.sources.residency import measure_planned
from exporter.sources.storage import StorageDescription, WeightStorage
from exporter.storage import cachectl
from exporter.storage.ownedfiles import OwnedFiles
from exporter.storage.pagecache import PassResult
from exporter.storage.weighttree import WeightFile, walk_weights
from exporter.trust.safeio import Refused
from exporter.vocabulary import StorageKind

DEFAULT_JOBS = 4


def _jobs(text: str) -> int:
    try:
        jobs = int(text)
    except ValueError:
        jobs = 0
    if not 1 <= jobs <= 256:
        raise argparse.ArgumentTypeError(
            f"expected a number of readers from 1 to 256, got {text!r}"
        )
    return jobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("paths", nargs="+", metavar="PATH", help="weight files or directories")
    parser.add_argument(
        "--jobs",
        type=_jobs,
        default=DEFAULT_JOBS,
        metavar="N",
        help=f"parallel readers (default {DEFAULT_JOBS})",
    )
    parser.add_argument("--evict", action="store_true", help="drop the files from the page cache")
    parser.add_argument(
        "--force", action="store_true", help="read even when the files exceed available memory"
    )
    parser.add_argument(
        "--include",
        action="append",
        metavar="PATTERN",
        help=f"file patterns in directories (repeatable; default {' '.join(DEFAULT_INCLUDE)})",
    )


def find_files(paths: Sequence[str], include: Sequence[str]) -> tuple[WeightFile, ...]:
    """Files as the exporter finds a target's weights; a missing path is a usage error."""
    for path in paths:
        if not os.path.exists(path):
            raise UsageError(f"{path} does not exist")
    absolute = tuple(os.path.abspath(p) for p in paths)
    files = walk_weights(WeightsConfig(paths=absolute, include=tuple(include))).files
    if not files:
        raise UsageError(f"no weight files under {' '.join(paths)} (include: {' '.join(include)})")
    return files


def refusal(description: StorageDescription) -> str | None:
    """Why prewarming these weights would not make the next load warm, or None."""
    for mount in description.mounts:
        if mount.bypass.value:
            return f"reads of {mount.mount_point} bypass the page cache: {mount.bypass.reason}"
        if not mount.page_cache.value:
            return f"{mount.mount_point} is not served by the page cache: {mount.page_cache.reason}"
        if mount.kind is StorageKind.FUSE and not mount.residency.value:
            return f"{mount.mount_point}: {mount.residency.reason}"
    return None


def _residency(files: Sequence[WeightFile], storage: WeightStorage) -> PassResult:
    return measure_planned(files, storage, per_file=True)


def _share(result: PassResult) -> str:
    if result.resident_bytes is None:
        return "unknown (residency cannot be measured here)"
    ratio = result.resident_bytes / result.total_bytes if result.total_bytes else 1.0
    return f"{terminal.size(result.resident_bytes)} ({terminal.percent(ratio)})"


def run(args: argparse.Namespace) -> int:
    logging.getLogger("exporter").addHandler(logging.NullHandler())  # reasons arrive as values
    include = tuple(args.include or DEFAULT_INCLUDE)
    try:
        files = find_files(args.paths, include)
    except UsageError as exc:
        terminal.fail("prewarm", str(exc))
        return Exit.USAGE
    storage = WeightStorage(
        WeightsConfig(paths=tuple(os.path.abspath(p) for p in args.paths), include=include)
    )
    refused = refusal(storage.describe())
    if refused is not None:
        terminal.fail("prewarm", f"refusing: {refused}")
        return Exit.FAILED
    plan = storage.plan(files)
    real = (*plan.files, *plan.unmeasurable)  # the files below, or the files themselves
    owned = OwnedFiles(real)
    try:
        owned.check()  # before anything is measured, read or dropped
        before = _residency(files, storage)
        if args.evict:
            return _evict(files, real, before, storage, owned)
        return _prewarm(files, real, before, storage, args.jobs, args.force, owned)
    except Refused as exc:
        terminal.fail("prewarm", f"refusing: {exc.strerror}")
        return Exit.FAILED
    except OSError as exc:
        terminal.fail("prewarm", f"{exc.filename or 'read'}: {exc.strerror}")
        return Exit.FAILED
    finally:
        owned.close()


def _evict(
    files: Sequence[WeightFile],
    real: Sequence[WeightFile],
    before: PassResult,
    storage: WeightStorage,
    owned: OwnedFiles,
) -> int:
    started = time.monotonic()
    for wf in real:
        cachectl.evict(wf.path, owned.open)
    after = _residency(files, storage)
    print(
        f"evicted {len(files)} files, {terminal.size(before.total_bytes)} in "
        f"{terminal.duration(time.monotonic() - started)}; resident before {_share(before)}, "
        f"now {_share(after)}"
    )
    return Exit.OK


def _prewarm(
    files: Sequence[WeightFile],
    real: Sequence[WeightFile],
    before: PassResult,
    storage: WeightStorage,
    jobs: int,
    force: bool,
    owned: OwnedFiles,
) -> int:
    # Files already wholly resident are skipped; the others are read whole (cached parts of them
    # cost no I/O).
    resident = {row.path: row.resident_bytes for row in before.per_file}
    sizes = [(wf.path, wf.size, resident.get(wf.name, 0)) for wf in real]
    todo = [(path, size) for path, size, cached in sizes if cached < size]
    missing = before.total_bytes - (before.resident_bytes or 0)
    available = read_meminfo().available_bytes
    if missing > available and not force:
        terminal.fail(
            "prewarm",
            f"refusing: {terminal.size(missing)} of the {terminal.size(before.total_bytes)} are "
            f"not in the page cache but only {terminal.size(available)} of memory is available "
            "(MemAvailable); reading them would evict what was read first and other cached data. "
            "--force reads anyway",
        )
        return Exit.FAILED
    todo_bytes = sum(size for _, size in todo)
    started = time.monotonic()
    with _progress(todo_bytes) as advance:
        read = cachectl.prewarm_files(todo, jobs, advance, opener=owned.open)
    seconds = time.monotonic() - started
    after = _residency(files, storage)
    speed = terminal.rate(read / seconds if seconds else None)
    print(
        f"prewarmed {len(files)} files, {terminal.size(before.total_bytes)}: read "
        f"{terminal.size(read)} in {seconds:.2f}s ({speed}); "
        f"already resident {_share(before)}, now {_share(after)}"
    )
    return Exit.OK


@contextmanager
def _progress(total: int) -> Iterator[cachectl.Progress | None]:
    """A progress bar on a terminal; nothing in a pipe (the final line says it all)."""
    if not sys.stdout.isatty():
        yield None
        return
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    with Progress(
        "prewarm",
        BarColumn(),
        DownloadColumn(binary_units=True),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    ) as bar:
        task = bar.add_task("read", total=total)
        yield lambda n: bar.advance(task, n)  # Progress takes its own lock: readers are threads
