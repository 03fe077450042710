"""Where a target's weights live, and what can and cannot be measured there, with the reasons.

Residency and the cold/warm verdict assume weights on a local filesystem whose reads go through
the page cache. Elsewhere they must be redirected, qualified or dropped, never wrong:

* overlayfs: `cachestat` through the overlay's descriptor reports 0 pages while the real file
  below is fully cached, so residency is measured on the real file (exporter/storage/below.py
  finds it and checks it is the one);
* FUSE: every `open()` of a file on a mount without `keep_cache` (bindfs's default) drops that
  file's page cache, so the residency pass would evict what the server just loaded. A passthrough
  whose source directory is named by the mount (bindfs) is measured there; elsewhere files are
  opened only where a probe on another file of the model showed the mount keeps the cache, and
  a probe that found nothing cached after a read shows direct I/O (mountpoint-s3): reads bypass
  the page cache;
* ZFS: its ARC, not the page cache, serves reads, so page-cache residency says nothing of the next
  load; residency is dropped and the load's cache label is `unknown` (the ARC counters are in
  exporter/sources/zfs.py);
* tmpfs, ramfs, hugetlbfs: the weights are in memory by construction; residency is truthful (the
  pages are the file) and a load from them is never cold.

`WeightStorage` answers for one target: `describe()` is its per-target source (what status shows
and the tracker's cache label follows), `plan()` tells the residency pass and `prewarm` which
file to open for each weight file, or why none may be opened.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.config.schema import WeightsConfig
from exporter.sources.sample import Health, Sample
from exporter.storage.backing import MAX_DEPTH, Layer, describe
from exporter.storage.below import (
    Below,
    FuseProbe,
    moved,
    overlay_below,
    passthrough_below,
    probe_fuse,
    stat_if,
)
from exporter.storage.mounts import Mount, Mounts, Placed, relative_to
from exporter.storage.weighttree import WeightFile
from exporter.vocabulary import Cache, StorageKind

_READ_COUNTED_BY = {
    StorageKind.NFS: "nfs",
    StorageKind.LUSTRE: "lustre",
    StorageKind.CEPHFS: "cephfs",
    StorageKind.ZFS: "zfs",
}


@dataclass(frozen=True)
class Fact:
    """Whether something holds (None: cannot be known here) and why."""

    value: bool | None
    reason: str


@dataclass(frozen=True)
class MountStorage:
    """One filesystem under a target's weights and what can be measured on it."""

    kind: StorageKind
    fstype: str
    mount_point: str
    source: str
    summary: str  # "xfs on loop1 (buffered, backing /img/m.img) over ext4 on vda"
    paths: tuple[str, ...]  # the weight paths (or files) on it
    devices: tuple[str, ...]  # block devices its reads are counted on (diskstats)
    lower_devices: tuple[str, ...]  # devices further down (under a loop device's backing file)
    read_rate: Fact  # whether this exporter counts the bytes read from it, and where
    residency: Fact  # whether residency here is true, and by what method
    page_cache: Fact  # whether the page cache is the cache that serves its reads
    bypass: Fact  # whether reads of it go around the page cache
    in_memory: bool  # tmpfs, ramfs, hugetlbfs: the files are memory
    passthrough: str | None  # the directory a FUSE passthrough serves (verified per file)
    notes: tuple[str, ...]  # what else an operator should know (a loop's second page cache)


@dataclass(frozen=True)
class StorageDescription(Sample):
    """What holds one target's weights, and the rules its load's cache label follows.

    The label (DESIGN, "cache temperature"): `bypass` when reads of the weights go around the
    page cache, `unknown` when page-cache residency is not the cache temperature (ZFS's ARC
    serves the reads) or cannot be measured truthfully, never `cold` when every weight is in
    memory by construction (tmpfs), else warm/cold/mixed from residency. `fixed_cache()` is the
    first two, `in_memory` the third. A file opened with O_DIRECT (FileUse.direct) is `bypass`
    too; that is the process's choice, not the storage's, so it is not in here.
    """

    mounts: tuple[MountStorage, ...]
    unplaced: tuple[str, ...]  # "PATH: why" for weight paths that could not be looked at
    residency_is_temperature: bool
    in_memory: bool
    bypass: bool
    reason: str | None  # why the label is fixed, or why the weights are in memory

    def health(self) -> Health:
        """What status shows beside a successful sample: the weight paths that could not be
        looked at, else why the cache label is fixed."""
        return Health(note="; ".join(self.unplaced) or self.reason)

    def fixed_cache(self) -> Cache | None:
        """The load's cache label whatever residency says, or None when residency decides."""
        if self.bypass:
            return Cache.BYPASS
        if not self.residency_is_temperature:
            return Cache.UNKNOWN
        return None

    @property
    def kinds(self) -> tuple[StorageKind, ...]:
        return tuple(dict.fromkeys(m.kind for m in self.mounts))


