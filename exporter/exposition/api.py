"""The /api/v1 documents as typed classes: what the exporter serves and what its clients read.

`/api/v1/status` and `/api/v1/loads` are a public surface (the live page, `wait`, `status`,
`history`, the MCP tools and users' scripts read them), so each document and part is defined
once, here: the web side builds these classes from the snapshot and writes `to_json()`, the
commands read the answer back with `from_json()`. A key renamed on one side is then an error on
the other, not a silent `None`.

`from_json` is strict about what it knows (a missing key or a value of the wrong type is a
`DocumentError` of one line that says where) and ignores keys it does not know, so an older
client reads a newer exporter. Words from the exporter's vocabulary (phase, cache, outcome,
server, storage kind, step) are plain strings here for the same reason: a newer exporter may
speak one more. Stdlib only, and nothing of the exporter's own but exporter/trust/untrusted.py
(itself stdlib only): the client commands import this without the exporter's sources.

`to_json` is one of the exporter's two exits for text (the metric labels are the other): every
string of every document, keys too, passes `untrusted.clean` there, so a path, an argument or a
log line a server chose reaches /api/v1, the live page, the CLI, history's JSON and the MCP tools
as valid UTF-8 without control or format characters, whichever field carries it.

Two kinds of optional part, as the JSON has always had them: a key written only when there is
something to say (OPTIONAL: no `residency` before the first pass), and a group of keys merged
into its parent, all present or all absent (MERGED: a target's load state, absent before the
tracker's first tick; a log's reading, before it is sampled).
"""

from __future__ import annotations

import dataclasses
import functools
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Self, Union

from exporter.trust.untrusted import clean

MAX_LOADS = 1000  # the most loads one /api/v1/loads answer holds

# Field metadata, as `field(default=None, metadata=OPTIONAL)`:
OPTIONAL = {"optional": True}  # the key is left out when the value is None
MERGED = {"optional": True, "merged": True}  # a part whose keys go into its parent's object


class DocumentError(ValueError):
    """An answer that is not the document it should be: where and what, in one line."""


class _Field(NamedTuple):
    name: str
    hint: Any  # its type, resolved
    optional: bool
    merged: bool


@functools.cache
def _schema(document: type) -> tuple[_Field, ...]:
    """A document class's fields with their types (resolved once: 10 times the cost of reading
    the document otherwise)."""
    hints = typing.get_type_hints(document)
    return tuple(
        _Field(
            f.name, hints[f.name], bool(f.metadata.get("optional")), bool(f.metadata.get("merged"))
        )
        for f in dataclasses.fields(document)
    )


class Document:
    """`to_json()` and `from_json()` for a frozen dataclass, from its fields and their types."""

    __dataclass_fields__: ClassVar[dict[str, dataclasses.Field[Any]]]  # each one is a dataclass

    def to_json(self) -> dict[str, Any]:
        """Plain JSON types (dicts, lists, str, int, float, bool, None), keys in field order."""
        out: dict[str, Any] = {}
        document: type = type(self)  # (mypy takes a class's type for unhashable)
        for f in _schema(document):
            value = getattr(self, f.name)
            if value is None and f.optional:
                continue
            if f.merged:
                out.update(value.to_json())
            else:
                out[f.name] = _encode(value)
        return out

    @classmethod
    def from_json(cls, data: object, where: str = "") -> Self:
        """The document in `data` (parsed JSON); DocumentError naming the first bad key."""
        if not isinstance(data, dict):
            raise DocumentError(f"{_at(where)}expected an object, got {_kind(data)}")
        document: type = cls
        values: dict[str, Any] = {}
        for f in _schema(document):
            if f.merged:
                part = _without_none(f.hint)
                first = _schema(part)[0].name
                values[f.name] = part.from_json(data, where) if first in data else None
            elif f.name in data:
                values[f.name] = _decode(f.hint, data[f.name], f"{where}.{f.name}".lstrip("."))
            elif not f.optional:
                raise DocumentError(f"{_at(where)}no {f.name!r}")
        return cls(**values)


