"""What one tick sees of a target (exporter/runtime/observe.py): the sources' readings of varied
shapes turned into the tracker's Observation, and which readings are news, without threads or a
runtime."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, TypeVar

import pytest

from exporter.load.events import EventKind, LogEvent
from exporter.load.observation import FileView
from exporter.load.records import LoadState
from exporter.load.tracker import Tracker
from exporter.runtime.observe import (
    Marked,
    TargetReadings,
    bytes_read_under,
    counters_before,
    file_view,
    files_news,
    log_is_news,
    observe,
    probe_is_news,
    read_counters,
    storage_cache,
    tree_rx,
)
from exporter.runtime.sampler import Reading
from exporter.sources.disk import DeviceReads, DiskSample
from exporter.sources.endpoint import ProbeSample
from exporter.sources.gpu import GpuDevice, GpuProcess, GpuSample
from exporter.sources.logs import LogSample
from exporter.sources.netfs import MountReads, NetFsSample
from exporter.sources.process import ProcessSample
from exporter.sources.residency import ResidencySample
from exporter.sources.storage import StorageDescription
from exporter.sources.weightfiles import FileUse, WeightFilesSample
from exporter.sources.zfs import PoolReads, ZfsSample
from exporter.vocabulary import Cache, ProbeResult, Step, StorageKind

NOW = 1_764_489_600.0
GIB = 1 << 30
T = TypeVar("T")


def reading(value: T, at: float = NOW - 1, ok: bool = True, target: str = "m") -> Reading[T]:
    return Reading("source", target, value, ok, None if ok else "down", 0.01, at)


def process(
    root: int = 100, pids: tuple[int, ...] = (100, 101), found: bool = True
) -> ProcessSample:
    return ProcessSample(
        found=found,
        pids=pids if found else (),
        root_pid=root if found else None,
        start_time=NOW - 30 if found else None,
        read_bytes=7 * GIB if found else None,
        read_chars=3 * GIB if found else None,
        cmdline="vllm serve" if found else None,
        cpu_seconds=12.5 if found else None,
        state="D" if found else None,
    )


def use(name: str, size: int, consumed: int, direct: bool = False) -> FileUse:
    return FileUse(name, size, consumed, True, "read", 1, direct)


def weight_files(
    root: int = 100, visible: bool = True, files: tuple[FileUse, ...] = ()
) -> WeightFilesSample:
    files = files or (use("a.safetensors", 4 * GIB, 4 * GIB), use("b.safetensors", 4 * GIB, GIB))
    return WeightFilesSample(
        visible=visible,
        reason=None if visible else "another user's process",
        root_pid=root,
        files_total=len(files),
        total_bytes=sum(f.size_bytes for f in files),
        first_open_at=NOW - 20,
        first_open_seen=True,
        idle_since=None,
        consumed_bytes=sum(f.consumed_bytes for f in files),
        seen_bytes=sum(f.size_bytes for f in files),
        held_files=len(files),
        files=files,
        measured_at=NOW - 1,
    )


def gpu(*devices: GpuDevice, processes: tuple[GpuProcess, ...] = ()) -> GpuSample:
    return GpuSample("550.54", devices, processes, ())


def device(index: int, rx: int | None) -> GpuDevice:
    return GpuDevice(index, f"GPU-{index}", "H100", 10 * GIB, 80 * GIB, pcie_rx_bytes=rx)


def log_sample(*seqs: int, lines: int = 40, skipped: int = 0) -> LogSample:
    events = tuple(LogEvent(EventKind.WEIGHTS_PROGRESS, NOW - 10 + s, seq=s) for s in seqs)
    return LogSample(
        up=True,
        reason=None,
        source="file:/var/log/vllm.log",
        format="vllm",
        format_reason="configured",
        events=events,
        last_seq=seqs[-1] if seqs else 0,
        step=Step.WEIGHTS,
        step_since=NOW - 20,
        steps=(),
        weights=(1, 2),
        cuda_graphs=None,
        ready_at=None,
        fatal=None,
        lines_total=lines,
        bytes_total=lines * 80,
        last_line_at=NOW - 2,
        skipped_bytes=skipped,
    )


def residency(measured_at: float = NOW - 3, resident: int | None = 6 * GIB) -> ResidencySample:
    return ResidencySample(
        files=2,
        total_bytes=8 * GIB,
        resident_bytes=resident,
        per_file=(),
        method="cachestat",
        measured_at=measured_at,
        pass_cpu_seconds=0.01,
        next_pass_due=NOW + 60,
        reason=None,
    )


def disk(read: int, target: str = "m") -> DiskSample:
    return DiskSample((DeviceReads("nvme0n1", read, None),), {target: ("nvme0n1",)}, {})


def netfs(read: int, target: str = "m") -> NetFsSample:
    mount = MountReads(StorageKind.NFS, "srv:/models", "/models", read, None)
    return NetFsSample((mount,), {target: (mount.key,)}, ())


def zfs(read: int, target: str = "m", counted: bool = True) -> ZfsSample:
    pools = (PoolReads("tank", read, None),) if counted else ()
    return ZfsSample(pools, None, {target: ("tank",)}, ())


def storage(
    *, bypass: bool = False, temperature: bool = True, memory: bool = False
) -> StorageDescription:
    return StorageDescription((), (), temperature, memory, bypass, None)


def readings(**fields: Any) -> TargetReadings:
    base: dict[str, Any] = {
        "name": "m",
        "gpus": "auto",
        "process_configured": True,
        "probe": None,
        "process": None,
        "pagecache": None,
        "logs": None,
        "log_followed": False,
        "files": None,
        "gpu": None,
        "disk": None,
        "storage": None,
        "log_seq": 0,
    }
    return TargetReadings(**(base | fields))


def probe(result: ProbeResult, at: float = NOW - 1) -> Reading[ProbeSample]:
    return reading(ProbeSample(result, 0.01, 200, "ok", "vllm", {result: 1}), at)


# -- the observation -----------------------------------------------------------------------------


def test_an_endpoint_only_target_is_seen_through_its_probe_alone() -> None:
    seen = observe(readings(process_configured=False, probe=probe(ProbeResult.REFUSED)), NOW)
    obs = seen.observation
    assert obs.time == NOW and not obs.process_configured and not obs.process_found
    assert obs.endpoint_result is ProbeResult.REFUSED and obs.endpoint_probe_time == NOW - 1
    assert obs.files is None and obs.weights_bytes is None and obs.disk_read_bytes is None
    assert obs.log_events == () and obs.log_lines is None and obs.gpu_rx_bytes is None
    assert seen.gpu_memory == {} and seen.log_seq == 0


def test_a_failed_probe_reading_has_no_result_but_keeps_its_time() -> None:
    failed = reading(ProbeSample(ProbeResult.READY, 0.0, None, "", "", {}), NOW - 4, ok=False)
    obs = observe(readings(probe=failed), NOW).observation
    assert obs.endpoint_result is None and obs.endpoint_probe_time == NOW - 4


def test_readings_stamped_after_a_clock_step_back_are_not_in_the_future() -> None:
    later = NOW + 3600
    obs = observe(
        readings(
            probe=probe(ProbeResult.READY, at=later),
            pagecache=reading(residency(measured_at=later), later),
            logs=reading(log_sample(1), later),
        ),
        NOW,
    ).observation
    assert obs.endpoint_probe_time == obs.resident_measured_at == obs.log_read_at == NOW


def test_a_loading_target_is_seen_from_every_source() -> None:
    tree = process(root=100, pids=(100, 101))
    nvml = gpu(
        device(0, 5 * GIB),
        device(1, 2 * GIB),
        device(2, 9 * GIB),
        processes=(
            GpuProcess(101, 0, "GPU-0", 3 * GIB),
            GpuProcess(101, 1, "GPU-1", GIB),
            GpuProcess(999, 2, "GPU-2", 8 * GIB),  # another tree's
        ),
    )
    seen = observe(
        readings(
            probe=probe(ProbeResult.REFUSED),
            process=tree,
            pagecache=reading(residency()),
            logs=reading(log_sample(3, 4, 5, lines=40, skipped=2)),
            files=reading(weight_files(root=100)),
            gpu=nvml,
            disk=disk(11 * GIB),
            storage=storage(),
            log_seq=3,
        ),
        NOW,
    )
    obs = seen.observation
    assert (obs.process_found, obs.process_pid, obs.process_start_time) == (True, 100, NOW - 30)
    assert (obs.process_read_bytes, obs.process_read_chars) == (7 * GIB, 3 * GIB)
    assert (obs.process_cpu_seconds, obs.process_state) == (12.5, "D")
    assert (obs.weights_bytes, obs.resident_bytes) == (8 * GIB, 6 * GIB)
    assert obs.resident_measured_at == NOW - 3
    assert obs.disk_read_bytes == 11 * GIB
    # Only the events after the last one handed over, and the sequence moves on to the newest.
    assert [e.seq for e in obs.log_events] == [4, 5] and seen.log_seq == 5
    assert obs.log_lines == 42  # lines read, and bytes skipped unread: both are movement
    # The tree holds GPUs 0 and 1: their memory and PCIe counters, not GPU 2's (another tree).
    assert seen.gpu_memory == {0: 3 * GIB, 1: GIB} and obs.process_gpu_bytes == 4 * GIB
    assert obs.gpu_rx_bytes == 7 * GIB
    assert obs.files == FileView(NOW - 20, True, None, 5 * GIB, 8 * GIB, 8 * GIB)
    assert obs.storage_cache is None  # residency decides


def test_configured_gpus_count_whatever_the_tree_holds() -> None:
    nvml = gpu(
        device(0, 5 * GIB),
        device(1, 2 * GIB),
        device(2, 9 * GIB),
        processes=(GpuProcess(100, 0, "GPU-0", 3 * GIB), GpuProcess(100, 2, "GPU-2", GIB)),
    )
    seen = observe(readings(process=process(), gpu=nvml, gpus=(1, 2)), NOW)
    assert seen.gpu_memory == {2: GIB}  # of the configured ones, the tree holds GPU 2 only
    assert seen.observation.gpu_rx_bytes == 11 * GIB  # both configured GPUs' counters


def test_a_down_log_still_hands_over_the_events_it_read() -> None:
    down = reading(log_sample(1, 2), ok=False)
    seen = observe(readings(logs=down, log_seq=1), NOW)
    assert [e.seq for e in seen.observation.log_events] == [2] and seen.log_seq == 2


def test_without_a_log_the_sequence_stays_where_it_was() -> None:
    seen = observe(readings(log_seq=9), NOW)
    assert seen.log_seq == 9 and seen.observation.log_read_at is None


def test_residency_unknown_still_gives_the_weights_size() -> None:
    obs = observe(readings(pagecache=reading(residency(resident=None))), NOW).observation
    assert obs.weights_bytes == 8 * GIB and obs.resident_bytes is None


def test_a_process_the_file_view_has_not_looked_at_is_pending() -> None:
    obs = observe(readings(process=process(), files=None), NOW).observation
    assert obs.files is not None and obs.files.pending and obs.files.total_bytes == 0


# -- the file view -------------------------------------------------------------------------------


@pytest.mark.parametrize("tree", [None, process(found=False)])
def test_no_file_view_without_a_running_process(tree: ProcessSample | None) -> None:
    assert file_view(weight_files(), tree) is None
    assert file_view(None, tree, looked=False) is None


def test_a_view_that_cannot_see_the_tree_leaves_it_to_the_counters() -> None:
    assert file_view(weight_files(visible=False), process()) is None
    assert file_view(None, process(), looked=True) is None  # the last look failed


def test_a_view_of_an_older_process_is_pending_with_the_files_size() -> None:
    view = file_view(weight_files(root=99), process(root=100))
    assert view == FileView(None, False, None, 0, 0, 8 * GIB, pending=True)


@pytest.mark.parametrize("direct", [(False, False), (False, True), (True, True)])
def test_one_file_opened_direct_makes_the_view_direct(direct: tuple[bool, bool]) -> None:
    files = (use("a", GIB, GIB, direct[0]), use("b", 2 * GIB, 0, direct[1]))
    view = file_view(weight_files(files=files), process())
    assert view is not None and not view.pending
    assert view.direct is any(direct) and (view.consumed_bytes, view.total_bytes) == (GIB, 3 * GIB)


# -- the GPUs' PCIe counters and the storage's label -----------------------------------------------


def test_tree_rx_sums_the_trees_gpus_only_when_each_has_a_counter() -> None:
    sample = gpu(device(0, 100), device(1, 50), device(2, None))
    assert tree_rx(sample, {0, 1}) == 150
    assert tree_rx(sample, {1}) == 50
    assert tree_rx(sample, {0, 2}) is None  # a part would read as the whole
    assert tree_rx(sample, {0, 7}) is None  # GPU 7 is not in the sample
    assert tree_rx(sample, set()) is None and tree_rx(None, {0}) is None


@pytest.mark.parametrize(
    ("description", "cache"),
    [
        (None, None),
        (storage(), None),
        (storage(bypass=True), Cache.BYPASS),
        (storage(bypass=True, memory=True), Cache.BYPASS),
        (storage(temperature=False), Cache.UNKNOWN),
        (storage(memory=True), Cache.WARM),
    ],
)
def test_the_storage_fixes_the_label_or_leaves_it_to_residency(
    description: StorageDescription | None, cache: Cache | None
) -> None:
    assert storage_cache(description) is cache
    obs = observe(readings(storage=description), NOW).observation
    assert obs.storage_cache is cache


# -- the storage's read counters ------------------------------------------------------------------


def test_bytes_read_under_the_weights_sum_every_counter_that_sees_them() -> None:
    assert bytes_read_under("m", (disk(5), netfs(7), zfs(11))) == 23
    assert bytes_read_under("m", (None, netfs(7), None)) == 7
    # A counter that does not see this target's weights adds nothing; none at all: unknown.
    assert bytes_read_under("m", (disk(5, target="other"), zfs(11))) == 11
    assert bytes_read_under("m", (disk(5, target="other"), zfs(11, counted=False))) is None
    assert bytes_read_under("m", (None, None, None)) is None


def test_read_counters_are_keyed_by_what_holds_the_weights_and_dated_by_the_oldest() -> None:
    marked = read_counters(
        "m", (reading(disk(5), NOW - 2), reading(netfs(7), NOW - 9), reading(zfs(11), NOW - 1))
    )
    assert marked == Marked(
        {("disk", "nvme0n1"): 5, (StorageKind.NFS, "/models"): 7, ("zfs", "tank"): 11}, NOW - 9
    )


def test_a_failed_counter_reading_neither_counts_nor_dates() -> None:
    marked = read_counters("m", (reading(disk(5), NOW - 2), reading(netfs(7), NOW - 9, ok=False)))
    assert marked == Marked({("disk", "nvme0n1"): 5}, NOW - 2)
    assert read_counters("m", (None, reading(zfs(1), ok=False))) is None


def started(at: float | None) -> LoadState:
    return replace(Tracker("m", stall_after=300).state(NOW), started_at=at)


def test_counters_before_a_load_are_the_last_read_at_or_before_its_start() -> None:
    seen = [Marked({("disk", "a"): n}, NOW - 10 + n) for n in range(5)]  # at NOW-10 .. NOW-6
    assert counters_before(seen, started(NOW - 8)) == {("disk", "a"): 2}
    assert counters_before(seen, started(NOW - 7.5)) == {("disk", "a"): 2}
    assert counters_before(seen, started(NOW)) == {("disk", "a"): 4}
    assert counters_before(seen, started(NOW - 11)) is None  # read too late to hold one
    assert counters_before(seen, started(None)) is None
    assert counters_before([], started(NOW)) is None


# -- news ---------------------------------------------------------------------------------------


def test_files_news_changes_with_the_first_open_the_let_go_and_the_last_byte() -> None:
    loading = weight_files()
    assert files_news(loading) == (NOW - 20, None, False)
    whole = (use("a", GIB, GIB), use("b", GIB, GIB))
    assert files_news(weight_files(files=whole)) == (NOW - 20, None, True)
    assert files_news(replace(loading, idle_since=NOW - 1)) == (NOW - 20, NOW - 1, False)
    empty = replace(loading, total_bytes=0, consumed_bytes=0)
    assert files_news(empty)[2] is False  # nothing to consume is not all consumed


READY, REFUSED, TIMEOUT = ProbeResult.READY, ProbeResult.REFUSED, ProbeResult.TIMEOUT


@pytest.mark.parametrize(
    ("result", "last", "in_progress", "news"),
    [
        (READY, REFUSED, True, True),  # a load answers ready: it ends at this answer
        (READY, READY, True, True),
        (REFUSED, REFUSED, True, False),  # a load's refusals are expected
        (None, None, True, False),
        (READY, READY, False, False),  # serving, as before
        (REFUSED, READY, False, True),  # every failure between loads counts
        (REFUSED, REFUSED, False, True),
        (TIMEOUT, REFUSED, False, True),
        (READY, TIMEOUT, False, True),  # the first good answer after them
        (None, READY, False, True),
    ],
)
def test_which_probe_answers_are_news(
    result: ProbeResult | None, last: ProbeResult | None, in_progress: bool, news: bool
) -> None:
    assert probe_is_news(result, last, in_progress) is news


@pytest.mark.parametrize(
    ("seqs", "seen", "in_progress", "last", "news"),
    [
        ((1, 2), 1, False, READY, True),  # a line between loads may begin one in the server
        ((1, 2), 2, False, READY, False),  # nothing new
        ((), 0, False, None, False),
        (None, 0, False, READY, False),  # no good reading
        ((1,), 1, True, READY, True),  # a load answered ready: the read after the answer
        ((1, 2), 1, True, REFUSED, False),  # a load's lines wait for the tick
        (None, 0, True, READY, True),
    ],
)
def test_which_log_reads_are_news(
    seqs: tuple[int, ...] | None,
    seen: int,
    in_progress: bool,
    last: ProbeResult | None,
    news: bool,
) -> None:
    sample = log_sample(*seqs) if seqs is not None else None
    assert log_is_news(sample, seen, in_progress, last) is news
