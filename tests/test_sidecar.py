"""The sidecar's privileges (deploy/kubernetes/sidecar/), held to this kernel.

In a pod with `shareProcessNamespace: true` the exporter sees the server's processes but not its
mount namespace, and both run as root unless told otherwise; the server keeps the container
runtime's default capabilities. That is emulated here without a cluster: the stand-in server
(SGLang's command line, the simulator underneath) runs as root with exactly containerd's default
capability set, in its own mount namespace where its weights are bind-mounted at a path that is
empty outside it; the exporter runs with no config, as root with only the capabilities the
manifests give it. The claim: CAP_SYS_PTRACE alone is enough for the process's read bytes, its
weight files and their residency (through /proc/PID/root); without it they are absent, never
wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from helpers.kubelet import Prober
from helpers.processes import cold_checkpoint
from helpers.standins import install
from helpers.support import free_port, wait_for

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv", "unshare")]

REPO = Path(__file__).resolve().parent.parent
SIDECAR = REPO / "deploy" / "kubernetes" / "sidecar"
# containerd's (and Docker's) default capabilities for a container that asks for none.
RUNTIME_DEFAULT = (
    "chown", "dac_override", "fsetid", "fowner", "mknod", "net_raw", "setgid", "setuid",
    "setfcap", "setpcap", "net_bind_service", "sys_chroot", "kill", "audit_write",
)  # fmt: skip
SHARDS, SHARD_SIZE = 4, 16 << 20


def manifest_capabilities() -> tuple[list[str], list[str]]:
    """What the manifests leave the sidecar and the server (all alike, tests/test_deploy.py
    checks): the capabilities each adds after dropping ALL."""
    deployment = next(yaml.safe_load_all((SIDECAR / "vllm.yaml").read_text()))
    spec = deployment["spec"]["template"]["spec"]
    (sidecar,), (server,) = spec["initContainers"], spec["containers"]
    kept = []
    for container in (sidecar, server):
        capabilities = container["securityContext"]["capabilities"]
        assert capabilities["drop"] == ["ALL"]
        kept.append([c.lower() for c in capabilities.get("add", [])])
    return kept[0], kept[1]


def bounding(capabilities: list[str] | tuple[str, ...]) -> str:
    return "--bounding-set=-all" + "".join(f",+{c}" for c in capabilities)


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    return cold_checkpoint(tmp_path / "weights", SHARDS, SHARD_SIZE)


@pytest.fixture
def pod(tmp_path: Path, weights: Path) -> Iterator[Any]:
    """start(exporter_capabilities) -> (exporter URL, server process, its model path)."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(
        capabilities: list[str], server_capabilities: tuple[str, ...]
    ) -> tuple[str, subprocess.Popen[bytes], Path]:
        port, server_port = free_port(), free_port()
        exporter = subprocess.Popen(
            ["setpriv", bounding(capabilities), "--no-new-privs", sys.executable, "-m", "exporter",
             f"--web.listen-address=127.0.0.1:{port}", "--sample.interval=250ms",
             f"--history.path={tmp_path / f'history-{port}.sqlite'}"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(exporter)
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _answers(f"{url}/-/ready"), 30)
        # The server's own view: its weights at a path that is an empty directory outside.
        mount_point = tmp_path / f"models-{server_port}"
        mount_point.mkdir()
        site, _ = install(tmp_path / "standins")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(site), *sys.path]),
            "STANDIN_SIM_ARGS": "--read-rate 12MB/s --startup-seconds 0.5 --init-seconds 1",
        }
        script = (
            f"mount --bind {weights} {mount_point} && exec setpriv {bounding(server_capabilities)}"
            f" {sys.executable} -m sglang.launch_server --model-path {mount_point}"
            f" --port {server_port}"
        )
        server = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        procs.append(server)
        return url, server, mount_point

    yield start
    for proc in reversed(procs):
        proc.terminate()
        proc.wait(timeout=15)


