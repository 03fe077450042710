"""What one server's noisy log costs the exporter and the other targets (issue 27 row 4).

    .venv/bin/python bench/noisy_log.py [--seconds 20] [--rate 10MB] [--noisy 1] [--code DIR]

An exporter process follows --noisy servers' log files (configured `log: {file, format: auto}`)
beside one more target. Two rounds: each noisy server writing `--rate` bytes a second of short
lines no rule knows ("ok"), then writing ten lines a second (a quiet log). In each round, for
--seconds: the exporter's CPU share of one core (/proc/PID/stat), the p50 and p99 of a /metrics
scrape taken every 0.2 s and the p99 of /api/v1/status right after it, the worst and p99 age of
the other target's endpoint sample in /api/v1/status (it is due every 0.5 s), and the bytes each
noisy log skipped. After the writers stop: how long the exporter's CPU keeps going (work left
behind). `--code DIR` runs the exporter from another checkout (an older commit, for the figure
before the fix).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers import noisylog  # noqa: E402
from helpers.hostile import ExporterProcess  # noqa: E402
from helpers.support import free_port, wait_for  # noqa: E402

QUIET_RATE = 30  # bytes a second: ten short lines
LOOK_SECONDS = 0.2


def size(text: str) -> int:
    units = {"KB": 10**3, "MB": 10**6, "GB": 10**9}
    for unit, factor in units.items():
        if text.upper().endswith(unit):
            return int(float(text[: -len(unit)]) * factor)
    return int(text)


def percentile(values: list[float], share: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(share * len(ordered)))]


def round_of(args: argparse.Namespace, rate: int, work: Path) -> dict[str, float]:
    logs = [work / f"noisy-{i}.log" for i in range(args.noisy)]
    for log in logs:
        log.write_bytes(b"")
    targets = [
        {
            "name": f"noisy-{i}",
            "endpoint": {"url": f"http://127.0.0.1:{free_port()}", "timeout": "1s"},
            "log": {"file": str(log), "format": "auto"},
        }
        for i, log in enumerate(logs)
    ]
    targets.append(
        {"name": "other", "endpoint": {"url": f"http://127.0.0.1:{free_port()}", "timeout": "1s"}}
    )
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump({"sample_interval": "500ms", "history_path": "", "targets": targets})
    )
    exporter = ExporterProcess(["serve", f"--config.file={config}"], code=args.code or REPO)
    writers: list[subprocess.Popen[bytes]] = []
    try:
        exporter.wait_listening()
        wait_for(lambda: len(exporter.get("/api/v1/status").json()["targets"]) == len(targets))
        writers = [subprocess.Popen(noisylog.command(log, rate, args.seconds)) for log in logs]
        time.sleep(1.0)
        cpu0, wall0 = exporter.cpu_seconds(), time.monotonic()
        scrapes, statuses, ages = [], [], []
        while time.monotonic() - wall0 < args.seconds - 1.0:
            began = time.monotonic()
            exporter.get("/metrics", timeout=60).raise_for_status()
            scrapes.append(time.monotonic() - began)
            began = time.monotonic()
            status = exporter.get("/api/v1/status", timeout=60).json()
            statuses.append(time.monotonic() - began)
            other = next(t for t in status["targets"] if t["target"] == "other")
            ages.append(other["sources"]["endpoint"]["age_seconds"])
            time.sleep(LOOK_SECONDS)
        cpu = (exporter.cpu_seconds() - cpu0) / (time.monotonic() - wall0)
        skipped = sum(t["log"].get("skipped_bytes", 0) for t in status["targets"] if "log" in t)
        for writer in writers:
            writer.wait()
        after0, wall1 = exporter.cpu_seconds(), time.monotonic()
        time.sleep(5.0)
        after = (exporter.cpu_seconds() - after0) / (time.monotonic() - wall1)
        written = sum(log.stat().st_size for log in logs)
    finally:
        for writer in writers:
            writer.kill()
        exporter.stop()
    return {
        "cpu": cpu,
        "scrape_p50": statistics.median(scrapes),
        "scrape_p99": percentile(scrapes, 0.99),
        "status_p99": percentile(statuses, 0.99),
        "age_p99": percentile(ages, 0.99),
        "age_max": max(ages),
        "skipped_mb": skipped / 1e6,
        "written_mb": written / 1e6,
        "cpu_after": after,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", default="10MB", help="bytes a second each noisy server writes")
    parser.add_argument("--noisy", type=int, default=1, help="noisy servers")
    parser.add_argument("--code", type=Path, help="run the exporter from this checkout")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="mle-bench-noisy-"))
    print(f"{args.noisy} log(s), {args.seconds:.0f} s a round, exporter from {args.code or REPO}")
    print(
        "| log | CPU (share of a core) | scrape p50 / p99 | /api/v1/status p99 | other target's "
        "sample age p99 / max | skipped / written | CPU in the 5 s after the writers stop |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, rate in (("noisy", size(args.rate)), ("quiet", QUIET_RATE)):
        r = round_of(args, rate, work)
        print(
            f"| {name} | {r['cpu']:.1%} | {r['scrape_p50'] * 1000:.0f} / "
            f"{r['scrape_p99'] * 1000:.0f} ms | {r['status_p99'] * 1000:.0f} ms | "
            f"{r['age_p99']:.2f} / {r['age_max']:.2f} s | "
            f"{r['skipped_mb']:.0f} / {r['written_mb']:.0f} MB | {r['cpu_after']:.1%} |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
