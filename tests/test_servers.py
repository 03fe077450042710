"""Adding a server is one module and one registry line (exporter/servers/__init__.py).

The worked example: a sixth server kind, `fakeserve`, made up in this file and registered from
it alone (`FAKESERVE` is the module, the `registered` fixture is the registry line). With nothing
else edited, the config accepts it, discovery recognises its command line, the log parser reads
its format, and the endpoint probe names it from its answers; then a real process of it is found
and watched through a whole load by a running exporter.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.support import free_port, metrics_when, sample_value, wait_for

from exporter.config.reader import parse_config
from exporter.config.schema import EndpointConfig
from exporter.config.values import ConfigError
from exporter.discovery.serverargs import find_launch, recognise
from exporter.load.events import EventKind
from exporter.logs.markers import MarkerParser
from exporter.servers import SERVERS
from exporter.servers.logformat import CAUSE_RULES, LogFormat, rule, stamp_utc
from exporter.servers.server import Answers, Command, Role, Server
from exporter.sim.shards import generate_shards
from exporter.sources.endpoint import EndpointProber
from exporter.vocabulary import AUTO, ProbeKind, ProbeResult, ServerKind

# --- the module: everything fakeserve is ------------------------------------------------------

FAKESERVE = Server(
    kind="fakeserve",
    commands=(
        Command(
            label="FakeServe",
            consoles={"fakeserve": "up"},
            modules={"fakeserve.main": None},
            flags={
                Role.MODEL: ("--weights",),
                Role.HOST: ("--bind",),
                Role.PORT: ("--listen-port",),
            },
            defaults={Role.HOST: "127.0.0.1", Role.PORT: "7777"},
            probe=ProbeKind.HEALTH,
            probe_path="/ready",
        ),
    ),
    log=LogFormat(
        signature=re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z fakeserve: "),
        prefix=re.compile(
            r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)T(?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)"
            r"\.(?P<f>\d{3})Z fakeserve: "
        ),
        stamp=stamp_utc,
        rules=(
            rule(EventKind.WEIGHTS_BEGIN, "weights: begin", r"^weights: begin"),
            rule(
                EventKind.WEIGHTS_PROGRESS, "weights: ", r"^weights: (?P<done>\d+)/(?P<total>\d+)"
            ),
            rule(EventKind.WEIGHTS_END, "weights: done", r"^weights: done"),
            rule(EventKind.KV_CACHE, "kv cache: ", r"^kv cache: \d+ blocks"),
            rule(EventKind.READY, "ready: ", r"^ready: serving"),
            rule(EventKind.FATAL, "fatal: ", r"^fatal: "),
            *CAUSE_RULES,
        ),
    ),
    answers=Answers(server_header="fakeserve"),
)


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry line, as exporter/servers/__init__.py would hold it for a module."""
    monkeypatch.setitem(SERVERS, FAKESERVE.kind, FAKESERVE)


LOG = """\
2026-03-02T10:00:00.000Z fakeserve: fakeserve 1.0 on 127.0.0.1:7777
2026-03-02T10:00:01.000Z fakeserve: weights: begin
2026-03-02T10:00:02.000Z fakeserve: weights: 1/2
2026-03-02T10:00:03.000Z fakeserve: weights: 2/2
2026-03-02T10:00:03.500Z fakeserve: weights: done
2026-03-02T10:00:04.000Z fakeserve: kv cache: 512 blocks
2026-03-02T10:00:06.000Z fakeserve: ready: serving
"""
LOG_AT = 1_772_445_606.0  # 2026-03-02T10:00:06Z: the log read as its last line was written


# --- the engines pick it up -------------------------------------------------------------------


def test_the_config_accepts_a_registered_kind_and_only_then(registered: None) -> None:
    target = {"name": "t", "endpoint": {"url": "http://127.0.0.1:1"}}
    config = parse_config(
        {
            "targets": [{**target, "log": {"file": "/x.log", "format": "fakeserve"}}],
            "discovery": {"enabled": True, "servers": ["vllm", "fakeserve"]},
        }
    )
    log = config.targets[0].log
    assert log is not None and log.format == "fakeserve"
    assert config.discovery.servers == ("vllm", "fakeserve")
    with pytest.raises(ConfigError, match=r"must be one of auto, sglang, .*, fakeserve, got"):
        parse_config({"targets": [{**target, "log": {"file": "/x.log", "format": "fakeserv"}}]})


