"""What anyone can see of a process's use of its weight files through /proc, looked at from
outside while it runs: open descriptors and their offsets, mappings and their mapped pages, read()
bytes per thread. The simulator's tests hold it to these signals."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

_POS = re.compile(r"^pos:\s+(\d+)", re.M)
_RCHAR = re.compile(r"^rchar: (\d+)", re.M)
_FILE = re.compile(r" file=(\S+)")
_MAPPED = re.compile(r" mapped=(\d+)")
_DIRTY_OR_ANON = re.compile(r" (?:dirty|anon)=(\d+)")


@dataclass(frozen=True)
class Look:
    """One process at one moment (between `began` and `ended`, unix seconds)."""

    pid: int
    ppid: int
    began: float
    ended: float
    rchar: int
    positions: dict[str, int]  # open weight file -> its descriptor's offset (fdinfo pos)
    mapped: dict[str, int]  # mapped weight file -> pages of it mapped in (numa_maps)
    libraries: frozenset[str]  # other files mapped from `others`
    thread_rchar: dict[int, int]  # read() bytes of each thread but the main one


def _rchar(path: str) -> int:
    match = _RCHAR.search(Path(path).read_text())
    assert match, path
    return int(match.group(1))


def _positions(pid: int, weights: Path) -> dict[str, int]:
    positions = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = Path(os.readlink(f"/proc/{pid}/fd/{fd}"))
            info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
        except FileNotFoundError:  # closed meanwhile
            continue
        match = _POS.search(info)
        if target.parent == weights and match:
            positions[target.name] = int(match.group(1))
    return positions


def _pages(numa_maps_line: str) -> int:
    """Pages of a mapping mapped in. numa_maps leaves `mapped=` out when it equals `dirty=` (a
    file just written) or `anon=`; then the larger of those is the count."""
    if match := _MAPPED.search(numa_maps_line):
        return int(match.group(1))
    return max((int(n) for n in _DIRTY_OR_ANON.findall(numa_maps_line)), default=0)


def look(pid: int, weights: Path, others: Path) -> Look | None:
    """What /proc shows of `pid`'s weight files in `weights`; None once it is gone."""
    began = time.time()
    try:
        ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        rchar = _rchar(f"/proc/{pid}/io")
        positions = _positions(pid, weights)
        mapped: dict[str, int] = {}
        libraries = set()
        for line in Path(f"/proc/{pid}/numa_maps").read_text().splitlines():
            if not (file := _FILE.search(line)):
                continue
            path = Path(file.group(1))
            if path.parent == weights:
                mapped[path.name] = mapped.get(path.name, 0) + _pages(line)
            elif path.parent == others:
                libraries.add(path.name)
        threads = {}
        for task in os.listdir(f"/proc/{pid}/task"):
            if int(task) != pid:
                try:
                    threads[int(task)] = _rchar(f"/proc/{pid}/task/{task}/io")
                except FileNotFoundError:  # the thread ended meanwhile
                    continue
    except (FileNotFoundError, ProcessLookupError):
        return None
    return Look(
        pid, ppid, began, time.time(), rchar, positions, mapped, frozenset(libraries), threads
    )
