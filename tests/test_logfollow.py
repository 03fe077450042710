"""exporter/runtime/logfollow.py without the runtime's threads: which log a target follows and when
that changes, decided from real process readings (ProcessFinder on real processes, named by pidfile
as a supervisor names them) and followed in real files. The exporter doing the same end to end:
tests/test_logs_e2e.py, tests/test_zero_config.py, tests/test_trust_round2.py."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import pytest
from helpers.fakeservers import world_dir
from helpers.support import wait_for

from exporter.config.schema import LogConfig, ProcessConfig
from exporter.discovery.found import DiscoveredServer
from exporter.runtime.admission import on_behalf_of
from exporter.runtime.logfollow import (
    Configured,
    FindFor,
    TargetLog,
    outlived,
    read_every_interval,
    wanted,
)
from exporter.runtime.sampler import Reading, Sampler
from exporter.sources import LOGS, PROCESS
from exporter.sources.logs import LogSample, LogSource
from exporter.sources.process import ProcessFinder, ProcessSample, process_start_time
from exporter.trust.asprocess import Actor, OnBehalf
from exporter.vocabulary import ProbeKind

FIXTURES = Path(__file__).parent / "fixtures" / "logs"
NOBODY = 65534


def own_rights(pid: int) -> OnBehalf | None:
    """The exporter's own rights for every log (as for a process whose credentials are unread)."""
    return None


@contextlib.contextmanager
def server(
    pidfile: Path, argv: Sequence[str] = ("sleep", "60"), out: IO[Any] | int | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """A process named by `pidfile`, as a supervisor names its server, once it runs `sleep`
    (its descriptors set); its stdout and stderr go to `out`, else nowhere."""
    sink = out if out is not None else subprocess.DEVNULL
    proc = subprocess.Popen(list(argv), stdin=subprocess.DEVNULL, stdout=sink, stderr=sink)
    try:
        wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text() == "sleep\n")
        pidfile.write_text(f"{proc.pid}\n")
        yield proc
    finally:
        proc.kill()
        proc.wait()


class Watch:
    """A target's process as the runtime's process loop reads it: a finder on a pidfile, each
    reading taken by a sampler (never started: no thread)."""

    def __init__(self, pidfile: Path) -> None:
        self.finder = ProcessFinder(ProcessConfig(pidfile=str(pidfile)))
        self.sampler = Sampler(1.0)

    def read(self) -> Reading[ProcessSample]:
        return self.sampler.run_once(PROCESS, "t", self.finder.sample)


def sample(source: LogSource) -> LogSample:
    value = Sampler(1.0).run_once(LOGS, "t", source.sample).value
    assert value is not None
    return value


# -- wanted: what to open, from the process reading alone ---------------------------------------


def test_a_configured_log_waits_for_the_first_process_reading_then_starts_at_its_start(
    tmp_path: Path,
) -> None:
    """An exporter started mid-load reads a journal from the server's start, not from now."""
    pidfile = tmp_path / "server.pid"
    now = time.time() + 100.0
    assert wanted(True, False, None, None, watched=True, now=now) is None
    with server(pidfile) as proc:
        reading = Watch(pidfile).read()
        move = wanted(True, False, None, reading, watched=True, now=now)
        start = process_start_time(proc.pid)
    assert reading.good is not None and reading.good.start_time is not None
    assert start is not None and start < now
    assert move == Configured(since=reading.good.start_time)
    assert move.since == pytest.approx(start, abs=0.02)


def failed_reading() -> Reading[ProcessSample]:
    """The reading a process loop stores when its sample raised."""

    def unreadable() -> ProcessSample:
        raise PermissionError("/proc/1/stat")

    return Sampler(1.0).run_once(PROCESS, "t", unreadable)


