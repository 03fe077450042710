"""`--web.config.file`: TLS and basic auth in the shape of Prometheus exporter-toolkit.

Same file format as every official exporter, so one web config serves the whole host:

    tls_server_config:
      cert_file: tls.crt                  # relative paths are relative to this file
      key_file: tls.key
      client_ca_file: ca.crt              # alone: clients must present a certificate it signed
      client_auth_type: RequireAndVerifyClientCert
      min_version: TLS12                  # TLS12 (default) or TLS13; max_version likewise
      cipher_suites: [TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256]   # Go names; TLS 1.2 only
    http_server_config:
      headers: {X-Frame-Options: deny}    # the headers exporter-toolkit allows
      allowed_hosts: [gpu-7.example]      # ours, not the toolkit's: Host values answered
    basic_auth_users:
      prometheus: $2y$10$...              # bcrypt hash, as htpasswd -B makes

A key this exporter does not implement is an error naming it, never ignored: a typo such as
`client_ca_fle` must not silently turn mutual TLS off. Python's TLS verifies every client
certificate it accepts, so the two toolkit modes that accept unverified certificates
(RequestClientCert, RequireAnyClientCert) are refused rather than weakened or strengthened.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import ssl
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import bcrypt

from exporter.config.reader import read_yaml
from exporter.config.values import ConfigError

TLS_VERSIONS: Mapping[str, ssl.TLSVersion] = {
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
CLIENT_AUTH: Mapping[str, ssl.VerifyMode] = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
_UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
# Go's names of the TLS 1.2 suites it offers -> OpenSSL's. TLS 1.3 suites are fixed in both.
GO_CIPHERS: Mapping[str, str] = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305": "ECDHE-RSA-CHACHA20-POLY1305",
}
_TLS13_CIPHERS = (
    "TLS_AES_128_GCM_SHA256",
    "TLS_AES_256_GCM_SHA384",
    "TLS_CHACHA20_POLY1305_SHA256",
)
# The response headers exporter-toolkit lets a web config set, with their allowed values.
EXTRA_HEADERS: Mapping[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
# exporter-toolkit keys this exporter does not implement, and why.
_UNSUPPORTED = {
    "rate_limit": "not supported by model-load-exporter",
    "cert": "inline PEM is not supported: use cert_file",
    "key": "inline PEM is not supported: use key_file",
    "client_ca": "inline PEM is not supported: use client_ca_file",
    "curve_preferences": "not supported by Python's TLS: OpenSSL's defaults apply",
    "client_allowed_sans": "not supported by model-load-exporter",
}
_TOP_KEYS = ("tls_server_config", "http_server_config", "basic_auth_users")
_TLS_KEYS = (
    "cert_file",
    "key_file",
    "client_ca_file",
    "client_auth_type",
    "min_version",
    "max_version",
    "cipher_suites",
    "prefer_server_cipher_suites",
)
_HTTP_KEYS = ("http2", "headers", "allowed_hosts")
_HOST_RE = re.compile(r"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.:-]+)(?::[0-9]{1,5})?\Z")
_BCRYPT_RE = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}\Z")
BCRYPT_MAX_PASSWORD = 72  # bcrypt reads no further; the library refuses longer ones
# A bcrypt hash of a random password: unknown users cost the same as known ones.
_DUMMY_HASH = b"$2b$10$8uftkJhxOOMjke6owQUDAed8SPAZcGoM4rHmauSo/VmRdhzH4ft3S"


@dataclass(frozen=True)
class TlsConfig:
    cert_file: str
    key_file: str
    client_ca_file: str | None = None
    client_auth: ssl.VerifyMode = ssl.CERT_NONE
    min_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_2
    max_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3
    ciphers: str | None = None  # OpenSSL cipher list for TLS 1.2
    prefer_server_ciphers: bool = True

    def context(self) -> ssl.SSLContext:
        """A fresh server context; OSError or ssl.SSLError when a file is wrong."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = self.min_version
        context.maximum_version = self.max_version
        # An encrypted key would make OpenSSL prompt on the terminal: fail instead.
        context.load_cert_chain(self.cert_file, self.key_file, password=lambda: b"")
        if self.client_ca_file:
            context.load_verify_locations(self.client_ca_file)
        context.verify_mode = self.client_auth
        if self.ciphers:
            context.set_ciphers(self.ciphers)
        if self.prefer_server_ciphers:
            context.options |= ssl.OP_CIPHER_SERVER_PREFERENCE
        return context