def _encode(value: object) -> object:
    if isinstance(value, Document):
        return value.to_json()
    if isinstance(value, tuple):
        return [_encode(v) for v in value]
    if isinstance(value, Mapping):
        return {clean(str(k), None): _encode(v) for k, v in value.items()}
    if isinstance(value, str):
        # A StrEnum member as its plain value; every string cleaned on its way out, whoever
        # wrote it (exporter/trust/untrusted.py says why here).
        return clean(str(value), None)
    return value


def _without_none(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not types.NoneType]
    return args[0] if len(args) == 1 else hint


def _decode(hint: Any, value: object, where: str) -> Any:
    """`value` as `hint` says, or DocumentError: JSON's types, checked, nothing converted."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if value is None and types.NoneType in options:
            return None
        for option in options:
            if option is not types.NoneType and _shaped(option, value):
                return _decode(option, value, where)  # its inner errors say where they are
        raise _wrong(hint, value, where)
    if not _shaped(hint, value):
        raise _wrong(hint, value, where)
    if origin is tuple:
        assert isinstance(value, list)
        items = typing.get_args(hint)
        if items[-1] is Ellipsis:
            items = (items[0],) * len(value)
        elif len(value) != len(items):
            raise _wrong(hint, value, where)
        pairs = enumerate(zip(items, value, strict=True))
        return tuple(_decode(item, v, f"{where}[{i}]") for i, (item, v) in pairs)
    if origin is Mapping:
        assert isinstance(value, dict)
        item = typing.get_args(hint)[1]
        return {k: _decode(item, v, f"{where}.{k}") for k, v in value.items()}
    if _is_document(hint):
        return hint.from_json(value, where)
    return value


def _is_document(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, Document)


def _shaped(hint: Any, value: object) -> bool:
    """Whether `value` is the JSON kind `hint` wants, its insides not looked at."""
    origin = typing.get_origin(hint)
    if origin is tuple:
        return isinstance(value, list)
    if origin is Mapping or _is_document(hint):
        return isinstance(value, dict)
    return _is(hint, value)


def _is(hint: Any, value: object) -> bool:
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # JSON has one number type: 0 is as good a float as 0.0
        return isinstance(value, int | float) and not isinstance(value, bool)
    return hint is str and isinstance(value, str)


_NAMES = {bool: "true or false", int: "a whole number", float: "a number", str: "a string"}


def _described(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        names = [_described(a) for a in options if a is not types.NoneType]
        return " or ".join(names + (["null"] if types.NoneType in options else []))
    if origin is tuple:
        items = typing.get_args(hint)
        return "a list" if items[-1] is Ellipsis else f"a list of {len(items)}"
    if origin is Mapping or _is_document(hint):
        return "an object"
    return _NAMES.get(hint, str(hint))


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return repr(shown)
    if isinstance(value, int | float):
        return repr(value)
    return f"a list of {len(value)}" if isinstance(value, list) else "an object"


def _at(where: str) -> str:
    return f"{where}: " if where else ""


def _wrong(hint: Any, value: object, where: str) -> DocumentError:
    return DocumentError(f"{_at(where)}expected {_described(hint)}, got {_kind(value)}")


# --- /api/v1/loads -----------------------------------------------------------------------------


@dataclass(frozen=True)
class PhaseTime(Document):
    """A phase or fine step of a finished load against its median over the loads before it."""

    phase: str  # starting, loading_weights, initializing, or a fine step (compile, ...)
    seconds: float
    median_seconds: float | None  # None: no earlier load to compare with


@dataclass(frozen=True)
class StorageRead(Document):
    """What one device, network mount or ZFS pool under the weights read while a load ran."""

    kind: str  # disk, nfs, lustre, cephfs, zfs
    name: str  # the block device, the mount point, the pool
    read_bytes: int  # its counter at the load's end less at its start (host-wide)


@dataclass(frozen=True)
class ReadRate(Document):
    """The rate a load's weights came at, against the best the loads before it saw there."""

    source: str  # storage (a cold load) or page_cache (a warm one)
    bytes_per_second: float
    best_before_bytes_per_second: float | None  # None: no earlier load read from there