@dataclass(frozen=True)
class MeasurePlan:
    """What a residency pass or prewarm opens: each weight file, or the real file below it."""

    files: tuple[WeightFile, ...]  # to open (names kept; path, dev, ino of the file opened)
    unmeasurable: tuple[WeightFile, ...]  # must not, or cannot truthfully, be opened
    reason: str | None  # why the first unmeasurable one is
    redirected: int  # files measured below their mount (overlay layer, FUSE source)
    where: str | None  # "on the real files below the overlay", for status


# A mount as one namespace's table lists it: ids are reused after an unmount, whole lines not.
_Key = tuple[str, Mount]


@dataclass(frozen=True)
class _MountFacts:
    """What is known of one mount, kept for its life (keyed by mount id)."""

    layer: Layer
    placed: Placed
    probe: FuseProbe | None

    @property
    def passthrough(self) -> str | None:
        return self.layer.passthrough


class WeightStorage:
    """The storage of one target's weights. Thread-safe: its per-mount knowledge is locked."""

    def __init__(
        self, weights: WeightsConfig, proc_root: str = "/proc", sys_root: str = "/sys"
    ) -> None:
        self._weights = weights
        self._proc_root = proc_root
        self._sys_root = sys_root
        self._lock = threading.Lock()
        self._facts: dict[_Key, _MountFacts] = {}
        self._by_dev: dict[int, _MountFacts | None] = {}
        self._below_by_dev: dict[int, _MountFacts | None] = {}  # the real files' mounts
        self._extra: dict[_Key, str] = {}  # mounts the passes found, with a file on each
        # Each redirected file's real file, found by the last pass: the next one checks it with
        # two stats instead of placing the file again (measured over 2,000 overlay files here:
        # 13 us a file on top of the pass's own 10, instead of 110).
        self._below: dict[tuple[int, int], Below] = {}

    # -- the description -------------------------------------------------------------------

    def describe(self) -> StorageDescription:
        """The storage under every weight path, and under every mount a residency pass met
        (a symlinked blob on another filesystem, a mount inside the weights directory)."""
        mounts = Mounts(self._proc_root)
        named: dict[_Key, list[str]] = {}
        unplaced: list[str] = []
        with self._lock:
            # Mounts may have changed: passes place their files afresh.
            self._by_dev, self._below_by_dev = {}, {}
            for path in self._weights.paths:
                try:
                    facts = self._facts_of(path, mounts)
                except OSError as exc:
                    unplaced.append(f"{path}: {exc.strerror}")
                    continue
                if facts is None:
                    unplaced.append(f"{path}: no mount table holds it")
                else:
                    named.setdefault(_key(facts), []).append(path)
            for key, path in list(self._extra.items()):
                try:
                    facts = self._facts_of(path, mounts)
                except OSError:
                    facts = None
                if facts is None:  # gone since the pass met it: its mount may be too
                    del self._extra[key]
                elif _key(facts) not in named:
                    named[_key(facts)] = [path]
            described = tuple(
                self._mount_storage(self._facts[key], tuple(paths)) for key, paths in named.items()
            )
        return _verdicts(described, tuple(unplaced))

    def _facts_of(self, path: str, mounts: Mounts) -> _MountFacts | None:
        placed = mounts.place(path)
        if placed is None:
            return None
        key = (placed.table.prefix, placed.mount)
        if key not in self._facts:
            layer = describe(placed, mounts, self._sys_root)
            probe = None
            if layer.kind is StorageKind.FUSE:  # a passthrough too: direct_io is per open
                probe = probe_fuse(self._probe_candidates(placed), self._weights.include)
            self._facts[key] = _MountFacts(layer, placed, probe)
        return self._facts[key]

    def _probe_candidates(self, placed: Placed) -> list[str]:
        """Weight roots on this mount, whose other files may serve as the FUSE probe."""
        point = placed.table.outside(placed.mount.mount_point)
        roots = [p for p in self._weights.paths if relative_to(p, point) is not None]
        return roots or [placed.table.outside(placed.path)]

    def _mount_storage(self, facts: _MountFacts, paths: tuple[str, ...]) -> MountStorage:
        layer = facts.layer
        kind = layer.kind
        devices = layer.read_devices()
        lower = tuple(d for d in layer.all_devices() if d not in devices)
        notes = [
            f"{loop.device} reads through the page cache of its backing file "
            f"{loop.backing_file}: a load may be served from there while the disk below reads "
            "nothing and the weights' own residency says cold"
            for loop in layer.all_loops()
            if not loop.direct_io
        ]
        if layer.problem:
            notes.append(layer.problem)
        return MountStorage(
            kind=kind,
            fstype=layer.fstype,
            mount_point=facts.placed.mount.mount_point,
            source=facts.placed.mount.source,
            summary=layer.summary(),
            paths=paths,
            devices=devices,
            lower_devices=lower,
            read_rate=_read_rate(layer, devices, lower),
            residency=_residency(kind, facts),
            page_cache=_page_cache(kind),
            bypass=_bypass(kind, facts),
            in_memory=kind is StorageKind.MEMORY,
            passthrough=facts.passthrough,
            notes=tuple(notes),
        )

    # -- what a pass opens -----------------------------------------------------------------

    def plan(self, files: Sequence[WeightFile]) -> MeasurePlan:
        """For each weight file, the file to open to measure it truthfully and harmlessly."""
        mounts = Mounts(self._proc_root)
        out: list[WeightFile] = []
        unmeasurable: list[WeightFile] = []
        reason: str | None = None
        redirected = 0
        where: str | None = None
        with self._lock:
            known, self._below = self._below, {}
            for wf in files:
                try:
                    facts = self._facts_by_dev(wf, mounts)
                except OSError:
                    out.append(wf)  # vanished since discovery: the pass notices and rediscovers
                    continue
                try:
                    real, why = self._real_file(wf, facts, mounts, known)
                except OSError as exc:
                    real, why = None, f"cannot follow {wf.path} below its mount: {exc.strerror}"
                if real is None:
                    unmeasurable.append(wf)
                    reason = reason or why
                    continue
                if real is not wf:
                    redirected += 1
                    where = where or why
                out.append(real)
        return MeasurePlan(tuple(out), tuple(unmeasurable), reason, redirected, where)

    def _facts_by_dev(
        self, wf: WeightFile, mounts: Mounts, below: bool = False
    ) -> _MountFacts | None:
        """One placement per device number: every file of a plain filesystem is measured as
        it is, so a pass over 10,000 shards pays for one lookup, not 10,000. The mounts of the
        weights themselves are added to the description; those of real files below are not
        (the overlay's or passthrough's summary names them)."""
        cache = self._below_by_dev if below else self._by_dev
        if wf.dev not in cache:
            facts = self._facts_of(wf.path, mounts)
            cache[wf.dev] = facts
            if facts is not None and not below:
                self._extra.setdefault(_key(facts), wf.path)
        return cache[wf.dev]

    def _real_file(
        self,
        wf: WeightFile,
        facts: _MountFacts | None,
        mounts: Mounts,
        known: Mapping[tuple[int, int], Below],
        depth: int = 0,
    ) -> tuple[WeightFile | None, str | None]:
        """(the file to open, how it was found) or (None, why none may be opened). A real file
        found below may itself be on an overlay (a container in a container): followed too."""
        if facts is None:
            return wf, None
        kind = facts.layer.kind
        if kind is StorageKind.ZFS:
            return None, _ZFS_RESIDENCY
        if kind is StorageKind.FUSE and facts.passthrough is None:
            verdict = _residency(kind, facts)
            return (wf, None) if verdict.value else (None, verdict.reason)
        if kind not in (StorageKind.OVERLAY, StorageKind.FUSE):
            return wf, None
        seen = os.stat(wf.path)
        below = known.get((wf.dev, wf.ino))
        real_st = stat_if(below.path) if below is not None else None
        if below is None or real_st is None or not below.matches(seen, real_st):
            placed = mounts.place(wf.path)
            if placed is None:
                return None, f"cannot place {wf.path} on its {facts.layer.fstype} mount"
            if kind is StorageKind.OVERLAY:
                found = overlay_below(wf, seen, placed)
            else:
                found = passthrough_below(wf, seen, placed, facts.passthrough or "")
            if isinstance(found, str):
                return None, found
            below, real_st = found
        self._below[(wf.dev, wf.ino)] = below
        real = moved(wf, below.path, real_st)
        if depth >= MAX_DEPTH:
            return real, below.how
        deeper, deeper_how = self._real_file(
            real, self._facts_by_dev(real, mounts, below=True), mounts, known, depth + 1
        )
        return deeper, deeper_how if deeper is None or deeper is not real else below.how