def _answers(url: str) -> bool:
    try:
        return requests.get(url, timeout=2).status_code == 200
    except requests.ConnectionError:
        return False


def target(url: str, pid: int) -> dict[str, Any] | None:
    """The target discovery made of the server with this pid (this host may run others)."""
    targets = requests.get(f"{url}/api/v1/status", timeout=5).json()["targets"]
    return next((t for t in targets if t.get("discovered", {}).get("pid") == pid), None)


def loaded(url: str, pid: int) -> dict[str, Any]:
    """Its status entry once its first load finished."""
    found = wait_for(lambda: (t := target(url, pid)) is not None and t.get("last_record") and t, 60)
    return dict(found)


def test_the_sidecars_capabilities_measure_a_server_in_its_own_mount_namespace(
    pod: Any, weights: Path
) -> None:
    sidecar, server_capabilities = manifest_capabilities()
    assert sidecar == server_capabilities == []  # none at all: the kernel's rule, below
    url, server, mount_point = pod(sidecar, tuple(server_capabilities))
    assert not any(mount_point.iterdir())  # the weights are only in the server's namespace
    name = wait_for(lambda: (t := target(url, server.pid)) and t["target"], 30)
    alive = Prober(f"{url}/probe/alive?target={name}", period=0.5, timeout=1.0).start()
    try:
        entry = loaded(url, server.pid)
    finally:
        alive.stop()
    assert server.poll() is None
    record = entry["last_record"]
    # Found by discovery (every 5 s), maybe mid-load: cold all the same (reads since its start).
    assert (record["outcome"], record["cache"]) == ("ready", "cold")
    assert record["bytes_read"] >= SHARDS * SHARD_SIZE  # /proc/PID/io
    assert entry["sources"]["process"]["note"] is None
    assert entry["weight_files"]["visible"] and entry["weight_files"]["files_total"] == SHARDS
    assert entry["residency"]["resident_bytes"] >= SHARDS * SHARD_SIZE * 0.9
    seen = alive.seen()
    assert seen and all(p.code == 200 for p in seen), [(p.code, p.body) for p in seen]
    assert alive.restart_at() is None


def test_a_server_keeping_the_runtimes_capabilities_shows_less_and_nothing_false(
    pod: Any, weights: Path
) -> None:
    """The server left with containerd's defaults: the kernel lets the exporter into its /proc
    only with CAP_SYS_PTRACE or every capability the server holds."""
    url, server, _ = pod([], RUNTIME_DEFAULT)
    entry = loaded(url, server.pid)
    note = entry["sources"]["process"]["note"]
    assert note is not None and "read counters unknown" in note, note
    assert entry["last_record"]["bytes_read"] is None
    assert entry["last_record"]["outcome"] == "ready"
    why = {e["what"]: (e["value"], e["source"]) for e in entry["discovered"]["why"]}
    assert why["files"] == ("as on this host", "mount namespace unreadable"), why
    assert entry["residency"]["resident_bytes"] is None  # the server's files are out of reach
    assert entry["sources"]["weight_files"]["up"] is False
    assert server.poll() is None


def test_sys_ptrace_instead_reads_the_counters_but_not_the_servers_files(
    pod: Any, weights: Path
) -> None:
    """CAP_SYS_PTRACE opens /proc/PID/io, but the server's files are read with the server's own
    capabilities (exporter/trust/asprocess.py), which a more capable server's /proc/PID/root
    refuses: the server without capabilities is the way, not this one."""
    url, server, _ = pod(["sys_ptrace"], RUNTIME_DEFAULT)
    entry = loaded(url, server.pid)
    assert entry["sources"]["process"]["note"] is None
    assert entry["last_record"]["bytes_read"] >= SHARDS * SHARD_SIZE
    why = {e["what"]: (e["value"], e["source"]) for e in entry["discovered"]["why"]}
    assert why["weights"] == ("refused", "Permission denied"), why
    assert entry.get("residency") is None
