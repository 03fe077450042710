"""The whole /metrics exposition and /api/v1/status, pinned: a snapshot built by hand, compared
with golden files.

The dashboard, the alert rules and every user's queries depend on the metric names, and the live
page and scripts on the status document's keys, so a rename must show up as a diff in review
(node_exporter's e2e-output.txt does the same). Regenerate after an intended change with
`UPDATE_GOLDEN=1 pytest tests/test_exposition.py`.

Every family of the catalog has samples here or in tests/fixtures/e2e-output.prom, the runtime's
own exposition over a fixture host (tests/test_e2e_golden.py): a source that host exercises
needs nothing in this snapshot.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
from pathlib import Path
from typing import Any, TypeVar

import prometheus_client.exposition
import pytest
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from exporter.config.reader import parse_config
from exporter.config.schema import LogConfig, MetricsConfig
from exporter.discovery.found import DiscoveredServer
from exporter.discovery.refusals import REASONS
from exporter.discovery.serverargs import Evidence
from exporter.exposition.api_build import status_document
from exporter.exposition.collector import CATALOG, ExporterCollector
from exporter.exposition.http.metricspage import FORMATS_KEPT, MetricsPage
from exporter.history.forecast import Forecast
from exporter.history.histograms import Histograms
from exporter.history.pastloads import PastLoads
from exporter.history.startupwindow import StartupAdvice
from exporter.load.records import LoadRecord, LoadState
from exporter.load.report import LoadReport, PhaseTime, ReadRate, StorageRead
from exporter.logs.find import LogFinding
from exporter.runtime.sampler import Reading
from exporter.runtime.snapshot import Snapshot, TargetView
from exporter.sources import (
    ENDPOINT,
    LOGS,
    MEMORY,
    NVML,
    PAGECACHE,
    PROCESS,
    STORAGE,
    WEIGHT_FILES,
    SourceKey,
)
from exporter.sources.disk import DISK, DeviceReads, DiskSample
from exporter.sources.endpoint import ProbeSample
from exporter.sources.gpu import GpuDevice, GpuProcess, GpuSample, PcieMark
from exporter.sources.logs import LogSample
from exporter.sources.memory import MemorySample
from exporter.sources.netfs import NETFS, MountReads, NetFsSample
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.storage import Fact, MountStorage, StorageDescription
from exporter.sources.weightfiles import FileUse, WeightFilesSample
from exporter.sources.zfs import ZFS, ArcReads, PoolReads, ZfsSample
from exporter.storage.pagecache import FileResidency
from exporter.vocabulary import (
    Cache,
    Outcome,
    Phase,
    ProbeKind,
    ProbeResult,
    ServerKind,
    Step,
    StorageKind,
)

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).with_name("fixtures") / "metrics.prom"
E2E_GOLDEN = GOLDEN.with_name("e2e-output.prom")  # tests/test_e2e_golden.py's, of a fixture host
STATUS_GOLDEN = GOLDEN.with_name("status.json")
DESIGN_METRICS = ROOT / "tests" / "fixtures" / "design-metrics.txt"
GIB = 1 << 30
NOW = 1_764_489_600.0
T = TypeVar("T")


def reading(key: SourceKey[T], value: T, target: str = "", ok: bool = True) -> Reading[T]:
    return Reading(key.name, target, value, ok, None if ok else "down", 0.0125, NOW - 0.5)


def state(target: str, phase: Phase, **fields: Any) -> LoadState:
    base: dict[str, Any] = {
        "target": target,
        "phase": phase,
        "in_progress": phase.in_progress,
        "started_at": None,
        "elapsed_seconds": 0.0,
        "progress_ratio": None,
        "throughput_bytes_per_second": None,
        "weights_eta_seconds": None,
        "eta_seconds": None,
        "seconds_since_progress": None,
        "stalled": False,
        "cache": None,
        "partial": False,
        "seen_late": False,
        "progress_source": None,
        "signals": {},
        "last_record": None,
        "step": None,
        "fatal": None,
    }
    return LoadState(**(base | fields))


def golden_snapshot() -> Snapshot:
    """Two targets, one loading cold from storage and one ready, on a host with two GPUs."""
    config = parse_config(
        {
            "targets": [
                # Credentials in the URL are the probe's: the label shows them redacted.
                {
                    "name": "kimi-k2",
                    "endpoint": {"url": "http://probe:s3cret@127.0.0.1:30001", "model": "kimi"},
                },
                {"name": "qwen", "endpoint": {"url": "http://127.0.0.1:8000", "probe": "health"}},
            ]
        }
    )
    kimi, qwen = config.targets
    disk = DiskSample(
        devices=(DeviceReads("nvme0n1", 412 * GIB, 240e6), DeviceReads("vda", 3 * GIB, None)),
        devices_by_target={"kimi-k2": ("nvme0n1",), "qwen": ("vda",)},
        unbacked_by_target={"kimi-k2": (), "qwen": ()},
    )
    # Weights elsewhere on the same host: an NFS export, a Lustre and a CephFS mount, a ZFS pool.
    nfs = MountReads(StorageKind.NFS, "10.0.0.5:/models", "/mnt/models", 80 * GIB, 1.1e9,
                     buffered_read_bytes_total=79 * GIB, direct_read_bytes_total=GIB)  # fmt: skip
    ceph = "admin@6f0d2d5e-1b7c-4b0e-9c51-3f1f0e3a1b2c.cephfs=/"
    netfs = NetFsSample(
        mounts=(
            nfs,
            MountReads(StorageKind.LUSTRE, "10.0.0.9@o2ib:/lustre", "/lustre", 12 * GIB, 3.2e9),
            MountReads(StorageKind.CEPHFS, ceph, "/mnt/ceph", 5 * GIB, 0.0),
        ),
        mounts_by_target={},
        unmeasured=(),
    )
    zfs = ZfsSample(
        pools=(PoolReads("tank", 7 * GIB, 2.5e8),),
        arc=ArcReads(hits_total=7_221_032, misses_total=73_300, hit_ratio=0.25),
        pools_by_target={},
        unmeasured=(),
    )
    gpus = GpuSample(
        driver_version="570.133.20",
        devices=(
            GpuDevice(0, "GPU-aaaa", "NVIDIA H200", 70 * GIB, 141 * GIB, pcie_rx_bytes=75 * GIB),
            # No PCIe byte counter on this one (NOT_SUPPORTED): no series for it.
            GpuDevice(1, "GPU-bbbb", "NVIDIA H200", None, 141 * GIB),
        ),
        processes=(GpuProcess(4242, 0, "GPU-aaaa", 69 * GIB),),
        errors=("gpu 1: GetMemoryInfo: Unknown Error",),
    )
    loading = TargetView(
        config=kimi,
        state=state(
            "kimi-k2",
            Phase.LOADING_WEIGHTS,
            started_at=NOW - 120,
            elapsed_seconds=120.0,
            progress_ratio=0.25,
            throughput_bytes_per_second=240e6,
            weights_eta_seconds=360.0,
            eta_seconds=480.0,
            seconds_since_progress=0.0,
            cache=Cache.COLD,
            step=Step.WEIGHTS,
            activity={
                "weight_bytes": 0.0,
                "storage_reads": 0.0,
                "log_lines": 1.0,
                "gpu_memory": 40.0,
                "cpu": 0.0,
            },
            cpu_share=1.4,
            process_state="R",
        ),
        readings={
            "endpoint": reading(
                ENDPOINT,
                ProbeSample(
                    ProbeResult.REFUSED,
                    0.0004,
                    None,
                    "connection refused",
                    ServerKind.SGLANG,
                    {ProbeResult.READY: 310, ProbeResult.REFUSED: 118},
                ),
                "kimi-k2",
            ),
            "process": reading(
                PROCESS,
                ProcessSample(True, (4242, 4243), 4242, NOW - 120, 96 * GIB, 97 * GIB, "sglang"),
                "kimi-k2",
            ),
            "logs": reading(
                LOGS,
                LogSample(
                    up=True,
                    reason=None,
                    source="journald:sglang-k2.service",
                    format=ServerKind.SGLANG,
                    format_reason="configured",
                    events=(),
                    last_seq=3,
                    step=Step.WEIGHTS,
                    step_since=NOW - 100,
                    steps=(),
                    weights=(16, 64),
                    cuda_graphs=None,
                    ready_at=None,
                    fatal=None,
                    lines_total=420,
                    bytes_total=61_000,
                    last_line_at=NOW - 1,
                ),
                "kimi-k2",
            ),
            "pagecache": reading(
                PAGECACHE,
                ResidencySample(
                    files=2,
                    total_bytes=384 * GIB,
                    resident_bytes=96 * GIB,
                    per_file=(
                        FileResidency("model-00001-of-00002.safetensors", 192 * GIB, 96 * GIB),
                        # A file name that is not UTF-8 (kept by os.fsdecode as a surrogate):
                        # the label shows U+FFFD instead of failing the whole scrape.
                        FileResidency("model-00002-of-00002-\udcff.safetensors", 192 * GIB, 0),
                    ),
                    method="cachestat",
                    measured_at=NOW - 1,
                    pass_cpu_seconds=0.0002,
                    next_pass_due=NOW,
                    reason=None,
                ),
                "kimi-k2",
            ),
        },
        gpu_memory={0: 69 * GIB},
        # 25 % cached now: 60 s to start, 75 GiB from storage at 240 MB/s, 25 GiB from the
        # page cache at 3 GB/s, 180 s to initialize.
        forecast=Forecast(60.0 + 75 * GIB / 240e6 + 25 * GIB / 3e9 + 180.0, 0.25, None),
        # Its slowest cold load of 12 took 755.2 s: with the margin, 95 periods of 10 s.
        past=PastLoads(advice=StartupAdvice(10, 95, 12, 755.2, None)),
    )
    ready = TargetView(
        config=qwen,
        # Two models it loaded in place were unloaded since (model_load_unloads_total).
        state=state("qwen", Phase.READY, started_at=NOW - 900, progress_ratio=1.0, unloads=2),
        readings={
            "endpoint": reading(
                ENDPOINT,
                ProbeSample(ProbeResult.READY, 0.003, 200, "HTTP 200", ServerKind.UNKNOWN, {}),
                "qwen",
            ),
            # Residency not measurable (not the files' owner): size known, residency absent.
            "pagecache": reading(
                PAGECACHE,
                ResidencySample(4, 15 * GIB, None, (), None, NOW - 2, 0.0, NOW, "EPERM"),
                "qwen",
                ok=False,
            ),
        },
        gpu_memory={},
        discovered=DiscoveredServer(
            kind=ServerKind.VLLM,
            name="qwen",
            pid=777,
            start_ticks=123456,
            start_time=NOW - 900,
            url="http://127.0.0.1:8000",
            probe=ProbeKind.HEALTH,
            probe_path="/health",
            model="qwen",
            weights=(),
            weights_include=("*.safetensors",),
            reachable=True,
            evidence=(),
        ),
        past=PastLoads(
            expected={Cache.WARM: 50.0, Cache.COLD: 610.0},
            last=50.0,
            slower="weights took 3.1x their warm median: the page cache delivered 1.3 GB/s "
            "against 3.9 GB/s",
            advice=StartupAdvice(
                None, None, 0, None, "no cold load finished ready in history (4 warm ready)"
            ),
        ),
    )
    loads, phases = Histograms(), Histograms()
    record = LoadRecord("qwen", NOW - 900, NOW - 850, Outcome.READY, Cache.WARM, False, {}, 0, 0, 0)
    for seconds in (5.0, 5.0001, 7200.0, 8000.0):
        loads.observe(("qwen", Cache.WARM, Outcome.READY), seconds)
    loads.observe(("kimi-k2", Cache.COLD, Outcome.FAILED), record.duration_seconds)
    phases.observe(("qwen", Phase.LOADING_WEIGHTS), 12.5)
    phases.observe(("qwen", Phase.INITIALIZING), 37.5)
    phases.observe(("qwen", Step.CUDA_GRAPH), 21.0)
    return Snapshot(
        time=NOW,
        build={"version": "0.1.0", "python_version": "3.11.7"},
        host={
            "disk": reading(DISK, disk),
            "netfs": reading(NETFS, netfs),
            "zfs": reading(ZFS, zfs),
            "memory": reading(MEMORY, MemorySample(2048 * GIB, 1500 * GIB, 400 * GIB)),
            "nvml": reading(NVML, gpus),
        },
        targets=(loading, ready),
        load_durations=loads.snapshot(),
        phase_durations=phases.snapshot(),
        history_enabled=True,
        history_problem=None,
        config_reload_successful=True,
        history_up=True,
        discovery_refused={**dict.fromkeys(REASONS, 0), "max_targets": 468, "unreadable": 3},
    )


def host_snapshot(key: SourceKey[T], value: T) -> Snapshot:
    """A snapshot of one host-wide source's sample and nothing else: its families alone."""
    return Snapshot(
        time=NOW,
        build={"version": "0.1.0", "python_version": "3.11.7"},
        host={key.name: reading(key, value)},
        targets=(),
        load_durations={},
        phase_durations={},
        history_enabled=False,
        history_problem=None,
        config_reload_successful=True,
    )


