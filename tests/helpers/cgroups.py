"""Real cgroups for test processes, so that /proc/PID/cgroup names a systemd unit, a Docker
container or a pod's container exactly as it does under systemd, dockerd or the kubelet.

This machine mounts cgroups in hybrid mode: systemd's named v1 hierarchy at
/sys/fs/cgroup/systemd (the `name=systemd` line) and v2 at /sys/fs/cgroup/unified (the `0::`
line); elsewhere v2 may be /sys/fs/cgroup itself. Creating them needs root.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from helpers.require import require

NAMED_SYSTEMD = Path("/sys/fs/cgroup/systemd")


def v2_root() -> Path | None:
    for root in (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified")):
        if (root / "cgroup.procs").exists() and (root / "cgroup.controllers").exists():
            return root
    return None


def hierarchies(v2: bool = True, named: bool = True) -> list[Path]:
    """The roots asked for; the test is skipped (failed when strict) where one is missing."""
    roots = []
    if v2:
        root = v2_root()
        require(root is not None, "no cgroup v2 hierarchy")
        assert root is not None
        roots.append(root)
    if named:
        require((NAMED_SYSTEMD / "cgroup.procs").exists(), "no name=systemd cgroup hierarchy")
        roots.append(NAMED_SYSTEMD)
    return roots


@contextlib.contextmanager
def cgroups(relative: str, roots: Sequence[Path]) -> Iterator[list[Path]]:
    """The cgroup `relative` (e.g. `system.slice/docker-<id>.scope`) in each root, created with
    whatever parents it lacks and removed after, once the processes placed in it are gone."""
    require(os.geteuid() == 0, "needs root: cgroups")
    created: list[Path] = []
    try:
        for root in roots:
            path = root
            for part in Path(relative).parts:
                path = path / part
                try:
                    path.mkdir()
                    created.append(path)
                except FileExistsError:
                    pass
                except OSError as exc:
                    require(False, f"cannot create a cgroup: {exc}")
        yield [root / relative for root in roots]
    finally:
        for path in reversed(created):
            _remove(path)


def _remove(path: Path) -> None:
    """rmdir once the cgroup is empty: its processes may take a moment to be reaped. A parent
    another test still uses stays."""
    for _ in range(100):
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.1)


def joining(dirs: Sequence[Path], command: Sequence[str]) -> list[str]:
    """`command` run by a shell that first moves itself into each cgroup, then execs it: the
    process is in those cgroups from its first instruction, as runc and systemd place theirs."""
    moves = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))} && " for d in dirs)
    return ["sh", "-c", f'{moves}exec "$@"', "sh", *command]
