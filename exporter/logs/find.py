"""Find a model server's own log from its process alone, for a target with no `log:`.

Tried in this order, the first that applies wins:

1. stdout or stderr (`/proc/PID/fd/1`, `/2`) is a regular file: that file. When both are, and
   are different files, both: vLLM logs to stdout and draws its tqdm bars on stderr, SGLang and
   llama.cpp log to stderr, so either alone loses markers; one parser reads the two.
2. The process runs in a systemd service (`/proc/PID/cgroup`: cgroup v2's `0::` line, or hybrid
   mode's `name=systemd` one): the unit's journal.
3. A Kubernetes pod's container (`kubepods...pod<uid>.../<runtime>-<id>.scope`, or cgroupfs's
   `/kubepods/<qos>/pod<uid>/<id>`): its CRI file under /var/log/pods, the one the
   `/var/log/containers/<pod>_<ns>_<container>-<id>.log` link names, else the latest restart's of
   a pod with one container directory. Before Docker: a pod's container under the Docker runtime
   is a `docker-<id>.scope` too.
4. A Docker container (`docker-<id>.scope`, cgroupfs's `/docker/<id>`): its json-file log.

A file before the cgroup: a unit or container whose output goes to a file has nothing in its
journal or runtime log. Container cgroup paths are matched by their last components, so they are
found from inside a cgroup namespace too (`/../docker-<id>.scope`); a unit's path only from the
root of the hierarchy, through slices alone: with systemd's delegation a user may make any
cgroup below their own `user@UID.service`, `system.slice/sshd.service` included. Its journal is
then read with the process's rights, the unit matched literally (journal.py).

Where reading starts, so that a log found for a process already running gives this process's
markers from its start (an exporter started mid-load reads the whole load) and never an older
process's lines:

- a journal: from the process's start time;
- Docker and CRI files: the records stamped at or after the process's start (less
  `files.ENTRY_SKEW`), found by bisection;
- a plain file: from its start when it is this process's own: born (statx birth time) after the
  process started (by more than the clock tick its start is known to), or written through a
  descriptor that is not in append mode and whose offset is the file's size (the shell's `>`
  truncated it, so every byte is this descriptor's); else from its end. Each file on its own.

Paths outside /proc are read under `host_root`; a file the process names in its own mount
namespace is reached through `/proc/PID/root` when the same path here is another file. Every
file this module opens on the process's behalf is opened by `_read_small` (the rest are stats,
directory listings and link reads); the log found is opened by `files.FileReader._open`.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
import sys
from dataclasses import dataclass
from typing import Literal

from exporter.config.schema import LogConfig
from exporter.vocabulary import LogEncoding

SMALL_READ = 64 * 1024  # /proc/PID/cgroup and fdinfo are a few hundred bytes
STREAMS = ((1, "stdout"), (2, "stderr"))
O_APPEND = 0o2000
DOCKER_CONTAINERS = "/var/lib/docker/containers"
POD_LOGS = "/var/log/pods"
CONTAINER_LINKS = "/var/log/containers"

_HEX64 = "[0-9a-f]{64}"
_UUID = "[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
_POD_RE = re.compile(
    rf"(?:^|/)(?:kubepods(?:-[a-z]+)?-pod(?P<slice>{_UUID})\.slice/"
    rf"(?:cri-containerd|crio|docker)-(?P<scoped>{_HEX64})\.scope"
    rf"|pod(?P<dir>{_UUID})/(?:cri-containerd-|crio-|docker-)?(?P<bare>{_HEX64}))(?:/|$)"
)
_DOCKER_RE = re.compile(
    rf"(?:^|/)(?:docker-(?P<scoped>{_HEX64})\.scope|docker/(?P<bare>{_HEX64}))(?:/|$)"
)
# A unit the system manager owns: reached from the root of the hierarchy through slices alone.
# Below a service or scope is that unit's own subtree, delegated (user@UID.service holds the
# user's own units, a `system.slice/X.service` of theirs among them): no unit of the system's.
_UNIT_RE = re.compile(r"/(?:[^/]+\.slice/)*(?P<unit>[^/]+\.service)(?:/.*)?")
# systemd's unit-name grammar (unit_name_is_valid): letters, digits and `:_.\-`, an instance
# after `@` that may hold `@` too, the type suffix; UNIT_NAME_MAX characters at most. No glob
# character passes, and the name is matched literally besides (journal.py).
_UNIT_NAME_RE = re.compile(r"[A-Za-z0-9:_.\\-]+(?:@[A-Za-z0-9:_.\\@-]+)?\.service")
UNIT_NAME_MAX = 255
USER_MANAGER = "user@"  # user@UID.service: the user's own service manager
_RESTART_LOG_RE = re.compile(r"(\d+)\.log")


@dataclass(frozen=True)
class LogFinding:
    """Where a server's own log is and why; `config` None: none was found, `why` says why not."""

    config: LogConfig | None
    why: str
    whole_files: tuple[str, ...] = ()  # plain files shown to be this process's own: read all
    # The mark of this process's lines in a log it shares: a router's, which forwards its model
    # servers' lines with `[PORT] ` before each. None: the log is the process's alone.
    lines_of: str | None = None