class BasicAuth:
    """Checks `Authorization: Basic` headers against bcrypt hashes, cheaply under attack.

    As in exporter-toolkit: one bcrypt comparison at a time (each costs ~50 ms of a core at cost
    10, so a flood of wrong passwords can take at most one core), and answers are cached by a
    hash of user, password and stored hash. Successes and failures are cached apart, so a flood
    of wrong passwords cannot evict the scraper's good one and make it queue behind them.
    Unknown users are compared against a dummy hash (same cost: names cannot be probed by
    timing); passwords longer than bcrypt's 72 bytes are refused for every user alike.
    """

    def __init__(
        self, users: Mapping[str, bytes], good_cache: int = 64, bad_cache: int = 1024
    ) -> None:
        self._users = dict(users)
        self._bcrypt = threading.Lock()
        self._lock = threading.Lock()
        self._good: OrderedDict[bytes, None] = OrderedDict()
        self._bad: OrderedDict[bytes, None] = OrderedDict()
        self._sizes = {id(self._good): good_cache, id(self._bad): bad_cache}
        self.bcrypt_checks = 0  # comparisons actually run (for tests and debugging)

    @property
    def enabled(self) -> bool:
        return bool(self._users)

    def cached(self, header: str | None) -> bool | None:
        """The answer without bcrypt when there is one (cheap: fine on an event loop)."""
        if not self._users:
            return True
        parsed = _parse_basic(header)
        if parsed is None:
            return False
        user, password = parsed
        if len(password) > BCRYPT_MAX_PASSWORD:
            return False
        key = self._key(user, password)
        with self._lock:
            if key in self._good:
                self._good.move_to_end(key)
                return True
            if key in self._bad:
                return False
        return None

    def check(self, header: str | None) -> bool:
        """The full answer; may run one bcrypt comparison (serialised, tens of ms)."""
        answer = self.cached(header)
        if answer is not None:
            return answer
        parsed = _parse_basic(header)
        assert parsed is not None
        user, password = parsed
        hashed = self._users.get(user)
        with self._bcrypt:
            self.bcrypt_checks += 1
            try:
                ok = bcrypt.checkpw(password, hashed or _DUMMY_HASH) and hashed is not None
            except ValueError:  # a hash that passed load checks but bcrypt still refuses
                ok = False
        key = self._key(user, password)
        with self._lock:
            cache = self._good if ok else self._bad
            cache[key] = None
            if len(cache) > self._sizes[id(cache)]:
                cache.popitem(last=False)
        return ok

    def _key(self, user: str, password: bytes) -> bytes:
        hashed = self._users.get(user, _DUMMY_HASH)
        return hashlib.sha256(b"\0".join((user.encode(), hashed, password))).digest()


def _parse_basic(header: str | None) -> tuple[str, bytes] | None:
    """(user, password bytes) from a Basic Authorization header, or None if it is not one."""
    if not header or header[:6].lower() != "basic ":
        return None
    try:
        raw = base64.b64decode(header[6:].strip(), validate=True)
        user, sep, password = raw.partition(b":")
        return (user.decode(), password) if sep else None
    except (binascii.Error, UnicodeDecodeError, ValueError):
        return None