def exposition(snapshot: Snapshot) -> str:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector(lambda: snapshot))
    return generate_latest(registry).decode()


def assert_matches_golden(text: str, golden: Path) -> None:
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(text)
    assert text == golden.read_text(), f"{golden.name} changed: see the diff, then UPDATE_GOLDEN=1"


def with_samples(text: str) -> str:
    """The families of an exposition that have samples: an empty one pins nothing here, and that
    every family is exposed, empty or not, the end-to-end golden pins."""
    families = re.split(r"(?m)^(?=# HELP )", text)
    return "".join(f for f in families if any(not line.startswith("#") for line in f.splitlines()))


def test_exposition_matches_the_golden_file() -> None:
    assert_matches_golden(with_samples(exposition(golden_snapshot())), GOLDEN)


PROMETHEUS_ACCEPT = (  # what Prometheus 2.42 sends with every scrape
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)


def memory_moved(snapshot: Snapshot) -> Snapshot:
    """The snapshot a scrape later: host memory moved, nothing else did."""
    memory = reading(MEMORY, MemorySample(2048 * GIB, 1400 * GIB, 300 * GIB))
    return dataclasses.replace(snapshot, host={**snapshot.host, MEMORY.name: memory})


def test_the_metrics_page_is_the_librarys_encoding_scrape_after_scrape() -> None:
    """What /metrics answers is byte for byte what prometheus_client's own app would, in each
    format, as families change between scrapes and change back (encodings are kept per family
    and content type), gzipped or not."""
    current = [golden_snapshot()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector(lambda: current[0]))
    page, library = MetricsPage(registry), make_wsgi_app(registry)

    def librarys(accept: str) -> bytes:
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "HTTP_ACCEPT": accept}
        return b"".join(library(environ, lambda status, headers: None))

    snapshots = [golden_snapshot(), memory_moved(golden_snapshot()), golden_snapshot()]
    for accept in ("*/*", "application/openmetrics-text; version=1.0.0", PROMETHEUS_ACCEPT):
        for snapshot in snapshots:
            current[0] = snapshot
            body, headers = page.render(accept, "")
            assert body == librarys(accept)
            zipped, zipped_headers = page.render(accept, "gzip")
            assert gzip.decompress(zipped) == body
            assert zipped_headers == [*headers, ("Content-Encoding", "gzip")]