def find_routed_log(
    router_pid: int, router_start: float | None, port: int, **roots: str
) -> LogFinding:
    """The log of a model server a router started, which writes into a pipe to its router:
    the router's own log, the lines the router forwards from it (`[PORT] ` before each)."""
    found = find_log(router_pid, router_start, **roots)
    if found.config is None:
        return LogFinding(None, f"its router's log is not found either: {found.why}")
    mark = f"[{port:5d}] "  # printf's %5d: a port under 10000 is padded with spaces
    why = (
        f"its router (pid {router_pid}) forwards its lines with {mark.strip()!r} into: {found.why}"
    )
    return LogFinding(found.config, why, found.whole_files, mark)


def find_log(
    pid: int,
    start_time: float | None,
    *,
    proc_root: str = "/proc",
    host_root: str = "/",
) -> LogFinding:
    """The log of the server whose root process is `pid`, started at `start_time` (unix s)."""
    proc = os.path.join(proc_root, str(pid))
    files, described = _output_files(proc, pid, host_root)
    if files:
        return _plain(pid, files, start_time)
    cgroup = _read_small(os.path.join(proc, "cgroup"))
    if cgroup is None:
        return LogFinding(None, f"pid {pid}: {described}; its cgroup cannot be read")
    paths = cgroup_paths(cgroup)
    for path in paths:
        found = _from_cgroup(pid, path, host_root)
        if found is not None:
            return found
    shown = ", ".join(paths[:2]) or "none"
    return LogFinding(
        None,
        f"pid {pid}: {described}, and its cgroup ({shown}) is no systemd service, Docker "
        "container or Kubernetes pod",
    )


def cgroup_paths(text: str) -> list[str]:
    """The cgroup paths of /proc/PID/cgroup, those that name a unit or container first: cgroup
    v2's `0::` line, hybrid mode's `name=systemd` one, then the v1 controllers' (cgroupfs)."""
    first: list[str] = []
    rest: list[str] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        (first if controllers in ("", "name=systemd") else rest).append(path)
    return list(dict.fromkeys(first + rest))


@dataclass(frozen=True)
class CgroupOwner:
    """What a cgroup path says runs the process: a systemd unit, a Docker container, or a
    container of a Kubernetes pod."""

    kind: Literal["unit", "docker", "pod"]
    name: str  # the unit's name or the container's id
    pod_uid: str | None = None  # with dashes, as /var/log/pods names it


def cgroup_owner(path: str) -> CgroupOwner | None:
    """The owner a cgroup path names; a pod first (its container may be a `docker-<id>.scope`)."""
    pod = _POD_RE.search(path)
    if pod is not None:
        uid = (pod["slice"] or pod["dir"]).replace("_", "-")
        return CgroupOwner("pod", pod["scoped"] or pod["bare"], uid)
    docker = _DOCKER_RE.search(path)
    if docker is not None:
        return CgroupOwner("docker", docker["scoped"] or docker["bare"])
    unit = _UNIT_RE.fullmatch(path)
    if unit is None or not system_unit(unit["unit"]):
        return None
    return CgroupOwner("unit", unit["unit"])


