"""YAML config and single-target flags -> frozen dataclasses.

Every mistake is reported as one `ConfigError` line naming the file and key, because an exporter
that silently ignores a typo (`stall_afer: 5m`) watches the wrong thing for months.

The dataclasses are the schema: each section's keys, their types and defaults are its fields
(`read_section` reads any of them), so a key is spelled once. A type alone says how most keys read
(`Seconds` is a duration, `tuple[str, ...]` a list of strings, a dataclass a nested section);
a field whose rule is its own names its reader in its metadata (`read_by`), a field the YAML
never sets says so (`NOT_IN_YAML`), and a rule across keys of one section is in `_FINISH`.
A key given as null is a key not given.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import pwd
import re
import stat
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints
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
_D = TypeVar("_D")
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_HEADER_NAME_RE = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")  # an HTTP token (RFC 9110)
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_HEADER_VALUE_BAD_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")  # tab is allowed


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the user should see."""


# --- how a key reads, where its Python type alone does not say ----------------------------------


@dataclass(frozen=True)
class Duration:
    """A float read from a duration like `30s` (parse_duration), at most `maximum` seconds."""

    maximum: float = MAX_DURATION


@dataclass(frozen=True)
class Whole:
    """An int read as a whole number from 1 to `maximum`."""

    maximum: int = 10**9


Seconds = Annotated[float, Duration()]
Count = Annotated[int, Whole()]
# A key's reader: (YAML value, the key's dotted path for messages, the environment) -> value.
KeyReader = Callable[[object, str, Mapping[str, str]], Any]
NOT_IN_YAML = {"yaml": False}  # set by the exporter (discovery, flags), never by the file


def read_by(reader: KeyReader) -> dict[str, Any]:
    """Field metadata: this key has a rule of its own."""
    return {"read": reader}


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


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    if "\0" in value:
        raise ConfigError(f"{where}: contains a NUL byte")
    return value


def _one_of(value: object, where: str, choices: Sequence[str]) -> str:
    text = _text(value, where)
    if text not in choices:
        raise ConfigError(f"{where}: must be one of {', '.join(choices)}, got {text!r}")
    return text


