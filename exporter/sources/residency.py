"""One target's page-cache residency as a source: the weight tree walked
(exporter/storage/weighttree.py) and each file measured (exporter/storage/pagecache.py) where the
storage under it says a measurement is true (exporter/sources/storage.py), full passes spaced
to stay within a CPU budget.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from exporter.config.schema import DEFAULT_RESIDENCY_CPU_BUDGET, WeightsConfig
from exporter.sources.sample import Health, Sample
from exporter.sources.storage import WeightStorage
from exporter.storage.pagecache import METHODS, FileResidency, PassResult, measure, sizes_only
from exporter.storage.weighttree import WeightFile, WeightTree, walk_weights
from exporter.trust.asprocess import OnBehalf
from exporter.trust.safeio import Refused

log = logging.getLogger(__name__)

QUIET_REFRESH_SECONDS = 30.0
# While its server is ready and serving, residency matters for the next restart only, and a load's
# start always measures afresh: refresh it this seldom (a 500 GB model cached in 4 KiB pages
# costs about 0.7 s of CPU a pass).
SERVING_REFRESH_SECONDS = 300.0
MIN_READS_FOR_PASS = 1 << 20  # device bytes read before residency is worth measuring again
READS_SHARE_FOR_PASS = 0.001  # ... or this share of the weights, whichever is more
# Bytes that left the host's page cache before a serving target's residency is worth measuring
# again: this share of its weights (at least MIN_READS_FOR_PASS). The eviction alert fires under
# half, and a residency 5 % stale moves a restart forecast by under 5 %; a host that pages the
# weights out slowly (DAMON here: 100 MB a minute of 2 GB) pays a pass per twentieth, not per
# hundredth (at 1 %, 11 ms of CPU a minute in quiet mode on bench/exporter_cpu.py).
DEPARTED_SHARE_FOR_PASS = 0.05
PASS_TIMEOUT = 120.0  # a pass run with a process's rights (exporter/trust/asprocess.py)


def measure_planned(
    files: Sequence[WeightFile],
    storage: WeightStorage | None,
    per_file: bool = False,
    methods: Sequence[str] = METHODS,
    count_unreadable: bool = True,
) -> PassResult:
    """A pass that opens each file where `storage` says it may be measured truthfully and
    harmlessly: the real file below an overlay or a FUSE passthrough, or none at all."""
    if storage is None:
        return measure(files, per_file, methods, count_unreadable)
    plan = storage.plan(files)
    if plan.unmeasurable:
        return sizes_only(files, plan.reason or "residency cannot be measured here")
    result = measure(plan.files, per_file, methods, count_unreadable)
    return replace(result, where=plan.where) if plan.redirected else result


@dataclass(frozen=True)
class ResidencySample(Sample):
    files: int
    total_bytes: int
    resident_bytes: int | None
    per_file: tuple[FileResidency, ...]
    method: str | None
    measured_at: float
    pass_cpu_seconds: float
    next_pass_due: float
    reason: str | None
    where: str | None = None  # where residency was measured when not on the files themselves

    def health(self) -> Health:
        return Health(self.up, self.reason)

    @property
    def up(self) -> bool:
        return self.resident_bytes is not None


class ResidencySource:
    """Residency of one target's weights, with full passes spaced to stay within a CPU budget."""

    def __init__(
        self,
        weights: WeightsConfig,
        cpu_budget: float = DEFAULT_RESIDENCY_CPU_BUDGET,
        clock: Callable[[], float] = time.time,
        cpu_clock: Callable[[], float] = time.thread_time,
        methods: Sequence[str] = METHODS,
        refresh_after: Callable[[], float] = lambda: QUIET_REFRESH_SECONDS,
        on_behalf: OnBehalf | None = None,
        max_entries: int | None = None,
        on_refused: Callable[[Refused], None] | None = None,
        storage: WeightStorage | None = None,
    ) -> None:
        """`refresh_after`: how old a pass may get without reads before the next is worth it.

        A discovered target's passes run `on_behalf` of its process (with its rights), walk at
        most `max_entries` entries, and report a refused tree to `on_refused`; `storage` says
        where each file may be measured (exporter/sources/storage.py).
        """
        if not 0 < cpu_budget <= 1:
            raise ValueError(f"cpu_budget must be in (0, 1], got {cpu_budget}")
        self._weights = weights
        self._budget = cpu_budget
        self._clock = clock
        self._cpu_clock = cpu_clock
        self._methods = tuple(methods)
        self._refresh_after = refresh_after
        self._on_behalf = on_behalf
        self._max_entries = max_entries
        self._on_refused = on_refused
        self._refused: tuple[Refused, float] | None = None  # a refused tree, and until when
        self._storage = storage
        self._lock = threading.Lock()
        self._forced = threading.Event()
        self._news = threading.Event()  # reads or departures since the last pass
        self._tree: WeightTree | None = None
        self._last: ResidencySample | None = None
        self._reads_at_pass: int | None = None  # device read counter when a pass was last asked
        self._departed_at_pass: int | None = None  # the host's departures then (memory source)
        self._warned: str | None = None  # the reason last logged: each new one once

    def request_full_pass(self) -> None:
        """Make the next sample() measure afresh, whatever the budget says (thread-safe)."""
        self._forced.set()

    def note_device_reads(self, read_bytes_total: int | None) -> None:
        """Ask for a pass once the weights' devices have read a meaningful amount.

        Pages arrive only through reads, so without reads a pass would measure nothing new; but
        the devices also serve the rest of the host, and a 16 KB log read must not buy a 30 ms
        pass over 8 GB. `read_bytes_total` is the devices' read counter; None means reads cannot
        be seen (NFS, tmpfs: no block device), and then every call asks. Called from one thread
        (the tracker tick); the request it raises is thread-safe.
        """
        if read_bytes_total is None:
            self._news.set()
            return
        base = self._reads_at_pass
        if base is None or read_bytes_total < base:
            self._reads_at_pass = base = read_bytes_total
        last = self._last
        weights = last.total_bytes if last is not None else 0
        if read_bytes_total - base >= max(MIN_READS_FOR_PASS, weights * READS_SHARE_FOR_PASS):
            self._news.set()
            self._reads_at_pass = read_bytes_total

    def note_departures(self, departed_bytes_total: int) -> bool:
        """Ask for a pass once more has left the host's page cache than DEPARTED_SHARE_FOR_PASS
        of the weights, while some of them were cached: theirs may be among the pages that left.

        Without this a serving target's residency waits SERVING_REFRESH_SECONDS, and its
        eviction alert and restart forecast with it. `departed_bytes_total` is the memory
        source's count (exporter/sources/memory.py); True when a pass was asked, so the caller
        samples this source now. Called from one thread (the memory source's).
        """
        base, last = self._departed_at_pass, self._last
        if last is None or not last.resident_bytes or base is None or departed_bytes_total < base:
            self._departed_at_pass = departed_bytes_total  # a baseline, or nothing cached to lose
            return False
        threshold = max(MIN_READS_FOR_PASS, last.total_bytes * DEPARTED_SHARE_FOR_PASS)
        if departed_bytes_total - base < threshold:
            return False
        self._departed_at_pass = departed_bytes_total
        self._news.set()
        return True

    def sample(self) -> ResidencySample:
        """A fresh full pass when requested, or when due and worth it; else the last measurement.

        Due: the CPU budget allows it. Worth it: the weights' devices showed reads since the last
        pass (pages can only arrive through reads), the host's page cache lost a share of the
        weights' size (pages leave that way), or the last pass is `refresh_after()` old
        (QUIET_REFRESH_SECONDS, or SERVING_REFRESH_SECONDS while the server is ready). An idle
        host so pays one pass per refresh instead of one per budget period.
        """
        with self._lock:
            last = self._last
            now = self._clock()
            # A wall clock stepped back must not postpone the next pass by the size of the step.
            if last is not None and not self._forced.is_set() and last.measured_at <= now:
                if now < last.next_pass_due:
                    return last
                # Files added, removed or replaced change their directory: worth a pass too.
                changed = self._tree is None or self._tree.changed()
                quiet = now < last.measured_at + self._refresh_after()
                if not self._news.is_set() and not changed and quiet:
                    return last
            self._forced.clear()
            self._news.clear()
            self._last = self._full_pass()
            return self._last

    def _walk_and_measure(self) -> tuple[PassResult, float]:
        """One pass and its CPU seconds, taken on the thread that runs it (an actor's, maybe)."""
        cpu_start = self._cpu_clock()
        if self._tree is None or self._tree.changed():
            self._tree = walk_weights(self._weights, self._max_entries)
        result = measure_planned(
            self._tree.files,
            self._storage,
            self._weights.per_file,
            self._methods,
            count_unreadable=self._on_behalf is None,
        )
        if result.stale:
            self._tree = None
        return result, max(0.0, self._cpu_clock() - cpu_start)

    def _full_pass(self) -> ResidencySample:
        if self._refused is not None:
            refused, until = self._refused
            if self._clock() < until:
                raise refused.with_traceback(None)  # no new walk of a refused tree before then
        try:
            if self._on_behalf is not None:
                result, cost = self._on_behalf.run(self._walk_and_measure, PASS_TIMEOUT)
            else:
                result, cost = self._walk_and_measure()
        except Refused as exc:
            self._tree = None
            self._refused = (exc, self._clock() + QUIET_REFRESH_SECONDS)
            if self._on_refused is not None:
                self._on_refused(exc)
            raise
        self._refused = None
        now = self._clock()
        reason, resident = result.reason, result.resident_bytes
        if result.files == 0 and reason is None:
            # Not "0 of 0 bytes cached": deleted or not there yet, which a user must see.
            reason = (
                f"no weight files under {', '.join(self._weights.paths)} "
                f"matching {' '.join(self._weights.include)}"
            )
            resident = None
        if reason is not None and reason != self._warned:
            log.warning("page-cache residency unknown: %s", reason)
        self._warned = reason
        return ResidencySample(
            files=result.files,
            total_bytes=result.total_bytes,
            resident_bytes=resident,
            per_file=result.per_file,
            method=result.method,
            measured_at=now,
            pass_cpu_seconds=cost,
            next_pass_due=now + cost / self._budget,
            reason=reason,
            where=result.where,
        )
