"""The exporter's own log, folded per kind of line and what it is about (issue 37 row 7): a server
that logs an unload 2,000 times a second once wrote 2,048 of the exporter's lines a second, and
journald's rate limit then dropped its other messages. The filter alone over a clock of our own,
then a real Triton look-alike of user `nobody` flooding its log under a root exporter with no
config."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.fakeservers import FakeServers, world_dir
from helpers.hostile import ExporterProcess, discovering_exporter
from helpers.support import free_port, wait_for
from helpers.users import NOBODY

from exporter.logsetup import (
    FOLD_BURST,
    FOLD_EVERY_SECONDS,
    FOLD_KEYS,
    UNFOLDED,
    Folding,
    JsonFormatter,
    LogfmtFormatter,
)

UNLOADED = "target %s: the server unloaded model %s"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def logged(clock: Clock) -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger whose handler folds as the exporter's does, writing logfmt to a buffer."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(LogfmtFormatter())
    handler.addFilter(Folding(clock))
    logger = logging.getLogger(f"test-folding-{id(out)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield logger, out
    logger.removeHandler(handler)


def lines(out: io.StringIO) -> list[str]:
    return out.getvalue().splitlines()


def test_a_flood_of_one_kind_for_one_target_is_folded_and_counted(
    clock: Clock, logged: tuple[logging.Logger, io.StringIO]
) -> None:
    logger, out = logged
    for n in range(2048):
        logger.info(UNLOADED, "triton", f"model-{n}")
    written = lines(out)
    # The burst, then one line saying that what follows is folded.
    assert len(written) == FOLD_BURST + 1, written
    assert all("folded=" not in line for line in written)
    assert written[-1].endswith(f"folding={FOLD_EVERY_SECONDS:g}"), written[-1]
    clock.now += FOLD_EVERY_SECONDS  # a token again: the next such line says what was folded
    logger.info(UNLOADED, "triton", "model-last")
    last = lines(out)[-1]
    assert '"target triton: the server unloaded model model-last"' in last
    assert last.endswith(f"folded={2048 - FOLD_BURST - 1}"), last
    logger.info(UNLOADED, "triton", "model-next")  # still flooding: folded, no new announcement
    assert len(lines(out)) == FOLD_BURST + 2


def test_other_targets_and_other_kinds_keep_their_own_lines(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    for n in range(100):
        logger.info(UNLOADED, "noisy", f"m{n}")
    logger.info(UNLOADED, "quiet", "m")
    logger.info("target %s: the endpoint answers again", "noisy")
    logger.warning("source %s is down: %s", "gpu", "NVML gone")
    written = lines(out)
    assert len(written) == FOLD_BURST + 1 + 3, written
    assert "unloaded model m" in written[-3] and "target quiet" in written[-3]
    assert "target noisy: the endpoint answers again" in written[-2]
    assert "source gpu is down: NVML gone" in written[-1]


def test_a_quiet_spell_gives_the_burst_back(
    clock: Clock, logged: tuple[logging.Logger, io.StringIO]
) -> None:
    logger, out = logged
    for n in range(20):
        logger.info(UNLOADED, "t", f"m{n}")
    clock.now += FOLD_BURST * FOLD_EVERY_SECONDS  # the bucket full again: the flood is over
    for n in range(FOLD_BURST):
        logger.info(UNLOADED, "t", f"again{n}")
    written = lines(out)[FOLD_BURST + 1 :]
    assert len(written) == FOLD_BURST, written
    assert written[0].endswith(f"folded={20 - FOLD_BURST - 1}") and " folding=" not in written[0]


def test_debug_lines_are_asked_for_and_never_folded(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    for n in range(50):
        logger.debug(UNLOADED, "t", f"m{n}")
    assert len(lines(out)) == 50


def test_a_flood_of_subjects_grows_no_memory_and_a_forgotten_one_starts_afresh(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    for n in range(FOLD_BURST + 1):
        logger.info(UNLOADED, "first", f"m{n}")
    logger.info(UNLOADED, "first", "folded")
    assert len(lines(out)) == FOLD_BURST + 1
    for n in range(FOLD_KEYS):  # as many other subjects as are remembered: "first" is forgotten
        logger.info(UNLOADED, f"other-{n}", "m")
    before = len(lines(out))
    logger.info(UNLOADED, "first", "afresh")
    assert len(lines(out)) == before + 1 and "first" in lines(out)[-1]


def test_an_operators_own_act_is_said_each_time(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, out = logged
    for _ in range(3 * FOLD_BURST):
        logger.info("config reloaded: %d target(s)", 1, extra=UNFOLDED)
    assert len(lines(out)) == 3 * FOLD_BURST


def test_json_lines_carry_the_same_counts(clock: Clock) -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(Folding(clock))
    logger = logging.getLogger("test-folding-json")
    logger.propagate = False
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        for n in range(FOLD_BURST + 10):
            logger.info(UNLOADED, "t", n)
        clock.now += FOLD_EVERY_SECONDS
        logger.info(UNLOADED, "t", "end")
    finally:
        logger.removeHandler(handler)
    records = [json.loads(line) for line in out.getvalue().splitlines()]
    assert records[FOLD_BURST]["folding"] == FOLD_EVERY_SECONDS
    assert records[-1]["folded"] == 9 and records[-1]["msg"].endswith("model end")


# --- a real flood -------------------------------------------------------------------------------

TRITON = "tritonserver"
FLOOD = 1000  # lines at once: within the events one log sample keeps (sources/logs.MAX_EVENTS)


def triton_unload(n: int) -> str:
    now = time.time()
    stamp = time.strftime("%m%d %H:%M:%S", time.localtime(now)) + f".{int(now % 1 * 1e6):06d}"
    return f"I{stamp} 1 model_lifecycle.cc:620] \"successfully unloaded 'model-{n}' version 1\"\n"


def unloads_total(metrics: str, target: str) -> float | None:
    prefix = f'model_load_unloads_total{{target="{target}"}} '
    return next((float(line[len(prefix) :]) for line in metrics.splitlines()
                 if line.startswith(prefix)), None)  # fmt: skip


@pytest.mark.system
@pytest.mark.requires("root", "setpriv", "nobody_python")
def test_a_servers_flood_of_unloads_is_counted_but_not_written_line_by_line(
    tmp_path: Path,
) -> None:
    root = world_dir("folding-")
    try:
        repository = root / "repository"
        repository.mkdir()
        logs = [root / "a.log", root / "b.log"]
        for path in (repository, *logs):
            path.touch()
            os.chown(path, NOBODY, NOBODY)
        servers = [
            FakeServers([[TRITON, "--model-repository", repository, "--http-port", p]], stderr=log)
            for log, p in zip(logs, (str(free_port()), str(free_port())), strict=True)
        ]
        try:
            with discovering_exporter(tmp_path) as exporter:
                names = [_followed(exporter, fake.pids[0]) for fake in servers]
                with logs[0].open("a") as log:  # the flood: one server, FLOOD lines at once
                    log.write("".join(triton_unload(n) for n in range(FLOOD)))
                with logs[1].open("a") as log:  # the other server: one line
                    log.write(triton_unload(0))
                wait_for(lambda: unloads_total(exporter.get("/metrics").text, names[0]) == FLOOD,
                         timeout=30)  # fmt: skip
                wait_for(lambda: unloads_total(exporter.get("/metrics").text, names[1]) == 1,
                         timeout=10)  # fmt: skip
                said = [line for line in exporter.stderr().splitlines() if "unloaded model" in line]
                flooded = [line for line in said if f"target {names[0]}:" in line]
                assert len(flooded) == FOLD_BURST + 1, flooded
                assert re.search(r" folding=\d+$", flooded[-1]), flooded[-1]
                assert [line for line in said if f"target {names[1]}:" in line], said
        finally:
            for fake in servers:
                fake.stop()
    finally:
        _remove(root)


def _followed(exporter: ExporterProcess, pid: int) -> str:
    """The target's name once its log is followed."""

    def target() -> str | None:
        for entry in exporter.get("/api/v1/status").json()["targets"]:
            if entry.get("discovered", {}).get("pid") == pid and "up" in entry.get("log", {}):
                return str(entry["target"])
        return None

    return wait_for(target, timeout=20)


def _remove(root: Path) -> None:
    for path in sorted(root.rglob("*"), reverse=True):
        path.rmdir() if path.is_dir() else path.unlink()
    root.rmdir()
