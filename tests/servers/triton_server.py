"""A real Triton Inference Server (tritonserver 2.51, as the nvidia-pytriton 0.7.0 wheel ships it)
serving a Python-backend model whose initialize() reads safetensors shards, started as a plain
binary the way operators start it.

`make test-servers` copies the wheel's bin, backends and caches into its cache of server installs,
puts the Python backend's stub for this Python beside the backend, and names the folder in
MLE_TRITON_DIR; its `venv` (safetensors, numpy) is the Python the stub embeds and model.py
imports. The model repository is written once into `.servers/checkpoints` (seeded: the same
bytes every time).

The tree is `tritonserver` -> `triton_python_backend_stub` (started through `bash -c exec`):
short-lived stubs probe and auto-complete the model, then the instance's stub runs initialize(),
which maps each shard (safe_open) and lets it go at once. In the default model-control mode every
port stays closed until the model is loaded; in explicit mode the ports open at once and
`POST /v2/repository/models/NAME/load` loads it, answering once it is loaded; in poll mode the
server loads what is added to the repository (and unloads what is removed) at its next poll.
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import numpy as np
import psutil
import requests
from helpers.cgroups import joining
from helpers.support import free_port

from servers import launched
from servers.vllm_server import CHECKPOINTS

DIR_ENV = "MLE_TRITON_DIR"
MODEL = "tiny"
START_TIMEOUT = 120.0
# 4 shards of 100 MB: about 4 s from a disk read at 100 MB/s, well under a second from the cache.
SHARDS = 4
SHARD_TENSORS = 6
TENSOR_SHAPE = (1024, 4096)  # f32: 16 MiB each

CONFIG = """\
backend: "python"
max_batch_size: 0
input [ { name: "INPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
output [ { name: "OUTPUT" data_type: TYPE_FP32 dims: [ 1 ] } ]
instance_group [ { kind: KIND_CPU count: 1 } ]
"""

# What Triton users write: the weights sit beside model.py and initialize() reads them.
MODEL_PY = """\
import glob
import os

import numpy as np
import triton_python_backend_utils as pb_utils
from safetensors import safe_open


class TritonPythonModel:
    def initialize(self, args):
        here = os.path.join(args["model_repository"], args["model_version"])
        self.bias = 0.0
        for shard in sorted(glob.glob(os.path.join(here, "*.safetensors"))):
            with safe_open(shard, framework="numpy") as f:
                for name in f.keys():
                    self.bias += float(f.get_tensor(name)[0, 0])

    def execute(self, requests):
        out = []
        for request in requests:
            x = pb_utils.get_input_tensor_by_name(request, "INPUT").as_numpy()
            y = pb_utils.Tensor("OUTPUT", (x + self.bias).astype(np.float32))
            out.append(pb_utils.InferenceResponse([y]))
        return out
"""


_LIBDIR = "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"


def find_dir() -> Path | None:
    """The Triton install named in $MLE_TRITON_DIR (`make test-servers` sets it), or None."""
    named = os.environ.get(DIR_ENV)
    if not named:
        return None
    root = Path(named)
    return root if os.access(root / "bin" / "tritonserver", os.X_OK) else None


def ensure_repository() -> Path:
    """The model repository with MODEL in it, written once (into a scratch name, then renamed:
    one that exists is complete)."""
    repo = CHECKPOINTS / f"triton-{MODEL}-{SHARDS}x{SHARD_TENSORS}"
    if repo.exists():
        return repo
    scratch = repo.with_name(f".{repo.name}.partial")
    write_model(scratch, MODEL, SHARDS, seed=0)
    scratch.rename(repo)
    return repo


def write_model(repo: Path, name: str, shards: int, seed: int) -> Path:
    """Model `name` in `repo`: its config, model.py and `shards` safetensors shards of random
    f32 (seeded: the same bytes every time)."""
    from safetensors.numpy import save_file

    version = repo / name / "1"
    version.mkdir(parents=True, exist_ok=True)
    (repo / name / "config.pbtxt").write_text(CONFIG)
    (version / "model.py").write_text(MODEL_PY)
    rng = np.random.default_rng(seed)
    for k in range(shards):
        tensors = {
            f"layers.{k}.{i}.weight": rng.standard_normal(TENSOR_SHAPE, dtype=np.float32)
            for i in range(SHARD_TENSORS)
        }
        save_file(tensors, str(version / f"model-{k + 1:05d}-of-{shards:05d}.safetensors"))
    return repo / name


def shards(repo: Path) -> list[Path]:
    return sorted((repo / MODEL / "1").glob("*.safetensors"))


def add_model(source: Path, repo: Path, name: str, staging: Path) -> Path:
    """MODEL of the repository `source` added to `repo` as `name`, whole at once: built in
    `staging` (the same filesystem; its shards hard links, the same bytes and pages) and
    renamed in, so a polling server never sees it half-written."""
    built = staging / name
    version = built / "1"
    version.mkdir(parents=True)
    (built / "config.pbtxt").write_text(CONFIG)
    (version / "model.py").write_text(MODEL_PY)
    for shard in shards(source):
        os.link(shard, version / shard.name)
    return built.rename(repo / name)


class TritonServer:
    """One tritonserver on free ports serving `repo`, its output appended to `log`; in the
    blkio cgroup of `procs` when given, from its first instruction."""

    def __init__(
        self,
        install: Path,
        repo: Path,
        log: Path,
        procs: Path | None = None,
        explicit: bool = False,
        poll_seconds: int | None = None,
    ) -> None:
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(install / "bin" / "tritonserver"), f"--model-repository={repo}",
            f"--backend-directory={install / 'backends'}",
            f"--cache-directory={install / 'caches'}", f"--http-port={self.port}",
            f"--grpc-port={free_port()}", f"--metrics-port={free_port()}",
        ]  # fmt: skip
        if explicit:
            argv.append("--model-control-mode=explicit")
        if poll_seconds is not None:  # models added to (or removed from) the repository load
            argv += ["--model-control-mode=poll", f"--repository-poll-secs={poll_seconds}"]
        if procs is not None:
            argv = joining([procs.parent], argv)
        venv = install / "venv"
        libdir = subprocess.run(
            [str(venv / "bin" / "python"), "-c", _LIBDIR], capture_output=True, text=True,
            check=True,
        ).stdout.strip()  # fmt: skip
        env = {
            **os.environ,
            # The wheel's own libraries, and libpython for the stub that embeds it.
            "LD_LIBRARY_PATH": f"{install / 'libs'}:{libdir}",
            # The stub's interpreter finds the venv's site-packages through the first python.
            "PATH": f"{venv / 'bin'}:{os.environ.get('PATH', '')}",
        }
        with log.open("wb") as out:  # a new file written from its start: the process's own
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip

    def model_ready(self, name: str = MODEL) -> bool:
        try:
            return requests.get(f"{self.url}/v2/models/{name}/ready", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def live(self) -> bool:
        try:
            return requests.get(f"{self.url}/v2/health/live", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait(self, ready: bool = True, timeout: float = START_TIMEOUT) -> float:
        """Poll every 20 ms until the model is ready (or, `ready=False`, the server live); the
        unix time it first answered so. Fails at once if it exits."""
        check = self.model_ready if ready else self.live
        return launched.first_answer(
            self.proc, check, name="tritonserver", tail=self.tail, timeout=timeout, every=0.02
        )

    def repository(self, action: str, name: str = MODEL) -> tuple[float, float]:
        """`POST /v2/repository/models/NAME/{load,unload}`: when it was sent and answered."""
        sent = time.time()
        answer = requests.post(f"{self.url}/v2/repository/models/{name}/{action}", timeout=120)
        answered = time.time()
        assert answer.status_code == 200, (answer.status_code, answer.text, self.tail())
        return sent, answered

    def tail(self, lines: int = 30) -> str:
        return launched.tail(self.log, lines)

    def stop(self) -> list[psutil.Process]:
        """SIGTERM (it unloads its models and stops its stubs), SIGKILL after the grace to
        whatever of its group is left; the processes still alive after that (none)."""
        return launched.stop_group(self.proc)
