"""The exporter's configuration: one frozen dataclass per section, and their defaults.

The dataclasses are the schema: each section's keys, their types and defaults are its fields, so
a key is spelled once. exporter/config/reader.py reads a YAML document into them: a type alone
says how most keys read (`Seconds` is a duration, `tuple[str, ...]` a list of strings, a
dataclass a nested section, a tuple of them a list); a field whose rule is its own names its
reader in its metadata (`read_by`, the readers in exporter/config/values.py), a field the YAML
never sets says so (`NOT_IN_YAML`), and a rule across keys of one section is in `FINISH`. A key
given as null is a key not given. The single-target flags are exporter/commands/serve.py's: it
turns them into the same document, read the same way.

Every mistake is reported as one `ConfigError` line naming the file and key, because an exporter
that silently ignores a typo (`stall_afer: 5m`) watches the wrong thing for months.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal
from urllib.parse import unquote, urlsplit

from exporter.config.values import (
    NOT_IN_YAML,
    ConfigError,
    Count,
    Duration,
    Seconds,
    Whole,
    check_probe_path,
    check_url,
    key_path,
    read_auto_or_flag,
    read_by,
    read_count,
    read_gpus,
    read_headers,
    read_history_path,
    read_log_files,
    read_log_format,
    read_patterns,
    read_regex,
    read_server_kinds,
    read_share,
    read_target_name,
    read_users,
    read_weight_paths,
    redact_url,
    without_userinfo,
)
from exporter.servers import SERVERS
from exporter.servers.server import DEFAULT_INCLUDE
from exporter.vocabulary import AUTO, LogEncoding, ProbeKind, TargetRole

DEFAULT_PROBE_PATHS: Mapping[ProbeKind, str] = {
    ProbeKind.COMPLETION: "/v1/completions",
    ProbeKind.HEALTH: "/health",
    ProbeKind.MODELS: "/v1/models",
    ProbeKind.TCP: "",
}
DEFAULT_HISTORY_PATH = "/var/lib/model-load-exporter/history.sqlite"
DEFAULT_SAMPLE_INTERVAL = 1.0
DEFAULT_STALL_AFTER = 300.0
DEFAULT_PROBE_TIMEOUT = 8.0
DEFAULT_READY_INTERVAL = 10.0
DEFAULT_RESIDENCY_CPU_BUDGET = 0.01
MAX_SAMPLE_INTERVAL = 3600.0
# The servers discovery recognises by their command lines unless told which: all there are.
DISCOVERY_SERVERS: tuple[str, ...] = tuple(SERVERS)
DEFAULT_DISCOVERY_INTERVAL = 5.0
DEFAULT_DISCOVERY_KEEP_FOR = 3600.0
# What any local user can make discovery hold (a host runs a few servers per GPU at most).
DEFAULT_MAX_TARGETS = 32
DEFAULT_MAX_TARGETS_PER_USER = 16
DEFAULT_MAX_FILES = 10_000  # entries a discovered target's weights walk may look at
DEFAULT_HISTORY_MAX_ROWS = 100_000
DEFAULT_HISTORY_MAX_AGE = 365 * 86400.0


@dataclass(frozen=True)
class EndpointConfig:
    # May carry credentials (http://user:pw@host): shown only as display_url, never in repr.
    url: str = field(repr=False)
    probe: ProbeKind = ProbeKind.COMPLETION
    path: str = "/v1/completions"  # the probe's own by default (DEFAULT_PROBE_PATHS)
    model: str | None = None
    timeout: Seconds = DEFAULT_PROBE_TIMEOUT
    ready_interval: Seconds = DEFAULT_READY_INTERVAL
    # Values are secrets (API keys): kept out of repr so they never reach a log line.
    headers: Mapping[str, str] = field(
        default_factory=dict, repr=False, metadata=read_by(read_headers)
    )

    @property
    def display_url(self) -> str:
        """The URL as labels, status and logs show it: a password becomes `***`."""
        return redact_url(self.url)

    @property
    def probe_url(self) -> str:
        """Where the probe goes, without credentials (they travel as basic auth)."""
        return without_userinfo(self.url).rstrip("/") + self.path

    @property
    def credentials(self) -> tuple[str, str] | None:
        """User and password from the URL's userinfo, percent-decoded, or None."""
        parts = urlsplit(self.url)
        if parts.username is None:
            return None
        return unquote(parts.username), unquote(parts.password or "")

    def __repr__(self) -> str:
        return (
            f"EndpointConfig(url={self.display_url!r}, probe={self.probe!r}, path={self.path!r}, "
            f"model={self.model!r}, timeout={self.timeout!r}, "
            f"ready_interval={self.ready_interval!r})"
        )


