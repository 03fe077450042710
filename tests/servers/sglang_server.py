"""A real SGLang (0.5.23 on its CPU engine) serving the test checkpoint, started the way operators
start it, optionally inside a blkio cgroup that throttles its reads from the disk.

`make test-servers` installs it into its cache of server installs and names its python in
MLE_SGLANG_PYTHON, and the folder holding Debian's `libcuda.so.1` in MLE_LIBCUDA_DIR: PyPI's
sglang-kernel links that library for one symbol, so it must load, though no GPU is used.

SGLang runs as `python -m sglang.launch_server`: the launching process (tokenizer manager and
HTTP), a scheduler child that loads the weights, a detokenizer child. Its port stays closed until
the scheduler is ready; then it answers generations at once, while its own warm-up request runs
and `/health` still says 503 (tokenizer_manager.server_status stays Starting until that warm-up
is answered). So what a client sees first, and what the tests compare the exporter with, is the
first answered completion.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil
import requests
from helpers.cgroups import joining

from servers import launched
from servers.vllm_server import DTYPE, SERVERS, executable

PYTHON_ENV = "MLE_SGLANG_PYTHON"
LIBCUDA_ENV = "MLE_LIBCUDA_DIR"
START_TIMEOUT = 400.0  # about 75 s warm here on 2 shared cores, twice that with cold imports
ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "DO_NOT_TRACK": "1",
    "OUTLINES_CACHE_DIR": str(SERVERS / "cache" / "outlines"),
    "TRITON_CACHE_DIR": str(SERVERS / "cache" / "triton"),
}
PROMPT = "hello world"
# Its processes' scheduling priority: on this shared 2-core machine the other sessions' work
# stretched identical warm starts from 26 to 55 s (imports are CPU-bound), which no forecast
# made before a start can know; ahead of them it runs as on a host of its own.
NICE = -10
# SGLang's line prefix: `[YYYY-MM-DD HH:MM:SS( TPn| DPn ...)] `, whole seconds of local time.
_STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d)(?:\.\d+)?(?: [A-Z_]+\d+)*\] ")


def find_python() -> str | None:
    """SGLang's venv python ($MLE_SGLANG_PYTHON), when its libcuda folder is named too."""
    python = executable(PYTHON_ENV)
    libcuda = os.environ.get(LIBCUDA_ENV)
    if python is None or not libcuda or not (Path(libcuda) / "libcuda.so.1").exists():
        return None
    return python


def stamp_of(log: str, marker: str) -> float:
    """Unix time of the stamp of the first line of SGLang's log holding `marker`."""
    for line in log.splitlines():
        m = _STAMP.match(line)
        if m and marker in line:
            return datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp()
    raise AssertionError(f"no {marker!r} line in SGLang's log")


def startup_timings(log: str) -> dict[str, float]:
    """SGLang's own `Engine startup timings (s): load_weight=..., ...` as numbers."""
    m = re.search(r"Engine startup timings \(s\): (.*)", log)
    if m is None:
        return {}
    flat = re.sub(r"\{[^}]*\}", "", m.group(1))
    return {k: float(v) for k, v in re.findall(r"(\w+)=([\d.]+)", flat)}


class SglangServer:
    """One SGLang server on `port`, stdout and stderr appended to `log`; in the blkio cgroup of
    `procs` from its first instruction when given."""

    def __init__(
        self, python: str, model: Path, port: int, log: Path, procs: Path | None = None
    ) -> None:
        self.model = model
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            python, "-m", "sglang.launch_server", "--model-path", str(model), "--device", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--disable-cuda-graph",
            "--max-total-tokens", "16384", "--dtype", DTYPE,
        ]  # fmt: skip
        if procs is not None:
            argv = joining([procs.parent], argv)
        env = {**os.environ, **ENV, "LD_LIBRARY_PATH": os.environ[LIBCUDA_ENV]}
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                env=env, start_new_session=True, preexec_fn=lambda: os.nice(NICE),
            )  # fmt: skip
        self.pid = self.proc.pid

    def complete(self, timeout: float = 60.0) -> bool:
        """One greedy 1-token completion; whether SGLang answered it."""
        body = {"model": str(self.model), "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
        try:
            answer = requests.post(f"{self.url}/v1/completions", json=body, timeout=timeout)
        except requests.RequestException:
            return False
        return answer.status_code == 200 and bool(answer.json().get("choices"))

    def wait_first_completion(self, timeout: float = START_TIMEOUT) -> float:
        """Ask for a completion every 100 ms until one is answered; the unix time it was."""
        return launched.first_answer(
            self.proc, self.complete, name="SGLang", tail=self.tail, timeout=timeout, every=0.1
        )

    def wait_fired_up(self, timeout: float = 120.0) -> None:
        """Until SGLang's own warm-up is over (its log says so): a stop during it is untidy."""
        deadline = time.monotonic() + timeout
        while "The server is fired up" not in self.text():
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"SGLang's warm-up did not end:\n{self.tail()}")
            time.sleep(0.2)

    def tree(self) -> list[psutil.Process]:
        """SGLang's processes now: the launcher, its scheduler and detokenizer."""
        return launched.group(self.pid)

    def tail(self, lines: int = 30) -> str:
        return launched.tail(self.log, lines)

    def stop(self) -> list[psutil.Process]:
        return launched.stop_group(self.proc)

    def text(self) -> str:
        return self.log.read_text(errors="replace")


def describe(server: SglangServer) -> dict[str, Any]:
    """SGLang's own words about its start: the stamps of its step lines and its timings."""
    log = server.text()
    out: dict[str, Any] = {"startup_timings": startup_timings(log)}
    for key, marker in (("init_parallel", "Init parallel begin"),
                        ("weights_begin", "Load weight begin"), ("weights_end", "Load weight end"),
                        ("kv_cache", "KV Cache is allocated"), ("uvicorn", "Uvicorn running on"),
                        ("fired_up", "The server is fired up")):  # fmt: skip
        with contextlib.suppress(AssertionError):
            out[key] = stamp_of(log, marker)
    m = re.search(r"Load weight end\. elapsed=([\d.]+) s", log)
    out["weights_elapsed"] = float(m.group(1)) if m else None
    return out
