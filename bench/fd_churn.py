"""CPU of the weight-file view over a process holding ~20,000 descriptors that churns one.

    .venv/bin/python bench/fd_churn.py [--fds 19500] [--looks 30] [--baseline CHECKOUT]

Issue 27 row 7: a user's process held 19,500 descriptors of regular files and opened or closed
one every 0.5 s; the exporter spent a quarter of a core on that one target. A child process here
holds --fds descriptors (files of a scratch directory, and one weight shard open) and, before
each look of a WeightFilesSource (the exporter's view of a target's descriptors, one look per
sample), opens one more or closes one, so the count changes at every look: the worst case of that
churn. `steady` is the same process left alone. Each row: CPU (user+system of the measuring
process) per look, median and mean, what that is as a share of one core at one look a second,
and the descriptors identified (stat'ed) per look. With --baseline, another checkout (a git
worktree at an older commit) is measured in the same run, each in its own interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CHILD = r"""
import os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
libs, shard, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
names = sorted(os.listdir(libs))
held = [os.open(os.path.join(libs, names[i % len(names)]), os.O_RDONLY) for i in range(count)]
weights = os.open(shard, os.O_RDONLY)
churn = []
print("ready", flush=True)
for line in sys.stdin:
    if line.startswith("open"):
        churn.append(os.open(os.path.join(libs, names[len(churn) % len(names)]), os.O_RDONLY))
    elif churn:
        os.close(churn.pop())
    print("ok", flush=True)
"""

MEASURE = r"""
import json, os, statistics, subprocess, sys, time
from exporter.config.schema import WeightsConfig
from exporter.sources.process import ProcessSample
from exporter.sources.weightfiles import WeightFilesSource
child_code, libs, model = sys.argv[1:4]
fds, looks = int(sys.argv[4]), int(sys.argv[5])
shard = os.path.join(model, "model-00001-of-00001.safetensors")
child = subprocess.Popen([sys.executable, "-c", child_code, libs, shard, str(fds)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline() == "ready\n"
tree = ProcessSample(True, (child.pid,), child.pid, time.time(), 0, 0, None)
weights = WeightsConfig(paths=(model,), include=("*.safetensors",))
rows = {}
for scenario in ("steady", "churn"):
    source = WeightFilesSource(weights, lambda: tree)
    identified = 0
    plain = source._identify
    def counting(fd_dir, number):
        global identified
        identified += 1
        return plain(fd_dir, number)
    source._identify = counting
    sample = source.sample()  # the first look lists everything: not what is measured
    assert sample.held_files == 1, sample
    identified, costs = 0, []
    for look in range(looks):
        if scenario == "churn":
            child.stdin.write("open\n" if look % 2 == 0 else "close\n")
            child.stdin.flush()
            assert child.stdout.readline() == "ok\n"
        before = time.process_time()
        source.sample()
        costs.append(time.process_time() - before)
    rows[scenario] = {"median_ms": statistics.median(costs) * 1000,
                      "mean_ms": statistics.mean(costs) * 1000,
                      "identified_per_look": identified / looks}
child.kill()
child.wait()
print(json.dumps(rows))
"""


def measure(checkout: Path, libs: Path, model: Path, fds: int, looks: int) -> dict[str, dict]:
    done = subprocess.run(
        [sys.executable, "-c", MEASURE, CHILD, str(libs), str(model), str(fds), str(looks)],
        env={**os.environ, "PYTHONPATH": str(checkout)},
        cwd=checkout,
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"{checkout}: {done.stderr.strip().splitlines()[-1]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fds", type=int, default=19_500)
    parser.add_argument("--looks", type=int, default=30)
    parser.add_argument("--baseline", type=Path, help="another checkout to measure beside this")
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[1]
    checkouts = {"this checkout": here}
    if args.baseline is not None:
        if not (args.baseline / "exporter" / "__main__.py").is_file():
            raise SystemExit(f"--baseline {args.baseline}: not a checkout of model-load-exporter")
        checkouts[f"baseline {args.baseline.name}"] = args.baseline.resolve()
    scratch = Path(tempfile.mkdtemp(prefix="fd-churn-", dir="/var/tmp"))
    try:
        libs, model = scratch / "libs", scratch / "model"
        libs.mkdir()
        model.mkdir()
        for i in range(64):
            (libs / f"lib{i:02d}.so").write_bytes(os.urandom(4096))
        (model / "model-00001-of-00001.safetensors").write_bytes(os.urandom(1 << 20))
        print(f"{args.fds} descriptors held, {args.looks} looks per scenario, "
              f"{time.strftime('%Y-%m-%d')}")  # fmt: skip
        print(f"{'checkout':<24} {'scenario':<8} {'median ms':>10} {'mean ms':>9} "
              f"{'core at 1 Hz':>13} {'stat/look':>10}")  # fmt: skip
        results = {}
        for name, checkout in checkouts.items():
            results[name] = measure(checkout, libs, model, args.fds, args.looks)
            for scenario, row in results[name].items():
                share = row["mean_ms"] / 10  # ms per second, in percent of a core
                print(f"{name:<24} {scenario:<8} {row['median_ms']:>10.2f} {row['mean_ms']:>9.2f} "
                      f"{share:>12.2f}% {row['identified_per_look']:>10.1f}")  # fmt: skip
        if len(results) == 2:
            ours, theirs = (results[n]["churn"]["mean_ms"] for n in checkouts)
            print(f"churn: this checkout costs {ours / theirs:.3f}x the baseline's CPU per look")
    finally:
        shutil.rmtree(scratch)


if __name__ == "__main__":
    main()