def test_the_metrics_page_encodes_only_the_families_that_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A quiet scrape changes a few families of sixty: the others' encodings are reused."""
    encoded: list[str] = []

    def counting(registry: Any, escaping: str = "underscores") -> bytes:
        families = list(registry.collect())
        encoded.extend(f.name for f in families)
        return generate_latest(_Families(families), escaping)

    monkeypatch.setattr(prometheus_client.exposition, "generate_latest", counting)
    current = [golden_snapshot()]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector(lambda: current[0]))
    page = MetricsPage(registry)
    first, _ = page.render("*/*", "gzip")
    assert len(encoded) == len(CATALOG)
    encoded.clear()
    assert page.render("*/*", "gzip")[0] == first
    assert encoded == []
    current[0] = memory_moved(current[0])
    page.render("*/*", "")
    assert encoded == [
        "model_load_host_memory_available_bytes",
        "model_load_host_memory_page_cache_bytes",
    ]


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> list[Metric]:
        return self._families


def test_the_metrics_page_keeps_a_few_formats_whatever_clients_ask() -> None:
    """The version in an Accept header is the client's: each new one does not keep another
    copy of every family's encoding."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ExporterCollector(golden_snapshot))
    page = MetricsPage(registry)
    for patch in range(50):
        body, headers = page.render(f"application/openmetrics-text; version=1.0.{patch}", "")
        assert headers == [
            ("Content-Type", f"application/openmetrics-text; version=1.0.{patch}; "
                             "charset=utf-8; escaping=underscores")
        ]  # fmt: skip
        assert body.endswith(b"# EOF\n")
    assert len(page._kept) == FORMATS_KEPT


def golden_families(golden: Path) -> dict[str, Metric]:
    """A golden file's families by name (the end-to-end one's masked durations read as 0)."""
    text = re.sub(r" DURATION$", " 0", golden.read_text(), flags=re.M)
    return {f.name: f for f in text_string_to_metric_families(text)}


def test_every_family_of_the_catalog_has_samples_in_a_golden_file() -> None:
    """The snapshot built here needs to hold only what the fixture host of the end-to-end golden
    cannot show (network filesystems, ZFS, finished loads, refusals): a family with samples
    there is pinned from the files it is read from. This one keeps the catalog's order."""
    catalog = [f"model_load_{s.name}".removesuffix("_total") for s in CATALOG]
    made = golden_families(GOLDEN)
    assert list(made) == [name for name in catalog if name in made]
    pinned = {
        name
        for golden in (GOLDEN, E2E_GOLDEN)
        for name, family in golden_families(golden).items()
        if family.samples
    }
    assert not set(catalog) - pinned, f"no samples in either golden: {set(catalog) - pinned}"


