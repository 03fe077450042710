"""The exporter's HTTP surface against real loopback servers, promtool and a real Prometheus."""

from __future__ import annotations

import base64
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import requests
import yaml
from helpers.real_nvml import real_nvml
from helpers.support import (
    ModelServer,
    RunningExporter,
    free_port,
    metrics_when,
    sample_value,
    wait_for,
)
from helpers.users import NOBODY, REPO, nobody_python

from exporter.exposition.http.webconfig import load_web_config
from exporter.storage.cachectl import evict


def target(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "endpoint": {"url": url, "timeout": "3s", **extra}}


@pytest.mark.system
@pytest.mark.nvml
def test_metrics_reflect_a_real_endpoint_and_pass_promtool(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "a.safetensors").write_bytes(os.urandom(1 << 20))
    running: RunningExporter = start_exporter(
        {"targets": [{**target("m", model_server.url), "weights": {"paths": [str(weights)]}}]}
    )
    text = metrics_when(
        running.url,
        lambda t: (
            sample_value(t, "model_load_phase", target="m", phase="ready") == 1
            and sample_value(t, "model_load_source_up", source="nvml", target="") is not None
            # Ready may come from the probe before the first residency pass on a busy machine.
            and sample_value(t, "model_load_weights_bytes", target="m") is not None
        ),
    )
    assert sample_value(text, "model_load_endpoint_probes_total", target="m", result="ready") >= 1  # type: ignore[operator]
    assert sample_value(text, "model_load_weights_bytes", target="m") == 1 << 20
    assert sample_value(text, "model_load_weights_files", target="m") == 1
    assert sample_value(text, "model_load_source_up", source="endpoint", target="m") == 1
    assert sample_value(text, "model_load_phase", target="m", phase="ready") == 1
    assert sample_value(text, "model_load_host_memory_total_bytes") > 0  # type: ignore[operator]
    # The NVML source is up exactly where pynvml itself sees GPUs; none are invented elsewhere.
    gpus = real_nvml().gpus if real_nvml().present else ()
    assert sample_value(text, "model_load_source_up", source="nvml", target="") == bool(gpus)
    for gpu in gpus:
        total = sample_value(text, "model_load_gpu_memory_total_bytes", gpu=str(gpu.index))
        assert total == gpu.total_bytes
    assert text.count("model_load_gpu_memory_used_bytes{") == len(gpus)
    check = subprocess.run(
        ["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=30
    )
    assert check.returncode == 0, check.stdout + check.stderr

    model_server.mode = "503"
    text = metrics_when(
        running.url, lambda t: sample_value(t, "model_load_endpoint_up", target="m") == 0
    )
    assert sample_value(text, "model_load_endpoint_probes_total", target="m", result="http_error")


def test_openmetrics_negotiation(start_exporter: Any, model_server: ModelServer) -> None:
    running = start_exporter({"targets": [target("m", model_server.url)]})
    wait_for(lambda: running.runtime.ready)
    response = requests.get(
        f"{running.url}/metrics",
        headers={"Accept": "application/openmetrics-text; version=1.0.0"},
        timeout=10,
    )
    assert response.headers["Content-Type"].startswith("application/openmetrics-text")
    assert response.text.endswith("# EOF\n")
    assert "model_load_duration_seconds" in response.text


def test_hung_endpoint_does_not_slow_scrapes(
    start_exporter: Any, model_server: ModelServer
) -> None:
    model_server.mode = "hang"
    running = start_exporter(
        {"targets": [{"name": "hung", "endpoint": {"url": model_server.url, "timeout": "10s"}}]}
    )
    wait_for(lambda: running.runtime.ready)
    durations = []
    for _ in range(10):
        started = time.monotonic()
        text = running.metrics()
        durations.append(time.monotonic() - started)
        time.sleep(0.2)
    # The probe is stuck for its whole 10 s timeout during all of this; scrapes never wait on it.
    assert max(durations) < 1.0, durations
    assert 'model_load_endpoint_up{target="hung"}' not in text  # no probe has finished yet
    assert sample_value(text, "model_load_process_up", target="hung") is None


def test_status_landing_health_and_ready(start_exporter: Any, model_server: ModelServer) -> None:
    running = start_exporter({"targets": [target("m", model_server.url)]})
    wait_for(lambda: running.runtime.ready)
    status = wait_for(lambda: (s := running.status())["targets"][0].get("phase") == "ready" and s)
    entry = status["targets"][0]
    assert entry["target"] == "m" and entry["phase"] == "ready"
    assert entry["sources"]["endpoint"]["up"] is True
    landing = requests.get(running.url + "/", timeout=5)
    assert landing.status_code == 200 and 'href="metrics"' in landing.text
    assert requests.get(running.url + "/-/healthy", timeout=5).status_code == 200
    assert requests.get(running.url + "/-/ready", timeout=5).status_code == 200
    assert requests.get(running.url + "/api/v1/loads", timeout=5).json() == {"loads": []}
    assert requests.get(running.url + "/nope", timeout=5).status_code == 404


@pytest.mark.system
def test_basic_auth_and_tls(start_exporter: Any, model_server: ModelServer, tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4)).decode()
    web_file = tmp_path / "web.yml"
    web_file.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {"cert_file": str(cert), "key_file": str(key)},
                "basic_auth_users": {"prometheus": hashed},
            }
        )
    )
    running = start_exporter(
        {"targets": [target("m", model_server.url)]}, web=load_web_config(str(web_file))
    )
    assert running.url.startswith("https://")
    denied = requests.get(f"{running.url}/metrics", verify=str(cert), timeout=10)
    assert denied.status_code == 401
    wrong = requests.get(
        f"{running.url}/metrics", verify=str(cert), auth=("prometheus", "nope"), timeout=10
    )
    assert wrong.status_code == 401
    ok = requests.get(
        f"{running.url}/metrics", verify=str(cert), auth=("prometheus", "s3cret"), timeout=10
    )
    assert ok.status_code == 200 and "model_load_exporter_build_info" in ok.text
    # The kubelet's probes are behind the same TLS and auth (a probe can send the header).
    for path in ("/probe/alive", "/probe/ready?target=m"):
        assert requests.get(running.url + path, verify=str(cert), timeout=10).status_code == 401
    probe = requests.get(
        f"{running.url}/probe/alive?target=m",
        verify=str(cert),
        headers={"Authorization": "Basic " + base64.b64encode(b"prometheus:s3cret").decode()},
        timeout=10,
    )
    assert probe.status_code == 200 and probe.text.endswith("\n"), probe.text