@dataclass(frozen=True)
class LoadReport(Document):
    """Where a finished load's time went and why, against the loads before it
    (exporter/history/explain.py); each part None where it has no basis."""

    expected_seconds: float | None  # median duration of the earlier loads of its temperature
    phases: tuple[PhaseTime, ...]
    page_cache_bytes: int | None  # of the weights, in the page cache as the load began
    storage_bytes: int | None  # read from storage by the server's process tree
    storage_reads: tuple[StorageRead, ...] | None  # None: the counters at its start are unknown
    read_rate: ReadRate | None
    reason: str | None  # why it was slower than expected; None unless it was
    # Read from storage by the server's tree before its first weight file: its own environment.
    startup_storage_bytes: int | None = field(default=None, metadata=OPTIONAL)
    # The server's own files (interpreter, packages, libraries) and the bytes of them the page
    # cache held as it began; or why they are not known.
    environment_bytes: int | None = field(default=None, metadata=OPTIONAL)
    environment_resident_bytes: int | None = field(default=None, metadata=OPTIONAL)
    environment_unknown: str | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class Load(Document):
    """One finished load, as history keeps it (`load.records.LoadRecord`)."""

    target: str
    started_at: float
    ended_at: float
    outcome: str  # ready, failed
    cache: str | None  # None: residency at the start unknown
    partial: bool  # start not known: kept out of the histograms
    phase_seconds: Mapping[str, float]
    weights_bytes: int | None
    bytes_read: int | None
    gpu_bytes_at_weights_end: int | None
    seen_late: bool
    fatal: str | None  # the server's own fatal message, when its log gave one
    id: int | None = field(default=None, metadata=OPTIONAL)  # /api/v1/loads/ID; None: not kept
    startup_read_bytes: int | None = field(default=None, metadata=OPTIONAL)
    environment_bytes: int | None = field(default=None, metadata=OPTIONAL)
    environment_resident_bytes: int | None = field(default=None, metadata=OPTIONAL)
    report: LoadReport | None = field(default=None, metadata=OPTIONAL)

    @property
    def duration_seconds(self) -> float:
        return self.ended_at - self.started_at

    def with_duration(self) -> dict[str, Any]:
        """Its JSON with `duration_seconds`, for scripts (derived, so not read back)."""
        return {**self.to_json(), "duration_seconds": self.duration_seconds}


@dataclass(frozen=True)
class Loads(Document):
    """/api/v1/loads: newest first. Each load also says its `duration_seconds`, for scripts
    (derived, so not read back)."""

    loads: tuple[Load, ...]

    def to_json(self) -> dict[str, Any]:
        return {"loads": [load.with_duration() for load in self.loads]}


# --- /api/v1/status: the parts -----------------------------------------------------------------


@dataclass(frozen=True)
class SourceReading(Document):
    """The latest sample of one source, host-wide or a target's."""

    up: bool
    error: str | None  # why the sample failed
    note: str | None  # what a sample that succeeded could not see
    duration_seconds: float
    age_seconds: float


@dataclass(frozen=True)
class LoadState(Document):
    """A target's load as the tracker sees it (`load.records.LoadState`)."""

    phase: str
    in_progress: bool
    started_at: float | None
    elapsed_seconds: float
    progress_ratio: float | None
    throughput_bytes_per_second: float | None
    weights_eta_seconds: float | None
    eta_seconds: float | None
    seconds_since_progress: float | None
    stalled: bool
    cache: str | None
    partial: bool
    seen_late: bool
    progress_source: str | None
    signals: Mapping[str, float | None]
    last_record: Load | None
    step: str | None
    fatal: str | None
    failed_probes: int  # distinct failed probes in a row
    hung: bool  # ready, its process running, and its endpoint stopped answering
    # true when the current (or last) load is a running server's (a model loaded into it)
    in_server: bool | None = field(default=None, metadata=OPTIONAL)
    # what the running server last unloaded (its log's name for it), until its next load
    unloaded: str | None = field(default=None, metadata=OPTIONAL)
    # Seconds since each measured signal (weight_bytes, storage_reads, log_lines, gpu_memory,
    # cpu) last moved; optional, as exporters before it do not say.
    activity: Mapping[str, float] | None = field(default=None, metadata=OPTIONAL)
    cpu_share: float | None = field(default=None, metadata=OPTIONAL)  # of one core, last 10 s
    process_state: str | None = field(default=None, metadata=OPTIONAL)  # T, D, R, S (/proc)
    exited_at: float | None = field(default=None, metadata=OPTIONAL)  # the process seen gone
    # true for a follower whose end of start-up only its log tells, and none is read from the
    # load's start: its quiet is no stall, and nothing makes it ready
    end_unseen: bool | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class Residency(Document):
    """The last full pass of page-cache residency over the weight files."""

    files: int
    total_bytes: int
    resident_bytes: int | None  # None: not measurable truthfully, `reason` says why
    method: str | None
    last_full_pass_age_seconds: float
    last_full_pass_cpu_seconds: float
    reason: str | None
    measured_on: str | None  # where, when not on the files themselves