def system_unit(name: str) -> bool:
    """A valid name of a service of the system manager's own (not a user's manager)."""
    return (
        len(name) <= UNIT_NAME_MAX
        and _UNIT_NAME_RE.fullmatch(name) is not None
        and not name.startswith(USER_MANAGER)
    )


def _from_cgroup(pid: int, path: str, host_root: str) -> LogFinding | None:
    owner = cgroup_owner(path)
    if owner is None:
        return None
    where = f"(from /proc/{pid}/cgroup)"
    if owner.kind == "unit":
        why = f"pid {pid} runs in systemd unit {owner.name} {where}"
        return LogFinding(LogConfig(journald_unit=owner.name), why)
    if owner.pod_uid is not None:
        who = f"pid {pid} runs in container {owner.name[:12]} of pod {owner.pod_uid} {where}"
        return _pod_log(who, owner.name, owner.pod_uid, host_root)
    who = f"pid {pid} runs in Docker container {owner.name[:12]} {where}"
    log = os.path.join(DOCKER_CONTAINERS, owner.name, f"{owner.name}-json.log")
    if not _is_file(_under(host_root, log)):
        return LogFinding(
            None, f"{who}, but it has no json-file log at {log} (another log driver?)"
        )
    config = LogConfig(file=_under(host_root, log), encoding=LogEncoding.DOCKER)
    return LogFinding(config, f"{who}: its json-file log {log}")


def _pod_log(who: str, container: str, uid: str, host_root: str) -> LogFinding:
    """The kubelet's file of one container of a pod, by the link naming it or the pod's only
    container directory."""
    links = _under(host_root, CONTAINER_LINKS)
    for name in sorted(_listdir(links)):
        if not name.endswith(f"-{container}.log"):
            continue
        try:
            target = os.readlink(os.path.join(links, name))
        except OSError:
            continue
        pod_dir = os.path.basename(os.path.dirname(os.path.dirname(target)))
        if os.path.isabs(target) and target.startswith(POD_LOGS + "/") and pod_dir.endswith(uid):
            config = LogConfig(file=_under(host_root, target), encoding=LogEncoding.CRI)
            return LogFinding(config, f"{who}: {target}, named by {CONTAINER_LINKS}/{name}")
    pods = _under(host_root, POD_LOGS)
    pod_dirs = [d for d in _listdir(pods) if d.endswith(f"_{uid}")]
    if len(pod_dirs) != 1:
        return LogFinding(None, f"{who}, but {POD_LOGS} has no directory *_{uid}")
    pod = os.path.join(pods, pod_dirs[0])
    containers = [d for d in _listdir(pod) if os.path.isdir(os.path.join(pod, d))]
    if len(containers) != 1:
        return LogFinding(
            None,
            f"{who}, but its pod has {len(containers)} container directories and no "
            f"{CONTAINER_LINKS} link names this container",
        )
    directory = os.path.join(pod, containers[0])
    shown = os.path.join(POD_LOGS, pod_dirs[0], containers[0])
    restarts = [int(m[1]) for m in map(_RESTART_LOG_RE.fullmatch, _listdir(directory)) if m]
    if not restarts:
        return LogFinding(None, f"{who}, but {shown} holds no <restart>.log")
    name = f"{max(restarts)}.log"
    why = f"{who}: {shown}/{name}, the latest restart of the pod's only container"
    return LogFinding(LogConfig(file=os.path.join(directory, name), encoding=LogEncoding.CRI), why)


@dataclass(frozen=True)
class _Output:
    """A regular file a process writes its stdout or stderr to."""

    stream: str
    path: str  # where the exporter reaches it
    identity: tuple[int, int]
    born: float | None  # statx birth time, None where the filesystem keeps none
    whole: bool  # written through a non-append descriptor up to its end: every byte its own


def _output_files(proc: str, pid: int, host_root: str) -> tuple[list[_Output], str]:
    """The distinct regular files of stdout and stderr, and what they are in words."""
    found: list[_Output] = []
    words = []
    for fd, stream in STREAMS:
        output, what = _output(proc, pid, fd, stream, host_root)
        words.append(f"{stream} is {what}")
        if output is not None and all(o.identity != output.identity for o in found):
            found.append(output)
    return found, ", ".join(words)


