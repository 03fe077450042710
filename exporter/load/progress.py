"""What a load's signals say of its weights, tick by tick: each signal's estimate of the progress,
which of them may drive it given the cache temperature, the temperature itself, and what a tick's
observation adds to the load's account (the reads at the first weight-file open, the storage's
word on the label, the residency at the start).

Functions of the load's bookkeeping (exporter/load/book.py) and one observation: the rules the
tracker applies within a load, apart from its boundaries and phases (exporter/load/tracker.py).
"""

from __future__ import annotations

from collections.abc import Iterable

from exporter.load.activity import MOVE_BYTES
from exporter.load.book import Evidence, LoadBook
from exporter.load.observation import Observation
from exporter.vocabulary import Cache, Signal

# Tie-break order when two signals report the same progress.
PROGRESS_SOURCES = tuple(Signal)

# Resident share of the weights at the start that makes a load warm (>=) or cold (<=), mixed
# between: a few pages either way (a stray read, some eviction) must not change the label.
WARM_SHARE = 0.9
COLD_SHARE = 0.1

_STORAGE = (Signal.PAGE_CACHE, Signal.PROCESS_READS, Signal.DISK_READS)
_WHOLE = (Signal.GPU_MEMORY, Signal.PROCESS_READ_CHARS)


def note_files(load: LoadBook, obs: Observation, prev: Observation | None) -> None:
    """The storage reads at the first weight-file open (and at the look before it: what
    start-up read), and whether a late load's phases can be told at all."""
    files = obs.files
    if files is None or files.pending:
        return
    first_look, load.files_looked = not load.files_looked, True
    if files.first_open_at is None:
        if load.seen_late and first_look:
            load.phases_unknown = True  # nothing held on arrival: before or after its weights?
        return
    if load.reads_at_open is None:
        load.reads_at_open = obs.process_read_bytes
        before = prev.process_read_bytes if prev is not None else None
        load.startup_reads = obs.process_read_bytes if before is None else before
    if load.rx_at_open is None:
        load.rx_at_open = obs.gpu_rx_bytes
    if files.first_open_seen:
        load.phases_unknown = False


def note_storage(load: LoadBook, obs: Observation) -> None:
    """Where residency is not the cache temperature, the label says what is instead: a load
    whose weights are read with O_DIRECT or through a direct-I/O mount bypassed the cache
    (whatever was resident), one on ZFS is unknown (its ARC served it), one from tmpfs was
    in memory all along."""
    files = obs.files
    if files is not None and files.direct:
        load.cache = Cache.BYPASS
    elif obs.storage_cache is not None and load.cache is not Cache.BYPASS:
        load.cache = obs.storage_cache


def note_residency(load: LoadBook, obs: Observation) -> None:
    """Cache temperature and the storage baseline come from the first pass after the start.

    The pass lands up to a couple of intervals after the start (or, for a load first seen
    mid-way, long after it). What the tree has read from storage since it started was not
    cached at the start, so it is taken back out: otherwise the first second of a cold load
    at 240 MB/s would already read as "mixed", and a cold load seen half-way as "mixed" too.
    A load seen late whose tree's storage reads are unknown keeps an unknown temperature.
    """
    if load.resident_start is not None or load.partial or obs.resident_bytes is None:
        return
    measured = obs.resident_measured_at if obs.resident_measured_at is not None else obs.time
    if measured < load.started_at:
        return
    read_since_start = obs.process_read_bytes if obs.process_found else None
    if read_since_start is not None and load.reads_base is not None:
        read_since_start -= load.reads_base  # an in-server load: since it began
    if load.seen_late and read_since_start is None:
        return
    load.resident_start = max(0, obs.resident_bytes - (read_since_start or 0))
    if load.weights_bytes:
        load.cache = temperature(load.resident_start / load.weights_bytes)


