"""The weight paths a host-wide source watches, each placed on its filesystem's layers.

The disk, network-filesystem and ZFS sources all need the same thing: for every target, what
its weight paths stand on. Placing a path costs a mount lookup and a walk of /sys, so a layer is
kept per device number and found again by one `stat` per path and sample; a device number never
seen before (a new mount) is placed afresh with fresh mount tables.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from exporter.storage.backing import Layer, describe
from exporter.storage.mounts import Mounts, Placed
from exporter.trust.asprocess import OnBehalf

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlacedPath:
    path: str
    layer: Layer


class WatchedPaths:
    """Targets' weight paths -> their layers; `watch` may be called from any thread."""

    def __init__(
        self,
        paths_by_target: Mapping[str, Sequence[str]],
        proc_root: str = "/proc",
        sys_root: str = "/sys",
        logger: logging.Logger = log,
    ) -> None:
        self._paths_by_target = {t: tuple(p) for t, p in paths_by_target.items()}
        self._on_behalf: Mapping[str, OnBehalf] = {}
        self._mounts = Mounts(proc_root)
        self._sys_root = sys_root
        self._layers: dict[int, Layer | None] = {}
        self._reported: set[str] = set()
        self._log = logger

    def watch(
        self, target: str, paths: Sequence[str] | None, on_behalf: OnBehalf | None = None
    ) -> None:
        """Watch another target's weight paths, or none (thread-safe: the mappings are swapped).

        A discovered target's paths are stat'ed and placed `on_behalf` of its process, with its
        rights; what its mounts stand on (/sys, mount tables, loop images) is the host's.
        """
        watched = {t: p for t, p in self._paths_by_target.items() if t != target}
        behalf = {t: b for t, b in self._on_behalf.items() if t != target}
        if paths:
            watched[target] = tuple(paths)
            if on_behalf is not None:
                behalf[target] = on_behalf
        self._on_behalf = behalf
        self._paths_by_target = watched

    def placed(self) -> dict[str, tuple[PlacedPath, ...]]:
        """Every target's paths that could be placed (the others are logged once each)."""
        result: dict[str, tuple[PlacedPath, ...]] = {}
        on_behalf = self._on_behalf
        fresh = True
        for target, paths in self._paths_by_target.items():
            behalf = on_behalf.get(target)
            found: list[PlacedPath] = []
            for path, st_dev in _stat_all(paths, behalf):
                if isinstance(st_dev, OSError):
                    self.report_once(path, logging.WARNING, "cannot stat %s: %s", path, st_dev)
                    continue
                if st_dev not in self._layers:
                    if fresh:  # once per sample at most: a new device number, new mounts
                        self._mounts.refresh()
                        fresh = False
                    self._layers[st_dev] = self._place(path, behalf)
                layer = self._layers[st_dev]
                if layer is not None:
                    found.append(PlacedPath(path, layer))
            result[target] = tuple(found)
        return result

    def _place(self, path: str, behalf: OnBehalf | None) -> Layer | None:
        try:
            placed: Placed | None = (
                behalf.run(partial(self._mounts.place, path))
                if behalf
                else self._mounts.place(path)
            )
        except (OSError, TimeoutError) as exc:
            self.report_once(path, logging.WARNING, "cannot place %s on a mount: %s", path, exc)
            return None
        if placed is None:
            self.report_once(path, logging.WARNING, "no mount table holds %s", path)
            return None
        layer = describe(placed, self._mounts, self._sys_root)
        if layer.problem is not None:
            self.report_once(path, logging.INFO, "%s is on %s: %s", path, layer.summary(),
                             layer.problem)  # fmt: skip
        return layer

    def report_once(self, key: str, level: int, message: str, *args: object) -> None:
        if key not in self._reported:
            self._reported.add(key)
            self._log.log(level, message, *args)


def _stat_all(paths: Sequence[str], behalf: OnBehalf | None) -> list[tuple[str, int | OSError]]:
    """Each path's st_dev or why not, with the process's rights when `behalf` is given."""
    try:
        return behalf.run(partial(_devices_of, paths)) if behalf else _devices_of(paths)
    except (PermissionError, TimeoutError) as exc:
        return [(path, OSError(str(exc))) for path in paths]


def _devices_of(paths: Sequence[str]) -> list[tuple[str, int | OSError]]:
    result: list[tuple[str, int | OSError]] = []
    for path in paths:
        try:
            result.append((path, os.stat(path).st_dev))
        except OSError as exc:
            result.append((path, exc))
    return result
