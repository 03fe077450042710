"""A flood of fake model servers from one unprivileged user, against the exporter as root.

    sudo .venv/bin/python bench/trust_flood.py [--waves 4] [--per-wave 500] [--max-targets 32]

Issue 20's row: 500 fake servers, gone, then 500 more, once held 459 targets, 925 threads and
158 MB, and a scrape took 4 s. Here `nobody` starts --waves waves of --per-wave processes whose
command lines say `vllm serve` (tests/helpers/fakeservers.py: one parent forks them all, each
rewrites its own argv), each wave killed before the next, 2,000 processes in all by default.
After each wave, once discovery has seen it: the exporter's discovered targets, threads, RSS,
the time of one /metrics scrape, and what discovery refused. The bounds hold when the targets
stay at the user's share (discovery.max_targets_per_user) and threads and RSS stop growing.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from helpers.fakeservers import FakeServers  # noqa: E402
from helpers.hostile import ExporterProcess  # noqa: E402
from helpers.support import free_port, sample_value, wait_for  # noqa: E402


def refused_total(text: str) -> dict[str, float]:
    reasons = ("user_share", "max_targets", "unreachable", "error")
    return {
        r: sample_value(text, "model_load_discovery_refused_total", reason=r) or 0 for r in reasons
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waves", type=int, default=4)
    parser.add_argument("--per-wave", type=int, default=500)
    parser.add_argument("--max-targets", type=int, default=32)
    parser.add_argument("--per-user", type=int, default=16)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="trust-flood-"))
    config = work / "config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "history_path": str(work / "history.sqlite"),
                "discovery": {
                    "interval": "1s",
                    "max_targets": args.max_targets,
                    "max_targets_per_user": args.per_user,
                    "users": ["nobody"],  # other users' servers on a shared host stay out
                },
            }
        )
    )
    exporter = ExporterProcess([f"--config.file={config}", "--log.level=warn"])
    try:
        exporter.wait_listening()
        time.sleep(2)
        print(f"before: threads {exporter.threads()}, RSS {exporter.rss_bytes() / 2**20:.0f} MiB")
        print("wave  processes  targets  threads  RSS MiB  scrape ms  refused (user_share, "
              "max_targets)")  # fmt: skip
        seen = 0.0
        for wave in range(args.waves):
            argvs = [
                ["vllm", "serve", f"flood-{wave}", "--port", str(free_port())]
                for _ in range(args.per_wave)
            ]
            fakes = FakeServers(argvs)
            wanted = seen + args.per_wave - args.per_user

            def refused_enough(wanted: int = wanted) -> bool:
                return refused_total(exporter.get("/metrics").text)["user_share"] >= wanted

            wait_for(refused_enough, timeout=120, interval=1.0)
            started = time.monotonic()
            text = exporter.get("/metrics", timeout=30).text
            scrape = (time.monotonic() - started) * 1000
            status = exporter.get("/api/v1/status", timeout=30).json()["targets"]
            counts = refused_total(text)
            seen = counts["user_share"]
            print(f"{wave + 1:>4}  {(wave + 1) * args.per_wave:>9}  {len(status):>7}  "
                  f"{exporter.threads():>7}  {exporter.rss_bytes() / 2**20:>7.0f}  {scrape:>9.0f}"
                  f"  {counts['user_share']:.0f}, {counts['max_targets']:.0f}")  # fmt: skip
            fakes.stop()
            time.sleep(3)  # seen gone, so that the next wave's servers may take their places
    finally:
        exporter.close()
        shutil.rmtree(work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
