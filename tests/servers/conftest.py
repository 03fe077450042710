"""Fixtures for the tests against real model servers: vLLM and SGLang on CPU serving the test
checkpoint, and llama.cpp (llama-cpp-python built from source) serving a GGUF. llama.cpp's own
llama-server (test_llama_server.py) and Triton (test_triton.py) have their fixtures beside their
tests.

`make test` leaves this folder out (pyproject's addopts); `make test-servers` installs both and
runs it. A vLLM start costs about two minutes on this 2-core machine, so each test starts only
the servers it checks, and every test here gets a timeout that fits two starts at their limit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from helpers.require import require_all
from helpers.support import free_port

from servers import checkpoint, llamacpp_server, sglang_server
from servers.vllm_server import CHECKPOINTS, START_TIMEOUT, VllmServer, find_python, set_cache

HERE = Path(__file__).parent
TEST_TIMEOUT = 2 * START_TIMEOUT


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in item.path.parents:
            item.add_marker(pytest.mark.system)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(TEST_TIMEOUT))


@pytest.fixture(scope="session")
def vllm_python() -> str:
    """The vLLM venv's python; a skip without one (a failure under MLE_STRICT=1)."""
    require_all("vllm")
    python = find_python()
    assert python is not None
    return python


@pytest.fixture(scope="session")
def llama_checkpoint(vllm_python: str) -> Path:
    """The random-weight Llama, written once into `.servers/checkpoints` and reused."""
    return checkpoint.ensure(CHECKPOINTS, vllm_python)


@pytest.fixture
def start_vllm(
    vllm_python: str, llama_checkpoint: Path, tmp_path: Path
) -> Iterator[Callable[..., VllmServer]]:
    """`start_vllm(cache="cold" | "warm", wait=True, port=None)`: vLLM on `port` (else a free
    one; a restart on the same port is the same target to a zero-config exporter) serving the
    checkpoint, its log in `tmp_path`; with `wait`, returned once `/health` answers 200.
    Every server started is stopped afterwards, its whole process tree."""
    started: list[VllmServer] = []

    def start(cache: str = "cold", wait: bool = True, port: int | None = None) -> VllmServer:
        set_cache(llama_checkpoint, cache)
        log = tmp_path / f"vllm-{len(started)}.log"
        server = VllmServer(vllm_python, llama_checkpoint, port or free_port(), log)
        started.append(server)
        if wait:
            server.wait_healthy()
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def llamacpp_python() -> str:
    """The llama.cpp venv's python; a skip without one (a failure under MLE_STRICT=1)."""
    require_all("llamacpp")
    python = llamacpp_server.find_python()
    assert python is not None
    return python


@pytest.fixture(scope="session")
def gguf_model(llamacpp_python: str) -> Path:
    """The random-weight GGUF, written once into `.servers/checkpoints` and reused."""
    return llamacpp_server.ensure_model(llamacpp_python)


@pytest.fixture(scope="session")
def sglang_python() -> str:
    """SGLang's venv python; a skip without it and its libcuda (a failure under MLE_STRICT=1)."""
    require_all("sglang")
    python = sglang_server.find_python()
    assert python is not None
    return python


@pytest.fixture(scope="session")
def sglang_checkpoint(sglang_python: str) -> Path:
    """The same random-weight Llama as vLLM's (written with SGLang's torch if not there yet)."""
    return checkpoint.ensure(CHECKPOINTS, sglang_python)
