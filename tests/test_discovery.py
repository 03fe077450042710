"""Discovery against real processes whose command lines are the servers' real ones.

One fleet of stand-in servers (tests/helpers/standins.py: each runs the simulator on the port and
weights its own arguments say) is started once for the module, together with processes that only
look like servers; every test then checks one claim against a real /proc. Servers started
without a port flag run in their own network namespace (`unshare -n`), so their default ports
cannot collide with anything on this host.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from helpers.require import require
from helpers.standins import install
from helpers.support import free_port, wait_for

from exporter.discovery.found import DiscoveredServer, endpoint_config, weights_config
from exporter.discovery.scan import Discoverer
from exporter.sources.endpoint import EndpointProber
from exporter.vocabulary import ProbeKind, ProbeResult

pytestmark = pytest.mark.system

PY = sys.executable
SIM_ARGS = "--generate 2 --shard-size 64KiB --read-rate 10GB/s --init-seconds 0"
REVISION = "0123456789abcdef0123456789abcdef01234567"
POD_IP = "10.213.7.9"


def _can(*command: str) -> bool:
    return shutil.which(command[0]) is not None and subprocess.run(command).returncode == 0


UNSHARE_NET = _can("unshare", "-n", "true")
UNSHARE_MNT = _can("unshare", "-m", "true")


@dataclass
class Case:
    """One process to start and what discovery must say about it (None: do not check)."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    kind: str = ""
    name: str | None = None
    url: str | None = None
    probe: tuple[str, str] | None = None
    model: str | None = None
    weights: tuple[str, ...] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    reachable: bool = True
    evidence: tuple[tuple[str, str], ...] = ()  # (what, words in its source)
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class Fleet:
    cases: dict[str, Case]
    lookalikes: dict[str, subprocess.Popen[bytes]]
    servers: dict[int, DiscoveredServer]
    root: Path
    env: dict[str, str]


def _dirs(root: Path, case: str, *names: str) -> list[Path]:
    paths = []
    for name in names:
        path = root / case / name
        path.mkdir(parents=True)
        paths.append(path)
    return paths


