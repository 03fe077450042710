"""`prewarm` as a subprocess on real files, judged by util-linux's fincore (the kernel's mincore,
independent of the exporter's own residency code)."""

from __future__ import annotations

import os
import pty
import re
import subprocess
from pathlib import Path

import pytest
from helpers.pagecache_io import MIB, read_all, write_cold_file
from helpers.processes import CLI, cli

from exporter.sources.memory import read_meminfo

pytestmark = pytest.mark.system

SIZE = 8 * MIB
# This VM pages cold cache out in the background (DAMON): a few pages may leave between a read
# and the fincore that checks it.
SLACK = 16 * os.sysconf("SC_PAGE_SIZE")


def all_resident(resident: int, size: int = SIZE) -> bool:
    return size - SLACK <= resident <= size


def fincore(path: Path) -> int:
    """Resident bytes of a file per fincore (root, so mincore's answer is truthful)."""
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0])


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """Three cold shards and a file a weights pattern does not match."""
    directory = tmp_path / "model"
    (directory / "sub").mkdir(parents=True)
    for name in ("a.safetensors", "b.safetensors", "sub/c.safetensors", "notes.txt"):
        write_cold_file(directory / name, SIZE)
    return directory


def shards(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.safetensors"))


def test_prewarm_reads_cold_files_into_the_page_cache(model: Path) -> None:
    assert [fincore(p) for p in shards(model)] == [0, 0, 0]
    result = cli("prewarm", str(model), "--jobs", "2")
    assert result.returncode == 0, result.stderr
    assert all(all_resident(fincore(p)) for p in shards(model))
    assert fincore(model / "notes.txt") == 0  # directories expand like the exporter's weights
    assert re.fullmatch(
        r"prewarmed 3 files, 24\.0 MiB: read 24\.0 MiB in \d+\.\d\ds \(\d+\.\d [MG]B/s\); "
        r"already resident 0 B \(0 %\), now 24\.0 MiB \(100 %\)\n",
        result.stdout,
    ), result.stdout


def test_prewarm_reads_only_what_is_not_resident(model: Path) -> None:
    read_all(model / "a.safetensors")
    result = cli("prewarm", str(model / "a.safetensors"), str(model / "b.safetensors"))
    assert result.returncode == 0, result.stderr
    # This VM pages cold cache out in the background: if a page of a.safetensors went between
    # read_all and prewarm, prewarm rightly finds it not whole and reads it again.
    whole = "already resident 8.0 MiB (50 %), now 16.0 MiB (100 %)" in result.stdout
    read = "8.0" if whole else "16.0"
    assert f"files, 16.0 MiB: read {read} MiB in" in result.stdout, result.stdout
    assert "now 16.0 MiB (100 %)" in result.stdout
    assert all_resident(fincore(model / "b.safetensors"))


def test_evict_drops_the_files_from_the_page_cache(model: Path) -> None:
    # This VM pages cold cache out in the background: read again until all of it is resident
    # at once, so the eviction below has every page to drop.
    for _ in range(5):
        for path in shards(model):
            read_all(path)
        if [fincore(p) for p in shards(model)] == [SIZE] * 3:
            break
    else:
        pytest.fail("the shards never stayed resident long enough to be measured")
    result = cli("prewarm", "--evict", str(model))
    assert result.returncode == 0, result.stderr
    assert [fincore(p) for p in shards(model)] == [0, 0, 0]
    # What was resident as the command began: DAMON may have taken a page or two since the check.
    said = re.fullmatch(
        r"evicted 3 files, 24\.0 MiB in \S+; "
        r"resident before (\S+) MiB \((\d+) %\), now 0 B \(0 %\)\n",
        result.stdout,
    )
    assert said and 22.0 <= float(said[1]) <= 24.0 and int(said[2]) >= 90, result.stdout


def test_memory_guard_refuses_more_than_available_memory(tmp_path: Path) -> None:
    available = read_meminfo().available_bytes
    huge = tmp_path / "huge.gguf"
    with huge.open("wb") as f:
        f.truncate(available + (4 << 30))  # sparse: costs no disk
    result = cli("prewarm", str(huge))
    assert result.returncode == 1
    assert result.stdout == "" and result.stderr.count("\n") == 1
    assert re.fullmatch(
        r"model-load-exporter prewarm: error: refusing: (\d+\.\d GiB) of the \1 are not in the "
        r"page cache but only \d+\.\d GiB of memory is available \(MemAvailable\).*--force.*\n",
        result.stderr,
    ), result.stderr
    assert fincore(huge) == 0


def test_prewarm_on_a_terminal_shows_a_progress_bar(model: Path) -> None:
    controller, terminal = pty.openpty()
    env = {**os.environ, "TERM": "xterm-256color", "COLUMNS": "100"}
    proc = subprocess.Popen(
        [*CLI, "prewarm", str(model)], stdin=terminal, stdout=terminal, stderr=terminal, env=env
    )
    os.close(terminal)
    screen = b""
    while True:
        try:
            chunk = os.read(controller, 65536)
        except OSError:
            break
        if not chunk:
            break
        screen += chunk
    os.close(controller)
    assert proc.wait(timeout=30) == 0
    text = screen.decode(errors="replace")
    assert "prewarm" in text and "━" in text and "24.0/24.0 MiB" in text, text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["{tmp}/nothing"], "{tmp}/nothing does not exist"),
        (["{tmp}"], "no weight files under {tmp}"),
        (["{tmp}", "--jobs", "0"], "--jobs: expected a number of readers"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    result = cli("prewarm", *(a.format(tmp=tmp_path) for a in args))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert message.format(tmp=tmp_path) in result.stderr
