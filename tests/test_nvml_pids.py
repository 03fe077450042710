"""Whether NVML's PIDs are this PID namespace's: real processes, real /proc, real namespaces.

Only the GPU device is a stand-in: a GPU client is a process holding `/dev/nvidia*` open, and
here the test process holds a file named like one (`device_prefix` points the check at it).
The namespace tests run the source inside a real new PID namespace (`unshare --pid`), where a
child holds the stand-in device; the unprivileged one runs the check as `nobody`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from helpers.fake_nvml import GIB, FakeNvml, FakeProcess, h200_node
from helpers.support import RunningExporter, sample_value, wait_for
from helpers.users import REPO, as_nobody, nobody_python

from exporter.sources.gpu import NvmlSource, process_gpu_memory
from exporter.sources.nvml_pids import (
    INIT_PID_NAMESPACE_INODE,
    NvmlPidCheck,
    in_initial_pid_namespace,
)

TESTS = Path(__file__).resolve().parent
PYTHONPATH = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
# A GPU client stand-in: holds the device file named in argv open until killed.
HOLDER = "import sys, time\nf = open(sys.argv[1])\nprint('holding', flush=True)\ntime.sleep(120)\n"


class Devices:
    """A stand-in GPU device file, held open by this test process: the GPU client NVML lists."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = root / "nvidia0"
        self.prefix = str(root / "nvidia")
        self.path.write_text("")
        self._held = self.path.open()

    def client(self) -> int:
        """A process here that holds the (stand-in) GPU device open."""
        return os.getpid()

    def bystander(self) -> int:
        """A process here with no GPU device open: what a host PID can collide with."""
        return os.getppid()

    def check(self, **kwargs: Any) -> NvmlPidCheck:
        """A check as in a container: outside the host's namespace, so PIDs are verified."""
        return NvmlPidCheck(host_namespace=False, device_prefix=self.prefix, **kwargs)

    def close(self) -> None:
        self._held.close()


@pytest.fixture
def devices() -> Iterator[Devices]:
    # Not pytest's tmp_path (0700): the namespace and nobody tests need to reach the files.
    root = Path(tempfile.mkdtemp(prefix="nvml-pids-", dir="/tmp"))
    root.chmod(0o755)
    made = Devices(root)
    try:
        yield made
    finally:
        made.close()
        for path in root.iterdir():
            path.unlink()
        root.rmdir()


def absent_pid() -> int:
    """A PID no process can have here (above the kernel's pid_max)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def test_host_namespace_is_told_by_the_kernels_fixed_inode() -> None:
    link = os.readlink("/proc/self/ns/pid")
    assert in_initial_pid_namespace() is (link == f"pid:[{INIT_PID_NAMESPACE_INODE}]")
    assert NvmlPidCheck().host_namespace is in_initial_pid_namespace()


def test_in_the_host_namespace_every_pid_is_ours() -> None:
    check = NvmlPidCheck(host_namespace=True)
    assert check.problem({absent_pid(), os.getpid()}) is None


def test_gpu_clients_here_are_trusted(devices: Devices) -> None:
    check = devices.check()
    assert "not checked yet" in (check.problem(set()) or "")
    assert check.problem({devices.client()}) is None


def test_a_listed_pid_without_a_gpu_device_means_host_pids(devices: Devices) -> None:
    check = devices.check()
    bystander = devices.bystander()
    problem = check.problem({devices.client(), bystander})
    assert problem is not None
    assert f"pid {bystander} is a process here that holds no NVIDIA device open" in problem
    assert "--pid=host" in problem and "hostPID" in problem


def test_a_missing_pid_counts_only_when_listed_twice(devices: Devices) -> None:
    """Once can be a process that exited between NVML's list and our look; twice cannot."""
    check = devices.check()
    client, gone = devices.client(), absent_pid()
    assert check.problem({client, gone}) is None
    problem = check.problem({client, gone})
    assert problem is not None and f"pid {gone} is not a process in this PID namespace" in problem
    assert check.problem({client}) is None  # the evidence went with it


def test_a_verdict_stays_while_the_gpus_are_idle(devices: Devices) -> None:
    check = devices.check()
    assert check.problem({devices.client()}) is None
    assert check.problem(set()) is None
    bystander = devices.bystander()
    wrong = check.problem({bystander})
    assert wrong is not None
    assert check.problem(set()) == wrong


def test_source_refuses_attribution_but_keeps_memory(devices: Devices) -> None:
    client, bystander = devices.client(), devices.bystander()
    gpus = h200_node(2)
    gpus[0].processes = [FakeProcess(client, 20 * GIB)]
    gpus[0].used_bytes = 20 * GIB
    nvml = FakeNvml(gpus)
    source = NvmlSource(nvml, pid_check=devices.check())

    good = source.sample()
    assert good.attribution_problem is None and good.note is None
    assert process_gpu_memory(good, [client]) == {0: 20 * GIB}

    gpus[1].processes = [FakeProcess(bystander, 5 * GIB)]  # a host PID that names another process
    refused = source.sample()
    assert process_gpu_memory(refused, [client]) == {}
    assert process_gpu_memory(refused, [bystander]) == {}
    assert refused.devices[0].memory_used_bytes == 20 * GIB  # device memory is no PID matter
    assert refused.errors == ()
    assert refused.note is not None and refused.note.startswith(
        "per-process GPU memory not attributed: NVML reports host process IDs"
    )


