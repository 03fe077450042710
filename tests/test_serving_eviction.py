"""Residency stays current while serving: a ready server's weights evicted from the page cache
reach the shipped eviction alert within a minute, with the exporter at its real quiet pace.

The exporter watches a simulated server through its pidfile (so it goes quiet once the server
is ready: gauges every 30 s, a serving target's residency refreshed every 5 minutes) while a
real Prometheus scrapes it every 500 ms and evaluates the shipped rules, `for:` in seconds
(tests/test_dashboard_prometheus.py). The weights are evicted just after a look at host memory,
the worst moment: the exporter must notice the page cache shrink at its next look and measure
the weights at once, so `ModelWeightsEvicted`'s expression holds within 60 s, and the restart
forecast follows the residency, in the alert's description too.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest
from helpers.processes import Simulator, evict_dir
from helpers.support import RunningExporter, free_port, sim_target, wait_for
from test_dashboard_prometheus import SIM, AlertStates, Prometheus

from exporter.runtime.pacing import EVICTION_LOOK_SECONDS, QUIET_INTERVAL
from exporter.sim.shards import generate_shards
from exporter.sources import MEMORY, PAGECACHE
from exporter.sources.residency import SERVING_REFRESH_SECONDS

SHARDS, SHARD_SIZE = 4, 4 << 20
DEADLINE = 60.0  # DESIGN: an eviction is seen within a minute

pytestmark = pytest.mark.system


def test_an_eviction_while_serving_reaches_the_alert_within_a_minute(
    tmp_path: Path, start_exporter: Any
) -> None:
    weights = tmp_path / "model"
    generate_shards(weights, SHARDS, SHARD_SIZE)
    evict_dir(weights)
    port = free_port()
    running: RunningExporter = start_exporter(
        {
            "sample_interval": "200ms",
            "history_path": str(tmp_path / "history.sqlite"),  # the load: a basis to forecast
            "targets": [sim_target(port, weights, tmp_path / "server.pid")],
        },
        quiet_interval=QUIET_INTERVAL,
    )
    runtime = running.runtime
    prometheus = Prometheus(tmp_path, running.url.removeprefix("http://"))
    server = Simulator(tmp_path, weights, port, *SIM)
    try:
        wait_for(prometheus.scraping, timeout=30, interval=0.2)
        assert server.result()["outcome"] == "ready"
        wait_for(lambda: runtime.quiet, timeout=20)
        total = SHARDS * SHARD_SIZE

        def resident() -> int | None:
            sample = runtime.sampler.value(PAGECACHE, "sim")
            return sample.resident_bytes if sample is not None else None

        # Measured as the load ended: warm (the mmap loader may leave a page or two unread).
        wait_for(lambda: (resident() or 0) >= 0.9 * total, timeout=10)
        evicted = AlertStates(prometheus, "ModelWeightsEvicted")
        assert evicted() == "inactive"

        def memory_look() -> float | None:
            reading = runtime.sampler.latest(MEMORY)
            return reading.finished_at if reading is not None else None

        looked = memory_look()
        wait_for(lambda: memory_look() != looked, timeout=EVICTION_LOOK_SECONDS + 5, interval=0.05)
        evict_dir(weights)
        began = time.monotonic()
        wait_for(lambda: resident() == 0, timeout=DEADLINE, interval=0.1)
        measured = time.monotonic() - began
        wait_for(lambda: evicted() != "inactive", timeout=DEADLINE - measured, interval=0.2)
        alerted = time.monotonic() - began
        print(f"eviction measured after {measured:.1f}s, alert true after {alerted:.1f}s")
        assert alerted < DEADLINE
        # The next look at memory did it, not the serving refresh (5 minutes) nor the quiet pace.
        assert measured < EVICTION_LOOK_SECONDS + 5 < QUIET_INTERVAL < SERVING_REFRESH_SECONDS
        assert runtime.quiet  # at quiet mode's cost: nothing left the quiet pace for this

        def forecast() -> dict[str, Any]:
            return dict(running.status()["targets"][0].get("restart_forecast") or {})

        # The forecast follows at once too (not at the next quiet tick): all from storage now,
        # at the rate the cold load in history read at.
        wait_for(lambda: forecast().get("resident_share") == 0.0, timeout=5)
        assert forecast()["seconds"] > 0, forecast()
        wait_for(lambda: evicted() == "firing", timeout=30, interval=0.2)
        (alert,) = [a for a in prometheus.api("alerts")["alerts"]
                    if a["labels"]["alertname"] == "ModelWeightsEvicted"]  # fmt: skip
        assert re.fullmatch(
            r"Only 0% of the weights of sim are in the page cache on \S+: a restart now would "
            r"take about \S+ \(its restart forecast from this residency and past loads\)\.",
            alert["annotations"]["description"],
        ), alert["annotations"]
    finally:
        server.stop()
        prometheus.stop()