def test_every_counter_is_named_as_metrics_shows_it() -> None:
    """One spelling: a counter's name in the catalog is the one users query, `_total` and all."""
    counters = [spec.name for spec in CATALOG if spec.family is CounterMetricFamily]
    assert "discovery_refused_total" in counters
    assert [name for name in counters if not name.endswith("_total")] == []


def catalog_names(markdown: str) -> set[str]:
    """Metric names in the first column of the markdown tables that list metrics.

    Sibling gauges may be written as `model_load_host_memory_total_bytes` / `_available_bytes`:
    the shorthand replaces what follows `_memory_` (the only stem the catalogs shorten).
    """
    names: set[str] = set()
    for line in markdown.splitlines():
        if not line.startswith("| `model_load_"):
            continue
        for token in re.findall(r"`([a-z_]+)`", line.split("|")[1]):
            if token.startswith("model_load_"):
                names.add(token)
                full = token
            else:
                names.add(full[: full.index("_memory_") + len("_memory")] + token)
    return names


def exposed_names() -> set[str]:
    """Family names as a user queries them (counters with their `_total`), in either golden."""
    names = set()
    for golden in (GOLDEN, E2E_GOLDEN):
        for family in golden_families(golden).values():
            names.add(family.name + ("_total" if family.type == "counter" else ""))
    return names


