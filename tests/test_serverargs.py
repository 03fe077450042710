"""Recognising a server from its argv and environment: the rules, without processes.

Every case is a command line as it appears in /proc/PID/cmdline; the real-process side of the
same rules is tests/test_discovery.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from helpers.require import require

from exporter.config.reader import parse_config
from exporter.config.values import ConfigError
from exporter.discovery.found import target_name
from exporter.discovery.probehost import local_addresses, probe_host, url_host
from exporter.discovery.serverargs import SECRET, find_launch, recognise
from exporter.discovery.weights import _revision_snapshot

LAUNCHES: list[tuple[list[str], str | None]] = [
    (["python3", "-m", "sglang.launch_server", "--model-path", "m"], "sglang"),
    (["/usr/bin/python3.11", "-u", "-m", "sglang.launch_server"], "sglang"),
    (["python", "-um", "sglang.launch_server"], "sglang"),
    (["python", "-msglang.launch_server"], "sglang"),
    (["python", "-W", "ignore", "-X", "dev", "-m", "vllm.entrypoints.openai.api_server"], "vllm"),
    (["python3", "-Wignore", "-m", "vllm.entrypoints.cli.main", "serve", "m"], "vllm"),
    (["/venv/bin/python", "/venv/bin/vllm", "serve", "m"], "vllm"),
    (["vllm", "serve", "m"], "vllm"),
    (["/opt/venv/bin/sglang", "serve", "--model-path", "m"], "sglang"),
    (["python", "/src/sglang/python/sglang/launch_server.py", "--model-path", "m"], "sglang"),
    (["/usr/local/bin/llama-server", "-m", "x.gguf"], "llamacpp"),
    (["python3", "-m", "llama_cpp.server", "--model", "x.gguf"], "llamacpp"),
    (["text-generation-launcher", "--model-id", "x"], "tgi"),
    (["/opt/tritonserver/bin/tritonserver", "--model-repository", "/m"], "triton"),
    # Only looks like a server:
    (["grep", "sglang"], None),
    (["grep", "-r", "python -m sglang.launch_server", "."], None),
    (["bash", "-c", "python -m sglang.launch_server --port 1"], None),
    (["vim", "sglang/launch_server.py"], None),
    (["less", "/x/sglang/launch_server.py"], None),
    (["tail", "-f", "sglang.log"], None),
    (["python", "-c", "import sglang.launch_server", "-m", "sglang.launch_server"], None),
    (["python3", "-Bc", "import vllm", "serve"], None),
    (["python3", "-"], None),
    (["python3"], None),
    (["python3", "-i"], None),
    (["python3", "--version"], None),
    (["/usr/bin/python3", "/usr/bin/pip", "install", "vllm"], None),
    (["python", "-m", "pip", "install", "vllm", "sglang"], None),
    (["python", "-m", "sglang.bench_serving", "--port", "30000"], None),
    (["python", "launch_server.py"], None),
    (["python", "-m", "vllm.entrypoints.openai.api_server_turbo"], None),
    (["vllm", "bench", "serve"], None),
    (["vllm", "chat"], None),
    (["sglang", "version"], None),
    (["sglang"], None),
    (["vllm", "serve", "--help"], None),
    (["python", "-m", "sglang.launch_server", "--help"], None),
    (["strace", "-f", "python", "-m", "sglang.launch_server"], None),
    (["llama-server-wrapper", "-m", "x.gguf"], None),
    ([], None),
]


@pytest.mark.parametrize(
    ("argv", "kind"), LAUNCHES, ids=[" ".join(a) or "empty" for a, _ in LAUNCHES]
)
def test_recognised_by_executable_module_or_script_position(
    argv: list[str], kind: str | None
) -> None:
    launch = find_launch(argv)
    assert (launch.kind if launch else None) == kind


def test_server_kinds_can_be_left_out() -> None:
    assert find_launch(["vllm", "serve", "m"], kinds=("sglang",)) is None


def _values(
    argv: list[str], environ: dict[str, str] | None = None, **kwargs: object
) -> dict[str, object]:
    found = recognise(argv, environ, **kwargs)  # type: ignore[arg-type]
    assert found is not None
    return {
        "port": found.port,
        "host": found.host,
        "model": found.model,
        "served": found.served_model_name,
        "key": found.api_key,
    }


def test_equals_and_separate_values_and_the_last_one_wins() -> None:
    assert _values(["vllm", "serve", "m", "--port=9001"])["port"] == 9001
    assert _values(["vllm", "serve", "m", "--port", "9001", "--port", "9002"])["port"] == 9002
    assert _values(["text-generation-launcher", "-p", "3001"])["port"] == 3001
    assert _values(["text-generation-launcher", "-p=3002"])["port"] == 3002


def test_underscores_and_dashes_are_the_same_flag() -> None:
    assert _values(["vllm", "serve", "m", "--served_model_name", "x"])["served"] == "x"
    argv = ["python", "-m", "llama_cpp.server", "--model", "a.gguf", "--model_alias", "tiny"]
    assert _values(argv)["served"] == "tiny"


def test_positional_model_precedence_follows_each_server() -> None:
    # vLLM: the positional model_tag wins; SGLang: a later --model-path wins.
    assert _values(["vllm", "serve", "pos", "--model", "flag"])["model"] == "pos"
    assert _values(["sglang", "serve", "pos", "--model-path", "flag"])["model"] == "flag"
    assert _values(["sglang", "serve", "pos", "--port", "1"])["model"] == "pos"


def test_first_of_several_served_names_and_of_comma_lists() -> None:
    assert _values(["vllm", "serve", "m", "--served-model-name", "a", "b"])["served"] == "a"
    found = _values(["llama-server", "-m", "x.gguf", "-a", "one, two", "--api-key", "k1,k2"])
    assert (found["served"], found["key"]) == ("one", "k1")


def test_argv_beats_environment_beats_default() -> None:
    env = {"LLAMA_ARG_PORT": "9100", "LLAMA_ARG_HOST": "0.0.0.0", "LLAMA_API_KEY": "sk-env"}
    found = _values(["llama-server", "-m", "x.gguf", "--port", "9200"], env)
    assert (found["port"], found["host"], found["key"]) == (9200, "0.0.0.0", "sk-env")
    assert _values(["llama-server", "-m", "x.gguf"], None)["port"] == 8080  # environ unreadable
    found = _values(["text-generation-launcher"], {"MODEL_ID": "org/m", "PORT": "80"})
    assert (found["model"], found["port"]) == ("org/m", 80)
    assert _values(["text-generation-launcher"], {})["model"] == "bigscience/bloom-560m"
    assert _values(["vllm", "serve"], {"VLLM_API_KEY": "sk-v"})["key"] == "sk-v"


def test_defaults_of_each_server() -> None:
    defaults = {
        "python -m sglang.launch_server --model-path m": ("127.0.0.1", 30000),
        "vllm serve m": ("0.0.0.0", 8000),
        "llama-server -m m.gguf": ("127.0.0.1", 8080),
        "python -m llama_cpp.server --model m.gguf": ("localhost", 8000),
        "text-generation-launcher --model-id m": ("0.0.0.0", 3000),
        "tritonserver --model-repository /m": ("0.0.0.0", 8000),
    }
    for command, (host, port) in defaults.items():
        found = recognise(command.split(), {})
        assert found is not None and (found.host, found.port) == (host, port), command
        assert any(e.what == "port" and e.source.startswith("default of") for e in found.evidence)


def test_config_file_between_argv_and_environment() -> None:
    documents = {
        "/etc/vllm.yaml": {"model": "from-config", "port": 8123, "served_model_name": ["c1", "c2"]}
    }
    argv = ["vllm", "serve", "--config", "/etc/vllm.yaml", "--port", "8200"]
    found = recognise(argv, {}, read_config=documents.get)
    assert found is not None
    assert (found.model, found.port, found.served_model_name) == ("from-config", 8200, "c1")
    sources = {e.what: e.source for e in found.evidence}
    assert sources["model"] == "config file /etc/vllm.yaml, key model"
    unreadable = recognise(
        ["vllm", "serve", "--config", "/nope.yaml"], {}, read_config=lambda p: None
    )
    assert unreadable is not None
    assert unreadable.model is None  # not the default: the file may name another model
    assert any(e.what == "config_file" and "not readable" in e.source for e in unreadable.evidence)


def test_a_port_the_server_would_refuse_is_no_server() -> None:
    assert recognise(["vllm", "serve", "m", "--port", "http"], {}) is None
    assert recognise(["vllm", "serve", "m", "--port", "70000"], {}) is None


def test_api_key_is_kept_out_of_repr_and_evidence() -> None:
    found = recognise(["sglang", "serve", "m", "--api-key", "sk-very-secret"], {})
    assert found is not None and found.api_key == "sk-very-secret"
    assert "sk-very-secret" not in repr(found)
    assert [e.value for e in found.evidence if e.what == "api_key"] == [SECRET]


@pytest.mark.parametrize(
    ("kind", "model", "port", "name"),
    [
        ("sglang", "/models/Qwen2.5-7B-Instruct/", 30000, "sglang-Qwen2.5-7B-Instruct-30000"),
        ("vllm", "Qwen/Qwen2.5-7B", 8000, "vllm-Qwen2.5-7B-8000"),
        ("vllm", "/root/.cache/huggingface/hub/models--org--Big-Model/snapshots/0a1b2c", 8000,
         "vllm-Big-Model-8000"),
        ("llamacpp", "/m/qwen2.5-7b-q4_k_m.gguf", 8080, "llamacpp-qwen2.5-7b-q4_k_m-8080"),
        ("llamacpp", "/m/big-00001-of-00004.gguf", 8080, "llamacpp-big-8080"),
        ("vllm", "my model (v2)", 8000, "vllm-my-model-v2-8000"),
        ("llamacpp", None, 8080, "llamacpp-8080"),
        ("tgi", "/", 3000, "tgi-3000"),
        ("vllm", "_" + "x" * 200, 8000, "vllm-" + "x" * 80 + "-8000"),
    ],
)  # fmt: skip
def test_target_names_are_stable_and_valid(
    kind: str, model: str | None, port: int, name: str
) -> None:
    assert target_name(kind, model, port) == name
    # The config's own rule for target names accepts it.
    parse_config({"targets": [{"name": name, "endpoint": {"url": "http://h:1"}}]})


def test_an_invalid_name_would_be_refused_by_the_config() -> None:
    with pytest.raises(ConfigError):
        parse_config(
            {"targets": [{"name": "vllm-my model-8000", "endpoint": {"url": "http://h:1"}}]}
        )


@pytest.mark.parametrize(
    ("host", "same_netns", "addresses", "probed", "reachable"),
    [
        ("0.0.0.0", True, [], "127.0.0.1", True),
        ("::", True, [], "::1", True),
        ("localhost", True, [], "127.0.0.1", True),
        ("10.1.2.3", True, ["10.1.2.3"], "10.1.2.3", True),
        ("gpu-node-7", True, [], "127.0.0.1", True),
        ("0.0.0.0", False, ["10.0.0.5"], "10.0.0.5", True),
        ("gpu-pod-7", False, ["10.0.0.5"], "10.0.0.5", True),
        ("10.0.0.5", False, ["10.0.0.5"], "10.0.0.5", True),
        ("127.0.0.1", False, ["10.0.0.5"], "127.0.0.1", False),
        ("0.0.0.0", False, [], "127.0.0.1", False),
        # Only where the server is: not another host, link-local or a metadata service.
        ("10.1.2.3", True, ["10.0.0.5"], "10.1.2.3", False),
        ("10.1.2.3", False, ["10.0.0.5"], "10.1.2.3", False),
        ("169.254.169.254", True, ["169.254.169.254"], "169.254.169.254", False),
        ("fe80::1", True, ["fe80::1"], "fe80::1", False),
        ("fd00:ec2::254", True, ["fd00:ec2::254"], "fd00:ec2::254", False),
        ("0.0.0.0", False, ["169.254.3.4"], "127.0.0.1", False),
        # IPv4-mapped addresses are their IPv4 address: loopback stays loopback.
        ("::ffff:127.0.0.1", True, [], "127.0.0.1", True),
        ("::ffff:127.0.0.1", False, ["10.0.0.5"], "127.0.0.1", False),
        ("[::ffff:10.0.0.5]", False, ["10.0.0.5"], "10.0.0.5", True),
    ],
)
def test_probe_host(
    host: str, same_netns: bool, addresses: list[str], probed: str, reachable: bool
) -> None:
    assert probe_host(host, same_netns, addresses)[:2] == (probed, reachable)


def test_ipv6_hosts_are_bracketed_in_urls() -> None:
    assert url_host("::1") == "[::1]" and url_host("127.0.0.1") == "127.0.0.1"


@pytest.mark.system
def test_local_addresses_match_ip_addr() -> None:
    require(shutil.which("ip") is not None, "needs ip (iproute2)")
    out = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=True)
    expected = {line.split()[3].split("/")[0] for line in out.stdout.splitlines()}
    expected = {a for a in expected if not a.startswith("127.") and a != "::1"}
    assert set(local_addresses(f"/proc/{os.getpid()}")) == expected


def _repo(tmp_path: Path, *commits: str) -> Path:
    repo = tmp_path / "models--org--m"
    for i, commit in enumerate(commits):
        (repo / "snapshots" / commit).mkdir(parents=True)
        os.utime(repo / "snapshots" / commit, (1000 + i, 1000 + i))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    return repo


def test_snapshot_follows_refs_like_huggingface_hub(tmp_path: Path) -> None:
    old, new = "a" * 40, "b" * 40
    repo = _repo(tmp_path, old, new)
    (repo / "refs" / "main").write_text(old)
    (repo / "refs" / "v2").write_text(new + "\n")
    assert _revision_snapshot(str(repo), None)[0] == f"{repo}/snapshots/{old}"
    assert _revision_snapshot(str(repo), "v2")[0] == f"{repo}/snapshots/{new}"
    assert _revision_snapshot(str(repo), new)[0] == f"{repo}/snapshots/{new}"
    (repo / "refs" / "main").unlink()
    path, how = _revision_snapshot(str(repo), None)
    assert path == f"{repo}/snapshots/{new}" and "newest of 2" in how
    assert _revision_snapshot(str(tmp_path / "missing"), None)[0] is None
