"""The /api/v1 documents (exporter/exposition/api.py) built from a snapshot, and from history's
records.

The web side's half of the API: what each source's sample, the tracker's state, history's records
and the runtime's marks become in /api/v1/status and /api/v1/loads. Only here do the domain's
types meet the documents', so a source may change its dataclass and the public JSON stays as it
was. Where a document twins a domain dataclass, `_mirror` takes its fields by name (nested
dataclasses too), and what differs is said beside it: a rename, a value computed, a part left out.
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

from exporter.discovery.found import DiscoveredServer
from exporter.exposition import api, liveness
from exporter.history.startupwindow import StartupAdvice
from exporter.load.records import LoadRecord, LoadState
from exporter.runtime.sampler import Reading, health
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.sources import LOGS, NVML, PAGECACHE, STORAGE, WEIGHT_FILES
from exporter.sources.disk import DISK, DiskSample
from exporter.sources.gpu import pcie_rx_since
from exporter.sources.residency import ResidencySample
from exporter.sources.storage import StorageDescription
from exporter.sources.weightfiles import WeightFilesSample
from exporter.trust.untrusted import clean

UNBACKED_NOTE = (
    "no block device behind these paths (network or memory filesystem): "
    "disk read rate cannot be measured for them"
)


D = TypeVar("D", bound=api.Document)


def _mirror(document: type[D], source: object, **parts: Any) -> D:
    """A document whose fields are the source dataclass's of the same names, and `parts` (renamed
    or computed ones): where the public JSON is a domain value's own fields. A nested dataclass
    becomes the document its field's type names, the same way."""
    kind: type = document  # (mypy takes a class's type for unhashable)
    hints = _hints(kind)
    values = {
        f.name: _as(hints[f.name], getattr(source, f.name))
        for f in dataclasses.fields(document)
        if f.name not in parts
    }
    return document(**values, **parts)


@functools.cache
def _hints(document: type) -> Mapping[str, Any]:
    return typing.get_type_hints(document)


def _as(hint: Any, value: Any) -> Any:
    """A domain value as the document field `hint` holds: dataclasses mirrored, the rest as is."""
    if not dataclasses.is_dataclass(value) and not isinstance(value, tuple):
        return value
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        hint = next(a for a in typing.get_args(hint) if a is not types.NoneType)
    if isinstance(value, tuple):
        args = typing.get_args(hint)
        return tuple(_as(args[0], v) for v in value) if args[-1] is Ellipsis else value
    if not isinstance(hint, type) or not issubclass(hint, api.Document):
        return value
    return _mirror(hint, value)


def _load(record: LoadRecord) -> api.Load:
    """A finished load with its report: history's record field for field."""
    return _mirror(api.Load, record)


def loads_document(records: Iterable[LoadRecord]) -> api.Loads:
    """/api/v1/loads, and `history --json` read from the file in the same shape."""
    return api.Loads(tuple(map(_load, records)))


def load_document(record: LoadRecord) -> dict[str, Any]:
    """/api/v1/loads/ID: one load, as /api/v1/loads shows it."""
    return _load(record).with_duration()


def _source_reading(reading: Reading[Any], now: float) -> api.SourceReading:
    return api.SourceReading(
        up=reading.ok,
        error=reading.error,
        # What a source says about a sample that succeeded but is incomplete.
        note=health(reading.value).note,
        duration_seconds=round(reading.duration_seconds, 6),
        age_seconds=round(now - reading.finished_at, 3),
    )


def _gpu_pcie(snap: Snapshot, view: TargetView) -> tuple[api.GpuPcie, ...]:
    """Per GPU of the target (its configured `gpus`, else those its tree holds memory on): the
    PCIe RX counter, and the bytes received since the current (or last) load began."""
    reading = snap.host_reading(NVML)
    gpu = reading.good if reading is not None else None
    if reading is None or gpu is None:  # no GPU reading: nothing to show, not zeros
        return ()
    wanted = view.gpu_memory if view.config.gpus == "auto" else view.config.gpus
    entries = []
    for device in gpu.devices:
        if device.index not in wanted:
            continue
        mark = view.pcie_at_start.get((device.index, device.uuid))
        entries.append(
            api.GpuPcie(
                gpu=device.index,
                uuid=device.uuid,
                pcie_rx_bytes=device.pcie_rx_bytes,
                pcie_rx_bytes_since_load_start=pcie_rx_since(mark, device, reading.finished_at),
                pcie_rx_counted_since=mark.read_at if mark is not None else None,
            )
        )
    return tuple(entries)


def _gpu_memory(snap: Snapshot, view: TargetView) -> tuple[api.GpuMemory, ...]:
    """GPU memory the target holds per device, with the device's name and size when known."""
    gpu = snap.host_value(NVML)
    devices = {d.index: d for d in gpu.devices} if gpu is not None else {}
    entries = []
    for index, used in sorted(view.gpu_memory.items()):
        device = devices.get(index)
        entries.append(
            api.GpuMemory(
                gpu=index,
                name=device.name if device else None,
                used_bytes=used,
                total_bytes=device.memory_total_bytes if device else None,
            )
        )
    return tuple(entries)


