"""`--web.config.file`: TLS and basic auth in the shape of Prometheus exporter-toolkit.

Same file format as every official exporter, so one web config serves the whole host:

    tls_server_config:
      cert_file: /etc/model-load-exporter/tls.crt
      key_file: /etc/model-load-exporter/tls.key
      client_ca_file: /etc/model-load-exporter/ca.crt   # optional: require client certificates
    basic_auth_users:
      prometheus: $2y$10$...                             # bcrypt hash, as htpasswd -B makes
"""

from __future__ import annotations

import base64
import binascii
import ssl
from dataclasses import dataclass, field
from pathlib import Path

import bcrypt
import yaml

from exporter.config import ConfigError


@dataclass(frozen=True)
class WebConfig:
    cert_file: str | None = None
    key_file: str | None = None
    client_ca_file: str | None = None
    basic_auth_users: dict[str, bytes] = field(default_factory=dict, repr=False)

    def ssl_context(self) -> ssl.SSLContext | None:
        if not self.cert_file:
            return None
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.load_cert_chain(self.cert_file, self.key_file)
        if self.client_ca_file:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(self.client_ca_file)
        return context

    def authorized(self, header: str | None) -> bool:
        """Check an Authorization header against the bcrypt hashes (always True without users)."""
        if not self.basic_auth_users:
            return True
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError):
            return False
        hashed = self.basic_auth_users.get(user)
        if hashed is None:
            # Spend the same time as a real check so user names cannot be probed by timing.
            bcrypt.checkpw(b"", _DUMMY_HASH)
            return False
        return bcrypt.checkpw(password.encode(), hashed)


_DUMMY_HASH = b"$2b$10$8uftkJhxOOMjke6owQUDAed8SPAZcGoM4rHmauSo/VmRdhzH4ft3S"


def load_web_config(path: str) -> WebConfig:
    """Read and check the file; every problem is one ConfigError line naming the file and key."""
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError:
        raise ConfigError(f"{path}: invalid YAML") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping")
    unknown = set(data) - {"tls_server_config", "basic_auth_users", "http_server_config"}
    if unknown:
        raise ConfigError(f"{path}: unknown key {sorted(unknown)[0]!r}")
    tls = data.get("tls_server_config") or {}
    users = data.get("basic_auth_users") or {}
    if not isinstance(tls, dict) or not isinstance(users, dict):
        raise ConfigError(f"{path}: tls_server_config and basic_auth_users must be mappings")
    hashes: dict[str, bytes] = {}
    for user, hashed in users.items():
        if not isinstance(hashed, str) or not hashed.startswith("$2"):
            raise ConfigError(f"{path}: basic_auth_users.{user}: expected a bcrypt hash")
        hashes[str(user)] = hashed.encode()
    config = WebConfig(
        cert_file=tls.get("cert_file"),
        key_file=tls.get("key_file"),
        client_ca_file=tls.get("client_ca_file"),
        basic_auth_users=hashes,
    )
    if bool(config.cert_file) != bool(config.key_file):
        raise ConfigError(f"{path}: tls_server_config needs both cert_file and key_file")
    try:
        config.ssl_context()
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{path}: tls_server_config: {exc}") from None
    return config
