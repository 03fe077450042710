"""What the load model is fed: one tick's latest readings of one target (`Observation`), and
what the server's tree did with its weight files (`FileView`).

Defined with the model that reads them, in base units and plain values, so the tracker needs
nothing of the sources; exporter/runtime/observe.py builds one per tick from the sources'
readings, and tests build them by hand to drive whole loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.load.events import LogEvent
from exporter.vocabulary import Cache, ProbeResult


@dataclass(frozen=True)
class FileView:
    """What the server tree did with its weight files this process (sources/weightfiles.py)."""

    first_open_at: float | None  # a weight file first seen open or mapped: the weights began
    first_open_seen: bool  # an earlier look saw none held: the open happened while watched
    idle_since: float | None  # after the first open, no weight file held since then
    consumed_bytes: int  # of the weight files, file by file, whatever the loader
    seen_bytes: int  # sizes of the files held so far: the most the tree can have consumed
    total_bytes: int
    direct: bool = False  # a weight file was opened with O_DIRECT: reads around the page cache
    # Not looked at this process yet: nothing held, and not kept as the last view if the next
    # look cannot see (another user's tree): the counters take over then.
    pending: bool = False


@dataclass(frozen=True)
class Observation:
    """One tick's latest readings for one target, composed by the sampler."""

    time: float  # unix seconds
    endpoint_result: ProbeResult | None  # the newest probe's result
    endpoint_probe_time: float | None  # when that probe finished; a probe counts once
    process_configured: bool  # False: endpoint-only semantics
    process_found: bool
    process_pid: int | None
    process_start_time: float | None  # unix seconds: the process's own start time
    process_read_bytes: int | None  # storage bytes read by the tree, from 0 at its start
    process_read_chars: int | None  # bytes through read() by the tree (rchar), not mmap
    process_gpu_bytes: int | None  # GPU memory held by the tree, summed over GPUs
    weights_bytes: int | None  # total size of the weight files
    resident_bytes: int | None  # page-cache bytes of the weight files; None = not measurable
    resident_measured_at: float | None  # when resident_bytes was measured
    disk_read_bytes: int | None  # counter: reads of the devices backing the weights (host-wide)
    # When the newest probe was sent (None: when it finished): its answer is the server's word
    # at some moment between the two.
    endpoint_probe_sent: float | None = None
    log_events: tuple[LogEvent, ...] = ()  # the server log's markers new since the last tick
    log_lines: int | None = None  # lines of the server's log read, plus bytes skipped; None: no log
    log_read_at: float | None = None  # when the log was last read
    # The target follows a log, read or not yet: one just opened (a new process's) has no
    # reading before its first read, and lines it holds may date a load already over.
    log_followed: bool = False
    files: FileView | None = None  # None: the tree's weight files cannot be seen
    gpu_rx_bytes: int | None = None  # PCIe bytes received by the tree's GPUs (a counter)
    # What the storage under the weights says of the label (sources/storage.py): bypass (reads
    # go around the page cache), unknown (the page cache is not what serves them), warm (in
    # memory by construction, tmpfs), or None: residency decides.
    storage_cache: Cache | None = None
    process_cpu_seconds: float | None = None  # CPU time the tree used (not a progress signal)
    process_state: str | None = None  # the tree's most telling scheduler state (T, D, R, S)
