"""Issue 37, third trust round, rows 2 to 5: the environment measurement (the files a server's
tree maps or holds, exporter/sources/environment.py) against a local user.

The exporter's runtime runs here as root, as on a GPU host, its sampler stepped by the test;
each target is configured by command line (`process.cmdline`), so its tree is whatever process
matches, here a real process of `nobody` (setpriv), in a real user and mount namespace
(`unshare -Urm`) where a row needs one. Each row's test failed on the code before its fix; the
controls (the user's own files still learned and measured, a root server in its own mount
namespace seen as it sees its files) hold on both.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import time
import tracemalloc
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from helpers.fakeservers import SYSTEM_PYTHON, world_dir
from helpers.stepped import SteppedLoops
from helpers.support import free_port, wait_for
from helpers.users import NOBODY, SETPRIV

from exporter.config.reader import parse_config
from exporter.runtime.reactions import TRACKER_LOOP
from exporter.runtime.sampler import Sampler
from exporter.runtime.wiring import Runtime
from exporter.sources import ENVIRONMENT
from exporter.sources.environment import EnvironmentSample
from exporter.sources.process import process_start_time

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv", "unshare")]

# A server as far as the exporter can tell: it writes and maps, maps, holds open, unlinks and
# plants what its spec says, then forks, reaps, opens and closes on each line of stdin.
SERVER = r"""
import json, mmap, os, resource, signal, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
spec = json.loads(sys.argv[1])
held = []
for path, size in spec.get("write", []):
    with open(path, "wb") as f:
        f.write(b"\1" * size)
for path in [p for p, _ in spec.get("write", [])] + spec.get("maps", []):
    fd = os.open(path, os.O_RDONLY)
    held.append(mmap.mmap(fd, 0, prot=mmap.PROT_READ))
    os.close(fd)
for path in spec.get("reads", []):
    held.append(os.open(path, os.O_RDONLY))
for path in spec.get("unlink", []):
    os.unlink(path)
for link, target in spec.get("links", []):
    os.symlink(target, link)
fds = [os.open(spec["fill"], os.O_RDONLY) for _ in range(spec.get("fds", 0))]
children = []
print("ready", flush=True)
for line in sys.stdin:
    op, _, arg = line.strip().partition(" ")
    if op == "fork":
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        children.append(pid)
    elif op == "reap":
        while children:
            child = children.pop()
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
    elif op == "open":
        fds.append(os.open(arg or spec["fill"], os.O_RDONLY))
    elif op == "close":
        os.close(fds.pop())
    print("ok", flush=True)
"""


class Server:
    """A real process running SERVER with `spec`, its command line marked by `marker`."""

    def __init__(
        self, spec: dict[str, Any], marker: str, *, user: bool = True, wrap: Sequence[str] = ()
    ) -> None:
        ids = SETPRIV if user else []
        argv = [*ids, *wrap, SYSTEM_PYTHON, "-c", SERVER, json.dumps(spec), marker]
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd="/",
            start_new_session=True,  # its children in its process group: stopped with it
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == "ready\n", f"server did not start: {line!r}"

    def do(self, op: str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(op + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "ok\n"

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


class Watching:
    """The exporter's runtime watching configured targets (name -> command-line marker)."""

    def __init__(self, markers: dict[str, str], weights: Path) -> None:
        port = free_port()  # nothing listens: the probe is refused, the tree is what counts
        config = parse_config(
            {
                "sample_interval": "1s",
                "history_path": "",
                "targets": [
                    {
                        "name": name,
                        "endpoint": {"url": f"http://127.0.0.1:{port}"},
                        "weights": {"paths": [str(weights)]},
                        "process": {"cmdline": marker},
                    }
                    for name, marker in markers.items()
                ],
            },
            source="test",
        )
        self.loops = SteppedLoops(last=(TRACKER_LOOP,))
        self.runtime = Runtime(
            config, sampler=Sampler(config.sample_interval, time.time, periodic=self.loops)
        )

    def environment(self, name: str) -> EnvironmentSample | None:
        return self.runtime.sampler.value(ENVIRONMENT, name)

    def until(self, check: Callable[[], bool], timeout: float = 30.0, pause: float = 0.2) -> None:
        """Rounds of every loop until `check` holds (learning waits its CPU share between)."""

        def round_done() -> bool:
            self.loops.round()
            return check()

        wait_for(round_done, timeout=timeout, interval=pause)

    def stop(self) -> None:
        self.runtime.stop()