def test_the_metrics_reference_names_exactly_the_exposed_metrics() -> None:
    documented = catalog_names((ROOT / "docs" / "metrics.md").read_text())
    missing, stale = exposed_names() - documented, documented - exposed_names()
    assert not missing, f"not in docs/metrics.md's metric table: {sorted(missing)}"
    assert not stale, f"in docs/metrics.md's metric table but not exposed: {sorted(stale)}"


def test_every_name_the_design_fixes_is_exposed() -> None:
    """DESIGN.md fixes names the dashboards and rules rely on (tests/fixtures/design-metrics.txt
    is its catalog's copy); ours may add more in its style."""
    fixed = {line for line in DESIGN_METRICS.read_text().splitlines() if line and line[0] != "#"}
    missing = fixed - exposed_names()
    assert not missing, f"DESIGN.md names missing from /metrics: {sorted(missing)}"


def test_histogram_buckets_are_cumulative_and_upper_bounds_inclusive() -> None:
    """Observed 5.0, 5.0001, 7200 and 8000 s: `le` includes its bound, +Inf holds all four."""
    families = {f.name: f for f in text_string_to_metric_families(GOLDEN.read_text())}
    buckets = {
        s.labels["le"]: s.value
        for s in families["model_load_duration_seconds"].samples
        if s.name.endswith("_bucket") and s.labels["target"] == "qwen"
    }
    expected = {"5.0": 1, "10.0": 2, "5400.0": 2, "7200.0": 3, "+Inf": 4}
    assert {le: buckets[le] for le in expected} == expected
    assert list(buckets.values()) == sorted(buckets.values())
    assert len(buckets) == 21  # the 20 bounds of DESIGN, then +Inf
    count = sample_of(families, "model_load_duration_seconds_count", target="qwen")
    total = sample_of(families, "model_load_duration_seconds_sum", target="qwen")
    assert (count, total) == (4, 5.0 + 5.0001 + 7200.0 + 8000.0)


