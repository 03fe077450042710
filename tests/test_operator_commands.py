"""`wait`, `status` and `history` as subprocesses against a real exporter watching the real
simulator load real (evicted) shard files; the terminal path under a pseudo-terminal."""

from __future__ import annotations

import json
import math
import os
import pty
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from helpers.documents import load, status, target
from helpers.processes import CLI, ExitClock, Host, Simulator, cli
from helpers.scripted import ScriptedExporter
from helpers.support import free_port

from exporter.exposition.http.webconfig import TlsConfig, WebConfig
from exporter.sim.shards import generate_shards

pytestmark = pytest.mark.system

SHARDS, SHARD_SIZE = 4, 8 << 20  # 32 MiB at 40 MB/s: about a second of weights
READINESS_SECONDS = 1.0  # the promise: ready is seen within a second


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    running = Host(tmp_path_factory.mktemp("ops"), SHARDS, SHARD_SIZE, "--stall.after", "2s")
    yield running
    running.close()


@pytest.fixture(scope="module")
def finished_load(host: Host) -> dict[str, Any]:
    """`wait` in a pipe through one whole cold load: its output, exit and the server's truth."""
    sim = host.simulate()
    proc = subprocess.Popen(
        host.wait_cmd(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    exited = ExitClock(proc)
    exited_at = exited.join(30)
    stdout, stderr = proc.communicate()
    return {
        "code": proc.returncode,
        "stdout": stdout,
        "stderr": stderr,
        "exited_at": exited_at,
        "report": sim.result(),
    }


def assert_seen_in_time(report: dict[str, Any], exited_at: float) -> None:
    """The server's `ready_at` is taken just after it opens its port, so a fast probe may beat it;
    the port opens only after the weights and the init steps, so nothing earlier can be seen."""
    assert report["outcome"] == "ready"
    assert report["weights_done_at"] < exited_at < report["ready_at"] + READINESS_SECONDS


def test_wait_exits_0_within_a_second_of_ready(finished_load: dict[str, Any]) -> None:
    assert finished_load["code"] == 0, finished_load["stderr"]
    assert_seen_in_time(finished_load["report"], finished_load["exited_at"])


def test_wait_in_a_pipe_prints_one_stable_line_per_phase(finished_load: dict[str, Any]) -> None:
    lines = finished_load["stdout"].splitlines()
    assert finished_load["stderr"] == ""
    *progress, last, forecast = lines
    phases = [line.split()[1] for line in progress]
    assert all(line.startswith("sim: ") for line in progress), lines
    # One line per change (no heartbeat within 30 s), in load order.
    assert len(phases) == len(set(phases)), lines
    order = ["down", "starting", "loading_weights", "initializing"]
    assert phases == sorted(phases, key=order.index) and "loading_weights" in phases, lines
    weights = next(line for line in progress if line.startswith("sim: loading_weights "))
    assert re.fullmatch(r"sim: loading_weights \d+ % .*elapsed \d+\.\ds", weights), weights
    assert re.fullmatch(r"sim: ready after \d+\.\ds, cold cache; waited \d+\.\ds", last), last
    # Then what a restart would cost now: one cold load in history, the weights cached now, so
    # no basis yet for the rate the cache delivers.
    assert re.fullmatch(
        r"sim: a restart now: no forecast, \d+ % of the weights cached: "
        r"no warm load in history to time the page cache",
        forecast,
    ), forecast


def test_status_shows_every_target_in_a_table(host: Host, finished_load: dict[str, Any]) -> None:
    result = cli("status", "--exporter", host.exporter.url)
    assert result.returncode == 0, result.stderr
    table, forecasts, probes, storage = result.stdout.split("\n\n")
    header, row = table.splitlines()
    assert header.split() == [
        "TARGET", "PHASE", "PROGRESS", "ETA", "ELAPSED", "CACHE", "ENDPOINT", "RESIDENT",
        "GPU", "MEMORY", "LAST", "LOAD",
    ]  # fmt: skip
    assert re.match(
        rf"sim +ready +100 % +- +- +cold +http://127\.0\.0\.1:{host.sim_port} +\d+ % of 32\.0 MiB"
        r" +- +ready after \d+\.\ds, cold cache, \d+\.\ds ago$",
        row,
    ), row
    # Under the table, what a restart would cost now, or why that is not known yet.
    assert re.fullmatch(r"sim: a restart now: (~\S+|no forecast), \d+ % of the weights cached.*",
                        forecasts), forecasts  # fmt: skip
    # What the kubelet probes answer, and the startupProbe window the one cold load needs.
    alive, advice = probes.splitlines()
    assert alive == "sim: alive 200: ready"
    cold = json.loads(cli("history", "--exporter", host.exporter.url, "--json").stdout)["loads"]
    seconds = [load["duration_seconds"] for load in cold if load["cache"] == "cold"]
    periods = math.ceil(max(seconds) * 1.25 / 10)
    assert re.fullmatch(
        rf"sim: startupProbe without the exporter: periodSeconds 10 x failureThreshold {periods}"
        rf" \({periods * 10}s; cold p99 \d+\.\ds of {len(seconds)} loads?\)",
        advice,
    ), advice
    # Then what holds the weights (a local filesystem here) and what it allows.
    lines = storage.splitlines()
    assert re.fullmatch(r"sim storage: \w+ on \w+.*", lines[0]), lines
    assert lines[1].startswith("  reads: yes: disk: "), lines
    assert lines[2] == "  residency: yes: cachestat on the files", lines
    assert lines[-1] == "  cache label: from residency", lines
    document = json.loads(cli("status", "--exporter", host.exporter.url, "--json").stdout)
    assert [t["target"] for t in document["targets"]] == ["sim"]
    assert document["sample_interval_seconds"] == 0.25
    assert document["targets"][0]["storage"]["cache_label"]["fixed"] is None


def test_history_from_the_exporter_and_from_its_file_agree(
    host: Host, finished_load: dict[str, Any]
) -> None:
    api = json.loads(cli("history", "--exporter", host.exporter.url, "--json").stdout)["loads"]
    file = cli("history", "--history.path", str(host.exporter.history), "--json")
    assert file.returncode == 0, file.stderr
    assert json.loads(file.stdout)["loads"] == api
    first = api[-1]
    assert (first["outcome"], first["cache"]) == ("ready", "cold")
    assert abs(first["duration_seconds"] - finished_load["report"]["load_seconds"]) < 1.0
    table = cli("history", "--exporter", host.exporter.url, "--target", "sim", "--limit", "1")
    header, row = table.stdout.splitlines()
    assert header.split() == ["STARTED", "TARGET", "DURATION", "OUTCOME", "CACHE", "PHASES"]
    assert re.match(
        r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d +sim +\d+\.\ds +ready +cold +start \S+ weights \S+ init",
        row,
    ), row


def test_wait_on_a_terminal_shows_a_live_progress_bar(host: Host) -> None:
    host.simulate()
    controller, terminal = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100", "LINES": "30"}
    proc = subprocess.Popen(
        host.wait_cmd(), stdin=terminal, stdout=terminal, stderr=terminal, env=env
    )
    os.close(terminal)
    screen = b""
    while chunk := _read(controller):
        screen += chunk
    os.close(controller)
    assert proc.wait(timeout=10) == 0
    text = screen.decode(errors="replace")
    assert "\x1b[" in text  # drawn for a terminal, not printed as lines
    assert "━" in text and "loading_weights" in text and "100 %" in text
    assert re.search(r"sim: ready after \d+\.\ds, cold cache; waited", text), text[-500:]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, 65536)
    except OSError:  # EIO: the other side closed
        return b""


def test_wait_exits_1_as_soon_as_the_server_crashes(host: Host) -> None:
    sim = host.simulate("--crash-at", "0.5")
    proc = subprocess.Popen(host.wait_cmd(), stdout=subprocess.PIPE, text=True)
    exited_at = ExitClock(proc).join(30)
    crashed_at = sim.exit.join(10)
    stdout, _ = proc.communicate()
    assert proc.returncode == 1, stdout
    assert 0 <= exited_at - crashed_at < READINESS_SECONDS + 0.5
    *_, last, forecast = stdout.splitlines()
    assert re.fullmatch(r"sim: failed after \d+\.\ds, cold cache; waited \S+", last), last
    assert forecast.startswith("sim: a restart now: "), forecast


@pytest.fixture(scope="module")
def stalled(host: Host) -> Simulator:
    """A load stuck in its weights for longer than the tests below look at it."""
    sim = host.simulate("--stall-at", "0.3", "--stall-for", "60s")
    host.exporter.until("loading_weights")
    return sim


def test_wait_max_wait_exits_75_with_one_status_line(host: Host, stalled: Simulator) -> None:
    started = time.monotonic()
    result = subprocess.run(host.wait_cmd("--max-wait", "1s"), capture_output=True, text=True)
    assert result.returncode == 75, result.stderr
    assert time.monotonic() - started < 5
    last = result.stdout.splitlines()[-1]
    assert re.fullmatch(
        r"still loading: sim loading_weights \d+ %, (ETA \S+|no ETA), elapsed \d+\.\ds( STALLED)?",
        last,
    ), last


def test_wait_timeout_exits_124(host: Host, stalled: Simulator) -> None:
    started = time.monotonic()
    result = subprocess.run(host.wait_cmd("--timeout", "1s"), capture_output=True, text=True)
    assert result.returncode == 124, result.stderr
    assert time.monotonic() - started < 5
    assert re.fullmatch(
        r"timed out after 1\.\ds: still loading: sim loading_weights .*\n", result.stderr
    )


def test_wait_json_is_one_object_per_line(host: Host, stalled: Simulator) -> None:
    result = subprocess.run(
        host.wait_cmd("--json", "--max-wait", "1500ms"), capture_output=True, text=True
    )
    assert result.returncode == 75
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(records) >= 2 and all(r["target"] == "sim" for r in records)
    assert records[0]["phase"] == "loading_weights" and 0 < records[0]["progress_ratio"] < 1
    assert (records[-1]["result"], records[-1]["exit_code"]) == ("max_wait", 75)


def test_wait_url_probes_the_server_itself(tmp_path: Path) -> None:
    weights = tmp_path / "model"
    generate_shards(weights, 2, 8 << 20)
    port = free_port()
    waiting = subprocess.Popen(
        [*CLI, "wait", "--url", f"http://127.0.0.1:{port}"], stdout=subprocess.PIPE, text=True
    )
    exited = ExitClock(waiting)
    sim = Simulator(tmp_path, weights, port)
    try:
        exited_at = exited.join(30)
        report = sim.result()
    finally:
        sim.stop()
    assert waiting.returncode == 0
    assert_seen_in_time(report, exited_at)
    assert waiting.stdout is not None
    lines = waiting.stdout.read().splitlines()
    assert (
        lines[0] == f"http://127.0.0.1:{port}/v1/completions: waiting (refused: connection refused)"
    )
    assert re.fullmatch(rf"http://127\.0\.0\.1:{port}/v1/completions: ready; waited \S+", lines[-1])


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["wait", "--exporter", "http://127.0.0.1:{dead}", "--target", "sim"],
         "cannot reach the exporter at http://127.0.0.1:{dead}: connection refused"),
        (["wait", "--exporter", "{exporter}", "--target", "nope"],
         "unknown target 'nope' (the exporter watches: sim)"),
        (["wait", "--url", "localhost:8000"], "--url: expected an absolute http/https URL"),
        (["wait", "--target", "sim", "--timeout", "soon"], "--timeout: expected a duration"),
        (["wait", "--url", "http://127.0.0.1:1", "--target", "sim"], "--url probes the server"),
        (["status", "--exporter", "http://127.0.0.1:{dead}"], "cannot reach the exporter"),
        (["status", "--exporter", "ftp://x"], "--exporter: expected an http or https URL"),
        (["history", "--history.path", "{missing}"], "--history.path: {missing} does not exist"),
        (["history", "--history.path", "{notdb}"], "file is not a database"),
        (["history", "--exporter", "{exporter}", "--target", "nope"], "unknown target 'nope'"),
        (["mcp", "--exporter", "ftp://x"], "--exporter: expected an http or https URL"),
        (["mcp", "--exporter", "https://ops@127.0.0.1:1"], "names user 'ops': set $MODEL_LOAD"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    host: Host, tmp_path: Path, args: list[str], message: str
) -> None:
    notdb = tmp_path / "notdb"
    notdb.write_text("not sqlite " * 100)
    values = {
        "dead": str(free_port()),
        "exporter": host.exporter.url,
        "missing": str(tmp_path / "missing.sqlite"),
        "notdb": str(notdb),
    }
    result = cli(*(a.format(**values) for a in args))
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message.format(**values) in result.stderr