def _flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def _count(value: object, where: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(
            f"{where}: expected a whole number from 1 to {maximum}, got {_short(value)}"
        )
    return value


def _strings(value: object, where: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings; one string stands for a list of one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of strings")
    return tuple(_text(item, f"{where}[{i}]") for i, item in enumerate(value))


def _key(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


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


def _headers(value: object, where: str, env: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of header names to values")
    return dict(_header(name, text, f"{where}.{name}", env) for name, text in value.items())


def _check_probe_path(path: str, where: str) -> None:
    if not path.startswith("/"):
        raise ConfigError(f"{where}: must start with '/', got {_short(path)}")
    if _CONTROL_RE.search(path) or " " in path:
        raise ConfigError(f"{where}: spaces or control characters in {_short(path)}")


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


def _weight_paths(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    paths = _strings(value, where)
    for i, path in enumerate(paths):
        _check_weights_path(path, f"{where}[{i}]")
    return tuple(str(Path(p).absolute()) for p in paths)


def _patterns(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    patterns = _strings(value, where)
    for i, pattern in enumerate(patterns):
        problem = glob_problem(pattern)
        if problem is not None:
            raise ConfigError(f"{where}[{i}]: {_short(pattern)}: {problem}")
    return patterns


def _regex(value: object, where: str, env: Mapping[str, str]) -> str:
    text = _text(value, where)
    try:
        re.compile(text)
    except re.error as exc:
        raise ConfigError(f"{where}: invalid regular expression: {exc}") from None
    return text


def _log_files(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """`file` takes one path or several (a server's stdout and stderr): `_finish_log` splits."""
    files = _strings(value, where)
    if len(set(files)) != len(files):
        raise ConfigError(f"{where}: a path is listed twice")
    return files


def _target_name(value: object, where: str, env: Mapping[str, str]) -> str:
    name = _text(value, where)
    if not _TARGET_NAME_RE.match(name):
        raise ConfigError(f"{where}: {name!r} may use only letters, digits and _ . : -")
    return name


def _gpus(value: object, where: str, env: Mapping[str, str]) -> Literal["auto"] | tuple[int, ...]:
    if value is None or value == "auto":
        return "auto"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return tuple(value)
    raise ConfigError(f"{where}: expected auto or a list of GPU indexes like [0, 1], got {value!r}")


def _auto_or_flag(value: object, where: str, env: Mapping[str, str]) -> Literal["auto"] | bool:
    if value is not True and value is not False and value != "auto":
        raise ConfigError(f"{where}: expected auto, true or false, got {value!r}")
    return "auto" if value == "auto" else bool(value)


def _log_format(value: object, where: str, env: Mapping[str, str]) -> str:
    return _one_of(value, where, (AUTO, *SERVERS))  # the registry as it is now: it may grow


def _server_kinds(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    kinds = _strings(value, where)
    for i, kind in enumerate(kinds):
        _one_of(kind, f"{where}[{i}]", tuple(SERVERS))
    return tuple(dict.fromkeys(kinds))


def _users(value: object, where: str, env: Mapping[str, str]) -> tuple[int, ...] | None:
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


def _history_path(value: object, where: str, env: Mapping[str, str]) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise ConfigError(f'{where}: expected a path or "", got {_short(value)}')
    return value


def _share(value: object, where: str, env: Mapping[str, str]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{where}: expected a share of one core in (0, 1], got {value!r}")
    return float(value)


def _targets(value: object, where: str, env: Mapping[str, str]) -> tuple[TargetConfig, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: expected a list of targets")
    targets = tuple(
        read_section(TargetConfig, t, f"{where}[{i}]", env) for i, t in enumerate(value)
    )
    seen: set[str] = set()
    for i, target in enumerate(targets):
        if target.name in seen:
            raise ConfigError(f"{where}[{i}].name: duplicate target name {target.name!r}")
        seen.add(target.name)
    return targets


# --- the sections -------------------------------------------------------------------------------


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
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, metadata=read_by(_headers))

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
    paths: tuple[str, ...] = field(metadata=read_by(_weight_paths))
    include: tuple[str, ...] = field(default=DEFAULT_INCLUDE, metadata=read_by(_patterns))
    per_file: bool = False


@dataclass(frozen=True)
class ProcessConfig:
    systemd_unit: str | None = None
    pidfile: str | None = None
    cmdline: str | None = field(default=None, metadata=read_by(_regex))
    # A discovered server's process: its pid and start ticks.
    pid: int | None = field(default=None, metadata=NOT_IN_YAML)
    start_ticks: int | None = field(default=None, metadata=NOT_IN_YAML)


@dataclass(frozen=True)
class LogConfig:
    journald_unit: str | None = None
    file: str | None = field(default=None, metadata=read_by(_log_files))
    format: str = field(default=AUTO, metadata=read_by(_log_format))  # or a server kind
    encoding: LogEncoding = LogEncoding.PLAIN  # of the file(s)
    # The same server's other stream (stderr beside stdout): `file`'s list past its first.
    more_files: tuple[str, ...] = field(default=(), metadata=NOT_IN_YAML)

    @property
    def files(self) -> tuple[str, ...]:
        return (self.file, *self.more_files) if self.file else ()


@dataclass(frozen=True)
class TargetConfig:
    name: str = field(metadata=read_by(_target_name))
    endpoint: EndpointConfig
    weights: WeightsConfig | None = None
    process: ProcessConfig | None = None
    log: LogConfig | None = None
    gpus: Literal["auto"] | tuple[int, ...] = field(default="auto", metadata=read_by(_gpus))
    stall_after: Seconds = DEFAULT_STALL_AFTER


@dataclass(frozen=True)
class DiscoveryConfig:
    """Finding model servers by their command lines; `auto` is on when no target is configured."""

    enabled: Literal["auto"] | bool = field(default="auto", metadata=read_by(_auto_or_flag))
    interval: Seconds = DEFAULT_DISCOVERY_INTERVAL
    keep_for: Seconds = DEFAULT_DISCOVERY_KEEP_FOR
    servers: tuple[str, ...] = field(default=DISCOVERY_SERVERS, metadata=read_by(_server_kinds))
    max_targets: Annotated[int, Whole(10_000)] = DEFAULT_MAX_TARGETS
    max_targets_per_user: Count = DEFAULT_MAX_TARGETS_PER_USER  # at most max_targets
    max_files: Count = DEFAULT_MAX_FILES
    # uids whose processes may be discovered; None: all
    users: tuple[int, ...] | None = field(default=None, metadata=read_by(_users))

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
    targets: tuple[TargetConfig, ...] = field(default=(), metadata=read_by(_targets))
    sample_interval: Annotated[float, Duration(MAX_SAMPLE_INTERVAL)] = DEFAULT_SAMPLE_INTERVAL
    history_path: str = field(default=DEFAULT_HISTORY_PATH, metadata=read_by(_history_path))
    residency_cpu_budget: float = field(
        default=DEFAULT_RESIDENCY_CPU_BUDGET, metadata=read_by(_share)
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
    _check_url(values["url"], _key(where, "url"), probe)
    if "path" in values:
        _check_probe_path(values["path"], _key(where, "path"))
    return {"path": DEFAULT_PROBE_PATHS[probe], **values}


def _finish_process(values: Values, where: str) -> Values:
    if len(values) != 1:
        raise ConfigError(f"{where}: set exactly one of systemd_unit, pidfile, cmdline")
    return values


def _finish_log(values: Values, where: str) -> Values:
    if len([k for k in ("journald_unit", "file") if k in values]) != 1:
        raise ConfigError(f"{where}: set exactly one of journald_unit, file")
    if "journald_unit" in values and "encoding" in values:
        raise ConfigError(f"{_key(where, 'encoding')}: applies to file only; a journal has none")
    if "file" in values:
        first, *more = values["file"]
        values = {**values, "file": first, "more_files": tuple(more)}
    return values


def _finish_discovery(values: Values, where: str) -> Values:
    """The share per user is bounded by, and defaults to no more than, max_targets."""
    most = values.get("max_targets", DEFAULT_MAX_TARGETS)
    per_user = values.get("max_targets_per_user", min(DEFAULT_MAX_TARGETS_PER_USER, most))
    _count(per_user, _key(where, "max_targets_per_user"), most)
    return {**values, "max_targets_per_user": per_user}


def _finish_config(values: Values, where: str) -> Values:
    discovery: DiscoveryConfig = values.get("discovery", DiscoveryConfig())
    if not values.get("targets") and not discovery.active(has_targets=False):
        raise ConfigError(
            "targets: expected a non-empty list of targets (discovery.enabled is false)"
        )
    return values


_FINISH: Mapping[type, Callable[[Values, str], Values]] = {
    EndpointConfig: _finish_endpoint,
    ProcessConfig: _finish_process,
    LogConfig: _finish_log,
    DiscoveryConfig: _finish_discovery,
    Config: _finish_config,
}


# --- the reader ---------------------------------------------------------------------------------


class _Key:
    """One YAML key of a section: its field's name, whether it must be given, how it reads."""

    def __init__(self, f: dataclasses.Field[Any], hint: Any) -> None:
        self.name = f.name
        no_default = dataclasses.MISSING
        self.required = f.default is no_default and f.default_factory is no_default
        self.read: KeyReader = f.metadata.get("read") or _reader(hint)


@functools.cache
def _keys(section: type) -> tuple[_Key, ...]:
    hints = get_type_hints(section, include_extras=True)
    return tuple(
        _Key(f, hints[f.name]) for f in dataclasses.fields(section) if f.metadata.get("yaml", True)
    )


def _reader(hint: Any) -> KeyReader:
    """How a value of this type reads from YAML; TypeError for a type no rule covers (a field
    that needs `read_by`), raised when its section is first read."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        mark = hint.__metadata__[0]
        if isinstance(mark, Duration):
            return lambda v, where, env: parse_duration(v, where, mark.maximum)
        if isinstance(mark, Whole):
            return lambda v, where, env: _count(v, where, mark.maximum)
    if origin in (types.UnionType, Union) and len(args) == 2 and types.NoneType in args:
        return _reader(next(a for a in args if a is not types.NoneType))  # null: not given
    if hint is str:
        return lambda v, where, env: _text(v, where)
    if hint is bool:
        return lambda v, where, env: _flag(v, where)
    if hint == tuple[str, ...]:
        return lambda v, where, env: _strings(v, where)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return lambda v, where, env: hint(_one_of(v, where, tuple(hint)))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return functools.partial(read_section, hint)
    raise TypeError(f"no config reader for {hint!r}: give the field read_by(...)")


def read_section(section: type[_D], data: object, where: str, env: Mapping[str, str]) -> _D:
    """A dataclass from one YAML mapping: each field a key, unknown keys refused."""
    kind: type = section  # (mypy takes a class's type for unhashable)
    keys = _keys(kind)
    at = f"{where}: " if where else ""  # the top level: the file's name is all the place
    if not isinstance(data, Mapping):
        raise ConfigError(f"{at}expected a mapping, got {type(data).__name__}")
    names = [k.name for k in keys]
    unknown = [str(k) for k in data if k not in names]
    if unknown:
        raise ConfigError(f"{at}unknown key {unknown[0]!r} (allowed: {', '.join(names)})")
    values: Values = {}
    for key in keys:
        where_key = _key(where, key.name)
        if data.get(key.name) is not None:
            values[key.name] = key.read(data[key.name], where_key, env)
        elif key.required:
            raise ConfigError(f"{where_key}: required")
    finish = _FINISH.get(section)
    return section(**(finish(values, where) if finish else values))


def parse_config(
    data: object, source: str = "config", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-loaded YAML document (an empty one means: discover everything)."""
    config = read_section(
        Config, {} if data is None else data, "", os.environ if env is None else env
    )
    return dataclasses.replace(config, source=source)


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