def test_an_unregistered_kind_is_refused_by_the_config() -> None:
    with pytest.raises(ConfigError, match=r"^discovery.servers\[0\]: must be one of .*triton, got"):
        parse_config({"discovery": {"servers": ["fakeserve"]}})


@pytest.mark.parametrize(
    ("argv", "how"),
    [
        (["fakeserve", "up", "--weights", "/m"], "fakeserve up"),
        (
            ["/venv/bin/python3", "-m", "fakeserve.main", "--weights", "/m"],
            "python3 -m fakeserve.main",
        ),
        (["python", "/src/fakeserve/main.py", "--weights", "/m"], "python /src/fakeserve/main.py"),
        (["fakeserve", "down"], None),
        (["grep", "fakeserve"], None),
    ],
)
def test_its_command_lines_are_recognised(
    registered: None, argv: list[str], how: str | None
) -> None:
    launch = find_launch(argv, kinds=tuple(SERVERS))
    assert (launch.how if launch else None) == how
    assert launch is None or launch.kind == "fakeserve"


def test_its_arguments_say_where_it_listens_and_what_it_loads(registered: None) -> None:
    argv = ["python3", "-m", "fakeserve.main", "--weights=/models/tiny", "--listen-port", "9123"]
    found = recognise(argv, {}, kinds=tuple(SERVERS))
    assert found is not None
    assert (found.kind, found.host, found.port, found.model) == (
        "fakeserve",
        "127.0.0.1",
        9123,
        "/models/tiny",
    )
    assert [(e.what, e.source) for e in found.evidence] == [
        ("server", "FakeServe started as `python3 -m fakeserve.main`"),
        ("model", "argument --weights"),
        ("port", "argument --listen-port"),
        ("host", "default of FakeServe"),
    ]


def test_nothing_knows_it_before_it_is_registered() -> None:
    assert find_launch(["fakeserve", "up"], kinds=(*SERVERS, "fakeserve")) is None
    parser = MarkerParser(AUTO)
    assert parser.feed(LOG, LOG_AT) == [] and parser.format is None


def test_auto_detects_its_log_and_reads_its_markers(registered: None) -> None:
    parser = MarkerParser(AUTO)
    events = parser.feed(LOG, LOG_AT)
    assert parser.format == "fakeserve"
    assert "line 1 matched fakeserve's line prefix" in parser.format_reason
    # Stamps to the millisecond: each event at the end of its millisecond.
    assert [(e.kind, round(e.time - LOG_AT, 2), e.done) for e in events] == [
        (EventKind.WEIGHTS_BEGIN, -5.0, None),
        (EventKind.WEIGHTS_PROGRESS, -4.0, 1),
        (EventKind.WEIGHTS_PROGRESS, -3.0, 2),
        (EventKind.WEIGHTS_END, -2.5, None),
        (EventKind.KV_CACHE, -2.0, None),
        (EventKind.READY, 0.0, None),
    ]
    assert [e.kind for e in MarkerParser("fakeserve").feed(LOG, LOG_AT)] == [e.kind for e in events]


# --- a real fakeserve process ------------------------------------------------------------------

PROGRAM = r'''
"""fakeserve: reads its weight files, logs in its own format, then serves /ready."""
import argparse, os, sys, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

parser = argparse.ArgumentParser()
parser.add_argument("--weights", required=True)
parser.add_argument("--bind", default="127.0.0.1")
parser.add_argument("--listen-port", type=int, default=7777)
args = parser.parse_args()


def log(message):
    now = time.time()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(now)) + f".{int(now % 1 * 1000):03d}Z"
    print(f"{stamp} fakeserve: {message}", file=sys.stderr, flush=True)


class Handler(BaseHTTPRequestHandler):
    server_version = "fakeserve/1.0"

    def do_GET(self):
        self.send_response(200 if self.path == "/ready" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


log(f"fakeserve 1.0 on {args.bind}:{args.listen_port}")
time.sleep(1.0)  # imports
log("weights: begin")
shards = sorted(os.listdir(args.weights))
for done, name in enumerate(shards, 1):
    with open(os.path.join(args.weights, name), "rb") as shard:
        while shard.read(1 << 20):
            time.sleep(0.05)
    log(f"weights: {done}/{len(shards)}")
log("weights: done")
log("kv cache: 512 blocks")
time.sleep(0.5)
httpd = ThreadingHTTPServer((args.bind, args.listen_port), Handler)
log("ready: serving")
httpd.serve_forever()
'''


