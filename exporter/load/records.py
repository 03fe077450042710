"""What the tracker hands out: a target's state now (`LoadState`) and each finished load
(`LoadRecord`).

Apart from the Tracker because every later layer reads them (history stores the records, the
forecast and the report read them, the runtime files them, the exposition shows the state) and
none of those needs the state machine that makes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.load.report import LoadReport
from exporter.vocabulary import Cache, Outcome, Phase, Signal, Step


@dataclass(frozen=True)
class LoadRecord:
    """One finished load, as history stores it."""

    target: str
    started_at: float
    ended_at: float
    outcome: Outcome
    cache: Cache | None  # None when residency at the start is unknown
    partial: bool  # start not known (no process matching): kept out of histograms
    phase_seconds: Mapping[str, float]  # the in-progress phases the load went through
    weights_bytes: int | None
    bytes_read: int | None  # storage bytes the process tree read during the load
    gpu_bytes_at_weights_end: int | None  # the GPU size to expect next time
    seen_late: bool = False  # first seen mid-way: duration exact, only watched phases recorded
    fatal: str | None = None  # the server's own fatal message, when its log gave one
    resident_bytes_at_start: int | None = None  # weights in the page cache as it began
    # Storage bytes the tree read before its first weight file: its own environment (the
    # interpreter, packages, libraries), gigabytes when they had left the page cache.
    startup_read_bytes: int | None = None
    # The server's own files (sources/environment.py) as a run keeps them in the page cache
    # (what a start needs), and the bytes of that cached as it began, by the last pass before
    # its start; None where none was made.
    environment_bytes: int | None = None
    environment_resident_bytes: int | None = None
    # The user whose discovered server loaded (exporter/runtime/targetnames.py: a name's loads
    # count for its owner only); None for a configured target's.
    owner: int | None = None
    id: int | None = None  # history's row id, once stored and read back
    report: LoadReport | None = None  # where its time went and why (exporter/history/explain.py)

    @property
    def duration_seconds(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True)
class LoadState:
    """A target's load as the tracker sees it now: everything /metrics and /api/v1/status show
    of it."""

    target: str
    phase: Phase
    in_progress: bool
    started_at: float | None  # start of the current (or last) load
    elapsed_seconds: float  # since the current load started; 0 when none is in progress
    progress_ratio: float | None  # weights progress, 0..1, monotonic within a load
    throughput_bytes_per_second: float | None  # smoothed, while weights load
    weights_eta_seconds: float | None  # remaining weights / throughput
    eta_seconds: float | None  # until ready; None when any part has no basis
    seconds_since_progress: float | None  # None when no load is in progress
    stalled: bool
    cache: Cache | None
    partial: bool
    seen_late: bool
    progress_source: Signal | None  # the signal that last drove progress
    signals: Mapping[str, float | int | None]  # the raw evidence, for /api/v1/status
    last_record: LoadRecord | None
    step: Step | None  # the fine step the server's log says; None without log markers
    fatal: str | None  # why the last load failed, in the server's own words (from its log)
    failed_probes: int = 0  # distinct failed probes in a row
    # Ready, its process running, and tracker.ENDPOINT_FAILURES_FOR_LOAD probes in a row failed: no
    # new process, so no load, but the endpoint stopped answering (the ModelServerHung alert).
    hung: bool = False
    in_server: bool = False  # the load is a running server's (a model loaded into it)
    # What the running server last unloaded (its log's name for it), until its next load.
    unloaded: str | None = None
    # Models the running server unloaded since the exporter started; None until it showed it
    # loads models in place (a load or an unload inside it), so other servers carry no series.
    unloads: int | None = None
    # Seconds since each measured signal last moved (exporter/load/activity.py): what a stall's
    # reason is made of. A signal not measured is absent.
    activity: Mapping[str, float] = field(default_factory=dict)
    cpu_share: float | None = None  # the tree's CPU over the last 10 s, share of one core
    process_state: str | None = None  # the tree's most telling scheduler state (T, D, R, S)
    exited_at: float | None = None  # the watched process was seen gone then; None: running
    # A follower in progress whose end of start-up the exporter cannot see (no log read, or
    # not from this load's start): quiet is then no stall, and it is never ready.
    end_unseen: bool = False
