"""YAML config and single-target flags -> frozen dataclasses.

Every mistake is reported as one `ConfigError` line naming the file and key, because an exporter
that silently ignores a typo (`stall_afer: 5m`) watches the wrong thing for months.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml

from exporter.vocabulary import LogFormat, ProbeKind, ServerKind

DEFAULT_PROBE_PATHS: Mapping[ProbeKind, str] = {
    ProbeKind.COMPLETION: "/v1/completions",
    ProbeKind.HEALTH: "/health",
    ProbeKind.MODELS: "/v1/models",
    ProbeKind.TCP: "",
}
DEFAULT_INCLUDE: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
DEFAULT_HISTORY_PATH = "/var/lib/model-load-exporter/history.sqlite"
DEFAULT_SAMPLE_INTERVAL = 1.0
DEFAULT_STALL_AFTER = 300.0
DEFAULT_PROBE_TIMEOUT = 8.0
DEFAULT_RESIDENCY_CPU_BUDGET = 0.01
# The servers discovery can recognise by their command lines (exporter/serverargs.py).
DISCOVERY_SERVERS: tuple[ServerKind, ...] = tuple(k for k in ServerKind if k != ServerKind.UNKNOWN)
DEFAULT_DISCOVERY_INTERVAL = 5.0
DEFAULT_DISCOVERY_KEEP_FOR = 3600.0

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TARGET_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
_E = TypeVar("_E", bound=StrEnum)
_ENV_RE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ConfigError(ValueError):
    """A config problem, already phrased as the one line the user should see."""


@dataclass(frozen=True)
class EndpointConfig:
    url: str
    probe: ProbeKind = ProbeKind.COMPLETION
    path: str = "/v1/completions"
    model: str | None = None
    timeout: float = DEFAULT_PROBE_TIMEOUT
    # Values are secrets (API keys): kept out of repr so they never reach a log line.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False)

    @property
    def probe_url(self) -> str:
        return self.url.rstrip("/") + self.path


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
    format: LogFormat = LogFormat.AUTO


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
    servers: tuple[ServerKind, ...] = DISCOVERY_SERVERS

    def active(self, has_targets: bool) -> bool:
        return self.enabled is True or (self.enabled == "auto" and not has_targets)


@dataclass(frozen=True)
class Config:
    targets: tuple[TargetConfig, ...]
    sample_interval: float = DEFAULT_SAMPLE_INTERVAL
    history_path: str = DEFAULT_HISTORY_PATH
    residency_cpu_budget: float = DEFAULT_RESIDENCY_CPU_BUDGET
    source: str = "flags"
    discovery: DiscoveryConfig = DiscoveryConfig()


def parse_duration(value: object, where: str) -> float:
    """Parse a Prometheus-style duration (`500ms`, `30s`, `5m`, `1h30m`) into seconds."""
    if isinstance(value, bool) or not isinstance(value, str):
        raise ConfigError(f"{where}: expected a duration like 30s, 5m or 500ms, got {value!r}")
    text = value.strip()
    pos, total = 0, 0.0
    for match in _DURATION_RE.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ConfigError(f"{where}: expected a duration like 30s, 5m or 500ms, got {value!r}")
    if total <= 0:
        raise ConfigError(f"{where}: duration must be positive, got {value!r}")
    return total


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
        return value

    def choice(self, name: str, choices: type[_E], default: _E) -> _E:
        value = self.text(name, default) or default
        if value not in tuple(choices):
            raise ConfigError(
                f"{self.key(name)}: must be one of {', '.join(choices)}, got {value!r}"
            )
        return choices(value)

    def duration(self, name: str, default: float) -> float:
        return default if not self.has(name) else parse_duration(self.data[name], self.key(name))

    def flag(self, name: str, default: bool) -> bool:
        value = self.data.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{self.key(name)}: expected true or false, got {value!r}")
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
    parts = urlsplit(url)
    schemes = ("http", "https", "tcp") if probe == ProbeKind.TCP else ("http", "https")
    if parts.scheme not in schemes or not parts.hostname:
        raise ConfigError(f"{where}: expected an absolute {'/'.join(schemes)} URL, got {url!r}")
    try:
        port = parts.port
    except ValueError:
        raise ConfigError(f"{where}: invalid port in {url!r}") from None
    if probe == ProbeKind.TCP and port is None and parts.scheme == "tcp":
        raise ConfigError(f"{where}: a tcp probe needs a port in {url!r}")


def _endpoint(data: object, where: str, env: Mapping[str, str]) -> EndpointConfig:
    r = _Reader(data, where, ("url", "probe", "path", "model", "timeout", "headers"))
    probe = r.choice("probe", ProbeKind, ProbeKind.COMPLETION)
    url = r.text("url", required=True)
    assert url is not None
    _check_url(url, r.key("url"), probe)
    path = r.text("path", DEFAULT_PROBE_PATHS[probe]) or ""
    if path and not path.startswith("/"):
        raise ConfigError(f"{r.key('path')}: must start with '/', got {path!r}")
    raw_headers = r.data.get("headers") or {}
    if not isinstance(raw_headers, Mapping):
        raise ConfigError(f"{r.key('headers')}: expected a mapping of header names to values")
    headers: dict[str, str] = {}
    for name, value in raw_headers.items():
        key = f"{r.key('headers')}.{name}"
        if not isinstance(name, str) or not isinstance(value, str):
            raise ConfigError(f"{key}: header names and values must be strings")
        headers[name] = expand_env(value, key, env)
    return EndpointConfig(
        url=url,
        probe=probe,
        path=path,
        model=r.text("model"),
        timeout=r.duration("timeout", DEFAULT_PROBE_TIMEOUT),
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


def _weights(data: object, where: str) -> WeightsConfig:
    r = _Reader(data, where, ("paths", "include", "per_file"))
    paths = r.str_list("paths")
    for i, path in enumerate(paths):
        _check_weights_path(path, f"{r.key('paths')}[{i}]")
    return WeightsConfig(
        paths=tuple(str(Path(p).absolute()) for p in paths),
        include=r.str_list("include", DEFAULT_INCLUDE),
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
    r = _Reader(data, where, ("journald_unit", "file", "format"))
    if len([k for k in ("journald_unit", "file") if r.has(k)]) != 1:
        raise ConfigError(f"{where}: set exactly one of journald_unit, file")
    return LogConfig(
        journald_unit=r.text("journald_unit"),
        file=r.text("file"),
        format=r.choice("format", LogFormat, LogFormat.AUTO),
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
    r = _Reader(data, where, ("enabled", "interval", "keep_for", "servers"))
    raw_enabled = r.data.get("enabled", "auto")
    if raw_enabled is not True and raw_enabled is not False and raw_enabled != "auto":
        raise ConfigError(f"{r.key('enabled')}: expected auto, true or false, got {raw_enabled!r}")
    enabled: Literal["auto"] | bool = "auto" if raw_enabled == "auto" else bool(raw_enabled)
    servers = r.str_list("servers", DISCOVERY_SERVERS)
    for i, server in enumerate(servers):
        if server not in DISCOVERY_SERVERS:
            raise ConfigError(
                f"{r.key('servers')}[{i}]: must be one of {', '.join(DISCOVERY_SERVERS)}, "
                f"got {server!r}"
            )
    return DiscoveryConfig(
        enabled=enabled,
        interval=r.duration("interval", DEFAULT_DISCOVERY_INTERVAL),
        keep_for=r.duration("keep_for", DEFAULT_DISCOVERY_KEEP_FOR),
        servers=tuple(dict.fromkeys(ServerKind(s) for s in servers)),
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
        ("sample_interval", "history_path", "residency_cpu_budget", "discovery", "targets"),
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
    if not isinstance(history_path, str):
        raise ConfigError(f'history_path: expected a path or "", got {history_path!r}')
    budget = r.data.get("residency_cpu_budget", DEFAULT_RESIDENCY_CPU_BUDGET)
    if isinstance(budget, bool) or not isinstance(budget, int | float) or not 0 < budget <= 1:
        raise ConfigError(
            f"residency_cpu_budget: expected a share of one core in (0, 1], got {budget!r}"
        )
    return Config(
        targets=targets,
        sample_interval=r.duration("sample_interval", DEFAULT_SAMPLE_INTERVAL),
        history_path=history_path,
        residency_cpu_budget=float(budget),
        source=source,
        discovery=discovery,
    )


def load_config(path: str, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; every failure is one ConfigError line naming the file."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    try:
        return parse_config(data, source=path, env=env)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