def test_a_partial_load_is_kept_in_history_and_adds_nothing_to_metrics(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    """Seen loading (503) with no process to date it: its start is unknown, so no histogram."""
    model_server.mode = "503"
    running = start_exporter(
        {
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [target("late", model_server.url)],
        }
    )
    wait_for(lambda: running.status()["targets"][0].get("partial"))
    model_server.mode = "ready"
    loads = wait_for(lambda: requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"])
    assert [(r["outcome"], r["partial"]) for r in loads] == [("ready", True)]

    # History takes the load a moment before the targets' history views are read back from it.
    def with_last_duration() -> str | None:
        text = running.metrics()
        last = sample_value(text, "model_load_last_duration_seconds", target="late")
        return text if last is not None else None

    text = wait_for(with_last_duration)
    assert "model_load_duration_seconds_count" not in text
    assert "model_load_phase_duration_seconds_count" not in text


@pytest.mark.system
def test_real_prometheus_scrapes_the_exporter(
    start_exporter: Any, model_server: ModelServer, tmp_path: Path
) -> None:
    running = start_exporter(
        {
            "history_path": str(tmp_path / "history.sqlite"),
            "targets": [target("scraped", model_server.url)],
        }
    )
    prom_port = free_port()
    config = tmp_path / "prometheus.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                "scrape_configs": [
                    {
                        "job_name": "model-load",
                        "static_configs": [{"targets": [running.url.split("//")[1]]}],
                    }
                ],
            }
        )
    )
    prometheus = subprocess.Popen(
        ["prometheus", f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:

        def query(promql: str) -> list[dict[str, Any]] | None:
            try:
                response = requests.get(
                    f"http://127.0.0.1:{prom_port}/api/v1/query",
                    params={"query": promql},
                    timeout=5,
                )
            except requests.ConnectionError:
                return None
            result: list[dict[str, Any]] = response.json()["data"]["result"]
            return result or None

        result = wait_for(lambda: query('model_load_endpoint_up{target="scraped"}'), 60, 0.5)
        assert result[0]["metric"]["job"] == "model-load"
        assert result[0]["value"][1] == "1"

        # A load: the ready endpoint fails three probes, then answers again.
        model_server.mode = "503"
        wait_for(lambda: query('model_load_in_progress{target="scraped"} == 1'), 30, 0.2)
        model_server.mode = "ready"
        count = 'model_load_duration_seconds_count{target="scraped",outcome="ready"}'
        wait_for(lambda: query(f"{count} == 1"), 30, 0.5)
        [load] = requests.get(f"{running.url}/api/v1/loads", timeout=5).json()["loads"]
        assert 0 < load["duration_seconds"] <= 5 and not load["partial"]
        buckets = query('model_load_duration_seconds_bucket{target="scraped"}')
        assert buckets is not None
        by_le = {b["metric"]["le"]: float(b["value"][1]) for b in buckets}
        assert by_le["5.0"] == by_le["+Inf"] == 1 and len(by_le) == 21
        [median] = query(
            "histogram_quantile(0.5, sum by (le) "
            '(model_load_duration_seconds_bucket{target="scraped"}))'
        ) or [None]
        assert median is not None and 0 < float(median["value"][1]) <= 5
        [total] = query('model_load_duration_seconds_sum{target="scraped"}') or [None]
        assert total is not None
        assert float(total["value"][1]) == pytest.approx(load["duration_seconds"])
    finally:
        prometheus.terminate()
        prometheus.wait(timeout=30)


@pytest.mark.system
def test_exporter_process_shuts_down_on_sigterm(model_server: ModelServer) -> None:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--target", "m", "--endpoint", model_server.url,
         f"--web.listen-address=127.0.0.1:{port}", "--history.path=", "--sample.interval=200ms"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                return requests.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).ok
            except requests.ConnectionError:
                return False

        wait_for(ready, timeout=30)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
        _, stderr = proc.communicate()
        assert "shutting down" in stderr and "Traceback" not in stderr
    finally:
        proc.kill()


@pytest.mark.system
def test_port_in_use_is_one_line_error(model_server: ModelServer) -> None:
    port = model_server.httpd.server_address[1]
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "--target", "m", "--endpoint", model_server.url,
         f"--web.listen-address=127.0.0.1:{port}", "--history.path="],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert result.returncode == 1
    assert "cannot listen on" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.system
