"""A real llama.cpp (as llama-cpp-python 0.3.36 bundles it, built from source) serving a GGUF that
tests/fixtures/logs/tiny_gguf.py writes, started the way operators start it.

`make test-servers` installs it into `.servers/llamacpp` (with `gguf` and `numpy`, which the
model's writer needs) and names its python in MLE_LLAMACPP_PYTHON; the model is written once into
`.servers/checkpoints` and reused (the writer is seeded: the same bytes every time).

The server is `python -m llama_cpp.server --model FILE --port N`: it loads the model before
uvicorn listens (port closed until ready, then /v1/models answers), with mmap and mlock by
default, so a load reads the whole file through the page cache. Its stdout and stderr go to a
log file. It can start inside a cgroup (`procs`: a blkio throttle, so its cold reads take long
enough on this machine's fast disk for read rates to mean something).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import requests
from helpers.cgroups import joining

from servers import launched
from servers.vllm_server import CHECKPOINTS, REPO, executable

PYTHON_ENV = "MLE_LLAMACPP_PYTHON"
WRITER = REPO / "tests" / "fixtures" / "logs" / "tiny_gguf.py"
START_TIMEOUT = 120.0
# 1.08 GB of f32 (tiny_gguf.py's arguments: extra words, embedding, layers, heads, FFN, context):
# big enough that a cold load from a throttled disk takes seconds, small enough for this host.
SHAPE = (64, 1024, 16, 16, 4096, 512)


def find_python() -> str | None:
    """The llama.cpp venv's python named in $MLE_LLAMACPP_PYTHON (`make test-servers` sets it)."""
    return executable(PYTHON_ENV)


def ensure_model(python: str, shape: tuple[int, ...] = SHAPE) -> Path:
    """The GGUF of `shape`, written once (into a scratch name, then renamed: one that exists is
    complete)."""
    path = CHECKPOINTS / f"tiny-llama-{'-'.join(map(str, shape))}-f32.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        scratch = path.with_name(f".{path.name}.partial")
        subprocess.run(
            [python, str(WRITER), str(scratch), *map(str, shape)], check=True, timeout=600
        )
        scratch.rename(path)
    return path


class LlamaCppServer:
    """One llama-cpp-python server on `port`, its output appended to `log`; its pid written to
    `pidfile` (as a service manager would know it) so an exporter can match it."""

    def __init__(
        self,
        python: str,
        model: Path,
        port: int,
        log: Path,
        pidfile: Path,
        procs: Path | None = None,
    ) -> None:
        self.port = port
        self.log = log
        self.url = f"http://127.0.0.1:{port}"
        argv = [
            python, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--n_ctx", "512",
        ]  # fmt: skip
        if procs is not None:
            argv = joining([procs.parent], argv)  # in the cgroup before its first read
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        pidfile.write_text(f"{self.proc.pid}\n")  # the shell execs the server: the same pid

    def ready(self) -> bool:
        try:
            return requests.get(f"{self.url}/v1/models", timeout=5).status_code == 200
        except requests.RequestException:
            return False

    def wait_ready(self, timeout: float = START_TIMEOUT) -> float:
        """Poll /v1/models every 20 ms; the unix time it first answered. Fails if it exits."""
        return launched.first_answer(
            self.proc, self.ready, name="llama.cpp", tail=self.tail, timeout=timeout, every=0.02
        )

    def tail(self, lines: int = 30) -> str:
        return launched.tail(self.log, lines)

    def stop(self) -> int:
        return launched.stop(self.proc)
