"""YAML config and single-target flags -> frozen dataclasses.

Every mistake is reported as one `ConfigError` line naming the file and key, because an exporter
that silently ignores a typo (`stall_afer: 5m`) watches the wrong thing for months.
"""

from __future__ import annotations

import math
import os
import pwd
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import unquote, urlsplit, urlunsplit

import yaml

from exporter.servers import SERVERS
from exporter.servers.server import DEFAULT_INCLUDE
from exporter.vocabulary import AUTO, LogEncoding, ProbeKind

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
# Longer than any sensible setting and far below what timers accept (threading.TIMEOUT_MAX), so
# a typo like 99999999999h is an error here instead of an OverflowError in every sampler thread.
MAX_DURATION = 3650 * 86400.0
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

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TARGET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*\Z")
_E = TypeVar("_E", bound=StrEnum)
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")  # an HTTP token (RFC 9110)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_VALUE_BAD_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # tab is allowed


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the user should see."""


@dataclass(frozen=True)
class EndpointConfig:
    # May carry credentials (http://user:pw@host): shown only as display_url, never in repr.
    url: str = field(repr=False)
    probe: ProbeKind = ProbeKind.COMPLETION
    path: str = "/v1/completions"
    model: str | None = None
    timeout: float = DEFAULT_PROBE_TIMEOUT
    ready_interval: float = DEFAULT_READY_INTERVAL
    # Values are secrets (API keys): kept out of repr so they never reach a log line.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def display_url(self) -> str:
        """The URL as labels, status and logs show it: a password becomes `***`."""
        return redact_url(self.url)

    @property
    def probe_url(self) -> str:
        """Where the probe goes, without credentials (they travel as basic auth)."""
        return _without_userinfo(self.url).rstrip("/") + self.path

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


def redact_url(url: str) -> str:
    """`http://admin:pw@host:1` -> `http://admin:***@host:1`; URLs without a password unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def _without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


@dataclass(frozen=True)
class WeightsConfig:
    paths: tuple[str, ...]
    include: tuple[str, ...] = DEFAULT_INCLUDE
    per_file: bool = False


@dataclass(frozen=True)
class ProcessConfig:
    systemd_unit: str | None = None
    pidfile: str | None = None
    cmdline: str | None = None
    # A discovered server's process: its pid and start ticks (never from the YAML).
    pid: int | None = None
    start_ticks: int | None = None


@dataclass(frozen=True)
class LogConfig:
    journald_unit: str | None = None
    file: str | None = None
    format: str = AUTO  # or a server kind (exporter/servers)
    encoding: LogEncoding = LogEncoding.PLAIN  # of the file(s)
    more_files: tuple[str, ...] = ()  # the same server's other stream (stderr beside stdout)

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *self.more_files) if self.file else ()


@dataclass(frozen=True)
class TargetConfig:
    name: str
    endpoint: EndpointConfig
    weights: WeightsConfig | None = None
    process: ProcessConfig | None = None
    log: LogConfig | None = None
    gpus: Literal["auto"] | tuple[int, ...] = "auto"
    stall_after: float = DEFAULT_STALL_AFTER


@dataclass(frozen=True)
class DiscoveryConfig:
    """Finding model servers by their command lines; `auto` is on when no target is configured."""

    enabled: Literal["auto"] | bool = "auto"
    interval: float = DEFAULT_DISCOVERY_INTERVAL
    keep_for: float = DEFAULT_DISCOVERY_KEEP_FOR
    servers: tuple[str, ...] = DISCOVERY_SERVERS
    max_targets: int = DEFAULT_MAX_TARGETS
    max_targets_per_user: int = DEFAULT_MAX_TARGETS_PER_USER
    max_files: int = DEFAULT_MAX_FILES
    users: tuple[int, ...] | None = None  # uids whose processes may be discovered; None: all

    def active(self, has_targets: bool) -> bool:
        return self.enabled is True or (self.enabled == "auto" and not has_targets)


@dataclass(frozen=True)
class HistoryRetention:
    """How much of the past the history database keeps: no one can grow it without limit."""

    max_rows: int = DEFAULT_HISTORY_MAX_ROWS
    max_age: float = DEFAULT_HISTORY_MAX_AGE


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
    targets: tuple[TargetConfig, ...]
    sample_interval: float = DEFAULT_SAMPLE_INTERVAL
    history_path: str = DEFAULT_HISTORY_PATH
    residency_cpu_budget: float = DEFAULT_RESIDENCY_CPU_BUDGET
    source: str = "flags"
    discovery: DiscoveryConfig = DiscoveryConfig()
    history_retention: HistoryRetention = HistoryRetention()
    metrics: MetricsConfig = MetricsConfig()