@pytest.mark.parametrize("shape", ["not watched", "gone", "never started", "sample failed"])
def test_a_configured_log_starts_now_without_a_running_process(tmp_path: Path, shape: str) -> None:
    pidfile = tmp_path / "server.pid"
    reading: Reading[ProcessSample] | None = None
    if shape == "gone":
        with server(pidfile):
            pass  # exited and reaped; the pidfile still names it
        reading = Watch(pidfile).read()
    elif shape == "never started":
        reading = Watch(pidfile).read()  # no pidfile at all
    elif shape == "sample failed":
        reading = failed_reading()
        assert not reading.ok
    now = time.time()
    move = wanted(True, False, None, reading, watched=shape != "not watched", now=now)
    assert move == Configured(since=now)


def test_a_configured_log_is_opened_once_whatever_the_process_does(tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    watch = Watch(pidfile)
    with server(pidfile):
        first = watch.read()
    with server(pidfile):
        restarted = watch.read()
    for reading in (first, restarted, watch.read()):
        assert wanted(True, True, None, reading, watched=True, now=time.time()) is None


def test_an_unconfigured_log_is_found_afresh_for_each_new_server_process(tmp_path: Path) -> None:
    pidfile = tmp_path / "server.pid"
    watch = Watch(pidfile)
    now = time.time()
    assert wanted(False, False, None, None, watched=False, now=now) is None  # nothing to find by
    assert wanted(False, False, None, None, watched=True, now=now) is None  # not read yet
    assert wanted(False, False, None, watch.read(), watched=True, now=now) is None  # not running
    with server(pidfile) as first:
        reading = watch.read()
    move = wanted(False, False, None, reading, watched=True, now=now)
    assert isinstance(move, FindFor) and move.pid == first.pid
    found_for = (move.pid, move.start)
    assert wanted(False, True, found_for, reading, watched=True, now=now) is None  # same process
    # Found, but no log there: not looked for again while the same process runs.
    assert wanted(False, False, found_for, reading, watched=True, now=now) is None
    assert wanted(False, True, found_for, watch.read(), watched=True, now=now) is None  # gone
    with server(pidfile) as second:
        again = wanted(False, True, found_for, watch.read(), watched=True, now=now)
    assert isinstance(again, FindFor) and again.pid == second.pid and again.start >= move.start


# -- outlived: when a found log's process is gone ----------------------------------------------


def test_a_found_log_outlives_its_process_once_a_reading_says_another_or_none_is_the_root(
    tmp_path: Path,
) -> None:
    pidfile = tmp_path / "server.pid"
    watch = Watch(pidfile)
    with server(pidfile):
        running = watch.read().good
        assert running is not None and running.root_pid is not None
        assert running.start_time is not None
        found_for = (running.root_pid, running.start_time)
        assert not outlived(found_for, running)
        assert not outlived(None, running)  # no log found for a process: nothing to finish
        assert not outlived(found_for, None)  # nothing read: says nothing
    gone = watch.read().good
    assert gone is not None and not gone.found
    assert outlived(found_for, gone)
    with server(pidfile):
        assert outlived(found_for, watch.read().good)  # restarted: another root


# -- read_every_interval: a server that loads in place ------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "every"),
    [("triton-2.log", True), ("vllm-0.6.log", False), ("sglang-0.4.log", False), (None, False)],
)
def test_only_a_server_that_loads_in_place_has_its_log_read_every_interval(
    tmp_path: Path, fixture: str | None, every: bool
) -> None:
    log = tmp_path / "server.log"
    log.write_text("")
    source = LogSource(LogConfig(file=str(log)))
    try:
        sample(source)  # from the file's end: what follows is read
        if fixture is not None:
            log.write_text((FIXTURES / fixture).read_text())
        reading = Sampler(1.0).run_once(LOGS, "t", source.sample)
    finally:
        source.close()
    assert read_every_interval(reading) is every
    assert not read_every_interval(None)


# -- TargetLog: the source it opens and when it closes it ---------------------------------------