def test_exporter_drops_the_process_series_and_says_why_in_status(
    devices: Devices, start_exporter: Any, model_server: Any
) -> None:
    client = devices.client()
    pidfile = devices.root / "server.pid"
    pidfile.write_text(str(client))
    gpus = h200_node(1)
    gpus[0].processes = [FakeProcess(client, 20 * GIB)]
    gpus[0].used_bytes = 20 * GIB
    running: RunningExporter = start_exporter(
        {
            "targets": [
                {
                    "name": "m",
                    "endpoint": {"url": model_server.url},
                    "process": {"pidfile": str(pidfile)},
                }
            ]
        },
        nvml=FakeNvml(gpus),
        gpu_pid_check=devices.check(),
    )

    def attributed() -> float | None:
        return sample_value(
            running.metrics(), "model_load_process_gpu_memory_bytes", target="m", gpu="0"
        )

    assert wait_for(attributed) == 20 * GIB
    assert running.status()["host_sources"]["nvml"]["note"] is None

    gpus[0].processes.append(FakeProcess(devices.bystander(), GIB))
    wait_for(lambda: attributed() is None)
    text = running.metrics()
    assert sample_value(text, "model_load_gpu_memory_used_bytes", gpu="0") == 20 * GIB
    assert sample_value(text, "model_load_source_up", source="nvml", target="") == 1
    status = requests.get(f"{running.url}/api/v1/status", timeout=10).json()
    nvml = status["host_sources"]["nvml"]
    assert nvml["up"] is True
    assert "not attributed: NVML reports host process IDs" in nvml["note"]


# Runs inside a new PID namespace (as its PID 1): the source with the real namespace detection.
IN_NAMESPACE = """
import json, os, subprocess, sys
from helpers.fake_nvml import GIB, FakeNvml, FakeProcess, h200_node
from exporter.sources.gpu import NvmlSource, process_gpu_memory
from exporter.sources.nvml_pids import NvmlPidCheck, in_initial_pid_namespace

prefix, device, host_client = sys.argv[1], sys.argv[2], int(sys.argv[3])
holder = subprocess.Popen([sys.executable, "-c", sys.argv[4], device], stdout=subprocess.PIPE)
holder.stdout.readline()

def attribute(pid):
    gpus = h200_node(1)
    gpus[0].processes = [FakeProcess(pid, GIB)]
    source = NvmlSource(FakeNvml(gpus), pid_check=NvmlPidCheck(device_prefix=prefix))
    source.sample()
    last = source.sample()
    return {"problem": last.attribution_problem, "bytes": process_gpu_memory(last, [pid]).get(0)}

print(json.dumps({
    "host_namespace": in_initial_pid_namespace(),
    "own_pid": os.getpid(),
    "old_driver": attribute(host_client),  # the host's PID of a GPU client: not a PID here
    "collision": attribute(1),  # a host PID that names another process here (ours)
    "new_driver": attribute(holder.pid),  # translated into this namespace: a GPU client here
}))
holder.kill()
"""


@pytest.mark.system
@pytest.mark.requires("root", "unshare")
def test_in_a_new_pid_namespace_host_pids_are_refused_and_local_ones_trusted(
    devices: Devices,
) -> None:
    host_client = devices.client()
    done = subprocess.run(
        ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", IN_NAMESPACE,
         devices.prefix, str(devices.path), str(host_client), HOLDER],
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(TESTS), *PYTHONPATH])},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)

    assert seen["host_namespace"] is False and seen["own_pid"] == 1
    assert seen["old_driver"]["bytes"] is None
    assert (
        f"pid {host_client} is not a process in this PID namespace"
        in (seen["old_driver"]["problem"])
    )
    assert seen["collision"]["bytes"] is None
    assert (
        "pid 1 is a process here that holds no NVIDIA device open" in (seen["collision"]["problem"])
    )
    assert seen["new_driver"] == {"problem": None, "bytes": GIB}


UNREADABLE = """
import json, sys
from exporter.sources.nvml_pids import NvmlPidCheck
check = NvmlPidCheck(host_namespace=False, device_prefix=sys.argv[1])
print(json.dumps(check.problem({int(sys.argv[2])})))
"""


@pytest.mark.system
@pytest.mark.requires("root", "setpriv", "nobody_python")
def test_unprivileged_exporter_cannot_check_and_attributes_nothing(devices: Devices) -> None:
    python = nobody_python()
    assert python is not None
    client = devices.client()  # this root process: its /proc/PID/fd is closed to nobody
    done = as_nobody(python, "-c", UNREADABLE, devices.prefix, str(client))
    assert done.returncode == 0, done.stderr
    problem = json.loads(done.stdout)
    assert problem.startswith("cannot check NVML's process IDs against this PID namespace")
    assert f"pid {client} cannot be checked" in problem and "as uid 65534" in problem