def _cases(root: Path) -> dict[str, Case]:
    p = {
        name: free_port()
        for name in ("sg", "sgs", "vh", "vm", "ls", "le", "lp", "tg", "tr", "tm", "te", "mn")
    }
    (sg,) = _dirs(root, "sg", "Qwen2.5-7B-Instruct")
    (sgs,) = _dirs(root, "sgs", "Llama-3-8B")
    (sgd,) = _dirs(root, "sgd", "Mistral-7B")
    (vm,) = _dirs(root, "vm", "Phi-3")
    (vd,) = _dirs(root, "vd", "Gemma-2b")
    ggufs = {}
    for case in ("ls", "le", "lp", "ld", "lpd"):
        (directory,) = _dirs(root, case, "gguf")
        ggufs[case] = directory / "tiny-q4_k_m.gguf"
        ggufs[case].write_bytes(b"GGUF" + bytes(4092))
    (tg,) = _dirs(root, "tg", "falcon-7b")
    (tgd,) = _dirs(root, "tgd", "falcon-7b")
    (tr,) = _dirs(root, "tr", "model_repository")
    (trd,) = _dirs(root, "trd", "model_repository")
    (trm,) = _dirs(root, "trm", "repository")
    (tre,) = _dirs(root, "tre", "repository")
    for repository in (trm, tre):  # one model, and a directory that is none
        (repository / "tiny" / "1").mkdir(parents=True)
        (repository / "tiny" / "config.pbtxt").write_text('backend: "python"\n')
        (repository / "notes").mkdir()
    hf_home = root / "hf"
    repo = hf_home / "hub" / "models--acme--Hub-Model"
    (repo / "snapshots" / REVISION).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    inside = root / "mnt"
    inside.mkdir()

    def in_netns(*argv: str, setup: str = "") -> list[str]:
        if not setup:
            return ["unshare", "-n", *argv]
        return ["unshare", "-n", "sh", "-c", f'{setup}; exec "$@"', "sh", *argv]

    h = "http://127.0.0.1"
    cases = {
        "sglang-module-all-flags": Case(
            [PY, "-m", "sglang.launch_server", "--model-path", str(sg), "--port", str(p["sg"]),
             "--host", "127.0.0.1", "--served-model-name", "qwen-chat", "--api-key", "sk-sglang"],
            env={"STANDIN_FORK_WORKERS": "2"},
            kind="sglang", name=f"sglang-qwen-chat-{p['sg']}", url=f"{h}:{p['sg']}",
            probe=("completion", "/v1/completions"), model="qwen-chat", weights=(str(sg),),
            headers={"Authorization": "Bearer sk-sglang"},
            evidence=(("port", "--port"), ("served_model_name", "--served-model-name")),
        ),
        "sglang-serve-positional": Case(
            ["sglang", "serve", str(sgs), f"--port={p['sgs']}"],
            kind="sglang", name=f"sglang-Llama-3-8B-{p['sgs']}", url=f"{h}:{p['sgs']}",
            model=str(sgs), weights=(str(sgs),), evidence=(("model", "positional"),),
        ),
        "sglang-defaults": Case(
            in_netns(PY, "-m", "sglang.launch_server", "--model-path", str(sgd)),
            kind="sglang", name="sglang-Mistral-7B-30000", url="http://127.0.0.1:30000",
            weights=(str(sgd),), reachable=False,
            evidence=(("port", "default of SGLang"), ("host", "default of SGLang")),
        ),
        "vllm-hub-id": Case(
            ["vllm", "serve", "acme/Hub-Model", "--port", str(p["vh"])],
            env={"HF_HOME": str(hf_home), "VLLM_API_KEY": "sk-vllm"},
            kind="vllm", name=f"vllm-Hub-Model-{p['vh']}", url=f"{h}:{p['vh']}",
            probe=("health", "/health"), model="acme/Hub-Model",
            weights=(str(repo / "snapshots" / REVISION),),
            headers={"Authorization": "Bearer sk-vllm"},
            evidence=(("weights", "HF_HOME"), ("api_key", "VLLM_API_KEY")),
        ),
        "vllm-module": Case(
            [PY, "-m", "vllm.entrypoints.openai.api_server", "--model", str(vm),
             "--port", str(p["vm"]), "--served-model-name", "phi", "phi-alt"],
            kind="vllm", name=f"vllm-phi-{p['vm']}", url=f"{h}:{p['vm']}", model="phi",
            weights=(str(vm),),
        ),
        "vllm-defaults-pod-address": Case(
            in_netns("vllm", "serve", str(vd),
                     setup=f"ip link set lo up && ip addr add {POD_IP}/32 dev lo"),
            kind="vllm", name="vllm-Gemma-2b-8000", url=f"http://{POD_IP}:8000",
            evidence=(("probe host", "own network namespace"), ("port", "default of vLLM")),
        ),
        "llama-server-flags": Case(
            ["llama-server", "-m", str(ggufs["ls"]), "--port", str(p["ls"]), "-a", "tiny-alias"],
            kind="llamacpp", name=f"llamacpp-tiny-alias-{p['ls']}", url=f"{h}:{p['ls']}",
            probe=("health", "/health"), model="tiny-alias", weights=(str(ggufs["ls"]),),
        ),
        "llama-server-env": Case(
            ["llama-server", "-m", str(ggufs["le"])],
            env={"LLAMA_ARG_PORT": str(p["le"]), "LLAMA_API_KEY": "sk-llama"},
            kind="llamacpp", name=f"llamacpp-tiny-q4_k_m-{p['le']}", url=f"{h}:{p['le']}",
            headers={"Authorization": "Bearer sk-llama"},
            evidence=(("port", "LLAMA_ARG_PORT"), ("api_key", "LLAMA_API_KEY")),
        ),
        "llama-server-defaults": Case(
            in_netns("llama-server", "-m", str(ggufs["ld"])),
            kind="llamacpp", url="http://127.0.0.1:8080", reachable=False,
        ),
        "llama-cpp-python": Case(
            [PY, "-m", "llama_cpp.server", "--model", str(ggufs["lp"]), "--port", str(p["lp"])],
            kind="llamacpp", url=f"{h}:{p['lp']}", probe=("models", "/v1/models"),
            weights=(str(ggufs["lp"]),),
        ),
        "llama-cpp-python-defaults": Case(
            in_netns(PY, "-m", "llama_cpp.server", "--model", str(ggufs["lpd"])),
            kind="llamacpp", url="http://127.0.0.1:8000", reachable=False,
            evidence=(("host", "default of llama-cpp-python"),),
        ),
        "tgi-flags": Case(
            ["text-generation-launcher", "--model-id", str(tg), "-p", str(p["tg"])],
            kind="tgi", name=f"tgi-falcon-7b-{p['tg']}", url=f"{h}:{p['tg']}",
            probe=("health", "/health"), weights=(str(tg),),
        ),
        "tgi-defaults": Case(
            in_netns("text-generation-launcher", "--model-id", str(tgd)),
            kind="tgi", name="tgi-falcon-7b-3000", url="http://127.0.0.1:3000", reachable=False,
        ),
        "triton-flags": Case(
            ["tritonserver", f"--model-repository={tr}", "--http-port", str(p["tr"])],
            kind="triton", name=f"triton-model_repository-{p['tr']}", url=f"{h}:{p['tr']}",
            probe=("health", "/v2/health/ready"), model=None, weights=(str(tr),),
        ),
        "triton-defaults": Case(
            in_netns("tritonserver", "--model-repository", str(trd)),
            kind="triton", url="http://127.0.0.1:8000", reachable=False,
        ),
        # One model, loaded before the ports open: its own ready answer is the readiness.
        "triton-one-model": Case(
            ["tritonserver", f"--model-repository={trm}", "--http-port", str(p["tm"])],
            kind="triton", name=f"triton-tiny-{p['tm']}", url=f"{h}:{p['tm']}",
            probe=("health", "/v2/models/tiny/ready"), model="tiny", weights=(str(trm),),
            evidence=(("probe", "only model"),),
        ),
        # Explicit mode loads models on request: the server's readiness, not the model's.
        "triton-explicit": Case(
            ["tritonserver", f"--model-repository={tre}", "--http-port", str(p["te"]),
             "--model-control-mode=explicit"],
            kind="triton", name=f"triton-tiny-{p['te']}", url=f"{h}:{p['te']}",
            probe=("health", "/v2/health/ready"), model="tiny", weights=(str(tre),),
        ),
        "sglang-own-mount-namespace": Case(
            ["unshare", "-m", "sh", "-c",
             f'mount -t tmpfs tmpfs {inside} && mkdir {inside}/Only-Inside && exec "$@"', "sh",
             PY, "-m", "sglang.launch_server", "--model-path", f"{inside}/Only-Inside",
             "--port", str(p["mn"])],
            kind="sglang", name=f"sglang-Only-Inside-{p['mn']}", url=f"{h}:{p['mn']}",
            evidence=(("files", "mount namespace"),),
        ),
    }  # fmt: skip
    if not UNSHARE_NET:
        cases = {k: c for k, c in cases.items() if c.argv[:2] != ["unshare", "-n"]}
    if shutil.which("ip") is None:
        cases.pop("vllm-defaults-pod-address", None)
    if not UNSHARE_MNT:
        del cases["sglang-own-mount-namespace"]
    return cases


