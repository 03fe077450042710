"""--web.config.file: exporter-toolkit keys applied, everything else one line naming the key."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml
from helpers.hostile import make_tls

from exporter.config.values import ConfigError
from exporter.exposition.http.webconfig import load_web_config

GOOD_HASH = bcrypt.hashpw(b"pw", bcrypt.gensalt(rounds=4)).decode()


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_tls(tmp_path_factory.mktemp("tls"))


def write(path: Path, data: Any) -> Path:
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data))
    return path


def tls_section(tls: dict[str, Path], **extra: Any) -> dict[str, Any]:
    return {"cert_file": str(tls["tls.crt"]), "key_file": str(tls["tls.key"]), **extra}


BAD: list[tuple[str, Any, str]] = [
    ("unknown-top", {"tls_config": {}}, "tls_config: unknown key"),
    ("rate-limit", {"rate_limit": {"burst": 1}}, "rate_limit: not supported"),
    ("tls-typo", "TLS:client_ca_fle", "tls_server_config.client_ca_fle: unknown key"),
    ("curves", "TLS:curve_preferences", "curve_preferences: not supported"),
    ("require-any", "AUTH:RequireAnyClientCert", "RequireAnyClientCert is not supported"),
    ("request", "AUTH:RequestClientCert", "RequestClientCert is not supported"),
    ("auth-typo", "AUTH:RequireAndVerify", "client_auth_type: must be one of"),
    ("verify-no-ca", "NOCA:VerifyClientCertIfGiven", "needs client_ca_file"),
    ("ca-no-auth", "CA:NoClientCert", "client_ca_file is set but client_auth_type is NoClientCert"),
    ("tls10", "VERSION:min_version=TLS10", "min_version: must be one of TLS12, TLS13"),
    ("min-over-max", "VERSION:min_version=TLS13,max_version=TLS12", "min_version is above"),
    ("cipher", "CIPHER:TLS_RSA_WITH_RC4_128_SHA", "unknown cipher suite"),
    (
        "only-cert",
        {"tls_server_config": {"cert_file": "x.crt"}},
        "needs both cert_file and key_file",
    ),
    (
        "missing-cert",
        {"tls_server_config": {"cert_file": "nope.crt", "key_file": "nope.key"}},
        "nope.crt: No such file",
    ),
    (
        "malformed-hash",
        {"basic_auth_users": {"prom": "$2y$10$short"}},
        "basic_auth_users.prom: not a bcrypt hash",
    ),
    ("plain-password", {"basic_auth_users": {"prom": "hunter2"}}, "not a bcrypt hash"),
    ("colon-user", {"basic_auth_users": {"a:b": GOOD_HASH}}, "without ':'"),
    (
        "header-name",
        {"http_server_config": {"headers": {"X-Anything": "1"}}},
        "this header cannot be configured",
    ),
    (
        "header-value",
        {"http_server_config": {"headers": {"X-Frame-Options": "allow"}}},
        "must be one of deny, sameorigin",
    ),
    ("http-typo", {"http_server_config": {"http3": True}}, "http_server_config.http3: unknown key"),
    ("duplicate", "basic_auth_users: {a: x, a: y}\n", "duplicate key 'a'"),
    ("not-a-mapping", "- a\n- b\n", "expected a mapping"),
]


def expand(data: Any, tls: dict[str, Path]) -> Any:
    """Shorthands for configs that need the real TLS files."""
    if not isinstance(data, str) or ":" not in data or data.split(":")[0] not in (
        "TLS", "AUTH", "NOCA", "CA", "VERSION", "CIPHER",
    ):  # fmt: skip
        return data
    kind, value = data.split(":", 1)
    if kind == "TLS":
        return {"tls_server_config": tls_section(tls, **{value: str(tls["ca.crt"])})}
    if kind in ("AUTH", "CA"):
        return {
            "tls_server_config": tls_section(
                tls, client_ca_file=str(tls["ca.crt"]), client_auth_type=value
            )
        }
    if kind == "NOCA":
        return {"tls_server_config": tls_section(tls, client_auth_type=value)}
    if kind == "VERSION":
        pairs = dict(item.split("=") for item in value.split(","))
        return {"tls_server_config": tls_section(tls, **pairs)}
    return {"tls_server_config": tls_section(tls, cipher_suites=[value])}


@pytest.mark.parametrize(("case", "data", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_web_configs_are_one_line_naming_the_key(
    tmp_path: Path, tls: dict[str, Path], case: str, data: Any, message: str
) -> None:
    path = write(tmp_path / "web.yml", expand(data, tls))
    with pytest.raises(ConfigError) as caught:
        load_web_config(str(path))
    text = str(caught.value)
    assert "\n" not in text and text.startswith(str(path)), text
    assert message in text, text


def test_not_utf8_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "web.yml"
    path.write_bytes(b"basic_auth_users: {\xff: x}\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_web_config(str(path))


def test_relative_paths_ciphers_and_versions_are_applied(
    tmp_path: Path, tls: dict[str, Path]
) -> None:
    for name in ("tls.crt", "tls.key", "ca.crt"):
        (tmp_path / name).write_bytes(tls[name].read_bytes())
    path = write(
        tmp_path / "web.yml",
        {
            "tls_server_config": {
                "cert_file": "tls.crt",
                "key_file": "tls.key",
                "client_ca_file": "ca.crt",
                "cipher_suites": [
                    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384",
                    "TLS_AES_128_GCM_SHA256",
                ],
                "max_version": "TLS12",
            },
            "http_server_config": {"http2": True, "headers": {"X-Frame-Options": "deny"}},
            "basic_auth_users": {"prom": GOOD_HASH},
        },
    )
    web = load_web_config(str(path))
    assert web.tls is not None and web.tls.cert_file == str(tmp_path / "tls.crt")
    context = web.ssl_context()
    assert context is not None
    assert context.verify_mode is ssl.CERT_REQUIRED  # a CA alone means: verify every client
    assert context.maximum_version is ssl.TLSVersion.TLSv1_2
    tls12 = [c["name"] for c in context.get_ciphers() if c["protocol"] == "TLSv1.2"]
    assert tls12 == ["ECDHE-ECDSA-AES256-GCM-SHA384"]
    assert dict(web.headers) == {"X-Frame-Options": "deny"}
    assert web.authorized("Basic cHJvbTpwdw==")  # prom:pw