def evidence(load: LoadBook, obs: Observation) -> dict[Signal, Evidence]:
    """Every progress estimate this tick can make, whether or not it drives progress."""
    weights = load.weights_bytes
    out: dict[Signal, Evidence] = {}
    uncached = None
    if load.resident_start is not None and weights:
        uncached = max(0, weights - load.resident_start)
    storage_basis = uncached if uncached is not None else weights
    files = obs.files
    # With the files in view, the tree's storage bytes count only from the first weight-file
    # open and only up to the files held so far: never ahead of the file view. Residency
    # growth is the weight files' own pages: it counts even for files opened and closed
    # between two looks.
    cap = files.seen_bytes if files is not None else None
    if storage_basis:
        if uncached is not None and obs.resident_bytes is not None:
            growth = capped(obs.resident_bytes - (load.resident_start or 0), None)
            out[Signal.PAGE_CACHE] = Evidence(growth / storage_basis, storage_basis)
        if obs.process_read_bytes is not None:
            reads = obs.process_read_bytes
            if files is not None:
                at_open = load.reads_at_open if load.reads_at_open is not None else reads
                reads = capped(reads - at_open, cap)
            out[Signal.PROCESS_READS] = Evidence(reads / storage_basis, storage_basis)
        tree_unknown = obs.process_read_bytes is None and obs.process_read_chars is None
        if tree_unknown and obs.disk_read_bytes is not None and load.disk_base is not None:
            reads = obs.disk_read_bytes - load.disk_base
            out[Signal.DISK_READS] = Evidence(reads / storage_basis, storage_basis)
    if obs.process_read_chars is not None and weights:
        out[Signal.PROCESS_READ_CHARS] = Evidence(obs.process_read_chars / weights, weights)
    files_basis = weights or (files.total_bytes if files is not None else None)
    if files is not None and files_basis:
        out[Signal.WEIGHT_FILES] = Evidence(files.consumed_bytes / files_basis, files_basis)
        if obs.gpu_rx_bytes is not None and load.rx_at_open is not None:
            # Bytes reaching the GPUs since the first weight file opened: each rank's GPU
            # receives its own slice, so the sum is the tree's, capped by the files held.
            rx = capped(obs.gpu_rx_bytes - load.rx_at_open, cap)
            out[Signal.GPU_PCIE] = Evidence(rx / files_basis, files_basis)
    if load.log_shards is not None:
        done, total = load.log_shards
        out[Signal.LOG_SHARDS] = Evidence(done / total, weights or None)
    base = load.gpu_base
    if obs.process_gpu_bytes is not None and base is not None:
        expected = load.expected_gpu
        gpu_basis = expected - base if expected is not None and expected > base else weights
        if gpu_basis:
            held = obs.process_gpu_bytes - base
            out[Signal.GPU_MEMORY] = Evidence(held / gpu_basis, gpu_basis)
    return out


def driving(load: LoadBook, obs: Observation) -> tuple[Signal, ...]:
    """Which signals may drive progress, given what residency says about this load.

    Where the weight files are in view, they drive; storage reads (capped by them, see
    `evidence`) count too where the load reads from storage, for a loader that maps a file
    whole and lets readahead fill it (llama.cpp). Read() bytes and GPU memory never do:
    ranks read every file, and GPUs are allocated before anything is read.
    """
    if obs.files is not None:
        warm = load.cache is Cache.WARM
        seen = (Signal.WEIGHT_FILES, Signal.GPU_PCIE)
        return seen if warm else (*seen, *_STORAGE)
    if load.resident_start is not None and load.weights_bytes:
        warm = load.cache is Cache.WARM
        preferred, other = (_WHOLE, _STORAGE) if warm else (_STORAGE, _WHOLE)
        return preferred if any(s in load.evidence for s in preferred) else other
    if obs.resident_bytes is not None:
        # Residency is measurable but the first pass of this load has not landed yet: until
        # the cache temperature is known, only storage reads count. read() bytes would also
        # count the interpreter reading its own libraries from the page cache.
        return _STORAGE
    unknown = (*_STORAGE, Signal.PROCESS_READ_CHARS)
    return unknown if any(s in load.evidence for s in unknown) else (Signal.GPU_MEMORY,)