def test_wait_url_max_wait_while_refused(tmp_path: Path) -> None:
    port = free_port()
    result = cli("wait", "--url", f"http://127.0.0.1:{port}/health", "--probe", "health",
                 "--max-wait", "500ms")  # fmt: skip
    assert result.returncode == 75
    assert result.stdout.splitlines()[-1] == (
        f"still waiting: http://127.0.0.1:{port}/health is waiting (refused: connection refused)"
    )


def test_serve_does_not_import_the_client_commands_nor_rich_nor_the_simulator() -> None:
    code = (
        "import sys; from exporter import cli; cli.build_parser('serve'); "
        "print(sorted(m for m in sys.modules if m in ('rich', 'mcp', 'safetensors', 'numpy') or "
        "m.startswith('exporter.sim') or m.startswith('exporter.commands.') and "
        "m.split('.')[2] not in ('serve', 'exits')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]", result.stderr


def restart() -> Callable[[float, float], dict[str, Any]]:
    """A script whose clock starts at its first answer (the client's start-up may take longer
    than the script on a busy machine): the previous run's ready for 0.6 s (the exporter has not
    seen the restart), then the new load, starting until 1.2 s, ready after that."""
    first: list[float] = []

    def script(elapsed: float, began: float) -> dict[str, Any]:
        first.append(elapsed)
        return restarting(elapsed - first[0], began + first[0])

    return script


def restarting(elapsed: float, began: float) -> dict[str, Any]:
    state: dict[str, Any] = {"phase": "ready", "last_record": load("sim", began - 100, began - 40)}
    if elapsed >= 0.6:
        state.update(phase="starting", elapsed_seconds=elapsed - 0.6)
    if elapsed >= 1.2:
        state.update(phase="ready", last_record=load("sim", began + 0.6, began + 1.2))
    return status(began + elapsed, target("sim", **state))


def test_wait_does_not_take_the_previous_runs_ready_for_this_one() -> None:
    server = ScriptedExporter(restart())
    try:
        result = cli("wait", "--exporter", server.url, "--target", "sim", timeout=10)
    finally:
        server.close()
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "sim: ready after 1m00s"  # shown, but not taken as the answer
    assert lines[1].startswith("sim: starting")
    assert re.fullmatch(r"sim: ready after 0\.6s; waited \d+\.\ds", lines[2]), lines


def without_endpoint(elapsed: float, began: float) -> dict[str, Any]:
    """A status whose target lacks a key the client reads: another program, or a broken one."""
    document = status(began + elapsed, target("sim", "ready"))
    del document["targets"][0]["endpoint"]
    return document


def test_an_answer_that_is_not_the_document_is_one_line_naming_the_key() -> None:
    server = ScriptedExporter(without_endpoint)
    try:
        commands = [("status",), ("status", "--json"), ("wait",), ("history",)]
        results = {args[-1]: cli(*args, "--exporter", server.url) for args in commands}
    finally:
        server.close()
    for result in results.values():
        assert result.returncode == 2, result
        assert result.stdout == "" and result.stderr.count("\n") == 1, result.stderr
    not_status = f"{server.url}/api/v1/status: not the document this client reads"
    for command in ("status", "--json", "wait"):
        assert f"{not_status} (targets[0]: no 'endpoint')" in results[command].stderr
    # Every GET answers the script's status, so /api/v1/loads gets a document without loads.
    not_loads = f"{server.url}/api/v1/loads: not the document this client reads (no 'loads')"
    assert not_loads in results["history"].stderr


def test_client_commands_speak_tls_and_basic_auth(
    start_exporter: Any, model_server: Any, tmp_path: Path
) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    web = WebConfig(
        tls=TlsConfig(str(cert), str(key)),
        basic_auth_users={"ops": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))},
    )
    running = start_exporter(
        {"targets": [{"name": "m", "endpoint": {"url": model_server.url}}]}, web
    )
    url = running.url.replace("https://", "https://ops@")
    env = {**os.environ, "MODEL_LOAD_EXPORTER_PASSWORD": "s3cret"}
    ca = ("--exporter.ca-file", str(cert))
    ok = cli("status", "--exporter", url, *ca, "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["targets"][0]["target"] == "m"
    ready = cli("wait", "--exporter", url, *ca, "--timeout", "20s", env=env)
    assert ready.returncode == 0 and ready.stdout.startswith("m: "), ready.stderr
    problems = {
        "unset": cli("status", "--exporter", url, *ca),
        "wrong": cli("status", "--exporter", url, *ca,
                     env={**env, "MODEL_LOAD_EXPORTER_PASSWORD": "nope"}),
        "untrusted": cli("status", "--exporter", url, env=env),
    }  # fmt: skip
    assert {k: r.returncode for k, r in problems.items()} == dict.fromkeys(problems, 2)
    assert "names user 'ops': set $MODEL_LOAD_EXPORTER_PASSWORD" in problems["unset"].stderr
    assert "401 Unauthorized" in problems["wrong"].stderr
    assert "TLS certificate not trusted" in problems["untrusted"].stderr
    assert all(r.stderr.count("\n") == 1 and "s3cret" not in r.stderr for r in problems.values())
