"""Fixtures: loopback model-server stand-ins and a running exporter."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.journal import journald  # noqa: F401  (a fixture: tests that read a journal)
from helpers.require import require_all
from helpers.support import ModelServer, RunningExporter

from exporter.config.reader import parse_config
from exporter.exposition.http.webconfig import WebConfig
from exporter.sources.nvml_pids import NvmlPidCheck


def pytest_runtest_setup(item: pytest.Item) -> None:
    """`@pytest.mark.requires(...)`: skip without the prerequisites, fail under MLE_STRICT=1."""
    for marker in item.iter_markers("requires"):
        require_all(*marker.args)


@pytest.fixture
def model_server() -> Iterator[ModelServer]:
    server = ModelServer()
    yield server
    server.close()


@pytest.fixture
def start_exporter() -> Iterator[Callable[..., RunningExporter]]:
    started: list[RunningExporter] = []

    def start(data: dict[str, Any], web: WebConfig | None = None, **kwargs: Any) -> RunningExporter:
        """A runtime on `data`; with a fake `nvml=`, its PIDs count as the host's own, as a test
        lists them (tests of the PID-namespace rule pass their own `gpu_pid_check=`)."""
        data = {"sample_interval": "200ms", "history_path": "", **data}
        if "nvml" in kwargs:
            kwargs.setdefault("gpu_pid_check", NvmlPidCheck(host_namespace=True))
        running = RunningExporter(parse_config(data, source="test"), web, **kwargs)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()