def _output(
    proc: str, pid: int, fd: int, stream: str, host_root: str
) -> tuple[_Output | None, str]:
    link = os.path.join(proc, "fd", str(fd))
    try:
        target = os.readlink(link)
        st = os.stat(link)  # the magic link: the process's own file, whatever its namespace
    except FileNotFoundError:
        return None, "closed"
    except OSError as exc:
        return None, f"unreadable ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):
        return None, _kind(target, st)
    identity = (st.st_dev, st.st_ino)
    for path in (_under(host_root, target), os.path.join(proc, "root", target.lstrip("/"))):
        try:
            here = os.stat(path)
        except OSError:
            continue
        if (here.st_dev, here.st_ino) == identity:
            whole = _written_whole(proc, fd, st.st_size)
            return _Output(stream, path, identity, _birth_time(link), whole), target
    return None, f"the regular file {target}, deleted or not reachable from here"


def _kind(target: str, st: os.stat_result) -> str:
    if target.startswith("pipe:"):
        return "a pipe"
    if target.startswith("socket:"):
        return "a socket"
    if stat.S_ISCHR(st.st_mode):
        return f"the device {target}"
    return target


def _written_whole(proc: str, fd: int, size: int) -> bool:
    """Whether the descriptor writes at its own offset (no O_APPEND) and has reached the file's
    size: the file was empty when opened (truncated), so all of it came through this descriptor."""
    text = _read_small(os.path.join(proc, "fdinfo", str(fd)))
    fields = dict(line.split(":", 1) for line in (text or "").splitlines() if ":" in line)
    try:
        pos, flags = int(fields["pos"]), int(fields["flags"], 8)
    except (KeyError, ValueError):
        return False
    return not flags & O_APPEND and pos >= size


def _plain(pid: int, files: list[_Output], start_time: float | None) -> LogFinding:
    names = " and ".join(o.stream for o in files)
    verb = "is the regular file" if len(files) == 1 else "are the regular files"
    parts, whole = [], []
    for output in files:
        own = _own(output, start_time)
        if own is not None:
            whole.append(output.path)
            parts.append(f"{output.path}, {own}: read from its start")
        else:
            parts.append(f"{output.path}, not shown to be this process's own: read from its end")
    config = LogConfig(file=files[0].path, more_files=tuple(o.path for o in files[1:]))
    why = f"{names} of pid {pid} {verb} {'; '.join(parts)}"
    return LogFinding(config, why, tuple(whole))


def _own(output: _Output, start_time: float | None) -> str | None:
    """Why the whole file is this process's output, or None when that cannot be shown. A start
    time is known to a clock tick (it may be up to one early), so a file born within a tick of
    it may be older than the process."""
    tick = 1.0 / os.sysconf("SC_CLK_TCK")
    if start_time is not None and output.born is not None and output.born >= start_time + tick:
        return "created after the process started"
    if output.whole:
        return "written from its first byte through this descriptor"
    return None


def _under(host_root: str, path: str) -> str:
    return os.path.join(host_root, path.lstrip("/"))


def _is_file(path: str) -> bool:
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except OSError:
        return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _read_small(path: str) -> str | None:
    """The text of a small /proc file of the process: the one place this module opens a file
    on the process's behalf (the rest stats, lists and reads links)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        return os.read(fd, SMALL_READ).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


# statx(2) for the birth time, which os.stat does not give on Linux before Python 3.14.
_AT_FDCWD = -100
_STATX_BTIME = 0x800
_STATX_BTIME_OFFSET = 80  # struct statx: stx_btime (a statx_timestamp) at byte 80


def _birth_time(path: str) -> float | None:
    """When the file was created, where the filesystem records it (ext4, xfs, btrfs, tmpfs)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        statx = libc.statx
    except (OSError, AttributeError):
        return None
    buf = ctypes.create_string_buffer(256)
    if statx(_AT_FDCWD, os.fsencode(path), 0, _STATX_BTIME, buf) != 0:
        return None
    raw, at = buf.raw, _STATX_BTIME_OFFSET
    if not int.from_bytes(raw[0:4], sys.byteorder) & _STATX_BTIME:
        return None
    seconds = int.from_bytes(raw[at : at + 8], sys.byteorder, signed=True)
    return seconds + int.from_bytes(raw[at + 8 : at + 12], sys.byteorder) / 1e9
