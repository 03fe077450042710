"""What one tick sees of a target: its sources' latest readings turned into the tracker's
`Observation`, and which readings are news that the tick must see at once.

The Observation is the load model's (exporter/load/observation.py, defined in plain values beside
the tracker that reads it); building one needs the sources' sample types, so it is built here, in
the runtime that holds the readings.

Pure functions of plain values, so what a tick sees is tested as the tracker is, without threads,
a sampler or a runtime (tests/test_observation.py); exporter/runtime/wiring.py gathers the readings
and acts on the answers.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

from exporter.history.explain import Counters
from exporter.load.observation import FileView, Observation
from exporter.load.records import LoadState
from exporter.runtime.sampler import Reading
from exporter.sources.disk import DiskSample
from exporter.sources.endpoint import ProbeSample
from exporter.sources.gpu import GpuSample, process_gpu_memory
from exporter.sources.logs import LogSample, new_events
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.storage import StorageDescription
from exporter.sources.weightfiles import WeightFilesSample
from exporter.vocabulary import Cache, ProbeResult


@dataclass(frozen=True)
class TargetReadings:
    """The latest readings of one target's sources as a tick found them (None: no reading yet,
    or the target has no such source)."""

    name: str
    gpus: Literal["auto"] | tuple[int, ...]  # the GPUs configured, or found from its tree
    process_configured: bool  # False: endpoint-only semantics
    probe: Reading[ProbeSample] | None
    process: ProcessSample | None  # the latest good sample
    pagecache: Reading[ResidencySample] | None
    logs: Reading[LogSample] | None
    log_followed: bool  # a log is followed (its first reading may not have come yet)
    files: Reading[WeightFilesSample] | None  # the weight-file view; None until its first look
    gpu: GpuSample | None
    disk: DiskSample | None
    storage: StorageDescription | None
    log_seq: int  # the last log event already handed to the tracker


@dataclass(frozen=True)
class Seen:
    """A tick's observation of one target, the GPU memory its tree holds per GPU, and the last
    log event handed over with it."""

    observation: Observation
    gpu_memory: dict[int, int]
    log_seq: int


def observe(readings: TargetReadings, now: float) -> Seen:
    """The tracker's observation of one target at `now`."""
    probe, process, logs = readings.probe, readings.process, readings.logs
    # Taken even when residency is unknown: the weights' size is still measured then.
    residency = readings.pagecache.value if readings.pagecache is not None else None
    # Events even from a log that is down now (journalctl died after writing them).
    log_sample = logs.value if logs is not None else None
    events = new_events(log_sample, readings.log_seq) if log_sample is not None else ()
    files = readings.files.good if readings.files is not None else None
    probe_value = probe.good if probe is not None else None
    gpu_memory: dict[int, int] = {}
    if readings.gpu is not None and process is not None and process.found:
        gpu_memory = process_gpu_memory(readings.gpu, process.pids, readings.gpus)
    gpus = gpu_memory if readings.gpus == "auto" else readings.gpus
    disk = readings.disk
    observation = Observation(
        time=now,
        endpoint_result=probe_value.result if probe_value is not None else None,
        # A reading stamped before the wall clock stepped back must not look like the future.
        endpoint_probe_time=min(probe.finished_at, now) if probe is not None else None,
        endpoint_probe_sent=(
            min(probe.finished_at - probe.duration_seconds, now) if probe is not None else None
        ),
        process_configured=readings.process_configured,
        process_found=bool(process and process.found),
        process_pid=process.root_pid if process else None,
        process_start_time=process.start_time if process else None,
        process_read_bytes=process.read_bytes if process else None,
        process_read_chars=process.read_chars if process else None,
        process_gpu_bytes=sum(gpu_memory.values()) if gpu_memory else None,
        weights_bytes=residency.total_bytes if residency else None,
        resident_bytes=residency.resident_bytes if residency else None,
        resident_measured_at=min(residency.measured_at, now) if residency else None,
        disk_read_bytes=disk.read_bytes_of(readings.name) if disk is not None else None,
        log_events=events,
        log_lines=log_sample.activity if log_sample is not None else None,
        log_read_at=min(logs.finished_at, now) if logs is not None else None,
        log_followed=readings.log_followed,
        files=file_view(files, process, readings.files is not None),
        gpu_rx_bytes=tree_rx(readings.gpu, gpus),
        storage_cache=storage_cache(readings.storage),
        process_cpu_seconds=process.cpu_seconds if process else None,
        process_state=process.state if process else None,
    )
    log_seq = log_sample.last_seq if log_sample is not None else readings.log_seq
    return Seen(observation, gpu_memory, log_seq)