def advance_progress(load: LoadBook, obs: Observation) -> None:
    best: tuple[Signal, Evidence] | None = None
    # Shards the log has counted are this load's whatever the cache says; but shards differ
    # in size (vLLM's test checkpoint: 648, 24, 24 and 648 MB), so where the files are in
    # view, their bytes say it better and the count would run ahead of them.
    allowed = driving(load, obs)
    if obs.files is None:
        allowed = (*allowed, Signal.LOG_SHARDS)
    for source in PROGRESS_SOURCES:
        ev = load.evidence.get(source)
        if source in allowed and ev is not None and (best is None or ev.ratio > best[1].ratio):
            best = (source, ev)
    rose = False
    if best is not None:
        source, ev = best
        ratio = min(1.0, max(0.0, ev.ratio))
        before = load.progress
        if before is None or ratio > before:
            gained = ratio - (before or 0.0)
            rose = ev.basis is None or gained * ev.basis >= MOVE_BYTES
            load.progress, load.source, load.basis = ratio, source, ev.basis
    if rose:
        load.last_rise = obs.time
        load.gpu_at_rise = obs.process_gpu_bytes
    else:
        load.flat_time = obs.time
        load.flat_progress = load.progress or 0.0


def signals(load: LoadBook | None, obs: Observation | None) -> dict[str, float | int | None]:
    """Every signal and estimate behind the state, raw, for /api/v1/status to show."""
    out: dict[str, float | int | None] = {}
    if obs is not None:
        out.update(
            weights_bytes=obs.weights_bytes,
            resident_bytes=obs.resident_bytes,
            process_read_bytes=obs.process_read_bytes,
            process_read_chars=obs.process_read_chars,
            process_gpu_bytes=obs.process_gpu_bytes,
            disk_read_bytes=obs.disk_read_bytes,
        )
        if obs.files is not None:
            out.update(
                weight_files_consumed_bytes=obs.files.consumed_bytes,
                weight_files_seen_bytes=obs.files.seen_bytes,
                weight_files_first_open_at=obs.files.first_open_at,
            )
    if load is not None:
        out.update(
            resident_bytes_at_start=load.resident_start,
            gpu_bytes_at_start=load.gpu_base,
            expected_weights_gpu_bytes=load.expected_gpu,
            disk_read_bytes_at_start=load.disk_base,
        )
        out.update({f"progress_{k}": ev.ratio for k, ev in load.evidence.items()})
    return out


def temperature(resident_share: float) -> Cache:
    """Cache temperature of a load from the share of its weights cached at its start."""
    if resident_share >= WARM_SHARE:
        return Cache.WARM
    return Cache.COLD if resident_share <= COLD_SHARE else Cache.MIXED


def value_at(observations: Iterable[Observation], at: float) -> int | None:
    """Device-read counter at `at`: the last reading before it, else the first one after."""
    before = after = None
    for obs in observations:
        if obs.disk_read_bytes is None:
            continue
        if obs.time <= at:
            before = obs.disk_read_bytes
        elif after is None:
            after = obs.disk_read_bytes
    return before if before is not None else after


def moved(prev: Observation | None, obs: Observation) -> bool:
    """Whether any byte signal moved by MOVE_BYTES since the previous tick."""
    if prev is None:
        return False
    counters = [
        (prev.process_read_bytes, obs.process_read_bytes),
        (prev.process_read_chars, obs.process_read_chars),
    ]
    if obs.process_read_bytes is None and obs.process_read_chars is None:
        # Host-wide device reads are noise when the tree's own counters exist.
        counters.append((prev.disk_read_bytes, obs.disk_read_bytes))
    if prev.files is not None and obs.files is not None:
        counters.append((prev.files.consumed_bytes, obs.files.consumed_bytes))
    levels = [
        (prev.process_gpu_bytes, obs.process_gpu_bytes),
        (prev.resident_bytes, obs.resident_bytes),
    ]
    return any(a is not None and b is not None and b - a >= MOVE_BYTES for a, b in counters) or any(
        a is not None and b is not None and abs(b - a) >= MOVE_BYTES for a, b in levels
    )


def capped(value: int, cap: int | None) -> int:
    return max(0, value if cap is None else min(value, cap))
