"""Config validation: every malformed file is one precise line and a non-zero exit."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.cli import build_parser
from exporter.commands.serve import config_from_args
from exporter.config.reader import load_config, parse_config
from exporter.config.schema import DISCOVERY_SERVERS, DiscoveryConfig, HistoryRetention, LogConfig
from exporter.config.values import ConfigError, format_duration, parse_duration
from exporter.vocabulary import LogEncoding

GOOD = {
    "sample_interval": "500ms",
    "history_path": "",
    "targets": [
        {
            "name": "kimi-k2",
            "endpoint": {
                "url": "http://127.0.0.1:30001",
                "probe": "completion",
                "model": "/root/models/Kimi-K2.6",
                "timeout": "8s",
                "headers": {"Authorization": "Bearer ${TEST_API_KEY}"},
            },
            "weights": {"paths": ["WEIGHTS"], "include": ["*.safetensors"], "per_file": True},
            "process": {"cmdline": r"sglang\.launch_server.*--port 30001"},
            "log": {"journald_unit": "sglang-k26", "format": "sglang"},
            "gpus": [0, 1],
            "stall_after": "5m",
        }
    ],
}


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def write(tmp_path: Path, data: object, weights: Path) -> Path:
    text = yaml.safe_dump(data) if not isinstance(data, str) else data
    path = tmp_path / "config.yaml"
    path.write_text(text.replace("WEIGHTS", str(weights)))
    return path


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    d = tmp_path / "model"
    d.mkdir()
    (d / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 4096)
    return d


def test_good_config_loads_into_dataclasses(tmp_path: Path, weights: Path) -> None:
    config = load_config(str(write(tmp_path, GOOD, weights)), env={"TEST_API_KEY": "sekret"})
    target = config.targets[0]
    assert config.sample_interval == 0.5
    assert config.history_path == ""
    assert target.endpoint.path == "/v1/completions"
    assert target.endpoint.timeout == 8.0
    assert target.endpoint.headers == {"Authorization": "Bearer sekret"}
    assert "sekret" not in repr(config)
    assert target.weights is not None and target.weights.paths == (str(weights),)
    assert target.gpus == (0, 1)
    assert target.stall_after == 300.0


def test_log_file_takes_one_path_or_two_and_an_encoding(tmp_path: Path, weights: Path) -> None:
    both = {"file": ["/var/log/vllm.out", "/var/log/vllm.err"], "encoding": "plain"}
    cri = {"file": "/var/log/pods/ns_pod_uid/server/0.log", "encoding": "cri"}
    endpoint = {"url": "http://127.0.0.1:1"}
    targets = [
        {"name": n, "endpoint": endpoint, "log": log} for n, log in (("a", both), ("b", cri))
    ]
    first, second = load_config(str(write(tmp_path, {"targets": targets}, weights))).targets
    assert first.log is not None and first.log.files == ("/var/log/vllm.out", "/var/log/vllm.err")
    assert first.log.encoding is LogEncoding.PLAIN
    assert second.log is not None and second.log.files == (cri["file"],)
    assert second.log.encoding is LogEncoding.CRI and second.log.more_files == ()


@pytest.mark.parametrize(
    ("flag", "expected"),
    [
        ("journald:vllm.service", LogConfig(journald_unit="vllm.service")),
        ("file:/var/log/vllm.log", LogConfig(file="/var/log/vllm.log")),
        ("docker:/d/c-json.log", LogConfig(file="/d/c-json.log", encoding=LogEncoding.DOCKER)),
        ("cri:/var/log/pods/p/c/0.log", LogConfig(file="/var/log/pods/p/c/0.log", encoding=LogEncoding.CRI)),
    ],
)  # fmt: skip
def test_log_source_flag_names_the_log_as_status_shows_it(flag: str, expected: LogConfig) -> None:
    flags = ["serve", "--target", "t", "--endpoint", "http://127.0.0.1:1", f"--log.source={flag}"]
    [target] = config_from_args(build_parser("serve").parse_args(flags)).targets
    assert target.log == expected


def test_log_source_flag_of_an_unknown_kind_is_one_line() -> None:
    flags = ["serve", "--target", "t", "--endpoint", "http://127.0.0.1:1", "--log.source=pipe:x"]
    with pytest.raises(
        ConfigError, match="expected journald:UNIT, file:PATH, docker:PATH or cri:PATH"
    ):
        config_from_args(build_parser("serve").parse_args(flags))


def test_probe_kind_sets_default_path(tmp_path: Path, weights: Path) -> None:
    data = {"targets": [{"name": "a", "endpoint": {"url": "http://h:1", "probe": "health"}}]}
    config = load_config(str(write(tmp_path, data, weights)))
    assert config.targets[0].endpoint.probe_url == "http://h:1/health"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("500ms", 0.5), ("30s", 30), ("5m", 300), ("1h", 3600), ("1h30m", 5400), ("1.5s", 1.5)],
)
def test_durations(text: str, expected: float) -> None:
    assert parse_duration(text, "x") == expected
    assert parse_duration(format_duration(expected), "x") == expected


def _target(**changes: object) -> dict[str, object]:
    target = {"name": "a", "endpoint": {"url": "http://127.0.0.1:1"}}
    target.update(changes)
    return {"targets": [target]}


# (case id, document, text the one-line error must contain)
MALFORMED: list[tuple[str, object, str]] = [
    ("unknown top-level key", {**_target(), "sample_intervall": "1s"}, "unknown key 'sample_intervall'"),
    ("unknown target key", _target(stall_afer="5m"), "targets[0]: unknown key 'stall_afer'"),
    ("unknown endpoint key", _target(endpoint={"url": "http://h:1", "probes": "health"}), "targets[0].endpoint: unknown key 'probes'"),
    ("bad duration", _target(stall_after="5 minutes"), "targets[0].stall_after: expected a duration"),
    ("numeric duration", {**_target(), "sample_interval": 1}, "sample_interval: expected a duration"),
    ("zero duration", {**_target(), "sample_interval": "0s"}, "sample_interval: duration must be positive"),
    ("bad url scheme", _target(endpoint={"url": "ftp://h/x"}), "targets[0].endpoint.url: expected an absolute http/https URL"),
    ("url without host", _target(endpoint={"url": "http:///v1"}), "targets[0].endpoint.url"),
    ("bad port", _target(endpoint={"url": "http://h:99999"}), "invalid port"),
    ("bad probe kind", _target(endpoint={"url": "http://h:1", "probe": "ping"}), "targets[0].endpoint.probe: must be one of"),
    ("missing endpoint", {"targets": [{"name": "a"}]}, "targets[0].endpoint: required"),
    ("missing name", {"targets": [{"endpoint": {"url": "http://h:1"}}]}, "targets[0].name: required"),
    ("bad name", _target(name="has space"), "targets[0].name"),
    ("duplicate names", {"targets": [_target()["targets"][0], _target()["targets"][0]]}, "targets[1].name: duplicate target name 'a'"),  # type: ignore[index]
    ("no targets, discovery off", {"targets": [], "discovery": {"enabled": False}}, "targets: expected a non-empty list of targets (discovery.enabled is false)"),
    ("targets not a list", {"targets": {"name": "a"}}, "targets: expected a list of targets"),
    ("unknown discovery key", {"discovery": {"intervall": "5s"}}, "discovery: unknown key 'intervall'"),
    ("discovery not a mapping", {"discovery": ["sglang"]}, "discovery: expected a mapping"),
    ("bad discovery enabled", {"discovery": {"enabled": "yes please"}}, "discovery.enabled: expected auto, true or false, got 'yes please'"),
    ("bad discovery interval", {"discovery": {"interval": 5}}, "discovery.interval: expected a duration"),
    ("zero keep_for", {"discovery": {"keep_for": "0s"}}, "discovery.keep_for: duration must be positive"),
    ("unknown server kind", {"discovery": {"servers": ["vllm", "ollama"]}}, "discovery.servers[1]: must be one of sglang, vllm, llamacpp, tgi, triton, got 'ollama'"),
    ("empty server list", {"discovery": {"servers": []}}, "discovery.servers: expected a non-empty list"),
    ("zero max_targets", {"discovery": {"max_targets": 0}}, "discovery.max_targets: expected a whole number from 1 to 10000, got 0"),
    ("share above max_targets", {"discovery": {"max_targets": 4, "max_targets_per_user": 5}}, "discovery.max_targets_per_user: expected a whole number from 1 to 4, got 5"),
    ("max_files a string", {"discovery": {"max_files": "many"}}, "discovery.max_files: expected a whole number from 1 to"),
    ("unknown user", {"discovery": {"users": ["no-such-user-here"]}}, "discovery.users[0]: no user 'no-such-user-here' on this host"),
    ("users not a list", {"discovery": {"users": "root"}}, "discovery.users: expected a non-empty list of user names or uids"),
    ("unknown retention key", {"history_retention": {"rows": 5}}, "history_retention: unknown key 'rows'"),
    ("zero retention rows", {"history_retention": {"max_rows": 0}}, "history_retention.max_rows: expected a whole number"),
    ("unknown metrics key", {"metrics": {"buckets": True}}, "metrics: unknown key 'buckets'"),
    ("phase buckets not a flag", {"metrics": {"phase_buckets": "yes"}}, "metrics.phase_buckets: expected true or false"),
    ("native not a flag", {"metrics": {"native_histograms": 1}}, "metrics.native_histograms: expected true or false"),
    ("missing weights path", _target(weights={"paths": ["/nonexistent/model"]}), "targets[0].weights.paths[0]: /nonexistent/model does not exist"),
    ("weights paths not a list", _target(weights={"paths": 3}), "targets[0].weights.paths"),
    ("two process matchers", _target(process={"pidfile": "/run/x.pid", "cmdline": "x"}), "set exactly one of"),
    ("bad cmdline regex", _target(process={"cmdline": "sglang(("}), "invalid regular expression"),
    ("bad gpus", _target(gpus="all"), "targets[0].gpus: expected auto or a list"),
    ("bad log format", _target(log={"file": "/var/log/x", "format": "ollama"}), "targets[0].log.format: must be one of auto, sglang, vllm, llamacpp, tgi, triton, got 'ollama'"),
    ("bad log encoding", _target(log={"file": "/var/log/x", "encoding": "json-file"}), "targets[0].log.encoding: must be one of plain, docker, cri, got 'json-file'"),
    ("encoding of a journal", _target(log={"journald_unit": "x", "encoding": "cri"}), "targets[0].log.encoding: applies to file only"),
    ("log file listed twice", _target(log={"file": ["/var/log/x", "/var/log/x"]}), "targets[0].log.file: a path is listed twice"),
    ("empty log file list", _target(log={"file": []}), "targets[0].log.file: expected a non-empty list"),
    ("per_file not bool", _target(weights={"paths": ["WEIGHTS"], "per_file": "yes"}), "per_file: expected true or false"),
    ("unset env var in header", _target(endpoint={"url": "http://h:1", "headers": {"Authorization": "${NO_SUCH_VAR_XYZ}"}}), "environment variable NO_SUCH_VAR_XYZ is not set"),
    ("residency budget out of range", {**_target(), "residency_cpu_budget": 2}, "residency_cpu_budget"),
    ("not a mapping", "- just\n- a list\n", "expected a mapping"),
    ("invalid yaml", "targets: [\n  name: a\n", "invalid YAML at line"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "document", "expected"), MALFORMED, ids=[c[0] for c in MALFORMED])
def test_malformed_config_is_one_line_error(
    tmp_path: Path, weights: Path, case: str, document: object, expected: str
) -> None:
    path = write(tmp_path, document, weights)
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    message = str(info.value)
    assert expected in message, message
    assert "\n" not in message
    assert message.startswith(str(path))


def test_empty_config_means_discovery(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("")
    config = load_config(str(path))
    assert config.targets == ()
    assert config.discovery == DiscoveryConfig()
    assert config.discovery.active(has_targets=False)
    assert parse_config(None).discovery.active(has_targets=False)


def test_discovery_section_parses_into_a_dataclass() -> None:
    config = parse_config(
        {"discovery": {"enabled": True, "interval": "10s", "keep_for": "2h", "servers": ["vllm"]}}
    )
    assert config.discovery == DiscoveryConfig(
        enabled=True, interval=10.0, keep_for=7200.0, servers=("vllm",)
    )
    assert DiscoveryConfig().servers == DISCOVERY_SERVERS
    assert (DiscoveryConfig().interval, DiscoveryConfig().keep_for) == (5.0, 3600.0)


@pytest.mark.parametrize(
    ("enabled", "has_targets", "active"),
    [
        ("auto", False, True),
        ("auto", True, False),
        (True, True, True),
        (False, False, False),
    ],
)
def test_discovery_auto_is_on_only_without_targets(
    enabled: bool | str, has_targets: bool, active: bool
) -> None:
    data: dict[str, object] = {"discovery": {"enabled": enabled}}
    if has_targets:
        data.update(_target())
    if not has_targets and not active:
        with pytest.raises(ConfigError):
            parse_config(data)
        return
    config = parse_config(data)
    assert config.discovery.active(has_targets=bool(config.targets)) is active


@pytest.mark.system
def test_cli_config_check_accepts_an_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing: discover the servers\n")
    result = run_cli("--config.file", str(path), "--config.check")
    assert result.returncode == 0, result.stderr
    assert "0 target(s)" in result.stdout


@pytest.mark.requires("root")
def test_unreadable_weights_path(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.mkdir(mode=0o700)
    os.chmod(tmp_path, 0o755)
    os.seteuid(65534)  # nobody; the saved uid stays root so we can switch back
    try:
        with pytest.raises(ConfigError) as info:
            parse_config(_target(weights={"paths": [str(secret)]}))
    finally:
        os.seteuid(0)
    assert str(info.value) == f"targets[0].weights.paths[0]: {secret} is not readable by this user"


@pytest.mark.system
def test_cli_config_check_exits_1_with_one_line(tmp_path: Path, weights: Path) -> None:
    path = write(tmp_path, _target(stall_after="soon"), weights)
    result = run_cli("--config.file", str(path), "--config.check")
    assert result.returncode == 1
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "stall_after" in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.system
def test_cli_missing_config_file(tmp_path: Path) -> None:
    result = run_cli("--config.file", str(tmp_path / "nope.yaml"), "--config.check")
    assert result.returncode == 1
    assert result.stderr.strip() == f"model-load-exporter: {tmp_path / 'nope.yaml'}: no such file"


@pytest.mark.system
def test_cli_config_check_prints_summary(tmp_path: Path, weights: Path) -> None:
    path = write(tmp_path, GOOD, weights)
    result = run_cli("--config.file", str(path), "--config.check", env={"TEST_API_KEY": "sekret"})
    assert result.returncode == 0, result.stderr
    assert "config OK" in result.stdout and "kimi-k2" in result.stdout
    assert "process by cmdline" in result.stdout and "stall after 5m" in result.stdout
    assert "sekret" not in result.stdout


@pytest.mark.system
def test_cli_single_target_flags_are_validated_like_the_file(weights: Path) -> None:
    ok = run_cli("--target", "t", "--endpoint", "http://127.0.0.1:1", "--weights", str(weights),
                 "--config.check")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    bad = run_cli("--target", "t", "--endpoint", "nota-url", "--config.check")
    assert bad.returncode == 1
    assert "targets[0].endpoint.url" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.system
def test_cli_usage_errors_exit_2(tmp_path: Path, weights: Path) -> None:
    path = write(tmp_path, _target(), weights)
    both = run_cli("--config.file", str(path), "--target", "x", "--config.check")
    assert both.returncode == 2 and "cannot be combined" in both.stderr
    unknown = run_cli("--no-such-flag")
    assert unknown.returncode == 2 and len(unknown.stderr.strip().splitlines()) == 1
    half = run_cli("--target", "x", "--config.check")
    assert half.returncode == 2 and "--target and --endpoint" in half.stderr


@pytest.mark.system
def test_cli_with_no_config_at_all_discovers() -> None:
    done = run_cli("--config.check")
    assert done.returncode == 0, done.stderr
    assert "0 target(s)" in done.stdout and "discovery: sglang, vllm" in done.stdout


def test_the_trust_bounds_parse_into_the_discovery_config() -> None:
    config = parse_config(
        {
            "discovery": {
                "max_targets": 8,
                "max_targets_per_user": 2,
                "max_files": 500,
                "users": ["root", 65534],
            },
            "history_retention": {"max_rows": 1000, "max_age": "30d"},
        }
    )
    assert (config.discovery.max_targets, config.discovery.max_targets_per_user) == (8, 2)
    assert config.discovery.max_files == 500 and config.discovery.users == (0, 65534)
    assert config.history_retention == HistoryRetention(1000, 30 * 86400.0)
    # The share follows a smaller max_targets unless given.
    assert parse_config({"discovery": {"max_targets": 4}}).discovery.max_targets_per_user == 4


@pytest.mark.parametrize(
    ("document", "flags", "expected"),
    [
        ({}, [], (False, False)),
        ({"metrics": {"phase_buckets": True}}, [], (True, False)),
        ({"metrics": {"native_histograms": True}}, [], (False, True)),
        (None, ["--metrics.phase-buckets"], (True, False)),
        (None, ["--metrics.native-histograms"], (False, True)),
    ],
)
def test_metrics_options_from_the_file_or_the_flags(
    tmp_path: Path, document: dict[str, Any] | None, flags: list[str], expected: tuple[bool, bool]
) -> None:
    """The deep dive's detail and native histograms are off by default, on from the config
    file or a flag."""
    argv = ["serve", *flags, "--target=t", "--endpoint=http://127.0.0.1:1"]
    if document is not None:
        path = tmp_path / "config.yaml"
        path.write_text(yaml.safe_dump({**document, "discovery": {"enabled": True}}))
        argv = ["serve", f"--config.file={path}"]
    config = config_from_args(build_parser("serve").parse_args(argv))
    assert (config.metrics.phase_buckets, config.metrics.native_histograms) == expected