def _residency(sample: ResidencySample, now: float) -> api.Residency:
    return _mirror(
        api.Residency,
        sample,
        last_full_pass_age_seconds=round(now - sample.measured_at, 3),
        last_full_pass_cpu_seconds=sample.pass_cpu_seconds,
        measured_on=sample.where,
    )


def _weight_files(sample: WeightFilesSample) -> api.WeightFiles:
    """What the server's tree has done with its weight files: the files it holds in full, the
    ones it is done with as a count (a checkpoint may have hundreds of shards)."""
    return _mirror(
        api.WeightFiles,
        sample,
        files_seen=len(sample.files),
        files_done=sum(1 for f in sample.files if f.consumed_bytes >= f.size_bytes),
        held=tuple(_mirror(api.HeldFile, f) for f in sample.files if f.held),
    )


def _log(view: TargetView) -> api.Log:
    """Which log is followed and why: configured, found from the server's process (how), or
    none (why not); the reading's fields follow once it has been sampled."""
    finding = view.log_finding
    if view.config.log is not None:
        found_by, not_found = "configured", None
    elif finding is None:
        found_by = None
        not_found = "no server process seen yet" if view.config.process else "no process matching"
    elif finding.config is None:
        found_by, not_found = None, finding.why
    else:
        found_by, not_found = finding.why, None
    logs = view.reading(LOGS)
    sample = logs.value if logs is not None else None
    if sample is None:
        return api.Log(None, found_by, not_found)
    reading = _mirror(
        api.LogReading, sample, weights_shards=sample.weights, lines=sample.lines_total
    )
    return api.Log(sample.source, found_by, not_found, reading)


def _storage(description: StorageDescription) -> api.Storage:
    """What holds the weights, what can be measured there (each fact with its reason), and the
    rule the load's cache label follows."""
    label = _mirror(
        api.CacheLabel,
        description,
        fixed=description.fixed_cache(),
        never_cold=description.in_memory,
    )
    return _mirror(api.Storage, description, cache_label=label)


def _discovered(found: DiscoveredServer) -> api.Discovered:
    return _mirror(
        api.Discovered,
        found,
        weights=tuple(clean(path, 4096) for path in found.weights),
        why=tuple(_mirror(api.Evidence, e) for e in found.evidence),
    )


def _state(state: LoadState) -> api.LoadState:
    return _mirror(
        api.LoadState,
        state,
        in_server=state.in_server or None,
        end_unseen=state.end_unseen or None,
        unloaded=clean(state.unloaded, 256) if state.unloaded else None,  # the server's words
    )


def _probes(view: TargetView, now: float, interval: float) -> api.Probes:
    alive, ready = liveness.alive(view, now, interval), liveness.ready(view)
    return api.Probes(alive.ok, alive.line, ready.ok, ready.line)


def _startup_probe(advice: StartupAdvice) -> api.StartupProbe:
    return _mirror(api.StartupProbe, advice)


def _target(
    snap: Snapshot, view: TargetView, disk: DiskSample | None, interval: float
) -> api.Target:
    name = view.name
    pagecache, files = view.reading(PAGECACHE), view.reading(WEIGHT_FILES)
    storage = view.value(STORAGE)
    unbacked = disk.unbacked_by_target.get(name, ()) if disk is not None else ()
    return api.Target(
        target=name,
        endpoint=view.config.endpoint.display_url,
        server=view.server,
        role=view.config.role,
        sources={
            source: _source_reading(view.readings[source], snap.time)
            for source in sorted(view.readings)
        },
        model=view.config.endpoint.model,
        state=_state(view.state) if view.state is not None else None,
        residency=(
            _residency(pagecache.value, snap.time)
            if pagecache is not None and pagecache.value is not None
            else None
        ),
        storage=_storage(storage) if storage is not None else None,
        gpu_memory=_gpu_memory(snap, view),
        gpu_pcie=_gpu_pcie(snap, view),
        expected_duration_seconds={str(cache): s for cache, s in view.past.expected.items()},
        last_duration_seconds=view.past.last,
        weight_files=(
            _weight_files(files.value) if files is not None and files.value is not None else None
        ),
        log=_log(view),
        discovered=_discovered(view.discovered) if view.discovered is not None else None,
        block_devices=disk.devices_by_target.get(name, ()) if disk is not None else None,
        lower_block_devices=(
            (disk.lower_devices_by_target.get(name) or None) if disk is not None else None
        ),
        unbacked_weight_paths=unbacked or None,
        unbacked_note=UNBACKED_NOTE if unbacked else None,
        restart_forecast=(
            _mirror(api.RestartForecast, view.forecast) if view.forecast is not None else None
        ),
        probes=_probes(view, snap.time, interval),
        startup_probe=(_startup_probe(view.past.advice) if view.past.advice is not None else None),
    )


def status_document(snap: Snapshot, sample_interval: float) -> api.Status:
    """/api/v1/status: one entry per target with its state and the evidence."""
    disk = snap.host_value(DISK)
    return api.Status(
        time=snap.time,
        version=snap.build["version"],
        sample_interval_seconds=sample_interval,
        targets=tuple(_target(snap, view, disk, sample_interval) for view in snap.targets),
        host_sources={
            source: _source_reading(snap.host[source], snap.time) for source in sorted(snap.host)
        },
        history=api.History(
            enabled=snap.history_enabled, up=snap.history_up, problem=snap.history_problem
        ),
    )
