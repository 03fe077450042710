"""A model loaded into a running server, through the real runtime: a Triton-shaped target in
explicit model-control mode (test_triton.py in tests/servers/ does it with the real Triton).

The server is a real process that maps and reads real weight files when told (test_weightfiles'
Loader), a loopback endpoint that answers 503 while a model loads, and a log the test writes in
Triton's own format. The exporter has gone quiet (a ready target, its exit watched) when the
load begins: the log's `loading:` line must still start a load at once, with progress from the
files mapped afresh (the same files, consumed whole by the load before, are no progress of this
one), and the load must end within a second of the endpoint's first ready answer. Each unload
is counted in model_load_unloads_total and logged once, naming the target and the model.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from helpers.support import ModelServer, wait_for
from test_weightfiles import Loader

MIB = 1 << 20
SHARDS = 3
SHARD = 8 * MIB
STEP_SECONDS = 0.3  # between two mapped MiB-blocks: progress has time to show


def triton_line(message: str) -> str:
    """A line as tritonserver 2.51 writes it: glog prefix, local time, quoted message."""
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    return f'I{stamp} {os.getpid()} model_lifecycle.cc:472] "{message}"\n'


class FakeTriton:
    """The parts of a Triton the exporter sees: process, endpoint, log, weight files."""

    def __init__(self, tmp_path: Path) -> None:
        self.version = tmp_path / "repo" / "tiny" / "1"
        self.version.mkdir(parents=True)
        self.shards = []
        for k in range(SHARDS):
            shard = self.version / f"model-{k + 1:05d}-of-{SHARDS:05d}.safetensors"
            shard.write_bytes(os.urandom(SHARD))
            self.shards.append(shard)
        self.loader = Loader()
        self.pidfile = tmp_path / "tritonserver.pid"
        self.pidfile.write_text(f"{self.loader.pid}\n")
        self.endpoint = ModelServer()
        self.log = tmp_path / "triton.log"
        self.say('Started HTTPService at 0.0.0.0:8000"')

    def say(self, message: str) -> None:
        with self.log.open("a") as out:
            out.write(triton_line(message.rstrip('"')))

    def load(self, during: Callable[[], None]) -> float:
        """`POST .../tiny/load` as Triton answers it: its lines, the shards mapped and read two
        MiB at a time (`during` after each), then ready. When the endpoint first said ready."""
        self.endpoint.mode = "503"
        self.say("loading: tiny:1")
        time.sleep(0.5)  # the backend's stub starts
        self.say("TRITONBACKEND_ModelInstanceInitialize: tiny_0_0 (CPU device 0)")
        for shard in self.shards:
            self.loader.do(f"open {shard}", f"map {shard}", f"close {shard}")
            for mib in range(0, SHARD // MIB, 2):
                self.loader.do(f"touch {shard} {mib * MIB} {(mib + 2) * MIB}")
                time.sleep(STEP_SECONDS)
                during()
            self.loader.do(f"unmap {shard}")
        self.say("successfully loaded 'tiny'")
        self.endpoint.mode = "ready"
        return time.time()

    def close(self) -> None:
        self.loader.stop()
        self.endpoint.close()


@pytest.mark.system
def test_a_model_loaded_into_a_quiet_running_server_is_a_load_with_fresh_progress(
    tmp_path: Path, start_exporter: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.runtime.wiring")
    triton = FakeTriton(tmp_path)
    try:
        exporter = start_exporter(
            {
                "sample_interval": "250ms",
                "history_path": str(tmp_path / "history.sqlite"),
                "targets": [
                    {
                        "name": "triton",
                        "endpoint": {
                            "url": triton.endpoint.url,
                            "probe": "health",
                            "path": "/v2/health/ready",
                        },
                        "weights": {"paths": [str(tmp_path / "repo")]},
                        "process": {"pidfile": str(triton.pidfile)},
                        "log": {"file": str(triton.log), "format": "triton"},
                    }
                ],
            }
        )
        runtime = exporter.runtime

        def entry() -> dict[str, Any]:
            return dict(exporter.status()["targets"][0])

        loads: list[dict[str, Any]] = []
        for _ in range(2):  # the second reads the files the first consumed whole
            wait_for(lambda: runtime.quiet and entry().get("phase") == "ready", timeout=60)
            seen: list[dict[str, Any]] = []
            before = len(runtime.loads("triton", 5))  # the process's own start, if it was seen
            answered = triton.load(lambda seen=seen: seen.append(entry()))
            recorded = wait_for(
                lambda b=before: len(runtime.loads("triton", 5)) > b and time.time(),
                timeout=5,
                interval=0.02,
            )
            record = runtime.loads("triton", 1)[0]
            loads.append(
                {
                    "record": record,
                    "answered": answered,
                    "recorded_after": recorded - answered,
                    "during": [
                        (s["phase"], s.get("in_server"), s.get("progress_ratio")) for s in seen
                    ],
                }
            )
            triton.say("successfully unloaded 'tiny' version 1")
            wait_for(lambda: entry().get("unloaded") == "tiny", timeout=5)
            unloads = len(loads)  # one per load so far, counted in the metric
            wait_for(lambda n=unloads: unloads_total(exporter.metrics()) == n, timeout=5)
    finally:
        triton.close()
    said = [r.getMessage() for r in caplog.records if "unloaded model" in r.getMessage()]
    assert said == ["target triton: the server unloaded model tiny"] * 2, said
    for load in loads:
        record = load["record"]
        assert record.outcome == "ready" and not record.partial, load
        assert load["recorded_after"] <= 1.0, load
        assert abs(record.ended_at - load["answered"]) <= 1.0, load
        weights = [p for phase, in_server, p in load["during"] if phase == "loading_weights"]
        assert all(in_server for _, in_server, _ in load["during"]), load
        # Progress from the files mapped in this load, from its first block to its last.
        assert weights and weights[0] < 0.25 and 0.0 < weights[-2] < 1.0, load["during"]
        assert weights == sorted(weights), load


def unloads_total(metrics: str) -> float | None:
    """model_load_unloads_total of the target, None while it is absent."""
    for line in metrics.splitlines():
        if line.startswith('model_load_unloads_total{target="triton"} '):
            return float(line.split()[-1])
    return None
