"""What the exporter can see with a container's privileges, checked against this kernel.

docs/deploy.md says which capability buys what; these tests hold the kernel to it, and the
exporter to never turning a missing privilege into a wrong number. Each drops privileges in a
child process with setpriv (as root) or hides /sys/dev/block in a private mount namespace as
podman does, since the tests cannot start containers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.pagecache_io import file_residency

from exporter.storage.backing import block_device_of
from exporter.storage.cachectl import evict

pytestmark = pytest.mark.system  # child processes with fewer privileges

REPO = Path(__file__).resolve().parent.parent
MiB = 1 << 20
OTHER_UID = 4242  # owns neither this process nor the test files

needs_root = pytest.mark.requires("root", "setpriv")

RESIDENCY = """
import json, sys
from helpers.pagecache_io import file_residency
r = file_residency(sys.argv[1], tuple(sys.argv[2].split(",")))
print(json.dumps([r.resident_bytes, r.method, r.reason]))
"""


@pytest.fixture
def foreign_weights() -> Iterator[Path]:
    """64 MiB on a real disk, owned by another user and read-only, a quarter of it cached."""
    directory = Path(tempfile.mkdtemp(prefix="weights-", dir="/var/tmp"))
    path = directory / "model.safetensors"
    try:
        path.write_bytes(os.urandom(64 * MiB))
        evict(str(path))
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # exactly these pages, no readahead
            os.pread(fd, 16 * MiB, 0)
        finally:
            os.close(fd)
        os.chown(path, OTHER_UID, OTHER_UID)
        path.chmod(0o444)
        yield path
    finally:
        shutil.rmtree(directory)


def residency_as_root_with(capabilities: str, path: Path, methods: str) -> list:
    """file_residency in a root child whose capabilities are only `capabilities` (+a,+b or '')."""
    bounding = "-all" + "".join(f",+{c}" for c in capabilities.split(",") if c)
    done = subprocess.run(
        ["setpriv", "--inh-caps=-all", f"--bounding-set={bounding}",
         sys.executable, "-c", RESIDENCY, str(path), methods],
        cwd=REPO / "tests", capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": f"{REPO}:{REPO / 'tests'}"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))


@needs_root
def test_root_without_cap_fowner_gets_no_residency_rather_than_mincores_lie(
    foreign_weights: Path,
) -> None:
    truth = file_residency(str(foreign_weights)).resident_bytes
    assert truth == 16 * MiB
    # A container's root with every capability dropped: mincore would claim 64 MiB here.
    resident, method, reason = residency_as_root_with("", foreign_weights, "mincore")
    assert (resident, method) == (None, None)
    assert "no CAP_FOWNER" in reason
    resident, _, _ = residency_as_root_with("", foreign_weights, "cachestat,mincore")
    assert resident in (None, truth)  # cachestat refuses a non-owner on newer kernels
    # CAP_FOWNER (or DAC_OVERRIDE: write permission) makes either method tell the truth; the
    # kernel's count is taken right around each measurement (this VM pages out cold cache).
    for capability in ("fowner", "dac_override"):
        for methods in ("mincore", "cachestat,mincore"):
            before = file_residency(str(foreign_weights)).resident_bytes
            resident, _, _ = residency_as_root_with(capability, foreign_weights, methods)
            after = file_residency(str(foreign_weights)).resident_bytes
            assert resident is not None and before is not None and after is not None
            assert after <= resident <= before, (capability, methods, before, resident, after)


@needs_root
def test_another_users_proc_io_needs_sys_ptrace_and_dac_read_search() -> None:
    """docs/deploy.md's table: /proc/PID/io (mode 0400) of another user's server."""
    server = subprocess.Popen(["sleep", "60"])  # root, with every capability
    try:

        def readable(capabilities: str) -> bool:
            caps = [f"--inh-caps=+{capabilities}", f"--ambient-caps=+{capabilities}"]
            done = subprocess.run(
                ["setpriv", f"--reuid={OTHER_UID}", f"--regid={OTHER_UID}", "--clear-groups",
                 *(caps if capabilities else []), "cat", f"/proc/{server.pid}/io"],
                capture_output=True, text=True, timeout=10,
            )  # fmt: skip
            return done.returncode == 0 and "read_bytes:" in done.stdout

        assert not readable("")
        assert not readable("sys_ptrace")  # passes ptrace_may_access, not the file's mode
        assert not readable("dac_read_search")  # passes the mode, not ptrace_may_access
        assert readable("sys_ptrace,+dac_read_search")
    finally:
        server.kill()
        server.wait()


@pytest.mark.requires("root", "unshare")
def test_block_device_found_when_sys_dev_block_is_masked_as_podman_does() -> None:
    st_dev = os.stat("/var/tmp").st_dev
    expected = block_device_of(f"{os.major(st_dev)}:{os.minor(st_dev)}")
    if expected is None:
        pytest.skip("/var/tmp is on no block device here")
    probe = (
        "import os, sys; from exporter.storage.backing import block_device_of as b; "
        "d = os.stat('/var/tmp').st_dev; "
        "print(len(os.listdir('/sys/dev/block')), b(f'{os.major(d)}:{os.minor(d)}'))"
    )
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         'mount -t tmpfs tmpfs /sys/dev/block && exec "$0" -c "$1"', sys.executable, probe],
        cwd=REPO, capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["0", expected]
