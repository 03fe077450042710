"""The live page at `/` in a real browser (Debian's chromium, driven by Playwright) while the real
simulator loads real shards under a real exporter: the card's phase and progress bar move, a
stall turns red, ready appears with the load below it, and nothing is fetched from anywhere but
the exporter. GPUs cannot exist here, so NVML is the fake 2-GPU node, fed the simulator's pid.

`LIVE_PAGE_SCREENSHOT=docs/live-page.png pytest tests/test_live_page.py` refreshes the README's
screenshot of a load in progress.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

import bcrypt
import pytest
import requests
from helpers.fake_nvml import GIB, FakeNvml, FakeProcess, h200_node
from helpers.processes import Simulator, evict_dir
from helpers.require import require
from helpers.support import RunningExporter, free_port, wait_for

from exporter.config.reader import parse_config
from exporter.exposition.http.app import WebApp
from exporter.exposition.http.webconfig import WebConfig
from exporter.sim.shards import generate_shards

playwright = pytest.importorskip("playwright.sync_api")
pytestmark = pytest.mark.system

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--no-first-run", "--disable-sync", "--disable-quic",
]  # fmt: skip
RED = (209, 36, 47)  # --red of the light theme


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require(os.access(CHROMIUM, os.X_OK), f"{CHROMIUM} missing: apt-get install chromium")
    with playwright.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield launched
        launched.close()


class GpuFeed:
    """Grows the simulator's memory on two fake H200s with the exporter's weights progress."""

    def __init__(self, nvml: FakeNvml, running: RunningExporter, pid: int) -> None:
        self.nvml, self.running, self.pid = nvml, running, pid
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            targets = self.running.runtime.snapshot().targets
            state = next((t.state for t in targets if t.name == "sim"), None)
            ratio = state.progress_ratio if state and state.progress_ratio else 0.0
            for gpu in self.nvml.gpus:
                used = GIB // 2 + int(ratio * 38 * GIB)
                gpu.processes = [FakeProcess(self.pid, used)]
                gpu.used_bytes = used + GIB // 2

    def close(self) -> None:
        self.stop.set()
        self.thread.join()


class PageWatch:
    """What the page shows over time, and everything it asked for or complained about."""

    def __init__(self, page: Any, origin: str) -> None:
        self.page = page
        self.origin = origin
        self.requests: list[str] = []
        self.foreign: list[str] = []
        self.errors: list[str] = []
        self.seen: list[tuple[str, float, bool]] = []
        page.on("request", lambda r: self.requests.append(r.url))
        page.on("pageerror", lambda e: self.errors.append(str(e)))
        page.on("console", lambda m: m.type == "error" and self.errors.append(m.text))
        page.route("**/*", self._route)

    def _route(self, route: Any) -> None:
        if route.request.url.startswith(self.origin + "/"):
            route.continue_()
        else:
            self.foreign.append(route.request.url)
            route.abort()

    def card(self) -> dict[str, Any]:
        state: dict[str, Any] = self.page.evaluate(
            """() => {
              const c = document.querySelector('.card[data-target="sim"]');
              if (!c) return null;
              const badge = c.querySelector('.phase');
              return {
                phase: c.dataset.phase, badge: badge.textContent,
                color: getComputedStyle(badge).backgroundColor,
                stalled: c.classList.contains('stalled'),
                progress: parseFloat(c.querySelector('.bar').getAttribute('aria-valuenow')),
                text: c.innerText,
                recent: [...c.querySelectorAll('.recent tr:not(.reason)')].map(r => r.textContent),
                reasons: [...c.querySelectorAll('.recent tr.reason')].map(r => r.textContent),
                links: [...c.querySelectorAll('.recent a')].map(a => a.getAttribute('href')),
                forecast: c.querySelector('.forecast').textContent,
              };
            }"""
        )
        if state:
            self.seen.append((state["phase"], state["progress"], state["stalled"]))
        return state

    def until(self, predicate: Any, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.card()
            if state and predicate(state):
                return state
            time.sleep(0.1)
        raise AssertionError(f"page never showed it; last states {self.seen[-5:]}")


def forecast_shown(line: str, forecast: dict[str, Any] | None) -> bool:
    """Whether a card's forecast line says what a status's restart_forecast does."""
    if forecast is None:
        return False
    if forecast["seconds"] is None:
        return line == f"a restart now: no forecast: {forecast['reason']}"
    cached = f"{math.floor(forecast['resident_share'] * 100)} % of the weights cached"
    return re.fullmatch(rf"a restart now: ~\d\S*s, {cached}", line) is not None


def assert_forecast_shown(watch: PageWatch, running: RunningExporter) -> None:
    """The card shows the status's restart forecast (the page refreshes every second and a
    residency pass may land between two refreshes: asked until one refresh agrees)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        forecast = running.status()["targets"][0].get("restart_forecast")
        line = watch.card()["forecast"]
        if forecast_shown(line, forecast):
            return
        time.sleep(0.2)
    raise AssertionError(f"the card shows {line!r}, the status {forecast}")