@dataclass(frozen=True)
class WeightsConfig:
    paths: tuple[str, ...] = field(metadata=read_by(read_weight_paths))
    include: tuple[str, ...] = field(default=DEFAULT_INCLUDE, metadata=read_by(read_patterns))
    per_file: bool = False


@dataclass(frozen=True)
class ProcessConfig:
    systemd_unit: str | None = None
    pidfile: str | None = None
    cmdline: str | None = field(default=None, metadata=read_by(read_regex))
    # A discovered server's process: its pid and start ticks.
    pid: int | None = field(default=None, metadata=NOT_IN_YAML)
    start_ticks: int | None = field(default=None, metadata=NOT_IN_YAML)


@dataclass(frozen=True)
class LogConfig:
    journald_unit: str | None = None
    file: str | None = field(default=None, metadata=read_by(read_log_files))
    format: str = field(default=AUTO, metadata=read_by(read_log_format))  # or a server kind
    encoding: LogEncoding = LogEncoding.PLAIN  # of the file(s)
    # The same server's other stream (stderr beside stdout): `file`'s list past its first.
    more_files: tuple[str, ...] = field(default=(), metadata=NOT_IN_YAML)

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *self.more_files) if self.file else ()


@dataclass(frozen=True)
class TargetConfig:
    name: str = field(metadata=read_by(read_target_name))
    endpoint: EndpointConfig
    weights: WeightsConfig | None = None
    process: ProcessConfig | None = None
    log: LogConfig | None = None
    gpus: Literal["auto"] | tuple[int, ...] = field(default="auto", metadata=read_by(read_gpus))
    stall_after: Seconds = DEFAULT_STALL_AFTER
    # A follower (one node of a model over several hosts, which runs no API server) is never
    # probed: its log's end of start-up makes it ready (docs/how-it-decides.md#a-follower-node).
    role: TargetRole = TargetRole.SERVER


@dataclass(frozen=True)
class DiscoveryConfig:
    """Finding model servers by their command lines; `auto` is on when no target is configured."""

    enabled: Literal["auto"] | bool = field(default="auto", metadata=read_by(read_auto_or_flag))
    interval: Seconds = DEFAULT_DISCOVERY_INTERVAL
    keep_for: Seconds = DEFAULT_DISCOVERY_KEEP_FOR
    servers: tuple[str, ...] = field(default=DISCOVERY_SERVERS, metadata=read_by(read_server_kinds))
    max_targets: Annotated[int, Whole(10_000)] = DEFAULT_MAX_TARGETS
    max_targets_per_user: Count = DEFAULT_MAX_TARGETS_PER_USER  # at most max_targets
    max_files: Count = DEFAULT_MAX_FILES
    # uids whose processes may be discovered; None: all
    users: tuple[int, ...] | None = field(default=None, metadata=read_by(read_users))
    # A discovered target's `stall_after`: above the longest quiet step of the servers found
    # (a compile that logs nothing for minutes), as a configured target's own is.
    stall_after: Seconds = DEFAULT_STALL_AFTER

    def active(self, has_targets: bool) -> bool:
        return self.enabled is True or (self.enabled == "auto" and not has_targets)


@dataclass(frozen=True)
class HistoryRetention:
    """How much of the past the history database keeps: no one can grow it without limit."""

    max_rows: Count = DEFAULT_HISTORY_MAX_ROWS
    max_age: Seconds = DEFAULT_HISTORY_MAX_AGE