@dataclass(frozen=True)
class Fact(Document):
    """Whether something holds of a filesystem (None: cannot be known here), and why."""

    value: bool | None
    reason: str


@dataclass(frozen=True)
class Mount(Document):
    """One filesystem under a target's weights (`storage.MountStorage`)."""

    kind: str
    fstype: str
    mount_point: str
    source: str
    summary: str
    paths: tuple[str, ...]
    devices: tuple[str, ...]
    lower_devices: tuple[str, ...]
    read_rate: Fact
    residency: Fact
    page_cache: Fact
    bypass: Fact
    in_memory: bool
    passthrough: str | None
    notes: tuple[str, ...]


@dataclass(frozen=True)
class CacheLabel(Document):
    """The rule a load's cache label follows on this storage."""

    fixed: str | None  # bypass or unknown whatever residency says; None: residency decides
    never_cold: bool
    residency_is_temperature: bool
    bypass: bool
    reason: str | None


@dataclass(frozen=True)
class Storage(Document):
    """What holds a target's weights and what can be measured there."""

    kinds: tuple[str, ...]
    cache_label: CacheLabel
    mounts: tuple[Mount, ...]
    unplaced: tuple[str, ...]  # "PATH: why" for weight paths that could not be looked at


@dataclass(frozen=True)
class GpuMemory(Document):
    """GPU memory the target's process tree holds on one device."""

    gpu: int
    name: str | None
    used_bytes: int
    total_bytes: int | None


@dataclass(frozen=True)
class GpuPcie(Document):
    """One GPU's PCIe RX counter, and the bytes received since the load began."""

    gpu: int
    uuid: str
    pcie_rx_bytes: int | None
    pcie_rx_bytes_since_load_start: int | None
    pcie_rx_counted_since: float | None


@dataclass(frozen=True)
class HeldFile(Document):
    """A weight file the server's tree holds open or mapped now (`weightfiles.FileUse`)."""

    name: str
    size_bytes: int
    consumed_bytes: int
    held: bool
    how: str
    holders: int
    direct: bool


@dataclass(frozen=True)
class WeightFiles(Document):
    """What the server's tree has done with its weight files."""

    visible: bool
    reason: str | None
    first_open_at: float | None
    idle_since: float | None
    consumed_bytes: int
    total_bytes: int
    files_total: int
    files_seen: int
    files_done: int
    held: tuple[HeldFile, ...]


@dataclass(frozen=True)
class LogReading(Document):
    """What the followed log said, up to its latest sample."""

    up: bool
    reason: str | None
    format: str | None  # None while `auto` has not decided
    format_reason: str
    step: str
    step_since: float | None
    weights_shards: tuple[int, int] | None  # (done, total)
    cuda_graphs: tuple[int, int] | None  # (done, total) batch sizes captured
    fatal: str | None
    lines: int
    last_line_at: float | None
    # Bytes not parsed (over a sample's CPU or byte budget), and whether the log was let go
    # because its process is gone; absent from an exporter older than both.
    skipped_bytes: int = field(default=0, metadata=OPTIONAL)
    closed: bool = field(default=False, metadata=OPTIONAL)