def _key(facts: _MountFacts) -> _Key:
    return (facts.placed.table.prefix, facts.placed.mount)


_ZFS_RESIDENCY = (
    "ZFS serves reads from its ARC, not the page cache: page-cache residency says nothing of "
    "the next load (the ARC's hit share is in model_load_zfs_arc_*)"
)
_MEMORY_REASON = "the weights are on a memory filesystem: in memory by construction"


def _verdicts(mounts: tuple[MountStorage, ...], unplaced: tuple[str, ...]) -> StorageDescription:
    bypassed = [m for m in mounts if m.bypass.value]
    unknown = [m for m in mounts if _unknown_why(m) is not None]
    in_memory = bool(mounts) and all(m.in_memory for m in mounts)
    if bypassed:
        reason: str | None = f"{bypassed[0].mount_point}: {bypassed[0].bypass.reason}"
    elif unknown:
        reason = f"{unknown[0].mount_point}: {_unknown_why(unknown[0])}"
    else:
        reason = _MEMORY_REASON if in_memory else None
    return StorageDescription(
        mounts=mounts,
        unplaced=unplaced,
        residency_is_temperature=not unknown,
        in_memory=in_memory,
        bypass=bool(bypassed),
        reason=reason,
    )


def _unknown_why(mount: MountStorage) -> str | None:
    """Why residency is no cache temperature on this mount, or None when it is one: another
    cache serves the reads, residency cannot be measured, or whether reads skip the page cache
    cannot be told (a FUSE mount: `bypass` then `unknown`, never a guess of cold)."""
    if not mount.page_cache.value:
        return mount.page_cache.reason
    if mount.residency.value is False:
        return mount.residency.reason
    if mount.bypass.value is None:
        return mount.bypass.reason
    return None