@dataclass(frozen=True)
class MetricsConfig:
    """What /metrics carries beyond each target's default budget (docs/costs.md#a-fleet): the
    detail only a deep dive reads, which a fleet pays for in series on every host."""

    # The buckets of model_load_phase_duration_seconds (20 per phase and step; the dashboard
    # reads only _sum and _count, which are always there).
    phase_buckets: bool = False
    # Histograms also as native histograms, one series per label set, to a Prometheus that asks
    # for protobuf (>= 2.40 with --enable-feature=native-histograms); text scrapes unchanged.
    native_histograms: bool = False


@dataclass(frozen=True)
class Config:
    targets: tuple[TargetConfig, ...] = ()
    sample_interval: Annotated[float, Duration(MAX_SAMPLE_INTERVAL)] = DEFAULT_SAMPLE_INTERVAL
    history_path: str = field(default=DEFAULT_HISTORY_PATH, metadata=read_by(read_history_path))
    residency_cpu_budget: float = field(
        default=DEFAULT_RESIDENCY_CPU_BUDGET, metadata=read_by(read_share)
    )
    source: str = field(default="flags", metadata=NOT_IN_YAML)  # the file, or where instead
    discovery: DiscoveryConfig = DiscoveryConfig()
    history_retention: HistoryRetention = HistoryRetention()
    metrics: MetricsConfig = MetricsConfig()


# --- rules across the keys of one section -------------------------------------------------------

Values = dict[str, Any]  # a section's keys given, read


def _finish_endpoint(values: Values, where: str) -> Values:
    """The URL's allowed schemes and the path's default follow the probe."""
    probe = values.get("probe", ProbeKind.COMPLETION)
    check_url(values["url"], key_path(where, "url"), probe)
    if "path" in values:
        check_probe_path(values["path"], key_path(where, "path"))
    return {"path": DEFAULT_PROBE_PATHS[probe], **values}


def _finish_process(values: Values, where: str) -> Values:
    if len(values) != 1:
        raise ConfigError(f"{where}: set exactly one of systemd_unit, pidfile, cmdline")
    return values


def _finish_log(values: Values, where: str) -> Values:
    if len([k for k in ("journald_unit", "file") if k in values]) != 1:
        raise ConfigError(f"{where}: set exactly one of journald_unit, file")
    if "journald_unit" in values and "encoding" in values:
        raise ConfigError(
            f"{key_path(where, 'encoding')}: applies to file only; a journal has none"
        )
    if "file" in values:
        first, *more = values["file"]
        values = {**values, "file": first, "more_files": tuple(more)}
    return values


def _finish_discovery(values: Values, where: str) -> Values:
    """The share per user is bounded by, and defaults to no more than, max_targets."""
    most = values.get("max_targets", DEFAULT_MAX_TARGETS)
    per_user = values.get("max_targets_per_user", min(DEFAULT_MAX_TARGETS_PER_USER, most))
    read_count(per_user, key_path(where, "max_targets_per_user"), most)
    return {**values, "max_targets_per_user": per_user}


def _finish_config(values: Values, where: str) -> Values:
    """Targets are named apart, and without discovery there must be some."""
    targets: tuple[TargetConfig, ...] = values.get("targets", ())
    seen: set[str] = set()
    for i, target in enumerate(targets):
        if target.name in seen:
            where_name = key_path(where, f"targets[{i}].name")
            raise ConfigError(f"{where_name}: duplicate target name {target.name!r}")
        seen.add(target.name)
    discovery: DiscoveryConfig = values.get("discovery", DiscoveryConfig())
    if not values.get("targets") and not discovery.active(has_targets=False):
        raise ConfigError(
            "targets: expected a non-empty list of targets (discovery.enabled is false)"
        )
    return values


FINISH: Mapping[type, Callable[[Values, str], Values]] = {
    EndpointConfig: _finish_endpoint,
    ProcessConfig: _finish_process,
    LogConfig: _finish_log,
    DiscoveryConfig: _finish_discovery,
    Config: _finish_config,
}