@pytest.mark.requires("root", "setpriv", "nobody_python")
def test_unprivileged_exporter_exports_no_residency_rather_than_a_false_one(
    model_server: ModelServer,
) -> None:
    python = nobody_python()
    assert python is not None
    directory = Path(tempfile.mkdtemp(prefix="residency-nobody-", dir="/tmp"))
    try:
        directory.chmod(0o755)
        shard = directory / "model-00001-of-00001.safetensors"
        shard.write_bytes(os.urandom(8 << 20))
        shard.chmod(0o644)  # root-owned, readable by all: mincore as nobody would claim 100 %
        evict(str(shard))
        port = free_port()
        proc = subprocess.Popen(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
             python, "-m", "exporter", "--target", "m", "--endpoint", model_server.url,
             "--weights", str(directory), "--history.path=", "--sample.interval=200ms",
             f"--web.listen-address=127.0.0.1:{port}"],
            cwd=directory, env={"PYTHONPATH": str(REPO), "PATH": os.defpath},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            text = metrics_when(
                f"http://127.0.0.1:{port}", lambda t: "model_load_weights_files{" in t, timeout=30
            )
        finally:
            proc.terminate()
            _, stderr = proc.communicate(timeout=10)
    finally:
        shutil.rmtree(directory)
    assert sample_value(text, "model_load_weights_files", target="m") == 1
    assert sample_value(text, "model_load_weights_bytes", target="m") == 8 << 20
    assert sample_value(text, "model_load_source_up", source="pagecache", target="m") == 0
    assert "model_load_weights_resident_bytes" not in text.replace(
        "# HELP model_load_weights_resident_bytes", ""
    ).replace("# TYPE model_load_weights_resident_bytes", "")
    assert "run as the files' owner or root" in stderr


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs a tmpfs at /dev/shm")
def test_weights_without_a_block_device_are_reported_in_status(
    start_exporter: Any, model_server: ModelServer
) -> None:
    directory = Path(tempfile.mkdtemp(prefix="weights-", dir="/dev/shm"))
    try:
        (directory / "a.safetensors").write_bytes(b"\0" * 4096)
        running = start_exporter(
            {"targets": [{**target("m", model_server.url), "weights": {"paths": [str(directory)]}}]}
        )

        def described() -> dict[str, Any] | None:
            entry = running.status()["targets"][0]
            return entry if "block_devices" in entry and "storage" in entry else None

        entry = wait_for(described)
    finally:
        shutil.rmtree(directory)
    assert entry["block_devices"] == []
    assert entry["unbacked_weight_paths"] == [str(directory)]
    assert "no block device" in entry["unbacked_note"]
    # What holds them, and what that means for the load's label: in memory, never cold.
    storage = entry["storage"]
    assert storage["kinds"] == ["memory"]
    assert storage["cache_label"] == {
        "fixed": None, "never_cold": True, "residency_is_temperature": True, "bypass": False,
        "reason": "the weights are on a memory filesystem: in memory by construction",
    }  # fmt: skip
    (mount,) = storage["mounts"]
    assert (mount["fstype"], mount["paths"]) == ("tmpfs", [str(directory)])
    assert mount["read_rate"] == {"value": False, "reason": "a memory filesystem reads no device"}