def test_phase_buckets_only_behind_their_flag() -> None:
    """By default a phase costs 3 series (+Inf, _count, _sum: the dashboard's mean per phase);
    `metrics.phase_buckets` adds its 20 buckets, and changes nothing else."""
    snapshot = golden_snapshot()
    default, detailed = (
        list(text_string_to_metric_families(exposition(s)))
        for s in (snapshot, dataclasses.replace(snapshot, metrics=MetricsConfig(True)))
    )
    phases = [f for f in default if f.name == "model_load_phase_duration_seconds"]
    buckets = {(s.labels["phase"], s.labels["le"]) for s in phases[0].samples if "le" in s.labels}
    observed = {labels[1] for labels in snapshot.phase_durations}
    assert buckets == {(phase, "+Inf") for phase in observed}
    assert len(phases[0].samples) == 3 * len(observed)
    detail = [f for f in detailed if f.name == "model_load_phase_duration_seconds"]
    assert len(detail[0].samples) == 23 * len(observed)
    for family in (detail[0], phases[0]):
        initializing = {
            (s.name, s.labels.get("le")): s.value
            for s in family.samples
            if s.labels["phase"] == "initializing"
        }
        name = family.name
        assert initializing[(f"{name}_bucket", "+Inf")] == initializing[(f"{name}_count", None)]
        assert initializing[(f"{name}_sum", None)] == 37.5
    others = [f for f in default if f.name != "model_load_phase_duration_seconds"]
    assert others == [f for f in detailed if f.name != "model_load_phase_duration_seconds"]


# docs/costs.md#a-fleet: what one target costs by default, besides 23 series per (cache
# temperature, outcome) its finished loads had and 3 per phase or fine step they went through.
TARGET_BUDGET = 64
HISTOGRAMS = ("model_load_duration_seconds", "model_load_phase_duration_seconds")


def test_a_target_stays_within_its_budget() -> None:
    """A tensor-parallel-8 target whose log is read, loading, with every per-target source
    (the golden's kimi-k2, on 8 GPUs, with the sources the runtime has that it lacks)."""
    snapshot = golden_snapshot()
    kimi = snapshot.targets[0]
    readings = {**kimi.readings}
    for key in (STORAGE, WEIGHT_FILES):
        readings[key.name] = reading(key, None, "kimi-k2")  # type: ignore[arg-type]
    kimi = dataclasses.replace(
        kimi, readings=readings, gpu_memory=dict.fromkeys(range(8), 60 * GIB)
    )
    snapshot = dataclasses.replace(snapshot, targets=(kimi, *snapshot.targets[1:]))
    series = [
        (family.name, sample)
        for family in text_string_to_metric_families(exposition(snapshot))
        for sample in family.samples
        if sample.labels.get("target") == "kimi-k2"
    ]
    per_file = [s for name, s in series if name == "model_load_weights_file_resident_bytes"]
    histograms = [s for name, s in series if name in HISTOGRAMS]
    assert len(per_file) == 2  # per_file: true, opted into per weight file
    assert len(histograms) == 23 + 0  # one (cache, outcome): its failed cold load; no phases
    assert len(series) - len(per_file) - len(histograms) <= TARGET_BUDGET