def parse_duration(value: object, where: str, maximum: float = MAX_DURATION) -> float:
    """Parse a Prometheus-style duration (`500ms`, `30s`, `5m`, `1h30m`) into seconds."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ConfigError(
            f"{where}: expected a duration like 30s, 5m or 500ms, got {_short(value)}"
        )
    text = value.strip()
    pos, total = 0, 0.0
    for match in _DURATION_RE.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ConfigError(
            f"{where}: expected a duration like 30s, 5m or 500ms, got {_short(value)}"
        )
    if total <= 0:
        raise ConfigError(f"{where}: duration must be positive, got {value!r}")
    if not math.isfinite(total) or total > maximum:
        raise ConfigError(
            f"{where}: {_short(value)} is too long (at most {format_duration(maximum)})"
        )
    return total


def _short(value: object, limit: int = 40) -> str:
    """repr() cut to a length that keeps an error message on one readable line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 4]}...{text[-1]}"


def format_duration(seconds: float) -> str:
    """The inverse of parse_duration for summaries: 90 -> '1m30s', 1.5 -> '1s500ms'."""
    millis = round(seconds * 1000)
    parts = []
    for unit, size in (("h", 3_600_000), ("m", 60_000), ("s", 1000), ("ms", 1)):
        if millis >= size:
            parts.append(f"{millis // size}{unit}")
            millis %= size
    return "".join(parts) or "0s"


class _Reader:
    """Walks one mapping of the YAML tree, type-checking keys and rejecting unknown ones."""

    def __init__(self, data: object, where: str, allowed: Sequence[str]) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = [str(k) for k in data if k not in allowed]
        if unknown:
            raise ConfigError(
                f"{where}: unknown key {unknown[0]!r} (allowed: {', '.join(allowed)})"
            )
        self.data = data
        self.where = where

    def key(self, name: str) -> str:
        return f"{self.where}.{name}" if self.where else name

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def text(self, name: str, default: str | None = None, required: bool = False) -> str | None:
        value = self.data.get(name)
        if value is None:
            if required:
                raise ConfigError(f"{self.key(name)}: required")
            return default
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{self.key(name)}: expected a non-empty string, got {value!r}")
        if "\0" in value:
            raise ConfigError(f"{self.key(name)}: contains a NUL byte")
        return value

    def choice(self, name: str, choices: type[_E], default: _E) -> _E:
        return choices(self.one_of(name, tuple(choices), default))

    def one_of(self, name: str, choices: Sequence[str], default: str) -> str:
        value = self.text(name, default) or default
        if value not in choices:
            raise ConfigError(
                f"{self.key(name)}: must be one of {', '.join(choices)}, got {value!r}"
            )
        return value

    def duration(self, name: str, default: float, maximum: float = MAX_DURATION) -> float:
        if not self.has(name):
            return default
        return parse_duration(self.data[name], self.key(name), maximum)

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: expected true or false, got {value!r}")
        return value

    def count(self, name: str, default: int, maximum: int = 10**9) -> int:
        value = self.data.get(name, default)
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
            raise ConfigError(
                f"{self.key(name)}: expected a whole number from 1 to {maximum}, got "
                f"{_short(value)}"
            )
        return value

    def str_list(self, name: str, default: tuple[str, ...] | None = None) -> tuple[str, ...]:
        value = self.data.get(name)
        if value is None:
            if default is None:
                raise ConfigError(f"{self.key(name)}: required")
            return default
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{self.key(name)}: expected a non-empty list of strings")
        for i, item in enumerate(value):
            if not isinstance(item, str) or not item:
                raise ConfigError(
                    f"{self.key(name)}[{i}]: expected a non-empty string, got {item!r}"
                )
            if "\0" in item:
                raise ConfigError(f"{self.key(name)}[{i}]: contains a NUL byte")
        return tuple(value)