def rgb(css: str) -> tuple[int, ...]:
    return tuple(int(v) for v in css.removeprefix("rgb(").removesuffix(")").split(","))


@pytest.fixture
def scene(tmp_path: Path) -> Iterator[tuple[RunningExporter, FakeNvml, Path, int]]:
    weights = tmp_path / "model"
    generate_shards(weights, 4, 16 << 20)
    port = free_port()
    config = parse_config(
        {
            "sample_interval": "250ms",
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [
                {
                    "name": "sim",
                    "endpoint": {"url": f"http://127.0.0.1:{port}", "timeout": "1s"},
                    "weights": {"paths": [str(weights)]},
                    "process": {"pidfile": str(tmp_path / "server.pid")},
                    "stall_after": "1s",
                }
            ],
        }
    )
    nvml = FakeNvml(h200_node(2))
    running = RunningExporter(config, nvml=nvml)
    yield running, nvml, weights, port
    running.stop()


def test_live_page_follows_a_load(browser: Any, scene: Any, tmp_path: Path) -> None:
    running, nvml, weights, port = scene
    evict_dir(weights)
    # History for "expected" and recent loads; it must read as cold like the load under test.
    # The start's residency pass and the tree's read counter are sampled up to an interval
    # apart, so a slower read keeps what lands between them well under the 10 % of "mixed".
    first = Simulator(tmp_path, weights, port, "--read-rate", "16MB/s", "--init-seconds", "1.5")
    first.result()
    # Stopped only once the exporter has seen it ready: stopped earlier, it would be a failed load.
    wait_for(lambda: requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"])
    first.stop()
    evict_dir(weights)
    page = browser.new_page(viewport={"width": 820, "height": 480})
    watch = PageWatch(page, running.url)
    page.goto(running.url + "/")
    watch.until(lambda s: s["phase"] == "down" and len(s["recent"]) == 2)
    assert_forecast_shown(watch, running)
    watch.seen.clear()  # from here on: the load under test

    # About 4 s of weights, so the page (refreshed every second) sees the bar move several times,
    # and a stall that makes the load slower than expected: its report says why.
    slow = ("--read-rate", "16MB/s", "--cached-read-rate", "16MB/s", "--init-seconds", "1.5")
    sim = Simulator(tmp_path, weights, port, *slow, "--stall-at", "0.6", "--stall-for", "6s")
    feed = GpuFeed(nvml, running, sim.proc.pid)
    try:
        loading = watch.until(lambda s: s["phase"] == "loading_weights" and s["progress"] >= 30)
        assert "GPU0" in loading["text"] and "GPU1" in loading["text"]
        assert "in page cache" in loading["text"] and "cold at start" in loading["text"]
        assert re.search(r"Elapsed\s+\d+\.\ds of ~\d+\.\ds expected", loading["text"]), loading
        time.sleep(0.4)  # let the bar's transition finish for the picture
        page.screenshot(path=str(tmp_path / "live-page.png"), full_page=True)
        stalled = watch.until(lambda s: s["stalled"], timeout=20)
        assert stalled["badge"] == "stalled · loading_weights"
        assert rgb(stalled["color"]) == RED
        assert "No progress for" in stalled["text"]
        # The liveness line says what stopped: the simulator sleeps, so bytes and CPU are idle.
        probe = watch.until(lambda s: "liveness 503: stalled" in s["text"], timeout=10)
        assert re.search(r"no weight bytes for \d+s", probe["text"]), probe["text"]
        assert "CPU idle" in probe["text"], probe["text"]
        ready = watch.until(lambda s: s["phase"] == "ready", timeout=30)
        assert rgb(ready["color"]) != RED and ready["progress"] == 100
        shown = watch.until(lambda s: len(s["recent"]) == 3 and s["reasons"], timeout=15)
        recent = shown["recent"]
        assert recent[0] == "startedtookoutcomecachephases"
        assert all("ready" in row and "cold" in row for row in recent[1:]), recent
        # The newest load's reason under it, as its report gives it; each load links to it.
        newest, first_load = requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"]
        reason = newest["report"]["reason"]
        assert re.match(r"weights took \d+\.\dx their cold median: storage delivered", reason)
        assert shown["reasons"] == [f"slower than expected: {reason}"]
        assert shown["links"] == [f"api/v1/loads/{x['id']}" for x in (newest, first_load)]
        assert_forecast_shown(watch, running)
        advice = running.status()["targets"][0]["startup_probe"]
        assert f"failureThreshold {advice['failure_threshold']} " in shown["text"], advice
        assert f"of {advice['cold_loads']} loads)" in shown["text"]
    finally:
        feed.close()
        sim.stop()

    phases = [phase for phase, _, _ in watch.seen]
    order = ["down", "starting", "loading_weights", "initializing", "ready"]
    firsts = sorted(set(phases), key=phases.index)
    assert firsts == [p for p in order if p in firsts] and "initializing" in firsts, firsts
    progress = [p for phase, p, _ in watch.seen if phase == "loading_weights"]
    assert progress == sorted(progress) and len(set(progress)) >= 3, progress
    assert watch.errors == []
    assert watch.foreign == []
    assert all(url.startswith(running.url + "/") for url in watch.requests)
    assert {u.removeprefix(running.url) for u in watch.requests} >= {
        "/", "/api/v1/status", "/api/v1/loads?limit=100"
    }  # fmt: skip
    if target := os.environ.get("LIVE_PAGE_SCREENSHOT"):
        shutil.copyfile(tmp_path / "live-page.png", target)


class _Prefixed:
    """A reverse proxy's view of the app: mounted under /loads/."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        path = environ.get("PATH_INFO", "")
        if not path.startswith("/loads/"):
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [b"not under /loads/\n"]
        environ["PATH_INFO"] = path.removeprefix("/loads")
        return self.app(environ, start_response)


class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass


def test_live_page_works_behind_a_path_prefix_and_basic_auth(browser: Any, scene: Any) -> None:
    running, _, _, _ = scene
    hashed = bcrypt.hashpw(b"secret", bcrypt.gensalt(4))
    app = WebApp(running.runtime, WebConfig(basic_auth_users={"ops": hashed}))
    server = make_server("127.0.0.1", 0, _Prefixed(app), handler_class=_Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    origin = f"http://127.0.0.1:{server.server_port}"
    try:
        assert requests.get(f"{origin}/loads/", timeout=5).status_code == 401
        context = browser.new_context(http_credentials={"username": "ops", "password": "secret"})
        page = context.new_page()
        watch = PageWatch(page, origin)
        page.goto(f"{origin}/loads/")
        watch.until(lambda s: s["phase"] in ("down", "starting"))
        assert {u.removeprefix(origin) for u in watch.requests} >= {
            "/loads/",
            "/loads/api/v1/status",
        }
        links = page.eval_on_selector_all("nav a", "as => as.map(a => a.href)")
        assert links == [f"{origin}/loads/metrics", f"{origin}/loads/api/v1/status",
                         f"{origin}/loads/api/v1/loads"]  # fmt: skip
        assert watch.errors == [] and watch.foreign == []
        context.close()
    finally:
        server.shutdown()
        server.server_close()