@dataclass(frozen=True)
class WebConfig:
    tls: TlsConfig | None = None
    basic_auth_users: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    headers: Mapping[str, str] = field(default_factory=dict)  # added to every response
    allowed_hosts: tuple[str, ...] = ()  # Host header values accepted; empty: any
    auth: BasicAuth = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "auth", BasicAuth(self.basic_auth_users))

    def ssl_context(self) -> ssl.SSLContext | None:
        return self.tls.context() if self.tls is not None else None

    def authorized(self, header: str | None) -> bool:
        """Check an Authorization header (always True without users)."""
        return self.auth.check(header)


class _Section:
    """One mapping of the web config, rejecting unknown keys as the main config does."""

    def __init__(self, data: object, where: str, allowed: tuple[str, ...]) -> None:
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ConfigError(f"{where}: expected a mapping")
        for key in data:
            if key in _UNSUPPORTED:
                raise ConfigError(f"{_join(where, key)}: {_UNSUPPORTED[key]}")
            if key not in allowed:
                raise ConfigError(
                    f"{_join(where, key)}: unknown key (allowed: {', '.join(allowed)})"
                )
        self.data = data
        self.where = where

    def text(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, str) or not value or "\0" in value:
            raise ConfigError(f"{_join(self.where, key)}: expected a non-empty string")
        return value

    def choice(self, key: str, choices: Mapping[str, object], default: str) -> str:
        value = self.text(key) or default
        if value not in choices:
            raise ConfigError(
                f"{_join(self.where, key)}: must be one of {', '.join(choices)}, got {value!r}"
            )
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            raise ConfigError(f"{_join(self.where, key)}: expected true or false")
        return value


def _join(where: str, key: object) -> str:
    return f"{where}.{key}" if where else str(key)


def _tls(data: object, base: str) -> TlsConfig | None:
    s = _Section(data, "tls_server_config", _TLS_KEYS)
    if not s.data:
        return None
    cert, key = s.text("cert_file"), s.text("key_file")
    if not cert or not key:
        raise ConfigError("tls_server_config: needs both cert_file and key_file")
    ca = s.text("client_ca_file")
    auth_name = s.text("client_auth_type")
    if auth_name in _UNVERIFIED_CLIENT_AUTH:
        raise ConfigError(
            f"tls_server_config.client_auth_type: {auth_name} is not supported (Python's TLS "
            "verifies every client certificate it accepts): use VerifyClientCertIfGiven or "
            "RequireAndVerifyClientCert"
        )
    default_auth = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    auth = CLIENT_AUTH[s.choice("client_auth_type", CLIENT_AUTH, default_auth)]
    if ca and auth is ssl.CERT_NONE:
        raise ConfigError(
            "tls_server_config: client_ca_file is set but client_auth_type is NoClientCert"
        )
    if not ca and auth is not ssl.CERT_NONE:
        raise ConfigError(f"tls_server_config.client_auth_type: {auth_name} needs client_ca_file")
    low = TLS_VERSIONS[s.choice("min_version", TLS_VERSIONS, "TLS12")]
    high = TLS_VERSIONS[s.choice("max_version", TLS_VERSIONS, "TLS13")]
    if low > high:
        raise ConfigError("tls_server_config: min_version is above max_version")
    files = {k: _readable(base, k, v) for k, v in (("cert_file", cert), ("key_file", key))}
    return TlsConfig(
        cert_file=files["cert_file"],
        key_file=files["key_file"],
        client_ca_file=_readable(base, "client_ca_file", ca) if ca else None,
        client_auth=auth,
        min_version=low,
        max_version=high,
        ciphers=_ciphers(s.data.get("cipher_suites")),
        prefer_server_ciphers=s.flag("prefer_server_cipher_suites", True),
    )


def _ciphers(value: object) -> str | None:
    if value is None:
        return None
    where = "tls_server_config.cipher_suites"
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a list of cipher suite names")
    names = []
    for i, name in enumerate(value):
        if name in _TLS13_CIPHERS:
            continue  # fixed in TLS 1.3, as Go ignores them too
        if name not in GO_CIPHERS:
            raise ConfigError(f"{where}[{i}]: unknown cipher suite {name!r}")
        names.append(GO_CIPHERS[name])
    return ":".join(names) or None