@pytest.mark.system
def test_sighup_reloads_the_config_and_a_bad_one_keeps_the_old(
    model_server: ModelServer, tmp_path: Path
) -> None:
    config = tmp_path / "config.yaml"

    def write(*names: str) -> None:
        targets = [target(name, model_server.url) for name in names]
        config.write_text(yaml.safe_dump({"sample_interval": "200ms", "targets": targets}))

    write("a")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", f"--config.file={config}", "--history.path=",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def metrics_with(predicate: Callable[[str], bool]) -> str:
        return metrics_when(f"http://127.0.0.1:{port}", predicate, timeout=30)

    def up(text: str, name: str) -> float | None:
        return sample_value(text, "model_load_endpoint_up", target=name)

    try:
        metrics_with(lambda t: up(t, "a") == 1)
        write("a", "b")
        proc.send_signal(signal.SIGHUP)
        text = metrics_with(lambda t: up(t, "b") == 1)
        assert sample_value(text, "model_load_config_last_reload_successful") == 1
        config.write_text("targets: [{name: a, endpoint: {url: nope}}]\n")
        proc.send_signal(signal.SIGHUP)
        text = metrics_with(
            lambda t: sample_value(t, "model_load_config_last_reload_successful") == 0
        )
        assert up(text, "a") == 1 and up(text, "b") == 1  # the running config stays
        write("b")
        proc.send_signal(signal.SIGHUP)
        text = metrics_with(
            lambda t: sample_value(t, "model_load_config_last_reload_successful") == 1
        )
        assert 'target="a"' not in text and up(text, "b") == 1
    finally:
        proc.terminate()
        _, stderr = proc.communicate(timeout=10)
    assert "config reload failed, keeping the running config" in stderr
    assert "Traceback" not in stderr
