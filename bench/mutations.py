"""Mutation check: does the suite catch a one-line change to each rule users stake decisions on?

Each mutation is applied to a scratch copy of the tree and the fast (non-system) tests run
against it; a mutation that leaves them green is a rule no test defends. Run on demand:

    .venv/bin/python bench/mutations.py [-k SUBSTRING]

Prints one row per mutation (caught by which test, or MISSED) and exits 1 if any was missed.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent


class Mutation(NamedTuple):
    name: str
    path: str
    old: str
    new: str


MUTATIONS = (
    Mutation("warm threshold >= -> >", "exporter/load/progress.py",
             "if resident_share >= WARM_SHARE:", "if resident_share > WARM_SHARE:"),
    Mutation("WARM_SHARE 0.9 -> 0.99", "exporter/load/progress.py",
             "WARM_SHARE = 0.9\n", "WARM_SHARE = 0.99\n"),
    Mutation("COLD_SHARE 0.1 -> 0.3", "exporter/load/progress.py",
             "COLD_SHARE = 0.1\n", "COLD_SHARE = 0.3\n"),
    Mutation("probe answer change is not movement", "exporter/load/tracker.py",
             "if answer_changed or logged or moved(prev, obs):",
             "if logged or moved(prev, obs):"),
    Mutation("MOVE_BYTES 1 MiB -> 64 MiB", "exporter/load/activity.py",
             "MOVE_BYTES = 1 << 20\n", "MOVE_BYTES = 64 << 20\n"),
    Mutation("quiet-done after 6 intervals, not 5", "exporter/load/tracker.py",
             "QUIET_INTERVALS = 5\n", "QUIET_INTERVALS = 6\n"),
    Mutation("quiet-done from 97 %, not 90 %", "exporter/load/tracker.py",
             "QUIET_DONE_RATIO = 0.9\n", "QUIET_DONE_RATIO = 0.97\n"),
    Mutation("start grace 2 -> 30 intervals", "exporter/load/tracker.py",
             "START_GRACE_INTERVALS = 2.0\n", "START_GRACE_INTERVALS = 30.0\n"),
    Mutation("rate window 10 s -> 30 s", "exporter/load/eta.py",
             "RATE_WINDOW_SECONDS = 10.0\n", "RATE_WINDOW_SECONDS = 30.0\n"),
    Mutation("progress ratchet removed", "exporter/load/progress.py",
             "if before is None or ratio > before:", "if True:"),
    Mutation("ETA without the any-temperature fallback", "exporter/load/eta.py",
             "CACHE_INDEPENDENT: tuple[str, ...] = (Phase.INITIALIZING, *FINE_STEPS)",
             "CACHE_INDEPENDENT: tuple[str, ...] = ()"),
    Mutation("late loads' unwatched phases recorded", "exporter/load/tracker.py",
             "if seen and end_seen\n", "if True\n"),
    Mutation("histogram bisect_left -> bisect_right", "exporter/history/histograms.py",
             "bisect.bisect_left(", "bisect.bisect_right("),
    Mutation("every load into +Inf", "exporter/history/histograms.py",
             "counts[bisect.bisect_left(self.buckets, value)] += 1", "counts[-1] += 1"),
    Mutation("partial loads observed into the histograms", "exporter/runtime/filing.py",
             "        if not record.partial:\n", "        if True:\n"),
    Mutation("NVMLLibraryMismatchError not handled per call", "exporter/sources/gpu.py",
             'mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)', "mismatch = None"),
)  # fmt: skip


def run_tests(tree: Path) -> tuple[bool, str]:
    """The fast suite against `tree`; (passed, first failing test id)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not system", "-p", "no:cacheprovider",
         "--no-header", "-rf"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    failed = re.search(r"^FAILED (\S+)", done.stdout, re.MULTILINE)
    return done.returncode == 0, failed.group(1) if failed else done.stdout.strip()[-200:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-k", default="", help="only mutations whose name contains this")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if args.k in m.name]
    missed = 0
    with tempfile.TemporaryDirectory(prefix="mutations-") as scratch:
        tree = Path(scratch) / "tree"
        shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".venv", ".git", "*_cache"))
        passed, detail = run_tests(tree)
        if not passed:
            print(f"the unmutated suite fails: {detail}", file=sys.stderr)
            return 2
        print(f"{'mutation':<48} caught by")
        for mutation in chosen:
            path = tree / mutation.path
            original = path.read_text()
            if original.count(mutation.old) != 1:
                print(f"{mutation.name:<48} NOT APPLICABLE (source changed)")
                missed += 1
                continue
            path.write_text(original.replace(mutation.old, mutation.new))
            try:
                passed, detail = run_tests(tree)
            finally:
                path.write_text(original)
            missed += passed
            print(f"{mutation.name:<48} {'MISSED' if passed else detail}")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