def allowed_hosts(value: object, where: str) -> tuple[str, ...]:
    """Host names (or host:port) the server answers for; what a DNS-rebinding page is not."""
    if isinstance(value, str):
        value = [h for h in value.split(",") if h.strip()]
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{where}: expected a non-empty list of host names")
    hosts = []
    for i, host in enumerate(value):
        if not isinstance(host, str) or not _HOST_RE.match(host.strip()):
            raise ConfigError(f"{where}[{i}]: expected a host name or address, got {host!r}")
        hosts.append(host.strip().lower())
    return tuple(hosts)


def _http(data: object) -> dict[str, str]:
    s = _Section(data, "http_server_config", _HTTP_KEYS)
    s.flag("http2", True)  # accepted for compatibility: this server speaks HTTP/1.1 only
    raw = s.data.get("headers") or {}
    if not isinstance(raw, dict):
        raise ConfigError("http_server_config.headers: expected a mapping")
    headers: dict[str, str] = {}
    for name, value in raw.items():
        where = f"http_server_config.headers.{name}"
        if name not in EXTRA_HEADERS:
            raise ConfigError(
                f"{where}: this header cannot be configured (allowed: {', '.join(EXTRA_HEADERS)})"
            )
        allowed = EXTRA_HEADERS[name]
        if not isinstance(value, str) or re.search(r"[\x00-\x1f\x7f]", value):
            raise ConfigError(f"{where}: expected a single-line string")
        if allowed and value not in allowed:
            raise ConfigError(f"{where}: must be one of {', '.join(allowed)}, got {value!r}")
        headers[name] = value
    return headers


def _allowed_hosts_of(data: object) -> tuple[str, ...]:
    value = data.get("allowed_hosts") if isinstance(data, dict) else None
    return () if value is None else allowed_hosts(value, "http_server_config.allowed_hosts")


def _users(data: object) -> dict[str, bytes]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError("basic_auth_users: expected a mapping of user names to bcrypt hashes")
    hashes: dict[str, bytes] = {}
    for user, hashed in data.items():
        where = f"basic_auth_users.{user}"
        if not isinstance(user, str) or not user or ":" in user:
            raise ConfigError(f"{where}: user names are non-empty strings without ':'")
        if not isinstance(hashed, str) or not _BCRYPT_RE.match(hashed):
            raise ConfigError(f"{where}: not a bcrypt hash ($2y$10$ and 53 characters)")
        try:
            bcrypt.checkpw(b"", hashed.encode())
        except ValueError:
            raise ConfigError(f"{where}: not a valid bcrypt hash") from None
        hashes[user] = hashed.encode()
    return hashes


def _readable(base: str, key: str, path: str) -> str:
    """The path, relative to the web config's directory as in exporter-toolkit, checked now."""
    full = path if os.path.isabs(path) else os.path.join(base, path)
    try:
        with open(full, "rb"):
            pass
    except OSError as exc:
        raise ConfigError(f"tls_server_config.{key}: {full}: {exc.strerror}") from None
    return full


def load_web_config(path: str) -> WebConfig:
    """Read and check the file; every problem is one ConfigError line naming the file and key."""
    data = read_yaml(path)
    try:
        if data is None:
            data = {}
        top = _Section(data, "", _TOP_KEYS)
        config = WebConfig(
            tls=_tls(top.data.get("tls_server_config"), os.path.dirname(os.path.abspath(path))),
            basic_auth_users=_users(top.data.get("basic_auth_users")),
            headers=_http(top.data.get("http_server_config")),
            allowed_hosts=_allowed_hosts_of(top.data.get("http_server_config")),
        )
        try:
            config.ssl_context()
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"tls_server_config: cannot use the certificate or key: {exc}"
            ) from None
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return config
