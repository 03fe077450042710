"""Snapshot -> Prometheus metric families. The only module that knows metric names.

Built fresh on every scrape from an immutable snapshot (the node_exporter / client_python custom
collector pattern), so there are no long-lived gauges for threads to race on, and a series whose
number could not be measured is simply not emitted.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from exporter.app import Snapshot
from exporter.loadstats import LOAD_BUCKETS, HistogramCounts
from exporter.sources.disk import DiskSample
from exporter.sources.endpoint import ProbeResult, ProbeSample
from exporter.sources.gpu import GpuSample
from exporter.sources.memory import MemorySample
from exporter.sources.pagecache import ResidencySample
from exporter.sources.process import ProcessSample
from exporter.tracker import PHASES

NS = "model_load"


def _gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{NS}_{name}", doc, labels=list(labels))


def _histogram(
    name: str, doc: str, labels: tuple[str, ...], data: Mapping[tuple[str, ...], HistogramCounts]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(f"{NS}_{name}", doc, labels=list(labels))
    for values, counts in sorted(data.items()):
        buckets = [(_bound(le), c) for le, c in zip(LOAD_BUCKETS, counts.cumulative, strict=True)]
        buckets.append(("+Inf", counts.count))
        family.add_metric(list(values), buckets, counts.sum)
    return family


def _bound(value: float) -> str:
    return f"{float(value)}"


class ExporterCollector(Collector):
    """A prometheus_client collector over `snapshot()`."""

    def __init__(self, snapshot: Callable[[], Snapshot]) -> None:
        self._snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        yield from self._exporter(snap)
        yield from self._host(snap)
        yield from self._targets(snap)
        yield from self._loads(snap)

    def _exporter(self, snap: Snapshot) -> Iterator[Metric]:
        build = _gauge(
            "exporter_build_info", "Build of the exporter.", ("version", "python_version")
        )
        build.add_metric([snap.build["version"], snap.build["python_version"]], 1)
        yield build
        up = _gauge(
            "source_up", "1 if the last sample of the source succeeded.", ("source", "target")
        )
        duration = _gauge(
            "source_duration_seconds",
            "Duration of the last sample of the source.",
            ("source", "target"),
        )
        for (source, target), reading in sorted(snap.readings.items()):
            up.add_metric([source, target], 1 if reading.ok else 0)
            duration.add_metric([source, target], reading.duration_seconds)
        yield up
        yield duration
        reload_ok = _gauge(
            "config_last_reload_successful", "1 if the last config (re)load succeeded."
        )
        reload_ok.add_metric([], 1 if snap.config_reload_successful else 0)
        yield reload_ok

    def _host(self, snap: Snapshot) -> Iterator[Metric]:
        disk = snap.value("disk")
        if isinstance(disk, DiskSample):
            total = CounterMetricFamily(
                f"{NS}_disk_read_bytes",
                "Bytes read from block devices that back weight files.",
                labels=["device"],
            )
            rate = _gauge(
                "disk_read_bytes_per_second",
                "Read throughput over the last sample interval.",
                ("device",),
            )
            for dev in disk.devices:
                total.add_metric([dev.device], dev.read_bytes_total)
                if dev.read_bytes_per_second is not None:
                    rate.add_metric([dev.device], dev.read_bytes_per_second)
            yield total
            yield rate
        memory = snap.value("memory")
        if isinstance(memory, MemorySample):
            for suffix, value, doc in (
                ("total_bytes", memory.total_bytes, "MemTotal from /proc/meminfo."),
                ("available_bytes", memory.available_bytes, "MemAvailable from /proc/meminfo."),
                ("page_cache_bytes", memory.page_cache_bytes, "Cached from /proc/meminfo."),
            ):
                gauge = _gauge(f"host_memory_{suffix}", doc)
                gauge.add_metric([], value)
                yield gauge
        gpu = snap.value("nvml")
        if isinstance(gpu, GpuSample):
            yield from self._gpus(gpu)

    @staticmethod
    def _gpus(gpu: GpuSample) -> Iterator[Metric]:
        info = _gauge(
            "gpu_info", "GPU identity from NVML.", ("gpu", "uuid", "name", "driver_version")
        )
        used = _gauge("gpu_memory_used_bytes", "GPU memory in use (NVML).", ("gpu", "uuid"))
        total = _gauge("gpu_memory_total_bytes", "GPU memory size (NVML).", ("gpu", "uuid"))
        for dev in gpu.devices:
            index = str(dev.index)
            info.add_metric([index, dev.uuid, dev.name, gpu.driver_version], 1)
            if dev.memory_used_bytes is not None:
                used.add_metric([index, dev.uuid], dev.memory_used_bytes)
            if dev.memory_total_bytes is not None:
                total.add_metric([index, dev.uuid], dev.memory_total_bytes)
        yield info
        yield used
        yield total

    def _targets(self, snap: Snapshot) -> Iterator[Metric]:
        t = ("target",)
        info = _gauge(
            "target_info", "Configured target.", ("target", "endpoint", "model", "server")
        )
        weights_bytes = _gauge("weights_bytes", "Total size of the weight files.", t)
        weights_files = _gauge("weights_files", "Number of weight files.", t)
        resident = _gauge(
            "weights_resident_bytes", "Bytes of the weight files in the page cache.", t
        )
        file_resident = _gauge(
            "weights_file_resident_bytes",
            "Bytes of one weight file in the page cache.",
            ("target", "file"),
        )
        endpoint_up = _gauge("endpoint_up", "1 when the last probe said ready.", t)
        probe_duration = _gauge(
            "endpoint_probe_duration_seconds", "Duration of the last endpoint probe.", t
        )
        probes = CounterMetricFamily(
            f"{NS}_endpoint_probes", "Endpoint probes by result.", labels=["target", "result"]
        )
        process_up = _gauge("process_up", "1 when the server process was found.", t)
        process_start = _gauge(
            "process_start_time_seconds", "Unix time the server process started.", t
        )
        process_read = CounterMetricFamily(
            f"{NS}_process_read_bytes",
            "Storage bytes read by the server process tree.",
            labels=["target"],
        )
        process_gpu = _gauge(
            "process_gpu_memory_bytes",
            "GPU memory held by the server process tree.",
            ("target", "gpu"),
        )
        for target in snap.config.targets:
            name = target.name
            info.add_metric(
                [name, target.endpoint.url, target.endpoint.model or "", snap.servers[name]], 1
            )
            residency = snap.reading("pagecache", name)
            if residency is not None and isinstance(residency.value, ResidencySample):
                sample = residency.value
                weights_bytes.add_metric([name], sample.total_bytes)
                weights_files.add_metric([name], sample.files)
                if sample.resident_bytes is not None:
                    resident.add_metric([name], sample.resident_bytes)
                    for f in sample.per_file:
                        file_resident.add_metric([name, f.path], f.resident_bytes)
            probe = snap.value("endpoint", name)
            if isinstance(probe, ProbeSample):
                endpoint_up.add_metric([name], 1 if probe.result == ProbeResult.READY else 0)
                probe_duration.add_metric([name], probe.duration_seconds)
            counts = snap.probe_counts.get(name, {})
            for result in ProbeResult:
                probes.add_metric([name, str(result)], counts.get(str(result), 0))
            process = snap.value("process", name)
            if isinstance(process, ProcessSample):
                process_up.add_metric([name], 1 if process.found else 0)
                if process.start_time is not None:
                    process_start.add_metric([name], process.start_time)
                if process.read_bytes is not None:
                    process_read.add_metric([name], process.read_bytes)
            for index, used in sorted(snap.process_gpu_bytes.get(name, {}).items()):
                process_gpu.add_metric([name, str(index)], used)
        yield from (info, weights_bytes, weights_files, resident, file_resident)
        yield from (endpoint_up, probe_duration, probes)
        yield from (process_up, process_start, process_read, process_gpu)

    def _loads(self, snap: Snapshot) -> Iterator[Metric]:
        t = ("target",)
        phase = _gauge("phase", "1 for the current load phase of the target.", ("target", "phase"))
        in_progress = _gauge("in_progress", "1 while a load is in progress.", t)
        started = _gauge("started_timestamp_seconds", "Start of the current or last load.", t)
        elapsed = _gauge("elapsed_seconds", "Seconds since the current load started.", t)
        progress = _gauge("weights_progress_ratio", "Share of the weights loaded, 0..1.", t)
        throughput = _gauge(
            "weights_throughput_bytes_per_second", "Smoothed rate weights are arriving at.", t
        )
        weights_eta = _gauge(
            "weights_eta_seconds", "Estimated seconds until the weights are loaded.", t
        )
        eta = _gauge("eta_seconds", "Estimated seconds until the target is ready.", t)
        since = _gauge("seconds_since_progress", "Seconds since any progress signal moved.", t)
        stalled = _gauge("stalled", "1 when in progress and nothing moved for stall_after.", t)
        expected = _gauge(
            "expected_duration_seconds",
            "Median duration of recent successful loads.",
            ("target", "cache"),
        )
        last = _gauge("last_duration_seconds", "Duration of the last finished load.", t)
        for name, state in sorted(snap.states.items()):
            for p in PHASES:
                phase.add_metric([name, p], 1 if state.phase == p else 0)
            in_progress.add_metric([name], 1 if state.in_progress else 0)
            if state.started_at is not None:
                started.add_metric([name], state.started_at)
            elapsed.add_metric([name], state.elapsed_seconds)
            for family, value in (
                (progress, state.progress_ratio),
                (throughput, state.throughput_bytes_per_second),
                (weights_eta, state.weights_eta_seconds),
                (eta, state.eta_seconds),
                (since, state.seconds_since_progress),
            ):
                if value is not None:
                    family.add_metric([name], value)
            stalled.add_metric([name], 1 if state.stalled else 0)
        for (name, cache), seconds in sorted(snap.expected_durations.items()):
            expected.add_metric([name, cache], seconds)
        for name, seconds in sorted(snap.last_durations.items()):
            last.add_metric([name], seconds)
        yield from (phase, in_progress, started, elapsed, progress, throughput, weights_eta, eta)
        yield from (since, stalled, expected, last)
        yield _histogram(
            "duration_seconds",
            "Duration of finished loads.",
            ("target", "cache", "outcome"),
            snap.load_durations,
        )
        yield _histogram(
            "phase_duration_seconds",
            "Time spent in each phase of finished loads.",
            ("target", "phase"),
            snap.phase_durations,
        )