@dataclass(frozen=True)
class Log(Document):
    """Which log a target follows and why (configured, or found and how), or why none."""

    source: str | None  # "journald:UNIT", "file:PATH": once read
    found_by: str | None
    not_found: str | None = field(default=None, metadata=OPTIONAL)
    reading: LogReading | None = field(default=None, metadata=MERGED)


@dataclass(frozen=True)
class Evidence(Document):
    """One reason discovery gave a value: which argument, key, variable or default."""

    what: str
    value: str
    source: str


@dataclass(frozen=True)
class Discovered(Document):
    """How discovery found a target's server."""

    pid: int
    kind: str
    weights: tuple[str, ...]
    why: tuple[Evidence, ...]


@dataclass(frozen=True)
class RestartForecast(Document):
    """How long a restart begun now would take to be ready (exporter/history/forecast.py)."""

    seconds: float | None  # None: no basis, and `reason` says why
    resident_share: float | None  # share of the weights in page cache now, 0..1
    reason: str | None
    # Share of the server's own files in page cache now, 0..1; absent where not measured.
    environment_resident_share: float | None = field(default=None, metadata=OPTIONAL)
    starting_seconds: float | None = field(default=None, metadata=OPTIONAL)  # its start-up part


@dataclass(frozen=True)
class Probes(Document):
    """What /probe/alive and /probe/ready answer for the target now
    (exporter/exposition/liveness.py)."""

    alive: bool
    alive_line: str
    ready: bool
    ready_line: str


@dataclass(frozen=True)
class StartupProbe(Document):
    """The fixed startupProbe window this target's cold loads need
    (exporter/history/startupwindow.py); the numbers None and `reason` said when history has no
    cold load."""

    period_seconds: int | None
    failure_threshold: int | None
    window_seconds: int | None
    cold_loads: int
    cold_p99_seconds: float | None
    reason: str | None


# --- /api/v1/status ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Target(Document):
    """One target: its state and the evidence behind it."""

    target: str
    endpoint: str
    server: str
    sources: Mapping[str, SourceReading]
    # follower: a node of a model over several hosts that runs no API server (never probed,
    # ready at its log's end of start-up); server: any other; None: an exporter before roles
    role: str | None = field(default=None, metadata=OPTIONAL)
    # The model it serves, as configured (endpoint.model) or discovered; None: the one it is
    # named after (as the recording rules group it: docs/placement.md).
    model: str | None = field(default=None, metadata=OPTIONAL)
    state: LoadState | None = field(
        default=None, metadata=MERGED
    )  # None until the tracker's first tick
    residency: Residency | None = field(default=None, metadata=OPTIONAL)
    storage: Storage | None = field(default=None, metadata=OPTIONAL)
    gpu_memory: tuple[GpuMemory, ...] = ()
    gpu_pcie: tuple[GpuPcie, ...] = ()
    expected_duration_seconds: Mapping[str, float] = field(default_factory=dict)  # by cache
    last_duration_seconds: float | None = None
    weight_files: WeightFiles | None = field(default=None, metadata=OPTIONAL)
    log: Log = Log(None, None)
    discovered: Discovered | None = field(default=None, metadata=OPTIONAL)  # None: configured
    block_devices: tuple[str, ...] | None = field(
        default=None, metadata=OPTIONAL
    )  # None: no disk reading
    lower_block_devices: tuple[str, ...] | None = field(default=None, metadata=OPTIONAL)
    unbacked_weight_paths: tuple[str, ...] | None = field(default=None, metadata=OPTIONAL)
    unbacked_note: str | None = field(default=None, metadata=OPTIONAL)
    restart_forecast: RestartForecast | None = field(default=None, metadata=OPTIONAL)
    probes: Probes | None = field(default=None, metadata=OPTIONAL)
    startup_probe: StartupProbe | None = field(default=None, metadata=OPTIONAL)


@dataclass(frozen=True)
class History(Document):
    enabled: bool
    up: bool | None  # None: history_path "" (off by choice, not broken)
    problem: str | None


@dataclass(frozen=True)
class Status(Document):
    """/api/v1/status."""

    time: float
    version: str
    sample_interval_seconds: float
    targets: tuple[Target, ...]
    host_sources: Mapping[str, SourceReading]
    history: History