def sample_of(families: dict[str, Any], name: str, **labels: str) -> float:
    family = families[name.removesuffix("_count").removesuffix("_sum")]
    [value] = [
        s.value
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    return float(value)


def status_snapshot() -> Snapshot:
    """The golden snapshot with what /api/v1/status shows and /metrics does not: a storage
    description, the tree's weight files, PCIe counted since the load began, a finished load, how
    a discovered server and its log were found, a weight path with no block device below it."""
    snap = golden_snapshot()
    loading, ready = snap.targets
    overlay = MountStorage(
        kind=StorageKind.OVERLAY,
        fstype="overlay",
        mount_point="/models",
        source="overlay",
        summary="overlay over ext4 on nvme0n1",
        paths=("/models/kimi-k2",),
        devices=("nvme0n1",),
        lower_devices=(),
        read_rate=Fact(True, "counted on nvme0n1 (diskstats)"),
        residency=Fact(True, "cachestat on the real files below the overlay"),
        page_cache=Fact(True, "the real files' page cache serves reads"),
        bypass=Fact(False, "buffered reads"),
        in_memory=False,
        passthrough=None,
        notes=("an overlay's upper layer is empty here",),
    )
    storage = StorageDescription(
        mounts=(overlay,),
        unplaced=("/mnt/gone: No such file or directory",),
        residency_is_temperature=True,
        in_memory=False,
        bypass=False,
        reason=None,
    )
    shard = "model-00001-of-00002.safetensors"
    files = WeightFilesSample(
        visible=True,
        reason=None,
        root_pid=4242,
        files_total=2,
        total_bytes=384 * GIB,
        first_open_at=NOW - 110,
        first_open_seen=True,
        idle_since=None,
        consumed_bytes=96 * GIB,
        seen_bytes=384 * GIB,
        held_files=1,
        files=(
            FileUse(shard, 192 * GIB, 96 * GIB, True, "mmap", 1, False),
            FileUse(
                shard.replace("00001", "00002"), 192 * GIB, 192 * GIB, False, "closed", 0, False
            ),
        ),
        measured_at=NOW - 0.5,
    )
    loading = dataclasses.replace(
        loading,
        config=dataclasses.replace(loading.config, gpus=(0, 1)),
        readings={
            **loading.readings,
            "storage": reading(STORAGE, storage, "kimi-k2"),
            "weight_files": reading(WEIGHT_FILES, files, "kimi-k2"),
        },
        pcie_at_start={(0, "GPU-aaaa"): PcieMark(11 * GIB, NOW - 119)},
        log_finding=LogFinding(
            LogConfig(journald_unit="sglang-k2.service", format=ServerKind.SGLANG),
            "the journald unit of process 4242",
        ),
    )
    assert loading.state is not None and ready.state is not None
    loading = dataclasses.replace(
        loading,
        state=dataclasses.replace(
            loading.state,
            progress_source="weight_files",
            signals={"weights_bytes": 384 * GIB, "consumed_bytes": 96 * GIB, "shards": None},
        ),
    )
    # Its report: the weights from the page cache at a third of the best rate before.
    report = LoadReport(
        expected_seconds=16.0,
        phases=(
            PhaseTime(Phase.STARTING, 0.5, 0.5),
            PhaseTime(Phase.LOADING_WEIGHTS, 12.5, 4.0),
            PhaseTime(Phase.INITIALIZING, 37.0, None),
        ),
        page_cache_bytes=15 * GIB,
        storage_bytes=0,
        storage_reads=(StorageRead("disk", "vda", 0),),
        read_rate=ReadRate("page_cache", 15 * GIB / 12.5, 3.9e9),
        reason="weights took 3.1x their warm median: the page cache delivered 1.3 GB/s against "
        "3.9 GB/s",
    )
    last = LoadRecord(
        "qwen", NOW - 900, NOW - 850, Outcome.READY, Cache.WARM, False,
        {"starting": 0.5, "loading_weights": 12.5, "initializing": 37.0}, 15 * GIB, 0, 14 * GIB,
        report=report,
    )  # fmt: skip
    assert ready.discovered is not None
    ready = dataclasses.replace(
        ready,
        state=dataclasses.replace(ready.state, last_record=last),
        discovered=dataclasses.replace(
            ready.discovered,
            weights=("/srv/qwen",),
            evidence=(Evidence("port", "8000", "--port 8000"),),
        ),
        log_finding=LogFinding(None, "stdout is a pipe to another process"),
    )
    disk, gpus = snap.host_value(DISK), snap.host_value(NVML)
    assert disk is not None and gpus is not None
    disk = dataclasses.replace(
        disk,
        unbacked_by_target={"kimi-k2": ("/dev/shm/kimi",), "qwen": ()},
        lower_devices_by_target={"kimi-k2": ("sda",)},
    )
    failed = Reading("zfs", "", None, False, "OSError: /proc/spl/kstat/zfs: gone", 0.002, NOW - 3)
    gpus = dataclasses.replace(gpus, attribution_problem="in another PID namespace")
    host = {**snap.host, "disk": reading(DISK, disk), "nvml": reading(NVML, gpus), "zfs": failed}
    return dataclasses.replace(snap, targets=(loading, ready), host=host)


def test_status_document_matches_the_golden_file() -> None:
    document = status_document(status_snapshot(), sample_interval=1.0).to_json()
    assert_matches_golden(json.dumps(document, indent=2) + "\n", STATUS_GOLDEN)
