"""What one config key's value reads as: durations, counts, URLs, headers, paths, patterns, users,
each a reader that returns the value or raises one `ConfigError` line naming the key.

The sections (exporter/config/schema.py) name these readers for the keys whose Python type alone
does not say how they read (`read_by`); exporter/config/reader.py applies them.
"""

from __future__ import annotations

import math
import os
import pwd
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit, urlunsplit

from exporter.servers import SERVERS
from exporter.vocabulary import AUTO, ProbeKind

# Longer than any sensible setting and far below what timers accept (threading.TIMEOUT_MAX), so
# a typo like 99999999999h is an error here instead of an OverflowError in every sampler thread.
MAX_DURATION = 3650 * 86400.0

_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_TARGET_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]*\Z")
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
        raise ConfigError(f"{where}: expected a duration like 30s, 5m or 500ms, got {short(value)}")
    text = value.strip()
    pos, total = 0, 0.0
    for match in _DURATION_RE.finditer(text):
        if match.start() != pos:
            break
        total += float(match.group(1)) * _DURATION_UNITS[match.group(2)]
        pos = match.end()
    if pos != len(text) or not text:
        raise ConfigError(f"{where}: expected a duration like 30s, 5m or 500ms, got {short(value)}")
    if total <= 0:
        raise ConfigError(f"{where}: duration must be positive, got {value!r}")
    if not math.isfinite(total) or total > maximum:
        raise ConfigError(
            f"{where}: {short(value)} is too long (at most {format_duration(maximum)})"
        )
    return total


def short(value: object, limit: int = 40) -> str:
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


def read_text(value: object, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: expected a non-empty string, got {value!r}")
    if "\0" in value:
        raise ConfigError(f"{where}: contains a NUL byte")
    return value


def read_one_of(value: object, where: str, choices: Sequence[str]) -> str:
    text = read_text(value, where)
    if text not in choices:
        raise ConfigError(f"{where}: must be one of {', '.join(choices)}, got {text!r}")
    return text


def read_flag(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: expected true or false, got {value!r}")
    return value


def read_count(value: object, where: str, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= maximum:
        raise ConfigError(
            f"{where}: expected a whole number from 1 to {maximum}, got {short(value)}"
        )
    return value


def read_strings(value: object, where: str) -> tuple[str, ...]:
    """A non-empty list of non-empty strings; one string stands for a list of one."""
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of strings")
    return tuple(read_text(item, f"{where}[{i}]") for i, item in enumerate(value))


def key_path(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def expand_env(value: str, where: str, env: Mapping[str, str]) -> str:
    """Expand `${VAR}`; a missing variable is an error, not an empty credential."""

    def sub(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in env:
            raise ConfigError(f"{where}: environment variable {name} is not set")
        return env[name]

    return _ENV_RE.sub(sub, value)


def check_url(url: str, where: str, probe: ProbeKind) -> None:
    schemes = ("http", "https", "tcp") if probe == ProbeKind.TCP else ("http", "https")
    shown = short(redact_url_safely(url), 80)
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
        raise ConfigError(f"{where}: {short(name)} is not a valid HTTP header name")
    expanded = expand_env(value, where, env)
    if _HEADER_VALUE_BAD_RE.search(expanded):
        # CR/LF would end the header and let the config (or the environment) forge requests.
        raise ConfigError(f"{where}: the value contains a line break or control character")
    return name, expanded


def read_headers(value: object, where: str, env: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: expected a mapping of header names to values")
    return dict(_header(name, text, f"{where}.{name}", env) for name, text in value.items())


def check_probe_path(path: str, where: str) -> None:
    if not path.startswith("/"):
        raise ConfigError(f"{where}: must start with '/', got {short(path)}")
    if _CONTROL_RE.search(path) or " " in path:
        raise ConfigError(f"{where}: spaces or control characters in {short(path)}")


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


def read_weight_paths(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    paths = read_strings(value, where)
    for i, path in enumerate(paths):
        _check_weights_path(path, f"{where}[{i}]")
    return tuple(str(Path(p).absolute()) for p in paths)


def read_patterns(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    patterns = read_strings(value, where)
    for i, pattern in enumerate(patterns):
        problem = glob_problem(pattern)
        if problem is not None:
            raise ConfigError(f"{where}[{i}]: {short(pattern)}: {problem}")
    return patterns


def read_regex(value: object, where: str, env: Mapping[str, str]) -> str:
    text = read_text(value, where)
    try:
        re.compile(text)
    except re.error as exc:
        raise ConfigError(f"{where}: invalid regular expression: {exc}") from None
    return text


def read_log_files(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    """`file` takes one path or several (a server's stdout and stderr): `_finish_log` splits."""
    files = read_strings(value, where)
    if len(set(files)) != len(files):
        raise ConfigError(f"{where}: a path is listed twice")
    return files


def read_target_name(value: object, where: str, env: Mapping[str, str]) -> str:
    name = read_text(value, where)
    if not _TARGET_NAME_RE.match(name):
        raise ConfigError(f"{where}: {name!r} may use only letters, digits and _ . : -")
    return name


def read_gpus(
    value: object, where: str, env: Mapping[str, str]
) -> Literal["auto"] | tuple[int, ...]:
    if value is None or value == "auto":
        return "auto"
    if (
        isinstance(value, list)
        and value
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in value)
    ):
        return tuple(value)
    raise ConfigError(f"{where}: expected auto or a list of GPU indexes like [0, 1], got {value!r}")


def read_auto_or_flag(value: object, where: str, env: Mapping[str, str]) -> Literal["auto"] | bool:
    if value is not True and value is not False and value != "auto":
        raise ConfigError(f"{where}: expected auto, true or false, got {value!r}")
    return "auto" if value == "auto" else bool(value)


def read_log_format(value: object, where: str, env: Mapping[str, str]) -> str:
    return read_one_of(value, where, (AUTO, *SERVERS))  # the registry as it is now: it may grow


def read_server_kinds(value: object, where: str, env: Mapping[str, str]) -> tuple[str, ...]:
    kinds = read_strings(value, where)
    for i, kind in enumerate(kinds):
        read_one_of(kind, f"{where}[{i}]", tuple(SERVERS))
    return tuple(dict.fromkeys(kinds))


def read_users(value: object, where: str, env: Mapping[str, str]) -> tuple[int, ...] | None:
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
                raise ConfigError(f"{where}[{i}]: no user {short(user)} on this host") from None
        else:
            raise ConfigError(f"{where}[{i}]: expected a user name or uid, got {short(user)}")
    return tuple(dict.fromkeys(uids))


def read_history_path(value: object, where: str, env: Mapping[str, str]) -> str:
    if not isinstance(value, str) or "\0" in value:
        raise ConfigError(f'{where}: expected a path or "", got {short(value)}')
    return value


def read_share(value: object, where: str, env: Mapping[str, str]) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
        raise ConfigError(f"{where}: expected a share of one core in (0, 1], got {value!r}")
    return float(value)


def redact_url(url: str) -> str:
    """`http://admin:pw@host:1` -> `http://admin:***@host:1`; URLs without a password unchanged."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username}:***@{host}"))


def without_userinfo(url: str) -> str:
    parts = urlsplit(url)
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
