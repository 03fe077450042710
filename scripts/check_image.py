"""Run the built container image through what docs/deploy.md promises; by hand, as root.

    make image && sudo .venv/bin/python scripts/check_image.py [--image model-load-exporter:0.1.0]

For each privilege setting it starts the image with the host's PID namespace and a host file
bind-mounted read-only as the weights, then compares what the exporter inside reports with the
truth measured here on the host (cachestat as root): page-cache residency must be the true number
or absent with the reason, never a false one; a host process's storage reads must be present only
where the container may read /proc/PID/io. It also times start-up to /-/healthy, runs the image's
own HEALTHCHECK and scrapes /metrics. Not part of `make test`: it needs a container engine and root.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exporter.storage.cachectl import evict

REPO = Path(__file__).resolve().parent.parent
# The truth is measured as the tests measure it (cachestat as root, by path).
sys.path.insert(0, str(REPO / "tests"))

from helpers.pagecache_io import file_residency  # noqa: E402

MiB = 1 << 20
MARKER = "model-load-image-check-reader"
READER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
os.pread(fd, 16 << 20, 0)
print("read", flush=True)
time.sleep(600)
"""


@dataclass(frozen=True)
class Case:
    name: str
    flags: tuple[str, ...]
    owner: int = 0  # uid owning the weights file on the host


ROOT = ("--user", "0")
UNCONFINED = ("--security-opt", "seccomp=unconfined")
# deploy/kubernetes/daemonset.yaml's securityContext, as engine flags.
DAEMONSET = (
    *ROOT, "--cap-drop", "ALL", "--cap-add", "SYS_PTRACE", "--cap-add", "DAC_READ_SEARCH",
    "--cap-add", "FOWNER", "--read-only", "--security-opt", "no-new-privileges",
)  # fmt: skip
CASES = (
    Case("non-root (image default), default seccomp", ()),
    Case("non-root, seccomp unconfined", UNCONFINED),
    Case("non-root owning the file, default seccomp", (), owner=10001),
    Case("root, default seccomp", ROOT),
    Case("root, seccomp unconfined", (*ROOT, *UNCONFINED)),
    Case("root + SYS_PTRACE, default seccomp", (*ROOT, "--cap-add", "SYS_PTRACE")),
    Case("root, no capabilities, file of another user", (*ROOT, "--cap-drop", "ALL"), 4242),
    Case("DaemonSet securityContext, default seccomp, file of another user", DAEMONSET, 4242),
    Case("DaemonSet securityContext, seccomp unconfined", (*DAEMONSET, *UNCONFINED), 4242),
)


def engine_run() -> list[str]:
    if (
        shutil.which("docker")
        and subprocess.run(["docker", "info"], capture_output=True).returncode == 0
    ):
        return ["docker", "run"]
    # runc: crun refuses cgroup v1 hybrid mode on some hosts; runc cannot raise inherited rlimits.
    return [
        "podman", "--runtime", "runc", "run",
        "--ulimit", "nofile=1024:20000", "--ulimit", "nproc=1024:1024",
    ]  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 2.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def wait_for(check, timeout: float, step: float = 0.02):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    return None


def sample(text: str, prefix: str) -> float | None:
    """The first sample whose line starts with `prefix` (a name, or a name and leading labels)."""
    for line in text.splitlines():
        if line.startswith(prefix) and line[len(prefix)] in "{ ,":
            return float(line.rsplit(" ", 1)[1])
    return None