@pytest.fixture
def start_fakeserve(
    tmp_path: Path,
) -> Iterator[Callable[[Path], tuple[subprocess.Popen[bytes], int]]]:
    """Starts `python -m fakeserve.main --weights DIR --listen-port N`, its stderr in a file of
    its own (where the exporter finds its log), and stops it after the test."""
    site = tmp_path / "site"
    (site / "fakeserve").mkdir(parents=True)
    (site / "fakeserve" / "__init__.py").write_text("")
    (site / "fakeserve" / "main.py").write_text(PROGRAM)
    started: list[subprocess.Popen[bytes]] = []

    def start(weights: Path) -> tuple[subprocess.Popen[bytes], int]:
        port = free_port()
        with (tmp_path / f"fakeserve-{port}.log").open("w") as stderr:
            proc = subprocess.Popen(
                [sys.executable, "-m", "fakeserve.main", "--weights", str(weights),
                 "--listen-port", str(port)],
                env={"PYTHONPATH": str(site)}, stdout=subprocess.DEVNULL, stderr=stderr,
            )  # fmt: skip
        started.append(proc)
        return proc, port

    yield start
    for proc in started:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.system
def test_its_answers_name_it_only_once_registered(
    tmp_path: Path, start_fakeserve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    empty = tmp_path / "no-weights"
    empty.mkdir()
    _, port = start_fakeserve(empty)  # nothing to load: serving within two seconds
    config = EndpointConfig(url=f"http://127.0.0.1:{port}", probe=ProbeKind.HEALTH, path="/ready")
    prober = EndpointProber(config)
    before = wait_for(lambda: (s := prober.sample()).result == ProbeResult.READY and s)
    assert before.server == ServerKind.UNKNOWN
    monkeypatch.setitem(SERVERS, FAKESERVE.kind, FAKESERVE)
    after = EndpointProber(config).sample()
    assert (after.result, after.server) == (ProbeResult.READY, "fakeserve")


DURATION = "model_load_duration_seconds_count"
PHASE_DURATION = "model_load_phase_duration_seconds_count"


@pytest.mark.system
def test_a_running_fakeserve_is_discovered_its_log_read_and_its_load_measured(
    registered: None, tmp_path: Path, start_exporter: Any, start_fakeserve: Any
) -> None:
    weights = tmp_path / "Tiny-Fake"
    weights.mkdir()
    generate_shards(weights, 3, 8 << 20)
    exporter = start_exporter(
        {"sample_interval": "250ms", "discovery": {"servers": ["fakeserve"], "interval": "250ms"}}
    )
    proc, port = start_fakeserve(weights)
    name = f"fakeserve-Tiny-Fake-{port}"

    def ready() -> dict[str, Any] | None:
        found = [t for t in exporter.status()["targets"] if t["target"] == name]
        return found[0] if found and found[0].get("phase") == "ready" else None

    target = wait_for(ready, timeout=30)
    assert target["server"] == "fakeserve"
    assert target["discovered"]["kind"] == "fakeserve"
    assert target["discovered"]["pid"] == proc.pid
    assert target["endpoint"] == f"http://127.0.0.1:{port}"
    assert (target["log"]["format"], target["log"]["format_reason"][:5]) == (
        "fakeserve",
        "auto:",
    )
    # The finished load, observed whole (its start is the process's): its phases and the
    # fine step that only fakeserve's log could tell.
    metrics = metrics_when(
        exporter.url,
        lambda text: sample_value(text, DURATION, target=name, outcome="ready") == 1,
        timeout=10,
    )
    for phase in ("starting", "loading_weights", "kv_cache"):
        assert sample_value(metrics, PHASE_DURATION, target=name, phase=phase) == 1, phase
    info = {"target": name, "server": "fakeserve", "discovered": "true"}
    assert sample_value(metrics, "model_load_target_info", **info) == 1
    assert sample_value(metrics, "model_load_phase", target=name, phase="ready") == 1
    answered = {"target": name, "result": "ready"}
    assert (sample_value(metrics, "model_load_endpoint_probes_total", **answered) or 0) >= 1