def _read_rate(layer: Layer, devices: tuple[str, ...], lower: tuple[str, ...]) -> Fact:
    if devices:
        below = f" (and {', '.join(lower)} under the loop device's backing file)" if lower else ""
        return Fact(True, f"disk: {', '.join(devices)}{below}")
    counted = _READ_COUNTED_BY.get(layer.kind)
    if counted is not None:
        return Fact(True, f"{counted}: {layer.mount.source}")
    if layer.kind is StorageKind.MEMORY:
        return Fact(False, "a memory filesystem reads no device")
    if layer.kind is StorageKind.FUSE:
        return Fact(False, "FUSE has no per-mount byte counter")
    return Fact(False, f"no device or counter is known for {layer.fstype}")


def _residency(kind: StorageKind, facts: _MountFacts) -> Fact:
    if kind is StorageKind.ZFS:
        return Fact(False, _ZFS_RESIDENCY)
    if kind is StorageKind.OVERLAY:
        return Fact(
            True, "cachestat on the real files below the overlay (its upper or lower layer)"
        )
    if kind is StorageKind.FUSE:
        if facts.passthrough is not None:
            return Fact(True, f"cachestat on the passthrough's source files in {facts.passthrough}")
        probe = facts.probe
        if probe is not None and probe.direct:
            return Fact(False, f"reads bypass the page cache: {probe.reason}")
        if probe is None or probe.keeps_cache is None:
            why = probe.reason if probe is not None else "not probed"
            return Fact(False, f"opening a file on this FUSE mount may drop its page cache: {why}")
        if not probe.keeps_cache:
            return Fact(
                False,
                "every open of a file on this FUSE mount drops its page cache (no keep_cache), "
                f"so measuring would evict what the server loaded: {probe.reason}",
            )
        return Fact(True, f"cachestat through the mount, which keeps the cache: {probe.reason}")
    if kind is StorageKind.MEMORY:
        return Fact(True, "cachestat: the files' pages are the files")
    return Fact(True, "cachestat on the files")


def _page_cache(kind: StorageKind) -> Fact:
    if kind is StorageKind.ZFS:
        return Fact(False, "ZFS caches in its ARC; the page cache holds only mmap'ed pages")
    return Fact(True, "reads go through the page cache")


def _bypass(kind: StorageKind, facts: _MountFacts) -> Fact:
    if kind is not StorageKind.FUSE:
        return Fact(False, "buffered reads go through the page cache (a loader may still open "
                    "files with O_DIRECT: see the weight files' direct flag)")  # fmt: skip
    probe = facts.probe
    if probe is None or probe.direct is None:
        why = probe.reason if probe is not None else "not probed"
        return Fact(None, f"cannot tell whether reads through this FUSE mount skip the page "
                    f"cache (direct_io shows in no mount option): {why}")  # fmt: skip
    if not probe.direct and facts.passthrough is not None:
        return Fact(False, f"the passthrough reads {facts.passthrough} through its page cache "
                    f"and the mount keeps pages: {probe.reason}")  # fmt: skip
    return Fact(probe.direct, probe.reason)


# -- FUSE ----------------------------------------------------------------------------------
