"""exporter/logs/find.py on real processes: stdout and stderr redirected as shells and supervisors
redirect them, and processes placed in real cgroups named as systemd, Docker and the kubelet name
theirs (tests/helpers/cgroups.py), with the runtimes' log files laid out under a temporary host
root as those runtimes lay them. The exporter following what it finds: tests/test_logs_e2e.py."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.cgroups import cgroups, hierarchies, joining
from helpers.require import require
from helpers.support import wait_for

from exporter.config.schema import LogConfig
from exporter.logs.find import (
    CgroupOwner,
    LogFinding,
    _birth_time,
    cgroup_owner,
    cgroup_paths,
    find_log,
    find_routed_log,
)
from exporter.sources.process import process_start_time
from exporter.vocabulary import LogEncoding

ID = "4c0f6bd9d1e4e2a9b1f4b0e6f1b1f1f9f0a8e6d5c4b3a291807f6e5d4c3b2a19"
UID = "0b1e9a3c-6f2d-4c8e-9a7b-5d3c2e1f0a9b"

U_ = UID.replace("-", "_")  # the kubelet's slice names spell the pod UID with underscores
BURSTABLE = f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{U_}.slice"
BESTEFFORT = f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U_}.slice"
POD = CgroupOwner("pod", ID, UID)
# Paths as /proc/PID/cgroup shows them under each runtime, and what they say runs the process.
OWNERS = [
    ("/system.slice/vllm.service", CgroupOwner("unit", "vllm.service")),
    ("/system.slice/ai.slice/k26.service/payload", CgroupOwner("unit", "k26.service")),
    (f"/system.slice/docker-{ID}.scope", CgroupOwner("docker", ID)),
    (f"/docker/{ID}", CgroupOwner("docker", ID)),
    (f"/../docker-{ID}.scope", CgroupOwner("docker", ID)),  # read from a cgroup namespace
    (f"{BURSTABLE}/cri-containerd-{ID}.scope", POD),
    (f"/kubepods.slice/kubepods-pod{U_}.slice/crio-{ID}.scope", POD),  # guaranteed QoS
    (f"{BESTEFFORT}/docker-{ID}.scope", POD),  # cri-dockerd: a pod's, not a plain container
    (f"/kubepods/burstable/pod{UID}/{ID}", POD),
    (f"/kubepods/pod{UID}/crio-{ID}", POD),
    (f"/../../kubepods-burstable-pod{U_}.slice/cri-containerd-{ID}.scope", POD),
    ("/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service", None),
    ("/user.slice/user-1000.slice/session-3.scope", None),
    ("/init.scope", None),
    ("/", None),
    (f"/system.slice/crio-conmon-{ID}.scope", None),
    (f"/docker/{ID[:12]}", None),
]


@pytest.mark.parametrize(("path", "owner"), OWNERS, ids=[p for p, _ in OWNERS])
def test_cgroup_paths_name_their_owner(path: str, owner: CgroupOwner | None) -> None:
    assert cgroup_owner(path) == owner


def test_cgroup_lines_with_the_unit_or_container_first() -> None:
    unit = "/system.slice/x.service"
    hybrid = f"12:memory:/docker/{ID}\n1:name=systemd:{unit}\n0::{unit}\n"
    assert cgroup_paths(hybrid) == [unit, f"/docker/{ID}"]
    assert cgroup_paths("0::/\n") == ["/"]
    assert cgroup_paths("garbage\n\n3:cpu:/a:b\n") == ["/a:b"]  # a colon in a path is kept


@contextlib.contextmanager
def running(command: Sequence[str], **popen: Any) -> Iterator[subprocess.Popen[bytes]]:
    """A process, once it has exec'd its last program (`sleep`): its descriptors are set. Its
    output goes nowhere unless a test says where (not to pytest's own, maybe a file)."""
    popen.setdefault("stdout", subprocess.DEVNULL)
    popen.setdefault("stderr", subprocess.DEVNULL)
    proc = subprocess.Popen(list(command), stdin=subprocess.DEVNULL, **popen)
    try:
        wait_for(lambda: Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(b"sleep"))
        yield proc
    finally:
        proc.kill()
        proc.wait()


def found(proc: subprocess.Popen[bytes], host_root: str | Path = "/") -> LogFinding:
    return find_log(proc.pid, process_start_time(proc.pid), host_root=str(host_root))


def older_file(path: Path, text: str = "an older process's line\n") -> Path:
    path.write_text(text)
    time.sleep(0.05)  # well before the process starts: more than a clock tick
    return path


def test_stdout_truncated_by_the_shell_is_read_from_its_start(tmp_path: Path) -> None:
    """`server > log`: the descriptor writes from offset 0 and is at the file's end, so every
    byte is this process's, although the file is older than the process."""
    log = older_file(tmp_path / "server.log")
    with (
        log.open("w") as out,
        running(["sh", "-c", "echo hello; exec sleep 30"], stdout=out) as proc,
    ):
        wait_for(lambda: log.read_text() == "hello\n")
        finding = found(proc)
    assert finding.config == LogConfig(file=str(log))
    assert finding.whole_files == (str(log),)
    assert finding.why == (f"stdout of pid {proc.pid} is the regular file {log}, written from its "
                           "first byte through this descriptor: read from its start")  # fmt: skip


def test_stdout_appended_to_an_older_file_is_read_from_its_end(tmp_path: Path) -> None:
    log = older_file(tmp_path / "server.log")
    with (
        log.open("a") as out,
        running(["sh", "-c", "echo hello; exec sleep 30"], stdout=out) as proc,
    ):
        finding = found(proc)
    assert finding.config == LogConfig(file=str(log)) and finding.whole_files == ()
    assert finding.why.endswith(f"{log}, not shown to be this process's own: read from its end")


def test_a_file_created_after_the_process_started_is_its_own(tmp_path: Path) -> None:
    """A wrapper that sets up, then `exec 2>>log`: append mode, but the file is younger."""
    require(_birth_time(str(tmp_path)) is not None, "no birth times on this filesystem")
    log = tmp_path / "server.log"
    script = f"sleep 0.1; exec 2>>{log}; echo hello >&2; exec sleep 30"
    with running(["sh", "-c", script]) as proc:
        finding = found(proc)
    assert finding.whole_files == (str(log),)
    assert finding.why == (f"stderr of pid {proc.pid} is the regular file {log}, created after "
                           "the process started: read from its start")  # fmt: skip


def test_stdout_and_stderr_in_two_files_are_both_followed_each_from_where_it_may(
    tmp_path: Path,
) -> None:
    out_log, err_log = older_file(tmp_path / "vllm.out"), older_file(tmp_path / "vllm.err")
    with (
        out_log.open("w") as out,
        err_log.open("a") as err,
        running(["sleep", "30"], stdout=out, stderr=err) as proc,
    ):
        finding = found(proc)
    assert finding.config == LogConfig(file=str(out_log), more_files=(str(err_log),))
    assert finding.whole_files == (str(out_log),)  # stdout truncated; stderr appended to
    assert finding.why.startswith(f"stdout and stderr of pid {proc.pid} are the regular files ")
    with out_log.open("w") as both, running(["sleep", "30"], stdout=both, stderr=both) as proc:
        assert found(proc).config == LogConfig(file=str(out_log))  # 2>&1: one file, once


def test_pipes_and_devices_are_no_log_and_say_so(tmp_path: Path) -> None:
    with running(["sleep", "30"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL) as proc:
        finding = found(proc)
        paths = cgroup_paths(Path(f"/proc/{proc.pid}/cgroup").read_text())
    assert finding.config is None
    assert all(cgroup_owner(p) is None for p in paths), "the test runs in a unit or container"
    assert finding.why == (f"pid {proc.pid}: stdout is a pipe, stderr is the device /dev/null, "
                           f"and its cgroup ({', '.join(paths[:2])}) is no systemd service, "
                           "Docker container or Kubernetes pod")  # fmt: skip


@pytest.mark.parametrize(("port", "mark"), [(38321, "[38321] "), (8080, "[ 8080] ")])
def test_a_routers_model_server_has_its_lines_in_the_routers_log(
    tmp_path: Path, port: int, mark: str
) -> None:
    """llama-server's router writes its log, its model servers write into pipes to it and it
    forwards their lines marked `[%5d] ` with their port: a model server's log is the router's,
    its own lines those so marked; a router with no log of its own gives none."""
    log = tmp_path / "router.log"
    with (
        log.open("w") as out,
        running(["sh", "-c", "echo up; exec sleep 30"], stdout=out) as router,
    ):
        wait_for(lambda: log.read_text() == "up\n")
        finding = find_routed_log(router.pid, process_start_time(router.pid), port)
    assert finding.config == LogConfig(file=str(log)) and finding.whole_files == (str(log),)
    assert finding.lines_of == mark
    assert finding.why.startswith(f"its router (pid {router.pid}) forwards its lines with ")
    with running(["sleep", "30"], stdout=subprocess.PIPE) as silent:
        none = find_routed_log(silent.pid, process_start_time(silent.pid), port)
    assert none.config is None and none.why.startswith("its router's log is not found either: ")


def test_a_deleted_output_file_is_no_log(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    with log.open("w") as out, running(["sleep", "30"], stdout=out, stderr=out) as proc:
        log.unlink()
        finding = found(proc)
    assert finding.config is None
    assert f"stdout is the regular file {log} (deleted), deleted or not reachable" in finding.why


@pytest.mark.requires("root", "unshare")
def test_a_file_in_the_process_own_mount_namespace_is_reached_through_its_root(
    tmp_path: Path,
) -> None:
    """The process writes /X/server.log on a tmpfs only its mount namespace has; here the same
    path is another file, so the log is read through /proc/PID/root."""
    directory = tmp_path / "logs"
    directory.mkdir()
    (directory / "server.log").write_text("the host's own file of that name\n")
    script = f"mount -t tmpfs none {directory} && exec sleep 30 > {directory}/server.log"
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    with running(command) as proc:
        finding = found(proc)
        path = f"/proc/{proc.pid}/root{directory}/server.log"
        assert finding.config == LogConfig(file=path)
        assert os.stat(path).st_ino != os.stat(directory / "server.log").st_ino
    assert finding.whole_files == (path,)


# --- in cgroups -----------------------------------------------------------------------------


def in_cgroups(
    dirs: Sequence[Path], **popen: Any
) -> contextlib.AbstractContextManager[subprocess.Popen[bytes]]:
    return running(joining(dirs, ["sleep", "30"]), **popen)


@pytest.mark.parametrize(
    ("v2", "named"),
    [(True, False), (False, True), (True, True)],
    ids=["v2", "name=systemd", "hybrid"],
)
def test_a_systemd_service_has_its_journal(v2: bool, named: bool) -> None:
    unit = f"mle-logfind-{secrets.token_hex(4)}.service"
    with cgroups(f"system.slice/{unit}", hierarchies(v2, named)) as dirs, in_cgroups(dirs) as proc:
        finding = found(proc)
    assert finding.config == LogConfig(journald_unit=unit)
    assert (
        finding.why == f"pid {proc.pid} runs in systemd unit {unit} (from /proc/{proc.pid}/cgroup)"
    )


def test_a_service_writing_to_a_file_is_followed_by_the_file(tmp_path: Path) -> None:
    """`StandardOutput=file:`: the journal has nothing of it."""
    unit = f"mle-logfind-{secrets.token_hex(4)}.service"
    log = tmp_path / "server.log"
    with (
        cgroups(f"system.slice/{unit}", hierarchies()) as dirs,
        log.open("w") as out,
        in_cgroups(dirs, stdout=out) as proc,
    ):
        assert found(proc).config == LogConfig(file=str(log))


def docker_log(host: Path, container: str) -> Path:
    """/var/lib/docker/containers/<id>/<id>-json.log, with the files dockerd keeps beside it."""
    directory = host / "var/lib/docker/containers" / container
    directory.mkdir(parents=True)
    (directory / "config.v2.json").write_text('{"LogPath": "", "Driver": "overlay2"}')
    (directory / "hostconfig.json").write_text('{"LogConfig": {"Type": "json-file"}}')
    log = directory / f"{container}-json.log"
    log.write_text("")
    return log


@pytest.mark.parametrize(
    ("cgroup", "v2"), [("system.slice/docker-{}.scope", True), ("docker/{}", False)],
    ids=["systemd driver", "cgroupfs driver"],
)  # fmt: skip
def test_a_docker_container_has_its_json_file_log(tmp_path: Path, cgroup: str, v2: bool) -> None:
    container = secrets.token_hex(32)
    log = docker_log(tmp_path, container)
    with cgroups(cgroup.format(container), hierarchies(v2=v2)) as dirs, in_cgroups(dirs) as proc:
        finding = found(proc, tmp_path)
        log.unlink()
        gone = found(proc, tmp_path)
    assert finding.config == LogConfig(file=str(log), encoding=LogEncoding.DOCKER)
    short = container[:12]
    where = f"/var/lib/docker/containers/{container}/{container}-json.log"
    assert finding.why == (f"pid {proc.pid} runs in Docker container {short} (from "
                           f"/proc/{proc.pid}/cgroup): its json-file log {where}")  # fmt: skip
    assert gone.config is None and gone.why.endswith(
        f"no json-file log at {where} (another log driver?)"
    )


def pod_layout(host: Path, uid: str, containers: dict[str, str], restarts: int = 1) -> Path:
    """/var/log/pods/<ns>_<pod>_<uid>/<container>/<N>.log for N < restarts, and the kubelet's
    /var/log/containers/<pod>_<ns>_<container>-<id>.log links to each container's latest."""
    pod_dir = host / "var/log/pods" / f"inference_vllm-0_{uid}"
    links = host / "var/log/containers"
    links.mkdir(parents=True, exist_ok=True)
    for name, container in containers.items():
        (pod_dir / name).mkdir(parents=True)
        for restart in range(restarts):
            (pod_dir / name / f"{restart}.log").write_text("")
        if container:
            target = f"/var/log/pods/inference_vllm-0_{uid}/{name}/{restarts - 1}.log"
            (links / f"vllm-0_inference_{name}-{container}.log").symlink_to(target)
    return pod_dir


POD_CGROUPS = {
    "systemd driver": "kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u}.slice"
    "/cri-containerd-{c}.scope",
    "cgroupfs driver": "kubepods/besteffort/pod{uid}/{c}",
}


@pytest.mark.parametrize("driver", list(POD_CGROUPS))
def test_a_pod_container_has_its_file_under_var_log_pods(tmp_path: Path, driver: str) -> None:
    container, uid = secrets.token_hex(32), str(uuid.uuid4())
    other = secrets.token_hex(32)
    cgroup = POD_CGROUPS[driver].format(u=uid.replace("-", "_"), uid=uid, c=container)
    pod_dir = pod_layout(tmp_path, uid, {"server": container, "sidecar": other}, restarts=2)
    with cgroups(cgroup, hierarchies()) as dirs, in_cgroups(dirs) as proc:
        by_link = found(proc, tmp_path)
        shutil.rmtree(tmp_path / "var/log/containers")
        two = found(proc, tmp_path)
        shutil.rmtree(pod_dir / "sidecar")
        only = found(proc, tmp_path)
        shutil.rmtree(pod_dir)
        none = found(proc, tmp_path)
    who = (f"pid {proc.pid} runs in container {container[:12]} of pod {uid} "
           f"(from /proc/{proc.pid}/cgroup)")  # fmt: skip
    latest = pod_dir / "server" / "1.log"
    assert by_link.config == LogConfig(file=str(latest), encoding=LogEncoding.CRI)
    shown = f"/var/log/pods/inference_vllm-0_{uid}/server/1.log"
    assert by_link.why == (f"{who}: {shown}, named by /var/log/containers/"
                           f"vllm-0_inference_server-{container}.log")  # fmt: skip
    assert two.config is None
    assert two.why == (f"{who}, but its pod has 2 container directories and no "
                       "/var/log/containers link names this container")  # fmt: skip
    assert only == LogFinding(
        LogConfig(file=str(latest), encoding=LogEncoding.CRI),
        f"{who}: {shown}, the latest restart of the pod's only container",
    )
    assert none == LogFinding(None, f"{who}, but /var/log/pods has no directory *_{uid}")
