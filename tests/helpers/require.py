"""Prerequisites of tests: skipped where missing, failed under MLE_STRICT=1.

The tests that need root, util-linux tools or a recent kernel guard the claims users stake the
most on (no false residency as an unprivileged user, fincore as the truth). On a laptop a
missing prerequisite is a skip; CI sets MLE_STRICT=1 (.ci/run), where the same skip would hide a
test that must run, so it fails with the reason instead.

    @pytest.mark.requires("root", "setpriv")   # checked in conftest before the test runs
    require(condition, "why")                   # the same, inside a test or fixture
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable

import pytest

from exporter.storage import pagecache

STRICT_FLAG = "MLE_STRICT"


def strict() -> bool:
    return os.environ.get(STRICT_FLAG) == "1"


def require(condition: bool, reason: str) -> None:
    """Skip the running test with `reason` unless `condition`; fail it instead when strict."""
    if condition:
        return
    if strict():
        pytest.fail(f"{reason} ({STRICT_FLAG}=1: this test must run here)", pytrace=False)
    pytest.skip(reason)


def _cachestat_works() -> bool:
    fd = os.open(__file__, os.O_RDONLY)
    try:
        pagecache.cachestat(fd)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _nobody_python() -> bool:
    from helpers.users import nobody_python

    return nobody_python() is not None


def _vllm() -> bool:
    from servers.vllm_server import find_python

    return find_python() is not None


def _llamacpp() -> bool:
    from servers.llamacpp_server import find_python

    return find_python() is not None


def _sglang() -> bool:
    from servers.sglang_server import find_python

    return find_python() is not None


def _llama_server() -> bool:
    from servers.llama_server import find_binary

    return find_binary() is not None


def _triton() -> bool:
    from servers.triton_server import find_dir

    return find_dir() is not None


def _tool(name: str) -> tuple[Callable[[], bool], str]:
    return (lambda: shutil.which(name) is not None), f"needs {name} (util-linux)"


NEEDS: dict[str, tuple[Callable[[], bool], str]] = {
    "root": (lambda: os.geteuid() == 0, "needs root"),
    "setpriv": _tool("setpriv"),
    "unshare": _tool("unshare"),
    "ss": ((lambda: shutil.which("ss") is not None), "needs ss (iproute2)"),
    "fincore": _tool("fincore"),
    "cachestat": (_cachestat_works, "needs the cachestat syscall (Linux 6.5 or later)"),
    "nobody_python": (
        _nobody_python,
        "needs a Python that user nobody may run with this checkout's packages"
        " (a checkout or venv nobody can read)",
    ),
    "vllm": (
        _vllm,
        "needs vLLM on CPU: `make test-servers` installs it and names its python in"
        " MLE_VLLM_PYTHON",
    ),
    "sglang": (
        _sglang,
        "needs SGLang on its CPU engine and Debian's libcuda.so.1: `make test-servers`"
        " installs both and names them in MLE_SGLANG_PYTHON and MLE_LIBCUDA_DIR",
    ),
    "llamacpp": (
        _llamacpp,
        "needs llama-cpp-python built from source: `make test-servers` installs it and"
        " names its python in MLE_LLAMACPP_PYTHON",
    ),
    "llama_server": (
        _llama_server,
        "needs llama.cpp's llama-server: `make test-servers` builds it and names it in"
        " MLE_LLAMA_SERVER",
    ),
    "triton": (
        _triton,
        "needs tritonserver from the nvidia-pytriton wheel: `make test-servers` installs it"
        " and names its folder in MLE_TRITON_DIR",
    ),
}


def require_all(*needs: str) -> None:
    """`require` for each named prerequisite, in order (root first: the others may need it)."""
    for need in needs:
        available, reason = NEEDS[need]
        require(available(), reason)
