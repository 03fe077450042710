"""Snapshot -> Prometheus metric families. The only module that knows metric names.

Built fresh on every scrape from an immutable snapshot (the node_exporter / client_python custom
collector pattern), so there are no long-lived gauges for threads to race on, and a series whose
number could not be measured is simply not emitted. The catalog below is the whole exposition:
every family is declared once, with its help and labels, and each source has one small function
that fills the families it feeds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.samples import BucketSpan, NativeHistogram

from exporter.history.histograms import (
    LOAD_BUCKETS,
    NATIVE_SCHEMA,
    NATIVE_ZERO_THRESHOLD,
    HistogramCounts,
)
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.sources import (
    ENDPOINT,
    MEMORY,
    NVML,
    PAGECACHE,
    PROCESS,
    SourceKey,
)
from exporter.sources.disk import DISK, DiskSample
from exporter.sources.endpoint import ProbeSample
from exporter.sources.gpu import GpuSample
from exporter.sources.memory import MemorySample
from exporter.sources.netfs import NETFS, NetFsSample
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.zfs import ZFS, ZfsSample
from exporter.trust.untrusted import clean
from exporter.vocabulary import Cache, Phase, ProbeResult, Step, StorageKind

NS = "model_load"
MAX_LABEL = 4096  # characters of one label value (a path at most PATH_MAX)
# Label values kept cleaned: a scrape of a few targets has a hundred or so (targets, sources,
# phases, devices), each cleaned at every scrape otherwise; at most 4 MiB of cleaned text.
LABELS_KEPT = 1024
T = TypeVar("T")


Family = GaugeMetricFamily | CounterMetricFamily | HistogramMetricFamily


@dataclass(frozen=True, eq=False)
class MetricSpec:
    """One metric family: type, name (without the namespace), help and label names.

    One object per family (the catalog's), so identity is its equality and hashing it is free:
    a scrape looks its families up by spec at every sample.
    """

    family: type[Family]
    name: str
    doc: str
    labels: tuple[str, ...] = ()

    def new(self) -> Metric:
        return self.family(f"{NS}_{self.name}", self.doc, labels=list(self.labels))

    @functools.cached_property
    def empty(self) -> Metric:
        """The family without samples, made once: most families of a scrape have none (no
        GPU, no network file system, no load in progress), and nothing adds to this one."""
        return self.new()


# Every family, in the order /metrics shows them: the order they are defined in below, each
# added as it is made (so a metric is named once, where it is defined).
CATALOG: list[MetricSpec] = []


def _spec(family: type[Family], name: str, doc: str, labels: tuple[str, ...]) -> MetricSpec:
    spec = MetricSpec(family, name, doc, labels)
    CATALOG.append(spec)
    return spec


def _gauge(name: str, doc: str, *labels: str) -> MetricSpec:
    return _spec(GaugeMetricFamily, name, doc, labels)


def _counter(name: str, doc: str, *labels: str) -> MetricSpec:
    """A counter, named as /metrics shows it and users query it: with its `_total` (the client
    library writes the suffix on the samples whether the name has it or not)."""
    return _spec(CounterMetricFamily, name, doc, labels)


def _histogram(name: str, doc: str, *labels: str) -> MetricSpec:
    return _spec(HistogramMetricFamily, name, doc, labels)


# Exporter and sources
BUILD_INFO = _gauge("exporter_build_info", "Build of the exporter.", "version", "python_version")
SOURCE_UP = _gauge("source_up", "1 if the last sample of the source succeeded.", "source", "target")
SOURCE_DURATION = _gauge(
    "source_duration_seconds", "Duration of the last sample of the source.", "source", "target"
)
RELOAD_OK = _gauge("config_last_reload_successful", "1 if the last config (re)load succeeded.")
HISTORY_UP = _gauge(
    "history_up", "1 when finished loads are kept in the history database (absent when off)."
)
# Host
DISK_READ = _counter(
    "disk_read_bytes_total", "Bytes read from block devices that back weight files.", "device"
)
DISK_RATE = _gauge(
    "disk_read_bytes_per_second", "Read throughput over the last sample interval.", "device"
)
DISCOVERY_REFUSED = _counter(
    "discovery_refused_total",
    "Processes, files and addresses discovery declined, by reason.",
    "reason",
)
NFS_READ = _counter(
    "nfs_read_bytes_total", "Bytes read from the NFS server, per mount.", "mount", "mountpoint"
)
NFS_RATE = _gauge(
    "nfs_read_bytes_per_second",
    "Bytes per second read from the NFS server over the last sample interval.",
    "mount",
    "mountpoint",
)
NFS_APPLICATION_READ = _counter(
    "nfs_application_read_bytes_total",
    "Bytes applications read from the NFS mount: buffered (page-cache hits included) or direct.",
    "mount",
    "mountpoint",
    "io",
)
LUSTRE_READ = _counter(
    "lustre_read_bytes_total",
    "Bytes read through the Lustre client (llite read_bytes, cache hits included), per mount.",
    "mount",
    "mountpoint",
)
LUSTRE_RATE = _gauge(
    "lustre_read_bytes_per_second",
    "Lustre client read throughput over the last sample interval.",
    "mount",
    "mountpoint",
)
CEPHFS_READ = _counter(
    "cephfs_read_bytes_total",
    "Bytes the CephFS kernel client read from the OSDs, per mount.",
    "mount",
    "mountpoint",
)
CEPHFS_RATE = _gauge(
    "cephfs_read_bytes_per_second",
    "CephFS client read throughput over the last sample interval.",
    "mount",
    "mountpoint",
)
ZFS_READ = _counter("zfs_read_bytes_total", "Bytes the ZFS pool read from its vdevs.", "pool")
ZFS_RATE = _gauge(
    "zfs_read_bytes_per_second", "ZFS pool read throughput over the last sample interval.", "pool"
)
ZFS_ARC_READS = _counter(
    "zfs_arc_demand_data_reads_total",
    "File-data reads the ZFS ARC served (hit) or not (miss), host-wide.",
    "result",
)
ZFS_ARC_HIT = _gauge(
    "zfs_arc_hit_ratio", "Share of the ARC's demand data reads it served over the last interval."
)
MEMORY_TOTAL = _gauge("host_memory_total_bytes", "MemTotal from /proc/meminfo.")
MEMORY_AVAILABLE = _gauge("host_memory_available_bytes", "MemAvailable from /proc/meminfo.")
PAGE_CACHE = _gauge("host_memory_page_cache_bytes", "Cached from /proc/meminfo.")
GPU_INFO = _gauge("gpu_info", "GPU identity from NVML.", "gpu", "uuid", "name", "driver_version")
GPU_USED = _gauge("gpu_memory_used_bytes", "GPU memory in use (NVML).", "gpu", "uuid")
GPU_TOTAL = _gauge("gpu_memory_total_bytes", "GPU memory size (NVML).", "gpu", "uuid")
GPU_PCIE_RX = _counter(
    "gpu_pcie_rx_bytes_total", "Bytes the GPU received over PCIe (NVML).", "gpu", "uuid"
)
# Per target: what the sources see
TARGET_INFO = _gauge(
    "target_info",
    "A watched model server: configured, or discovered from its command line.",
    "target",
    "endpoint",
    "model",
    "server",
    "discovered",
    "role",
)
WEIGHTS_BYTES = _gauge("weights_bytes", "Total size of the weight files.", "target")
WEIGHTS_FILES = _gauge("weights_files", "Number of weight files.", "target")
RESIDENT = _gauge(
    "weights_resident_bytes", "Bytes of the weight files in the page cache.", "target"
)
FILE_RESIDENT = _gauge(
    "weights_file_resident_bytes", "Bytes of one weight file in the page cache.", "target", "file"
)
ENDPOINT_UP = _gauge("endpoint_up", "1 when the last probe said ready.", "target")
PROBE_DURATION = _gauge(
    "endpoint_probe_duration_seconds", "Duration of the last endpoint probe.", "target"
)
PROBES = _counter("endpoint_probes_total", "Endpoint probes by result.", "target", "result")
PROCESS_UP = _gauge("process_up", "1 when the server process was found.", "target")
PROCESS_START = _gauge(
    "process_start_time_seconds", "Unix time the server process started.", "target"
)
PROCESS_READ = _counter(
    "process_read_bytes_total", "Storage bytes read by the server process tree.", "target"
)
PROCESS_GPU = _gauge(
    "process_gpu_memory_bytes", "GPU memory held by the server process tree.", "target", "gpu"
)
# Per target: the load
PHASE = _gauge("phase", "1 for the current load phase of the target.", "target", "phase")
STEP = _gauge("step", "1 for the fine step the server's log says it is in.", "target", "step")
CACHE_TEMPERATURE = _gauge(
    "cache_temperature",
    "1 for the cache temperature of the current (or last) load.",
    "target",
    "cache",
)
IN_PROGRESS = _gauge("in_progress", "1 while a load is in progress.", "target")
STARTED = _gauge("started_timestamp_seconds", "Start of the current or last load.", "target")
ELAPSED = _gauge("elapsed_seconds", "Seconds since the current load started.", "target")
PROGRESS = _gauge("weights_progress_ratio", "Share of the weights loaded, 0..1.", "target")
THROUGHPUT = _gauge(
    "weights_throughput_bytes_per_second", "Smoothed rate weights are arriving at.", "target"
)
WEIGHTS_ETA = _gauge(
    "weights_eta_seconds", "Estimated seconds until the weights are loaded.", "target"
)
ETA = _gauge("eta_seconds", "Estimated seconds until the target is ready.", "target")
SINCE_PROGRESS = _gauge(
    "seconds_since_progress", "Seconds since any progress signal moved.", "target"
)
STALLED = _gauge("stalled", "1 when in progress and nothing moved for stall_after.", "target")
UNLOADS = _counter(
    "unloads_total",
    "Models the running server unloaded (its log says so), since the exporter started.",
    "target",
)
EXPECTED = _gauge(
    "expected_duration_seconds", "Median duration of recent successful loads.", "target", "cache"
)
LAST_DURATION = _gauge("last_duration_seconds", "Duration of the last finished load.", "target")
LAST_SLOWER = _gauge(
    "last_load_slower_info",
    "1 when the last finished load was slower than expected; reason: its report's one line.",
    "target",
    "reason",
)
RESTART_FORECAST = _gauge(
    "restart_forecast_seconds",
    "How long a restart begun now would take to be ready (residency now, past rates and phases).",
    "target",
)
STARTUP_WINDOW = _gauge(
    "startup_probe_window_seconds",
    "The fixed startupProbe window (periodSeconds x failureThreshold) this target's cold loads"
    " need: their p99 with a margin; absent without a cold load in history.",
    "target",
)
LOAD_DURATION = _histogram(
    "duration_seconds", "Duration of finished loads.", "target", "cache", "outcome"
)
PHASE_DURATION = _histogram(
    "phase_duration_seconds", "Time spent in each phase of finished loads.", "target", "phase"
)


class Scrape:
    """The families of one scrape, each made on first use and yielded in catalog order."""

    def __init__(self, native: bool = False) -> None:
        self._families: dict[MetricSpec, Metric] = {}
        self.native = native  # histograms carry their native buckets too (protobuf only)

    def _family(self, spec: MetricSpec) -> Metric:
        if spec not in self._families:
            self._families[spec] = spec.new()
        return self._families[spec]

    def add(self, spec: MetricSpec, labels: Sequence[str], value: float | None) -> None:
        """One sample; a value that could not be measured (None) is left out."""
        if value is not None:
            self._family(spec).add_metric([_label(v) for v in labels], value)  # type: ignore[attr-defined]

    def histogram(
        self, spec: MetricSpec, labels: Sequence[str], counts: HistogramCounts, buckets: bool = True
    ) -> None:
        """One histogram; without `buckets` only its +Inf bucket, _count and _sum (3 series
        instead of 23: rates and means still work, quantiles need the buckets)."""
        bounds = zip(LOAD_BUCKETS, counts.cumulative, strict=True) if buckets else ()
        series = [(f"{float(le)}", c) for le, c in bounds]
        series.append(("+Inf", counts.count))
        family = self._family(spec)
        values = [_label(v) for v in labels]
        family.add_metric(values, series, counts.sum)  # type: ignore[attr-defined]
        if self.native:
            family.add_sample(family.name, dict(zip(spec.labels, values, strict=True)),
                              counts.count, native_histogram=_native(counts))  # fmt: skip

    def families(self) -> Iterator[Metric]:
        for spec in CATALOG:
            yield self._families.get(spec) or spec.empty


def _native(counts: HistogramCounts) -> NativeHistogram:
    """The native buckets as spans of consecutive indexes and each count's delta to the last."""
    spans: list[BucketSpan] = []
    deltas: list[int] = []
    last_index, last_count = None, 0
    for index, count in counts.native:
        if last_index is None or index != last_index + 1:
            gap = index if last_index is None else index - last_index - 1
            spans.append(BucketSpan(gap, 0))
        spans[-1] = BucketSpan(spans[-1].offset, spans[-1].length + 1)
        deltas.append(count - last_count)
        last_index, last_count = index, count
    return NativeHistogram(
        counts.count, counts.sum, NATIVE_SCHEMA, NATIVE_ZERO_THRESHOLD, counts.native_zero,
        pos_spans=spans, pos_deltas=deltas,
    )  # fmt: skip


@functools.lru_cache(maxsize=LABELS_KEPT)
def _label(value: str) -> str:
    """A label value as it may leave: the exporter's second exit for text (the documents'
    `to_json` is the first; exporter/trust/untrusted.py says why), so a mount point, a file or a
    model name with an escape, a bidi override or a byte that is not UTF-8 encodes and shows as
    text."""
    return clean(value, limit=MAX_LABEL)


# -- one function per source -------------------------------------------------------------------


def _disk(out: Scrape, disk: DiskSample) -> None:
    for dev in disk.devices:
        out.add(DISK_READ, [dev.device], dev.read_bytes_total)
        out.add(DISK_RATE, [dev.device], dev.read_bytes_per_second)


_NETFS_FAMILIES = {
    StorageKind.NFS: (NFS_READ, NFS_RATE),
    StorageKind.LUSTRE: (LUSTRE_READ, LUSTRE_RATE),
    StorageKind.CEPHFS: (CEPHFS_READ, CEPHFS_RATE),
}


def _netfs(out: Scrape, netfs: NetFsSample) -> None:
    for mount in netfs.mounts:
        total, rate = _NETFS_FAMILIES[mount.kind]
        labels = [mount.mount, mount.mountpoint]
        out.add(total, labels, mount.read_bytes_total)
        out.add(rate, labels, mount.read_bytes_per_second)
        out.add(NFS_APPLICATION_READ, [*labels, "buffered"], mount.buffered_read_bytes_total)
        out.add(NFS_APPLICATION_READ, [*labels, "direct"], mount.direct_read_bytes_total)


def _zfs(out: Scrape, zfs: ZfsSample) -> None:
    for pool in zfs.pools:
        out.add(ZFS_READ, [pool.pool], pool.read_bytes_total)
        out.add(ZFS_RATE, [pool.pool], pool.read_bytes_per_second)
    if zfs.arc is not None:
        out.add(ZFS_ARC_READS, ["hit"], zfs.arc.hits_total)
        out.add(ZFS_ARC_READS, ["miss"], zfs.arc.misses_total)
        out.add(ZFS_ARC_HIT, [], zfs.arc.hit_ratio)


def _memory(out: Scrape, memory: MemorySample) -> None:
    out.add(MEMORY_TOTAL, [], memory.total_bytes)
    out.add(MEMORY_AVAILABLE, [], memory.available_bytes)
    out.add(PAGE_CACHE, [], memory.page_cache_bytes)


def _nvml(out: Scrape, gpu: GpuSample) -> None:
    for dev in gpu.devices:
        index = str(dev.index)
        out.add(GPU_INFO, [index, dev.uuid, dev.name, gpu.driver_version], 1)
        out.add(GPU_USED, [index, dev.uuid], dev.memory_used_bytes)
        out.add(GPU_TOTAL, [index, dev.uuid], dev.memory_total_bytes)
        out.add(GPU_PCIE_RX, [index, dev.uuid], dev.pcie_rx_bytes)


def _endpoint(out: Scrape, target: str, probe: ProbeSample) -> None:
    out.add(ENDPOINT_UP, [target], 1 if probe.result == ProbeResult.READY else 0)
    out.add(PROBE_DURATION, [target], probe.duration_seconds)
    for result in ProbeResult:
        out.add(PROBES, [target, result], probe.totals.get(result, 0))


def _process(out: Scrape, target: str, process: ProcessSample) -> None:
    out.add(PROCESS_UP, [target], 1 if process.found else 0)
    out.add(PROCESS_START, [target], process.start_time)
    out.add(PROCESS_READ, [target], process.read_bytes)


def _pagecache(out: Scrape, target: str, residency: ResidencySample) -> None:
    """Size and count even when residency is unknown: they are still measured then."""
    out.add(WEIGHTS_BYTES, [target], residency.total_bytes)
    out.add(WEIGHTS_FILES, [target], residency.files)
    if residency.resident_bytes is not None:
        out.add(RESIDENT, [target], residency.resident_bytes)
        for f in residency.per_file:
            out.add(FILE_RESIDENT, [target, f.path], f.resident_bytes)


HostFn = Callable[[Scrape, Snapshot], None]
TargetFn = Callable[[Scrape, TargetView], None]


def _host(key: SourceKey[T], fn: Callable[[Scrape, T], None]) -> HostFn:
    def collect(out: Scrape, snap: Snapshot) -> None:
        reading = snap.host_reading(key)
        if reading is not None and reading.value is not None:
            fn(out, reading.value)

    return collect


def _per_target(key: SourceKey[T], fn: Callable[[Scrape, str, T], None]) -> TargetFn:
    def collect(out: Scrape, view: TargetView) -> None:
        reading = view.reading(key)
        if reading is not None and reading.value is not None:
            fn(out, view.name, reading.value)

    return collect


# -- what is not a source: the exporter itself, the target, its load, history ------------------


def _exporter(out: Scrape, snap: Snapshot) -> None:
    out.add(BUILD_INFO, [snap.build["version"], snap.build["python_version"]], 1)
    for reading in snap.readings():
        out.add(SOURCE_UP, [reading.source, reading.target], 1 if reading.ok else 0)
        out.add(SOURCE_DURATION, [reading.source, reading.target], reading.duration_seconds)
    out.add(RELOAD_OK, [], 1 if snap.config_reload_successful else 0)
    for reason, count in (snap.discovery_refused or {}).items():
        out.add(DISCOVERY_REFUSED, [reason], count)
    if snap.history_up is not None:
        out.add(HISTORY_UP, [], 1 if snap.history_up else 0)


def _target_info(out: Scrape, view: TargetView) -> None:
    endpoint = view.config.endpoint
    discovered = "true" if view.discovered is not None else "false"
    # Credentials in the URL are the probe's, never a label's.
    labels = [
        view.name, endpoint.display_url, endpoint.model or "", view.server, discovered,
        view.config.role,
    ]  # fmt: skip
    out.add(TARGET_INFO, labels, 1)


def _gpu_memory(out: Scrape, view: TargetView) -> None:
    for index, used in sorted(view.gpu_memory.items()):
        out.add(PROCESS_GPU, [view.name, str(index)], used)


def _load(out: Scrape, view: TargetView) -> None:
    state, name = view.state, view.name
    if state is None:
        return
    for phase in Phase:
        out.add(PHASE, [name, phase], 1 if state.phase == phase else 0)
    if state.step is not None:  # only targets whose log is read
        for step in Step:
            out.add(STEP, [name, step], 1 if state.step == step else 0)
    if state.started_at is not None:  # no temperature before a target's first load
        temperature = state.cache or Cache.UNKNOWN
        for cache in Cache:
            out.add(CACHE_TEMPERATURE, [name, cache], 1 if temperature == cache else 0)
    out.add(IN_PROGRESS, [name], 1 if state.in_progress else 0)
    out.add(STARTED, [name], state.started_at)
    out.add(ELAPSED, [name], state.elapsed_seconds)
    out.add(PROGRESS, [name], state.progress_ratio)
    out.add(THROUGHPUT, [name], state.throughput_bytes_per_second)
    out.add(WEIGHTS_ETA, [name], state.weights_eta_seconds)
    out.add(ETA, [name], state.eta_seconds)
    out.add(SINCE_PROGRESS, [name], state.seconds_since_progress)
    out.add(STALLED, [name], 1 if state.stalled else 0)
    out.add(UNLOADS, [name], state.unloads)  # absent for a server that never loaded in place


def _history(out: Scrape, snap: Snapshot) -> None:
    """What each target's past loads say (view.past), by target name."""
    views = sorted(snap.targets, key=lambda v: v.name)
    for view in views:
        for cache, seconds in sorted(view.past.expected.items()):
            out.add(EXPECTED, [view.name, cache], seconds)
    for view in views:
        out.add(LAST_DURATION, [view.name], view.past.last)
    for view in views:
        if view.past.slower is not None:
            out.add(LAST_SLOWER, [view.name, view.past.slower], 1)
    for view in snap.targets:
        if view.forecast is not None:
            out.add(RESTART_FORECAST, [view.name], view.forecast.seconds)
        if view.past.advice is not None:
            out.add(STARTUP_WINDOW, [view.name], view.past.advice.window_seconds)
    for labels, counts in sorted(snap.load_durations.items()):
        out.histogram(LOAD_DURATION, labels, counts)
    for labels, counts in sorted(snap.phase_durations.items()):
        out.histogram(PHASE_DURATION, labels, counts, buckets=snap.metrics.phase_buckets)


HOST: tuple[HostFn, ...] = (
    _host(DISK, _disk),
    _host(NETFS, _netfs),
    _host(ZFS, _zfs),
    _host(MEMORY, _memory),
    _host(NVML, _nvml),
)
TARGET: tuple[TargetFn, ...] = (
    _target_info,
    _per_target(PAGECACHE, _pagecache),
    _per_target(ENDPOINT, _endpoint),
    _per_target(PROCESS, _process),
    _gpu_memory,
    _load,
)


class ExporterCollector(Collector):
    """A prometheus_client collector over a snapshot function."""

    def __init__(self, snapshot: Callable[[], Snapshot], native: bool = False) -> None:
        self._snapshot = snapshot
        self._native = native  # for the protobuf format: histograms with native buckets

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        out = Scrape(native=self._native)
        _exporter(out, snap)
        for host_fn in HOST:
            host_fn(out, snap)
        for view in snap.targets:
            for target_fn in TARGET:
                target_fn(out, view)
        _history(out, snap)
        yield from out.families()