def expand_env(value: str, where: str, env: Mapping[str, str]) -> str:
    """Expand `${VAR}`; a missing variable is an error, not an empty credential."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return env[name]

    return _ENV_RE.sub(sub, value)


def _check_url(url: str, where: str, probe: ProbeKind) -> None:
    schemes = ("http", "https", "tcp") if probe == ProbeKind.TCP else ("http", "https")
    shown = _short(redact_url_safely(url), 80)
    if _CONTROL_RE.search(url) or " " in url:
        raise ConfigError(f"{where}: spaces or control characters in {shown}")
    try:
        parts = urlsplit(url)
        hostname = parts.hostname
    except ValueError as exc:  # e.g. http://[::1:19201 ("Invalid IPv6 URL")
        raise ConfigError(f"{where}: malformed URL {shown}: {exc}") from None
    if parts.scheme not in schemes or not hostname:
        raise ConfigError(f"{where}: expected an absolute {'/'.join(schemes)} URL, got {shown}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{where}: invalid port in {shown}") from None
    if probe == ProbeKind.TCP and port is None and parts.scheme == "tcp":
        raise ConfigError(f"{where}: a tcp probe needs a port in {url!r}")


def redact_url_safely(url: str) -> str:
    """redact_url for a URL that may not even parse (error messages about it)."""
    try:
        return redact_url(url)
    except ValueError:
        scheme, sep, rest = url.partition("://")
        userinfo, at, host = rest.rpartition("@")
        if at and ":" in userinfo:
            return f"{scheme}{sep}{userinfo.partition(':')[0]}:***@{host}"
        return url


def _header(name: object, value: object, where: str, env: Mapping[str, str]) -> tuple[str, str]:
    """One probe header; the value (a secret, once expanded) never appears in an error."""
    if not isinstance(name, str) or not isinstance(value, str):
        raise ConfigError(f"{where}: header names and values must be strings")
    if not _HEADER_NAME_RE.match(name):
        raise ConfigError(f"{where}: {_short(name)} is not a valid HTTP header name")
    expanded = expand_env(value, where, env)
    if _HEADER_VALUE_BAD_RE.search(expanded):
        # CR/LF would end the header and let the config (or the environment) forge requests.
        raise ConfigError(f"{where}: the value contains a line break or control character")
    return name, expanded


def _endpoint(data: object, where: str, env: Mapping[str, str]) -> EndpointConfig:
    r = _Reader(
        data, where, ("url", "probe", "path", "model", "timeout", "ready_interval", "headers")
    )
    probe = r.choice("probe", ProbeKind, ProbeKind.COMPLETION)
    url = r.text("url", required=True)
    assert url is not None
    _check_url(url, r.key("url"), probe)
    path = r.text("path", DEFAULT_PROBE_PATHS[probe]) or ""
    if path and not path.startswith("/"):
        raise ConfigError(f"{r.key('path')}: must start with '/', got {_short(path)}")
    if _CONTROL_RE.search(path) or " " in path:
        raise ConfigError(f"{r.key('path')}: spaces or control characters in {_short(path)}")
    raw_headers = r.data.get("headers") or {}
    if not isinstance(raw_headers, Mapping):
        raise ConfigError(f"{r.key('headers')}: expected a mapping of header names to values")
    headers = dict(
        _header(name, value, f"{r.key('headers')}.{name}", env)
        for name, value in raw_headers.items()
    )
    return EndpointConfig(
        url=url,
        probe=probe,
        path=path,
        model=r.text("model"),
        timeout=r.duration("timeout", DEFAULT_PROBE_TIMEOUT),
        ready_interval=r.duration("ready_interval", DEFAULT_READY_INTERVAL),
        headers=headers,
    )


def _check_weights_path(path: str, where: str) -> None:
    try:
        is_dir = stat.S_ISDIR(os.stat(path).st_mode)
    except FileNotFoundError:
        raise ConfigError(f"{where}: {path} does not exist") from None
    except PermissionError:
        raise ConfigError(f"{where}: {path} is not readable by this user") from None
    except OSError as exc:
        raise ConfigError(f"{where}: {path}: {exc.strerror}") from None
    # Effective ids: what the exporter will have when it opens the files.
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0), effective_ids=True):
        raise ConfigError(f"{where}: {path} is not readable by this user")


def glob_problem(pattern: str) -> str | None:
    """Why an fnmatch pattern cannot mean what its author meant, or None.

    fnmatch takes an unclosed `[` literally, so `[unclosed` would match nothing, silently; and
    patterns are matched against file names, so one with a `/` never matches anything.
    """
    if "/" in pattern:
        return "patterns match file names, not paths: remove the directory part"
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "[":
            j = i + 1
            if j < n and pattern[j] == "!":
                j += 1
            if j < n and pattern[j] == "]":
                j += 1
            while j < n and pattern[j] != "]":
                j += 1
            if j >= n:
                return f"unclosed '[' at position {i}"
            i = j
        i += 1
    return None


def _weights(data: object, where: str) -> WeightsConfig:
    r = _Reader(data, where, ("paths", "include", "per_file"))
    paths = r.str_list("paths")
    for i, path in enumerate(paths):
        _check_weights_path(path, f"{r.key('paths')}[{i}]")
    include = r.str_list("include", DEFAULT_INCLUDE)
    for i, pattern in enumerate(include):
        problem = glob_problem(pattern)
        if problem is not None:
            raise ConfigError(f"{r.key('include')}[{i}]: {_short(pattern)}: {problem}")
    return WeightsConfig(
        paths=tuple(str(Path(p).absolute()) for p in paths),
        include=include,
        per_file=r.flag("per_file", False),
    )


def _process(data: object, where: str) -> ProcessConfig:
    r = _Reader(data, where, ("systemd_unit", "pidfile", "cmdline"))
    chosen = [k for k in ("systemd_unit", "pidfile", "cmdline") if r.has(k)]
    if len(chosen) != 1:
        raise ConfigError(f"{where}: set exactly one of systemd_unit, pidfile, cmdline")
    cmdline = r.text("cmdline")
    if cmdline is not None:
        try:
            re.compile(cmdline)
        except re.error as exc:
            raise ConfigError(f"{r.key('cmdline')}: invalid regular expression: {exc}") from None
    return ProcessConfig(
        systemd_unit=r.text("systemd_unit"), pidfile=r.text("pidfile"), cmdline=cmdline
    )


def _log(data: object, where: str) -> LogConfig:
    r = _Reader(data, where, ("journald_unit", "file", "format", "encoding"))
    if len([k for k in ("journald_unit", "file") if r.has(k)]) != 1:
        raise ConfigError(f"{where}: set exactly one of journald_unit, file")
    if r.has("journald_unit") and r.has("encoding"):
        raise ConfigError(f"{r.key('encoding')}: applies to file only; a journal has none")
    files = r.str_list("file") if r.has("file") else ()
    if len(set(files)) != len(files):
        raise ConfigError(f"{r.key('file')}: a path is listed twice")
    return LogConfig(
        journald_unit=r.text("journald_unit"),
        file=files[0] if files else None,
        more_files=files[1:],
        format=r.one_of("format", (AUTO, *SERVERS), AUTO),
        encoding=r.choice("encoding", LogEncoding, LogEncoding.PLAIN),
    )


def _gpus(value: object, where: str) -> Literal["auto"] | tuple[int, ...]:
    if value is None or value == "auto":
        return "auto"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return tuple(value)
    raise ConfigError(f"{where}: expected auto or a list of GPU indexes like [0, 1], got {value!r}")


def _target(data: object, where: str, env: Mapping[str, str]) -> TargetConfig:
    r = _Reader(
        data, where, ("name", "endpoint", "weights", "process", "log", "gpus", "stall_after")
    )
    name = r.text("name", required=True)
    assert name is not None
    if not _TARGET_NAME_RE.match(name):
        raise ConfigError(f"{r.key('name')}: {name!r} may use only letters, digits and _ . : -")
    if not r.has("endpoint"):
        raise ConfigError(f"{r.key('endpoint')}: required")
    return TargetConfig(
        name=name,
        endpoint=_endpoint(r.data["endpoint"], r.key("endpoint"), env),
        weights=_weights(r.data["weights"], r.key("weights")) if r.has("weights") else None,
        process=_process(r.data["process"], r.key("process")) if r.has("process") else None,
        log=_log(r.data["log"], r.key("log")) if r.has("log") else None,
        gpus=_gpus(r.data.get("gpus"), r.key("gpus")),
        stall_after=r.duration("stall_after", DEFAULT_STALL_AFTER),
    )


def _discovery(data: object, where: str) -> DiscoveryConfig:
    if data is None:
        return DiscoveryConfig()
    r = _Reader(
        data,
        where,
        (
            "enabled",
            "interval",
            "keep_for",
            "servers",
            "max_targets",
            "max_targets_per_user",
            "max_files",
            "users",
        ),
    )
    raw_enabled = r.data.get("enabled", "auto")
    if raw_enabled is not True and raw_enabled is not False and raw_enabled != "auto":
        raise ConfigError(f"{r.key('enabled')}: expected auto, true or false, got {raw_enabled!r}")
    enabled: Literal["auto"] | bool = "auto" if raw_enabled == "auto" else bool(raw_enabled)
    servers = r.str_list("servers", DISCOVERY_SERVERS)
    for i, server in enumerate(servers):
        if server not in SERVERS:
            raise ConfigError(
                f"{r.key('servers')}[{i}]: must be one of {', '.join(SERVERS)}, got {server!r}"
            )
    max_targets = r.count("max_targets", DEFAULT_MAX_TARGETS, 10_000)
    return DiscoveryConfig(
        enabled=enabled,
        interval=r.duration("interval", DEFAULT_DISCOVERY_INTERVAL),
        keep_for=r.duration("keep_for", DEFAULT_DISCOVERY_KEEP_FOR),
        servers=tuple(dict.fromkeys(servers)),
        max_targets=max_targets,
        max_targets_per_user=r.count(
            "max_targets_per_user", min(DEFAULT_MAX_TARGETS_PER_USER, max_targets), max_targets
        ),
        max_files=r.count("max_files", DEFAULT_MAX_FILES),
        users=_users(r.data.get("users"), r.key("users")),
    )


def _users(value: object, where: str) -> tuple[int, ...] | None:
    """User names or uids -> uids; a name this host does not know is an error, not a no-op."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of user names or uids")
    uids: list[int] = []
    for i, user in enumerate(value):
        if isinstance(user, int) and not isinstance(user, bool) and 0 <= user < 2**32 - 1:
            uids.append(user)
        elif isinstance(user, str) and user:
            try:
                uids.append(pwd.getpwnam(user).pw_uid)
            except KeyError:
                raise ConfigError(f"{where}[{i}]: no user {_short(user)} on this host") from None
        else:
            raise ConfigError(f"{where}[{i}]: expected a user name or uid, got {_short(user)}")
    return tuple(dict.fromkeys(uids))