def run_case(run: Sequence[str], image: str, case: Case, weights: Path) -> dict:
    os.chown(weights, case.owner, case.owner)
    history = Path(tempfile.mkdtemp(prefix="mle-history-", dir="/var/tmp"))  # root's, 0700
    port = free_port()
    name = f"mle-check-{os.getpid()}-{port}"
    argv = [
        *run, "-d", "--rm", "--name", name, "--network=host", "--pid=host",
        "-v", f"{weights.parent}:/weights:ro", "-v", f"{history}:/var/lib/model-load-exporter",
        *case.flags, image,
        "--target=w", "--endpoint=http://127.0.0.1:9", "--weights=/weights",
        f"--cmdline={MARKER}", "--sample.interval=200ms",
        f"--web.listen-address=127.0.0.1:{port}",
    ]  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    subprocess.run(argv, check=True, capture_output=True)
    try:
        healthy = wait_for(lambda: get(base + "/-/healthy")[0] == 200, 30)
        startup = time.monotonic() - started if healthy else None

        def residency_seen() -> dict | None:
            status, body = get(base + "/api/v1/status")
            if status != 200:
                return None
            target = json.loads(body)["targets"][0]
            if "residency" not in target or not target.get("process_up", True):
                return None
            return target

        target = wait_for(residency_seen, 20, 0.1) or {}
        time.sleep(0.5)  # one more process sample, so read bytes are in if readable
        metrics = get(base + "/metrics")[1]
        history_state = json.loads(get(base + "/api/v1/status")[1] or "{}").get("history", {})
        truth = file_residency(str(weights)).resident_bytes
        logs = subprocess.run(
            [run[0], "logs", name], capture_output=True, text=True
        ).stderr.splitlines()
    finally:
        subprocess.run([run[0], "rm", "-f", name], capture_output=True)
        shutil.rmtree(history)
    residency = target.get("residency", {})
    return {
        "case": case.name,
        "startup_s": startup,
        "resident_bytes": sample(metrics, "model_load_weights_resident_bytes"),
        "truth_now": truth,
        "method": residency.get("method"),
        "reason": residency.get("reason"),
        "pagecache_up": sample(metrics, 'model_load_source_up{source="pagecache"'),
        "process_up": sample(metrics, "model_load_process_up"),
        "process_read_bytes": sample(metrics, "model_load_process_read_bytes_total"),
        "history": history_state.get("problem") or history_state.get("enabled"),
        "log_lines": [line for line in logs if "pagecache" in line or "process" in line][:3],
    }


def check_healthcheck_and_scrape(run: Sequence[str], image: str) -> None:
    port = free_port()
    name = f"mle-check-{os.getpid()}-hc"
    subprocess.run(
        [
            *run, "-d", "--rm", "--name", name, "--network=host", image,
            "--target=t", "--endpoint=http://127.0.0.1:9", "--history.path=",
        ],
        check=True, capture_output=True,
    )  # fmt: skip
    try:
        wait_for(lambda: get("http://127.0.0.1:9847/-/healthy")[0] == 200, 30)
        if run[0] == "podman":
            done = subprocess.run(["podman", "healthcheck", "run", name], capture_output=True)
            print(f"HEALTHCHECK (podman healthcheck run): exit {done.returncode}")
        else:
            health = wait_for(
                lambda: (
                    subprocess.run(
                        ["docker", "inspect", "-f", "{{.State.Health.Status}}", name],
                        capture_output=True,
                        text=True,
                    ).stdout.strip()
                    == "healthy"
                ),
                60,
                1,
            )
            print(f"HEALTHCHECK: {'healthy' if health else 'not healthy after 60 s'}")
        text = get("http://127.0.0.1:9847/metrics")[1]
        families = sorted(
            {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")}
        )
        print(f"/metrics on :9847: {len(text.splitlines())} lines, {len(families)} families")
        for line in text.splitlines():
            if line.startswith(("model_load_exporter_build_info", "model_load_phase{")):
                print("   ", line)
    finally:
        subprocess.run([run[0], "rm", "-f", name], capture_output=True)
    del port


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--image", default="model-load-exporter:0.1.0")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print(
            "check_image: run as root (it starts containers and chowns a test file)",
            file=sys.stderr,
        )
        return 2
    run = engine_run()
    check_healthcheck_and_scrape(run, args.image)
    with tempfile.TemporaryDirectory(prefix="mle-weights-", dir="/var/tmp") as tmp:
        os.chmod(tmp, 0o755)
        weights = Path(tmp) / "model-00001-of-00001.safetensors"
        with open(weights, "wb") as f:
            f.write(os.urandom(64 * MiB))
        weights.chmod(0o644)
        evict(str(weights))
        # A host process that has read the first quarter of the weights, without readahead, and
        # stays up: its /proc/PID/io is what --pid=host lets the container see (or not).
        reader = subprocess.Popen(
            [sys.executable, "-c", READER, str(weights), MARKER], stdout=subprocess.PIPE
        )
        assert reader.stdout is not None and reader.stdout.readline()
        truth = file_residency(str(weights)).resident_bytes
        try:
            results = [run_case(run, args.image, case, weights) for case in CASES]
        finally:
            reader.kill()
            reader.wait()
    print(f"truth on the host (cachestat as root): {truth} of {64 * MiB} bytes resident")
    for r in results:
        print(json.dumps(r))
    startups = [r["startup_s"] for r in results if r["startup_s"] is not None]
    if startups:
        print(
            f"start-up to /-/healthy over {len(startups)} runs: median "
            f"{statistics.median(startups):.2f} s, max {max(startups):.2f} s"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