def learned(sample: EnvironmentSample | None) -> tuple[int, int] | None:
    """What an answer says of the environment: files and their bytes, as /api/v1 and the
    forecast pass them on."""
    return None if sample is None else (sample.files, sample.total_bytes)


@pytest.fixture
def user_dir() -> Iterator[Path]:
    """A directory of nobody's own."""
    path = world_dir("round3-nobody-")
    os.chown(path, NOBODY, NOBODY)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def root_dir() -> Iterator[Path]:
    """Root's: a directory anyone may enter holding a file only root may read, of a size no
    other file here has; and a world-readable file no server holds."""
    path = world_dir("round3-root-")
    secret = path / "secret.dat"
    secret.write_bytes(secrets.token_bytes(3_000_017))
    secret.chmod(0o600)
    other = path / "other.so"
    other.write_bytes(secrets.token_bytes(2_000_029))
    other.chmod(0o644)
    yield path
    shutil.rmtree(path)


@pytest.fixture
def weights() -> Iterator[Path]:
    path = world_dir("round3-weights-")
    (path / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    yield path
    shutil.rmtree(path)


def own_library(directory: Path, name: str, size: int = 1_000_003) -> Path:
    """A file of nobody's that its server maps as a library."""
    path = directory / name
    path.write_bytes(secrets.token_bytes(size))
    os.chown(path, NOBODY, NOBODY)
    return path


# -- rows 3 (a, b) and 4: a "(deleted)" name planted beside an unlinked file --------------------


def test_row3_row4_a_name_planted_where_a_deleted_file_was_is_never_learned(
    user_dir: Path, root_dir: Path, weights: Path
) -> None:
    """Each server maps its own library, holds it open and unlinks it; the kernel then names it
    `lib.so (deleted)` in maps and fd, and the user plants a symlink of that name: to root's
    unreadable file, to a missing one, to a world-readable file the server does not hold, or
    none (the control). Every answer is the control's: root's file is not measured with root's
    rights (a configured target's process is acted for with its own), what opens at the name
    is not the file the process holds, and a missing and an unreadable path look the same."""
    plants = {
        "control": None,
        "root-only": root_dir / "secret.dat",
        "missing": root_dir / "no-such-file",
        "readable": root_dir / "other.so",
    }
    servers, markers = [], {}
    try:
        for name, target in plants.items():
            home = user_dir / name
            home.mkdir()
            os.chown(home, NOBODY, NOBODY)
            lib = own_library(home, "lib.so")
            spec: dict[str, Any] = {"maps": [str(lib)], "reads": [str(lib)], "unlink": [str(lib)]}
            if target is not None:
                spec["links"] = [[f"{lib} (deleted)", str(target)]]
            markers[name] = f"mle-round3-{name}-{secrets.token_hex(4)}"
            servers.append(Server(spec, markers[name]))
        watching = Watching(markers, weights)
        try:
            watching.until(lambda: (learned(watching.environment("control")) or (0, 0))[0] > 0)
            time.sleep(1.0)  # what more a later learning would add
            for _ in range(3):
                watching.loops.round()
            control = watching.environment("control")
            assert control is not None and control.resident_bytes is not None, control
            assert control.files > 0  # the user's own server: its interpreter's libraries
            answers = {name: learned(watching.environment(name)) for name in markers}
            assert answers == dict.fromkeys(markers, learned(control)), answers
        finally:
            watching.stop()
    finally:
        for server in servers:
            server.stop()


# -- row 3 (c): a tmpfs in the user's own mount namespace over a path that is a symlink here -----


def test_row3_a_path_in_a_users_mount_namespace_is_not_opened_on_the_host(
    user_dir: Path, root_dir: Path, weights: Path
) -> None:
    """Inside `unshare -Urm` the user mounts a tmpfs on its own directory and maps a file it
    writes there; on the host that path is a symlink to root's unreadable file (or nothing, the
    control). The exporter must not open the path as the host sees it: both answer alike."""
    servers, markers = [], {}
    try:
        for name, planted in (("control", False), ("planted", True)):
            inside = user_dir / name
            inside.mkdir()
            os.chown(inside, NOBODY, NOBODY)
            lib = inside / "lib.so"
            if planted:
                lib.symlink_to(root_dir / "secret.dat")
                os.lchown(lib, NOBODY, NOBODY)
            mount = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs none "$0" && exec "$@"']
            markers[name] = f"mle-round3-ns-{name}-{secrets.token_hex(4)}"
            spec = {"write": [[str(lib), 1_000_003]]}
            servers.append(Server(spec, markers[name], wrap=[*mount, str(inside)]))
        watching = Watching(markers, weights)
        try:
            watching.until(lambda: all(watching.environment(n) for n in markers))
            time.sleep(1.0)
            for _ in range(3):
                watching.loops.round()
            answers = {name: learned(watching.environment(name)) for name in markers}
            assert answers["planted"] == answers["control"], answers
        finally:
            watching.stop()
    finally:
        for server in servers:
            server.stop()


def test_a_root_server_in_its_own_mount_namespace_is_measured_as_it_sees_its_files(
    user_dir: Path, weights: Path
) -> None:
    """The control for mount namespaces: root's server in `unshare -m` maps a file on a disk
    directory bind-mounted where the host has nothing, and a tmpfs file where the host has a
    file of its own. Its file is learned (through /proc/PID/root); the host's file, which the
    server never saw, is not; the tmpfs is memory."""
    disk = user_dir / "disk"
    disk.mkdir()
    library = disk / "mounted.so"
    library.write_bytes(secrets.token_bytes(1_500_007))
    hidden = user_dir / "hidden"
    hidden.mkdir()
    shadowed = hidden / "lib.so"
    shadowed.write_bytes(secrets.token_bytes(2_500_009))
    elsewhere = user_dir / "only-inside"
    mounts = (
        f'mkdir -p "{elsewhere}" && mount --bind "{disk}" "{elsewhere}" && '
        f'mount -t tmpfs none "{hidden}" && exec "$@"'
    )
    marker = f"mle-round3-rootns-{secrets.token_hex(4)}"
    spec = {
        "write": [[str(hidden / "lib.so"), 1_000_003]],
        "maps": [str(elsewhere / "mounted.so")],
    }
    elsewhere.mkdir()
    server = Server(spec, marker, user=False, wrap=["unshare", "-m", "sh", "-c", mounts, "sh"])
    try:
        watching = Watching({"root-ns": marker}, weights)
        try:
            watching.until(lambda: learned(watching.environment("root-ns")) is not None)
            time.sleep(1.0)
            for _ in range(3):
                watching.loops.round()
            sample = watching.environment("root-ns")
            assert sample is not None and sample.resident_bytes is not None, sample
            files = watching.runtime.targets["root-ns"].environment
            assert files is not None
            sizes = {f.size for f in files._files.values()}
            assert 1_500_007 in sizes  # its own file, seen where it sees it
            assert 2_500_009 not in sizes  # the host's file under its tmpfs: never its
            assert 1_000_003 not in sizes  # tmpfs: memory
        finally:
            watching.stop()
    finally:
        server.stop()


# -- row 2: memory under a tree forking a child every 0.2 s ------------------------------------


def test_row2_memory_stays_flat_under_a_tree_forking_children_that_map_long_paths(
    user_dir: Path, weights: Path
) -> None:
    """The tree maps 400 files of its own under long paths and forks a short-lived child every
    0.2 s (each child maps them too). What the exporter keeps must not grow with the children
    seen: it grew by every path of every child (38 -> 633 MB in 70 s)."""
    deep = user_dir
    for part in ("a" * 60, "b" * 60, "c" * 60):
        deep = deep / part
        deep.mkdir()
        os.chown(deep, NOBODY, NOBODY)
    libs = [own_library(deep, f"lib{'x' * 40}{i:04d}.so", 4096) for i in range(400)]
    marker = f"mle-round3-fork-{secrets.token_hex(4)}"
    server = Server({"maps": [str(p) for p in libs]}, marker)
    watching = Watching({"forking": marker}, weights)
    try:
        watching.until(lambda: (learned(watching.environment("forking")) or (0, 0))[0] >= 400)
        exporter_code = str(Path(__file__).resolve().parents[1] / "exporter")
        kept = tracemalloc.Filter(True, f"{exporter_code}/*")

        def kept_bytes() -> int:
            snapshot = tracemalloc.take_snapshot().filter_traces([kept])
            return sum(stat.size for stat in snapshot.statistics("filename"))

        tracemalloc.start()
        try:
            sizes = []
            for child in range(80):
                server.do("reap")
                server.do("fork")
                time.sleep(0.2)
                watching.loops.round()
                if child in (19, 79):
                    sizes.append(kept_bytes())
        finally:
            tracemalloc.stop()
        grown = sizes[1] - sizes[0]
        # 60 children of 400 paths of 250 characters: about 10 MB if each child's were kept.
        assert grown < 1 << 20, f"grew {grown / 1e6:.1f} MB over 60 children"
        sample = watching.environment("forking")
        assert sample is not None and sample.files >= 400  # still learned and measured
    finally:
        watching.stop()
        server.stop()


# -- row 5: descriptor work paid once per descriptor -------------------------------------------


def test_row5_descriptors_are_identified_once_not_at_every_look(
    user_dir: Path, weights: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server holding 5,000 descriptors opens or closes one between looks. The environment's
    learning read the link of every descriptor at every look (5,000 readlinks a sample); now a
    descriptor is looked at when it appears, and a file opened meanwhile is still learned."""
    held = 5000
    fill = own_library(user_dir, "torch.so", 8192)
    late = own_library(user_dir, "late.so", 777_777)
    marker = f"mle-round3-fds-{secrets.token_hex(4)}"
    server = Server({"fill": str(fill), "fds": held}, marker)
    watching = Watching({"fds": marker}, weights)
    try:
        watching.until(lambda: learned(watching.environment("fds")) is not None)
        fd_dir = f"/proc/{server.proc.pid}/fd/"
        looked = 0
        plain = os.readlink

        def readlink(path: Any, *args: Any, **kwargs: Any) -> Any:
            nonlocal looked
            looked += str(path).startswith(fd_dir)
            return plain(path, *args, **kwargs)

        monkeypatch.setattr(os, "readlink", readlink)
        rounds = 21  # the last one opens: the file below takes a number never seen before
        for look in range(rounds):
            server.do("open" if look % 2 == 0 else "close")
            time.sleep(0.1)
            watching.loops.round()
        assert looked / rounds < 100, looked / rounds
        server.do(f"open {late}")
        environment = watching.runtime.targets["fds"].environment
        assert environment is not None
        watching.until(lambda: any(f.size == 777_777 for f in environment._files.values()))
    finally:
        watching.stop()
        server.stop()


# -- row 3: learned files are not carried to another user's process ----------------------------


def test_row3_what_roots_server_taught_is_not_carried_to_another_users_process(
    user_dir: Path, root_dir: Path, weights: Path
) -> None:
    """Root's server maps a file only root may read, and exits; then a process of `nobody`
    takes the target's match (its command line). The learned set was kept across processes
    and users: root's file measured for nobody's server, and its passes handed to nobody's load
    as what its start found. Now nobody's process starts afresh (its own file learned) and its
    load's start finds nothing of root's; a restart by the same user keeps its files (the
    control: tests/test_environment.py)."""
    marker = f"mle-round3-owner-{secrets.token_hex(4)}"
    secret = root_dir / "secret.dat"
    mine = own_library(user_dir, "mine.so", 1_200_007)
    watching = Watching({"taken": marker}, weights)
    environment = watching.runtime.targets["taken"].environment
    assert environment is not None

    def sizes() -> set[int]:
        return {f.size for f in environment._files.values()}

    try:
        roots = Server({"maps": [str(secret)]}, marker, user=False)
        try:
            watching.until(lambda: 3_000_017 in sizes())
        finally:
            roots.stop()
        time.sleep(1.0)
        watching.until(lambda: len(environment._passes) > 0 and environment._root is None)
        users = Server({"maps": [str(mine)]}, marker)
        try:
            watching.until(lambda: 1_200_007 in sizes())
            assert 3_000_017 not in sizes()
            start = process_start_time(users.proc.pid)
            assert start is not None
            assert environment.before(start) is None  # root's passes say nothing of its start
        finally:
            users.stop()
    finally:
        watching.stop()