def _retention(data: object, where: str) -> HistoryRetention:
    if data is None:
        return HistoryRetention()
    r = _Reader(data, where, ("max_rows", "max_age"))
    return HistoryRetention(
        max_rows=r.count("max_rows", DEFAULT_HISTORY_MAX_ROWS),
        max_age=r.duration("max_age", DEFAULT_HISTORY_MAX_AGE),
    )


def _metrics(data: object, where: str) -> MetricsConfig:
    if data is None:
        return MetricsConfig()
    r = _Reader(data, where, ("phase_buckets", "native_histograms"))
    return MetricsConfig(
        phase_buckets=r.flag("phase_buckets", False),
        native_histograms=r.flag("native_histograms", False),
    )


def parse_config(
    data: object, source: str = "config", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-loaded YAML document (an empty one means: discover everything)."""
    env = os.environ if env is None else env
    if data is None:
        data = {}
    r = _Reader(
        data,
        "",
        (
            "sample_interval",
            "history_path",
            "history_retention",
            "residency_cpu_budget",
            "discovery",
            "metrics",
            "targets",
        ),
    )
    discovery = _discovery(r.data.get("discovery"), "discovery")
    raw_targets = r.data.get("targets")
    if raw_targets is None:
        raw_targets = []
    if not isinstance(raw_targets, list):
        raise ConfigError("targets: expected a list of targets")
    if not raw_targets and not discovery.active(has_targets=False):
        raise ConfigError(
            "targets: expected a non-empty list of targets (discovery.enabled is false)"
        )
    targets = tuple(_target(t, f"targets[{i}]", env) for i, t in enumerate(raw_targets))
    seen: set[str] = set()
    for i, target in enumerate(targets):
        if target.name in seen:
            raise ConfigError(f"targets[{i}].name: duplicate target name {target.name!r}")
        seen.add(target.name)
    history_path = r.data.get("history_path", DEFAULT_HISTORY_PATH)
    if not isinstance(history_path, str) or "\0" in history_path:
        raise ConfigError(f'history_path: expected a path or "", got {_short(history_path)}')
    budget = r.data.get("residency_cpu_budget", DEFAULT_RESIDENCY_CPU_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 1:
        raise ConfigError(
            f"residency_cpu_budget: expected a share of one core in (0, 1], got {budget!r}"
        )
    return Config(
        targets=targets,
        sample_interval=r.duration("sample_interval", DEFAULT_SAMPLE_INTERVAL, MAX_SAMPLE_INTERVAL),
        history_path=history_path,
        residency_cpu_budget=float(budget),
        source=source,
        discovery=discovery,
        history_retention=_retention(r.data.get("history_retention"), "history_retention"),
        metrics=_metrics(r.data.get("metrics"), "metrics"),
    )


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice: YAML keeps the last silently, hiding the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, list | dict):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {_short(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> Any:
    """Read a YAML file; every failure (unreadable, not UTF-8, bad YAML) is one ConfigError line."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None


def load_config(path: str, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; every failure is one ConfigError line naming the file."""
    data = read_yaml(path)
    try:
        return parse_config(data, source=path, env=env)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