def _lookalikes(root: Path, env: dict[str, str]) -> dict[str, subprocess.Popen[bytes]]:
    source = root / "src" / "sglang" / "launch_server.py"
    source.parent.mkdir(parents=True)
    source.write_text("print('not a server')\n")
    log = root / "sglang.log"
    log.write_text("[2025-01-01 00:00:00] Load weight begin. avail mem=10 GB\n")
    commands = {
        "shell running grep": ["bash", "-c", "grep sglang.launch_server; true"],
        "editor on launch_server.py": ["vim", "-n", str(source)],
        "python -c": [PY, "-c", "import sys; sys.stdin.read()", "-m", "sglang.launch_server"],
        "tail -f the log": ["tail", "-f", str(log)],
        "pip-like console script": [PY, str(source.parent / "pip"), "install", "vllm"],
    }
    (source.parent / "pip").write_text("import sys\nsys.stdin.read()\n")
    started = {}
    for name, argv in commands.items():
        if shutil.which(argv[0]) is None:
            continue
        started[name] = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    return started


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End a process we started and its session (its simulator child and fork workers)."""
    if proc.stdin is not None:
        proc.stdin.close()
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    root = tmp_path_factory.mktemp("discovery")
    site, scripts = install(root / "standins")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]),
        "PATH": f"{scripts}{os.pathsep}{os.environ['PATH']}",
        "STANDIN_SIM_ARGS": SIM_ARGS,
    }
    for var in ("HF_HOME", "HF_HUB_CACHE", "VLLM_API_KEY", "LLAMA_API_KEY", "LLAMA_ARG_PORT"):
        env.pop(var, None)
    cases = _cases(root)
    for case in cases.values():
        case.proc = subprocess.Popen(
            case.argv,
            env={**env, **case.env},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    lookalikes = _lookalikes(root, env)
    try:
        discoverer = Discoverer()
        pids = {c.proc.pid for c in cases.values() if c.proc is not None}

        def all_found() -> dict[int, DiscoveredServer] | None:
            found = {s.pid: s for s in discoverer.scan()}
            return found if pids <= found.keys() else None

        wait_for(all_found, timeout=30, interval=0.3)
        servers = {s.pid: s for s in discoverer.scan()}
        yield Fleet(cases, lookalikes, servers, root, env)
    finally:
        for proc in [*(c.proc for c in cases.values() if c.proc), *lookalikes.values()]:
            _stop(proc)


def _server(fleet: Fleet, case_id: str) -> DiscoveredServer:
    case = fleet.cases.get(case_id)
    require(case is not None, "needs unshare (root with CAP_SYS_ADMIN) and ip (iproute2)")
    assert case is not None and case.proc is not None
    return fleet.servers[case.proc.pid]


CASE_IDS = [
    "sglang-module-all-flags",
    "sglang-serve-positional",
    "sglang-defaults",
    "vllm-hub-id",
    "vllm-module",
    "vllm-defaults-pod-address",
    "llama-server-flags",
    "llama-server-env",
    "llama-server-defaults",
    "llama-cpp-python",
    "llama-cpp-python-defaults",
    "tgi-flags",
    "tgi-defaults",
    "triton-flags",
    "triton-defaults",
    "triton-one-model",
    "triton-explicit",
    "sglang-own-mount-namespace",
]


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_server_is_recognised_from_its_own_arguments(fleet: Fleet, case_id: str) -> None:
    server = _server(fleet, case_id)
    case = fleet.cases[case_id]
    assert server.kind == case.kind
    assert server.url == case.url
    assert server.reachable == case.reachable
    assert server.start_time == pytest.approx(psutil.Process(server.pid).create_time(), abs=1.0)
    if case.name is not None:
        assert server.name == case.name
    if case.probe is not None:
        assert (server.probe, server.probe_path) == case.probe
    if case.model is not None or case.kind == "triton":
        assert server.model == case.model
    if case.weights is not None:
        assert server.weights == case.weights
    assert dict(server.headers) == dict(case.headers)
    for what, words in case.evidence:
        sources = [e.source for e in server.evidence if e.what == what]
        assert any(words in source for source in sources), (what, server.evidence)


def test_reachable_servers_answer_the_discovered_probe(fleet: Fleet) -> None:
    """The URL, path and headers discovery derived reach the server the arguments started."""
    for case_id in fleet.cases:
        server = _server(fleet, case_id)
        if not server.reachable or case_id.startswith("vllm-defaults"):
            continue
        config = endpoint_config(server)
        if server.kind == "triton":  # the simulator has no Triton face: its port must be open
            config = dataclasses.replace(config, probe=ProbeKind.TCP, path="")
        prober = EndpointProber(config)
        result = wait_for(
            lambda p=prober: (s := p.sample()).result == ProbeResult.READY and s, timeout=20
        )
        assert result, case_id


def test_weights_are_files_the_exporter_can_open(fleet: Fleet) -> None:
    for case_id in fleet.cases:
        server = _server(fleet, case_id)
        weights = weights_config(server)
        assert weights is not None, (case_id, server.evidence)
        for path in weights.paths:
            assert os.path.exists(path), (case_id, path)


def test_weights_only_inside_a_mount_namespace_resolve_through_proc_root(fleet: Fleet) -> None:
    server = _server(fleet, "sglang-own-mount-namespace")
    inside = fleet.root / "mnt" / "Only-Inside"
    assert server.weights == (f"/proc/{server.pid}/root{inside}",)
    assert not inside.exists()  # on this host the directory is not there
    shards = sorted(os.listdir(server.weights[0]))
    assert shards and all(name.endswith(".safetensors") for name in shards)


def test_api_key_is_sent_but_never_shown(fleet: Fleet) -> None:
    for case_id in ("sglang-module-all-flags", "vllm-hub-id", "llama-server-env"):
        server = _server(fleet, case_id)
        key = server.headers["Authorization"].removeprefix("Bearer ")
        shown = repr(server) + json.dumps([dataclasses.asdict(e) for e in server.evidence])
        shown += repr(endpoint_config(server))
        assert key not in shown
        assert any(e.what == "api_key" and e.value == "(secret)" for e in server.evidence)


def test_workers_with_the_parents_command_line_are_not_servers(fleet: Fleet) -> None:
    case = fleet.cases["sglang-module-all-flags"]
    assert case.proc is not None
    parent = psutil.Process(case.proc.pid)
    workers = [c for c in parent.children() if c.cmdline() == parent.cmdline()]
    assert len(workers) == 2  # the stand-in forked them, like multiprocessing fork workers
    assert not {w.pid for w in workers} & fleet.servers.keys()


def test_lookalikes_are_not_servers(fleet: Fleet) -> None:
    assert len(fleet.lookalikes) >= 4
    for name, proc in fleet.lookalikes.items():
        assert proc.poll() is None, f"{name} exited before the scan"
        tree = [proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))]
        assert not set(tree) & fleet.servers.keys(), name


def test_only_the_configured_server_kinds_are_found(fleet: Fleet) -> None:
    found = Discoverer(servers=("vllm", "triton")).scan()
    ours = {c.proc.pid for c in fleet.cases.values() if c.proc}
    assert {s.kind for s in found if s.pid in ours} == {"vllm", "triton"}


def test_restart_keeps_the_name(fleet: Fleet, tmp_path: Path) -> None:
    """The same server started again is a new process under the same target name."""
    weights = tmp_path / "Restarted-7B"
    weights.mkdir()
    port = free_port()
    argv = [PY, "-m", "sglang.launch_server", "--model-path", str(weights), f"--port={port}"]
    discoverer = Discoverer()
    seen = []
    for _ in range(2):
        proc = subprocess.Popen(
            argv, env=fleet.env, stderr=subprocess.DEVNULL, start_new_session=True
        )
        try:
            seen.append(wait_for(lambda p=proc: _by_pid(discoverer.scan(), p.pid), timeout=10))
        finally:
            _stop(proc)
        assert _by_pid(discoverer.scan(), proc.pid) is None
    first, second = seen
    assert first.name == second.name == f"sglang-Restarted-7B-{port}"
    assert first.key != second.key


def test_a_wrapper_that_execs_late_is_found_by_the_refresh(fleet: Fleet, tmp_path: Path) -> None:
    """A process seen as a shell is looked at again until it has become the server."""
    weights = tmp_path / "Late-1B"
    weights.mkdir()
    port = free_port()
    script = f"sleep 1; exec {PY} -m sglang.launch_server --model-path {weights} --port {port}"
    discoverer = Discoverer(refresh_passes=2)
    proc = subprocess.Popen(
        ["sh", "-c", script], env=fleet.env, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        discoverer.scan()
        discoverer.scan()  # the second look at a new pid: still the shell
        time.sleep(1.5)
        found = wait_for(lambda: _by_pid(discoverer.scan(), proc.pid), timeout=10, interval=0.2)
    finally:
        _stop(proc)
    assert found.name == f"sglang-Late-1B-{port}"


def _by_pid(servers: tuple[DiscoveredServer, ...], pid: int) -> DiscoveredServer | None:
    return next((s for s in servers if s.pid == pid), None)


def test_a_routers_model_servers_are_servers_of_their_own(tmp_path: Path) -> None:
    """llama-server's router mode: a llama-server without a model starts a llama-server per
    model it loads, its environment naming the router's port. Such a child is a server of its
    own, `<router's name>/<model>` (the same name whichever port the router gives it); a child
    without that variable, or naming another router's port, is a worker as before."""
    gguf = tmp_path / "tiny-q4_k_m.gguf"
    gguf.write_bytes(b"GGUF" + bytes(4092))
    router_port, child_port, worker_port, other_port = (free_port() for _ in range(4))
    sleep = "import time; time.sleep(60)"

    def child(port: int, alias: str, router: int | None) -> str:
        argv = ["llama-server", "-c", sleep, "--model", str(gguf), "--alias", alias,
                "--port", str(port)]  # fmt: skip
        env = "" if router is None else f', "LLAMA_SERVER_ROUTER_PORT": "{router}"'
        return f"subprocess.Popen({argv!r}, executable={PY!r}, env={{**os.environ{env}}})\n"

    router_code = (
        "import os, subprocess, time\n"
        + child(child_port, "tiny", router_port)
        + child(worker_port, "worker", None)
        + child(other_port, "stray", router_port + 1)
        + "time.sleep(60)\n"
    )
    router = subprocess.Popen(
        ["llama-server", "-c", router_code, "--models-dir", str(tmp_path),
         "--host", "127.0.0.1", "--port", str(router_port)],
        executable=PY, start_new_session=True,
    )  # fmt: skip
    discoverer = Discoverer()
    try:

        def both() -> dict[str, DiscoveredServer] | None:
            found = {s.name: s for s in discoverer.scan()}
            if len(psutil.Process(router.pid).children()) < 3:
                return None
            return found if f"llamacpp-{router_port}/tiny" in found else None

        found = wait_for(both, timeout=10, interval=0.2)
        found = {s.name: s for s in discoverer.scan()}  # a second pass: from what it kept
    finally:
        _stop(router)
    ours = {name: s for name, s in found.items() if name.startswith(f"llamacpp-{router_port}")}
    assert set(ours) == {f"llamacpp-{router_port}", f"llamacpp-{router_port}/tiny"}, found.keys()
    model = ours[f"llamacpp-{router_port}/tiny"]
    assert model.pid != router.pid and model.url == f"http://127.0.0.1:{child_port}"
    assert (model.probe, model.probe_path, model.model) == (ProbeKind.HEALTH, "/health", "tiny")
    assert model.weights == (str(gguf),)
    assert any(e.what == "router" and e.value == f"llamacpp-{router_port}" for e in model.evidence)
    assert not any(s.url.endswith((f":{worker_port}", f":{other_port}")) for s in found.values())