def file_view(
    files: WeightFilesSample | None, process: ProcessSample | None, looked: bool = True
) -> FileView | None:
    """The weight files as the tracker sees them, None where they cannot be seen (the tracker
    then falls back on the tree's counters). A process the file view has not looked at yet (a
    target just discovered, a new process) holds nothing known: its imports must not read as
    weights while the view catches up, so the view is `pending` rather than absent."""
    if process is None or not process.found:
        return None
    if files is None and not looked:
        return FileView(None, False, None, 0, 0, 0, pending=True)
    if files is None or not files.visible:
        return None
    if files.root_pid != process.root_pid:
        return FileView(None, False, None, 0, 0, files.total_bytes, pending=True)
    return FileView(
        first_open_at=files.first_open_at,
        first_open_seen=files.first_open_seen,
        idle_since=files.idle_since,
        consumed_bytes=files.consumed_bytes,
        seen_bytes=files.seen_bytes,
        total_bytes=files.total_bytes,
        direct=any(f.direct for f in files.files),
    )


def tree_rx(gpu: GpuSample | None, gpus: Collection[int]) -> int | None:
    """PCIe bytes received so far by the GPUs the tree uses, summed; None unless every one of
    them has the counter (a part would read as the whole)."""
    if gpu is None or not gpus:
        return None
    counters = [d.pcie_rx_bytes for d in gpu.devices if d.index in gpus]
    if len(counters) != len(gpus) or None in counters:
        return None
    return sum(c for c in counters if c is not None)


def storage_cache(storage: StorageDescription | None) -> Cache | None:
    """The cache label the storage decides, if it does (in memory by construction: warm)."""
    if storage is None:
        return None
    fixed = storage.fixed_cache()
    return fixed if fixed is not None else Cache.WARM if storage.in_memory else None


class ReadCounters(Protocol):
    """A host-wide sample of read counters (block devices, network mounts, ZFS pools)."""

    def read_bytes_of(self, target: str) -> int | None: ...

    def counters_of(self, target: str) -> Mapping[tuple[str, str], int]: ...


def bytes_read_under(name: str, samples: Iterable[ReadCounters | None]) -> int | None:
    """Bytes read so far under a target's weights, from every counter that sees them
    (block devices, network mounts, ZFS pools); None where none does (tmpfs, FUSE)."""
    counts = [sample.read_bytes_of(name) for sample in samples if sample is not None]
    known = [count for count in counts if count is not None]
    return sum(known) if known else None


@dataclass(frozen=True)
class Marked:
    """Read counters, and when the oldest of the readings they come from was taken."""

    counters: Counters
    at: float


def read_counters(name: str, readings: Iterable[Reading[ReadCounters] | None]) -> Marked | None:
    """The read counter of each device, network mount and ZFS pool under a target's weights,
    with the time of the oldest reading they come from; None before any reading."""
    counters: dict[tuple[str, str], int] = {}
    times = []
    for reading in readings:
        if reading is not None and reading.good is not None:
            counters.update(reading.good.counters_of(name))
            times.append(reading.finished_at)
    return Marked(counters, min(times)) if times else None


def counters_before(seen: Iterable[Marked], state: LoadState) -> Counters | None:
    """The last counters read before a load's start; None when none was (the exporter started
    after it, or the counters were read too seldom to hold one from before it)."""
    start = state.started_at
    before = [marked for marked in seen if start is not None and marked.at <= start]
    return before[-1].counters if before else None


# -- news: readings the tracker acts on, so the tick runs now, not up to an interval later --

# A weight file's first open, the last let-go and whether every byte was consumed.
FilesNews = tuple[float | None, float | None, bool]


def files_news(files: WeightFilesSample) -> FilesNews:
    """What of the weight-file view moves the phase: a weight file first opened, every one let
    go, or every byte consumed (an mmap loader keeps its map). A change is news."""
    consumed = 0 < files.total_bytes <= files.consumed_bytes
    return (files.first_open_at, files.idle_since, consumed)


def probe_is_news(result: ProbeResult | None, last: ProbeResult | None, in_progress: bool) -> bool:
    """Whether a probe's answer matters now: the first ready answer of a load in progress ends it
    at that answer; between loads, every failed answer (each counts towards a hung server or an
    endpoint-only load) and the first good one after them."""
    ready = result is ProbeResult.READY
    return ready if in_progress else result != last or not ready


def log_is_news(
    sample: LogSample | None, log_seq: int, in_progress: bool, last: ProbeResult | None
) -> bool:
    """Whether a read of the log matters now: a load that answered ready waits for a read of the
    log after the answer (it dates a short load's phases); between loads, a line may begin a
    load inside the running server, or say it unloaded a model."""
    if in_progress:
        return last is ProbeResult.READY
    return sample is not None and sample.last_seq > log_seq
