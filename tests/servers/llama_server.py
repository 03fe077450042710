"""llama.cpp's own C++ `llama-server` (the release llama-cpp-python 0.3.36 vendors, built with
cmake by `make test-servers`) serving GGUFs that tests/fixtures/logs/tiny_gguf.py writes, started
the way operators start it.

The Makefile names the binary in MLE_LLAMA_SERVER. The models are written once into
`.servers/checkpoints` by this checkout's Python with the `gguf` package from the same llama.cpp
source (gguf-py, found through the build's CMakeCache.txt), so no other install is needed; the
writer is seeded: the same bytes every time.

The server opens its port at once and answers every path 503 `Loading model` until the model is
in, then /health is 200. It maps the GGUF by default; `--load-mode none` reads it instead. Its
stderr (stamped with the time since it started: `0.00.007.654 I srv load_model: ...`) goes to a
log file it owns from the first byte. Started without a model (`--models-dir DIR`) it is a
router: /health is 200 at once, and it starts a `llama-server --model FILE --alias NAME --port P`
child per model it loads (`POST /models/load`), forwarding the child's lines into its own log
with `[P] ` before each (stamped with the time since the child started).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import requests
from helpers.cgroups import joining
from helpers.support import free_port

from servers import launched
from servers.vllm_server import CHECKPOINTS, REPO

BINARY_ENV = "MLE_LLAMA_SERVER"
WRITER = REPO / "tests" / "fixtures" / "logs" / "tiny_gguf.py"
START_TIMEOUT = 120.0
# 0.55 GB of f32 (tiny_gguf.py's arguments: extra words, embedding, layers, heads, FFN, context):
# about 5 s from a disk read at 100 MB/s, small enough for two cores.
SHAPE = (64, 1024, 8, 16, 4096, 512)
_SOURCE = re.compile(r"^CMAKE_HOME_DIRECTORY:INTERNAL=(.+)$", re.MULTILINE)


def find_binary() -> Path | None:
    """The llama-server named in $MLE_LLAMA_SERVER (`make test-servers` sets it), or None."""
    named = os.environ.get(BINARY_ENV)
    return Path(named) if named and os.access(named, os.X_OK) else None


def gguf_py(binary: Path) -> Path:
    """The gguf-py of the llama.cpp source the binary was built from (its CMakeCache.txt)."""
    cache = (binary.parent.parent / "CMakeCache.txt").read_text()
    found = _SOURCE.search(cache)
    assert found, f"no source directory in {binary.parent.parent}/CMakeCache.txt"
    return Path(found.group(1)) / "gguf-py"


def ensure_model(binary: Path, splits: int = 1, shape: tuple[int, ...] = SHAPE) -> Path:
    """The GGUF of `shape` (in `splits` files, `-00001-of-0000N.gguf`), written once into a
    folder of its own (a scratch name, then renamed: one that exists is complete); the path to
    give `-m`: the file, or the first of the splits."""
    folder = CHECKPOINTS / f"llama-server-{'-'.join(map(str, shape))}-split{splits}"
    name = "tiny-llama-f32.gguf"
    if not folder.exists():
        scratch = folder.with_name(f".{folder.name}.partial")
        scratch.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "PYTHONPATH": str(gguf_py(binary))}
        argv = [sys.executable, str(WRITER), str(scratch / name), *map(str, shape)]
        if splits > 1:
            argv.append(str(splits))
        subprocess.run(argv, check=True, timeout=600, env=env, capture_output=True)
        scratch.rename(folder)
    if splits == 1:
        return folder / name
    return folder / f"tiny-llama-f32-00001-of-{splits:05d}.gguf"


def parts(model: Path) -> list[Path]:
    """Every file of the model: itself, or all its splits."""
    return sorted(model.parent.glob("*.gguf"))


class LlamaServer:
    """One llama-server on a free port, stderr and stdout into `log`; in the blkio cgroup of
    `procs` when given, from its first instruction."""

    def __init__(
        self,
        binary: Path,
        model: Path | None,
        log: Path,
        procs: Path | None = None,
        extra: tuple[str, ...] = (),
    ) -> None:
        """`model` None: a router (give it `--models-dir DIR` in `extra`)."""
        self.log = log
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            str(binary), *(("-m", str(model)) if model else ()), "--host", "127.0.0.1",
            "--port", str(self.port), "-c", "512", "-t", "2", *extra,
        ]  # fmt: skip
        if procs is not None:
            argv = joining([procs.parent], argv)
        with log.open("wb") as out:  # a new file written from its start: the process's own
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip

    def health(self) -> tuple[int, str] | None:
        """/health's status and body; None while nothing answers."""
        try:
            answer = requests.get(f"{self.url}/health", timeout=5)
        except requests.RequestException:
            return None
        return answer.status_code, answer.text

    def wait_ready(self, timeout: float = START_TIMEOUT) -> tuple[float, list[tuple[int, str]]]:
        """Poll /health every 20 ms until 200: when it first answered so, and every distinct
        answer before it. Fails at once if the server exits."""
        answers: list[tuple[int, str]] = []

        def ready() -> bool:
            answer = self.health()
            if answer is not None and answer[0] != 200 and answer not in answers:
                answers.append(answer)
            return answer is not None and answer[0] == 200

        at = launched.first_answer(
            self.proc, ready, name="llama-server", tail=self.tail, timeout=timeout, every=0.02
        )
        return at, answers

    def router_status(self, name: str) -> tuple[str, list[str]] | None:
        """A router's word on model `name` (`GET /models`): its status (unloaded, loading,
        loaded) and the arguments of its server; None while it does not answer."""
        try:
            listed = requests.get(f"{self.url}/models", timeout=5).json()["data"]
        except (requests.RequestException, ValueError, KeyError):
            return None
        for entry in listed:
            if entry.get("id") == name:
                status = entry.get("status") or {}
                return str(status.get("value")), list(status.get("args") or [])
        return None

    def router(self, action: str, name: str) -> float:
        """`POST /models/load` or `/models/unload` of model `name`: when it was answered (the
        router answers at once and loads in the background)."""
        answer = requests.post(f"{self.url}/models/{action}", json={"model": name}, timeout=30)
        assert answer.status_code == 200, (answer.status_code, answer.text, self.tail())
        return time.time()

    def tail(self, lines: int = 30) -> str:
        return launched.tail(self.log, lines)

    def stop(self) -> int:
        return launched.stop(self.proc)