def test_a_configured_file_is_followed_from_its_end_and_opened_once(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("before the exporter\n")
    target = TargetLog("t", LogConfig(file=str(log)), own_rights)
    switch = target.update(time.time(), None, watched=False)
    assert switch is not None and not switch.stopped and switch.opened is not None
    assert switch.opened is target.source
    try:
        assert sample(switch.opened).lines_total == 0  # what was there before is not read
        with log.open("a") as out:
            out.write("after\n")
        assert sample(switch.opened).lines_total == 1
        assert target.update(time.time(), None, watched=False) is None
        assert target.finding is None and target.found_for is None  # configured: nothing found
    finally:
        target.close()


def test_a_found_log_is_replaced_by_the_next_process_log_and_finished_when_it_is_gone(
    tmp_path: Path,
) -> None:
    pidfile, first_log, second_log = (tmp_path / n for n in ("pid", "first.log", "second.log"))
    watch = Watch(pidfile)
    target = TargetLog("t", None, own_rights)
    try:
        with first_log.open("w") as out, server(pidfile, out=out) as first:
            reading = watch.read()
            switch = target.update(time.time(), reading, watched=True)
            assert switch is not None and not switch.stopped and switch.opened is not None
            assert target.finding is not None
            assert target.finding.config == LogConfig(file=str(first_log))
            assert reading.good is not None
            assert target.found_for == (first.pid, reading.good.start_time)
            old = switch.opened
            out.write("first line\n")
            out.flush()
            assert sample(old).lines_total == 1
            target.seq = 7  # the tracker took events of the first log
            assert target.update(time.time(), watch.read(), watched=True) is None
        target.process_seen(watch.read().good)  # gone: its last lines, then closed
        with first_log.open("a") as out:
            out.write("its last words\n")
        last = sample(old)
        assert last.closed and last.lines_total == 2
        with second_log.open("w") as out, server(pidfile, out=out) as second:
            reading = watch.read()
            target.process_seen(reading.good)  # the old log is finished already: no harm
            switch = target.update(time.time(), reading, watched=True)
            assert switch is not None and switch.stopped and switch.opened is not None
            assert switch.opened is not old and target.seq == 0  # a new log's events count anew
            assert target.finding is not None
            assert target.finding.config == LogConfig(file=str(second_log))
            assert target.found_for is not None and target.found_for[0] == second.pid
    finally:
        target.close()


def test_a_process_without_a_log_has_none_opened_and_says_why(tmp_path: Path) -> None:
    pidfile, log = tmp_path / "pid", tmp_path / "server.log"
    watch = Watch(pidfile)
    target = TargetLog("t", None, own_rights)
    try:
        with server(pidfile) as first:  # stdout and stderr are /dev/null
            switch = target.update(time.time(), watch.read(), watched=True)
        assert switch is not None and not switch.stopped and switch.opened is None
        assert target.source is None and target.finding is not None
        assert target.finding.config is None
        assert target.finding.why.startswith(f"pid {first.pid}: stdout is the device /dev/null")
        with log.open("w") as out, server(pidfile, out=out):
            switch = target.update(time.time(), watch.read(), watched=True)
        assert switch is not None and not switch.stopped and switch.opened is not None
        assert target.finding.config == LogConfig(file=str(log))
    finally:
        target.close()


@pytest.mark.requires("root", "setpriv")
def test_a_process_holding_lent_rights_has_its_log_left_unread(tmp_path: Path) -> None:
    """A setuid-like process (real uid nobody, effective root): its log is not read at all."""
    pidfile, log = tmp_path / "pid", tmp_path / "server.log"
    actor = Actor()
    target = TargetLog("t", None, lambda pid: on_behalf_of(actor, "/proc", pid))
    argv = ("setpriv", f"--ruid={NOBODY}", "sleep", "60")
    try:
        with log.open("w") as out, server(pidfile, argv, out=out) as proc:
            switch = target.update(time.time(), Watch(pidfile).read(), watched=True)
        assert switch is not None and switch.opened is None and target.source is None
        assert target.finding is not None and target.finding.config is None
        assert target.finding.why.startswith(f"its log is not read: pid {proc.pid}: its real,")
    finally:
        target.close()
        actor.close()


def test_a_process_whose_credentials_cannot_be_read_has_its_log_read_with_the_exporters(
    tmp_path: Path,
) -> None:
    """A /proc tree without the process (a configured target's, gone meanwhile)."""
    pidfile, log = tmp_path / "pid", tmp_path / "server.log"
    actor = Actor()
    target = TargetLog("t", None, lambda pid: on_behalf_of(actor, str(tmp_path), pid))
    try:
        with log.open("w") as out, server(pidfile, out=out):
            switch = target.update(time.time(), Watch(pidfile).read(), watched=True)
            assert switch is not None and switch.opened is not None
            out.write("a line\n")
            out.flush()
            assert sample(switch.opened).lines_total == 1
    finally:
        target.close()
        actor.close()


@pytest.mark.system
@pytest.mark.requires("root", "setpriv")
def test_a_found_log_is_opened_with_its_process_rights_not_the_exporters() -> None:
    """nobody's server writing to a file in a directory only root may enter (its descriptor was
    opened for it): nobody could not open that file, so neither does the exporter for it; the
    same file configured as `log:` is read with the exporter's own rights."""
    directory = world_dir("logfollow-")
    directory.chmod(0o700)
    pidfile, log = directory / "pid", directory / "server.log"
    actor = Actor()
    as_server = TargetLog("t", None, lambda pid: on_behalf_of(actor, "/proc", pid))
    configured = TargetLog("t", LogConfig(file=str(log)), own_rights)
    argv = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sleep", "60")
    try:
        with log.open("w") as out, server(pidfile, argv, out=out):
            found = as_server.update(time.time(), Watch(pidfile).read(), watched=True)
            assert found is not None and found.opened is not None
            assert as_server.finding is not None
            assert as_server.finding.config == LogConfig(file=str(log))
            unread = sample(found.opened)
            assert not unread.up and "Permission denied" in (unread.reason or ""), unread
            mine = configured.update(time.time(), None, watched=False)
            assert mine is not None and mine.opened is not None
            assert sample(mine.opened).up
    finally:
        as_server.close()
        configured.close()
        actor.close()
        shutil.rmtree(directory)


def test_a_routed_model_server_without_a_log_of_its_own_is_read_in_its_routers(
    tmp_path: Path,
) -> None:
    """llama-server's router mode: the model server writes into a pipe to its router, whose log
    carries its lines behind `[PORT] `; a configured target (no router known) has none."""
    router_pidfile, pidfile, log = tmp_path / "router", tmp_path / "pid", tmp_path / "router.log"
    target = TargetLog("t", None, own_rights)
    unrouted = TargetLog("u", None, own_rights)
    try:
        with (
            log.open("w") as out,
            server(router_pidfile, out=out) as router,
            server(pidfile, out=subprocess.PIPE) as model_server,
        ):
            routed = DiscoveredServer(
                kind="llamacpp",
                name="llamacpp-m-8123",
                pid=model_server.pid,
                start_ticks=0,
                start_time=None,
                url="http://127.0.0.1:8123",
                probe=ProbeKind.HEALTH,
                probe_path="/health",
                model="m",
                weights=(),
                weights_include=(),
                reachable=True,
                evidence=(),
                router_pid=router.pid,
                router_start=process_start_time(router.pid),
            )
            reading = Watch(pidfile).read()
            switch = target.update(time.time(), reading, watched=True, found=routed)
            assert unrouted.update(time.time(), reading, watched=True) is not None
        assert switch is not None and switch.opened is not None
        assert target.finding is not None and target.finding.lines_of == "[ 8123] "
        assert target.finding.config == LogConfig(file=str(log))
        assert unrouted.finding is not None and unrouted.finding.config is None
    finally:
        target.close()
        unrouted.close()
