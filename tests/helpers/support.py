"""Loopback model-server stand-ins and a running exporter, shared by the tests."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families

from exporter.config.schema import Config
from exporter.exposition.http.app import HttpServer, WebApp
from exporter.exposition.http.webconfig import WebConfig
from exporter.runtime.wiring import Runtime

COMPLETION = {"id": "cmpl-1", "object": "text_completion", "choices": [{"index": 0, "text": "."}]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ModelServer:
    """A loopback HTTP server whose behaviour a test can switch: ready, 503, hang."""

    def __init__(self) -> None:
        self.mode = "ready"
        self.release = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                if outer.mode == "hang":
                    outer.release.wait(30)
                    return
                if outer.mode == "503":
                    self._send(503, {"error": {"message": "Loading model", "code": 503}})
                else:
                    self._send(200, COMPLETION)

            def _send(self, code: int, body: object) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer()

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self._answer()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class RunningExporter:
    """The exporter in this process on a free port.

    Its model servers are mostly ready ones, which would make it quiet (gauges every 30 s) and
    every test that changes a gauge wait that long: the quiet pace here is one second unless a
    test asks (tests/test_quiet.py does; exporters started as processes keep the real one).
    """

    def __init__(self, config: Config, web: WebConfig | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("quiet_interval", 1.0)
        self.runtime = Runtime(config, **kwargs)
        self.http = HttpServer(WebApp(self.runtime, web), "127.0.0.1:0")
        self.url = f"{self.http.scheme}://127.0.0.1:{self.http.port}"
        self.runtime.start()
        self.http.start()
        self.stopped = False

    def metrics(self) -> str:
        response = requests.get(f"{self.url}/metrics", timeout=10)
        response.raise_for_status()
        return response.text

    def status(self) -> dict[str, Any]:
        response = requests.get(f"{self.url}/api/v1/status", timeout=10)
        response.raise_for_status()
        return dict(response.json())

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        self.http.stop()
        self.runtime.stop()


def wait_for(predicate: Callable[[], Any], timeout: float = 20.0, interval: float = 0.1) -> Any:
    """Poll until predicate returns something truthy; fail with the last value otherwise."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout}s (last: {last!r})")


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample of `name` whose labels include `labels`, or None."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return None


def metrics_when(base_url: str, predicate: Callable[[str], bool], timeout: float = 20.0) -> str:
    """Scrape base_url/metrics until the exposition satisfies predicate (a starting exporter
    refuses connections at first); return that exposition."""

    def scrape() -> str | None:
        try:
            text = requests.get(f"{base_url}/metrics", timeout=5).text
        except requests.ConnectionError:
            return None
        return text if predicate(text) else None

    return str(wait_for(scrape, timeout))


def sim_target(
    port: int, weights: Path, pidfile: Path, name: str = "sim", **overrides: Any
) -> dict[str, Any]:
    """The config of a target watching the simulator: its endpoint on `port`, its weights, its
    process through the simulator's `--pidfile`; `overrides` replace or add keys."""
    return {
        "name": name,
        "endpoint": {"url": f"http://127.0.0.1:{port}", "timeout": "1s"},
        "weights": {"paths": [str(weights)]},
        "process": {"pidfile": str(pidfile)},
        **overrides,
    }
