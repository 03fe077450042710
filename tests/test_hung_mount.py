"""A user's FUSE mount that stops answering under their own server's weights.

Any local user may run a FUSE daemon (bindfs, sshfs, one of their own) and point a server's
`--model` into it; when the daemon stops answering (stopped, deadlocked, its network gone), every
stat, open and read under the mount blocks until it answers again. The exporter reads a
discovered server's files with that server's rights on dedicated threads
(exporter/trust/asprocess.py), so such a hang holds those threads; it must hold nothing else.

Here the daemon is a real bindfs, stopped with SIGSTOP, under a fake server's weights (a process
of one user whose command line says `vllm serve <the mount>`); the exporter runs as root with
discovery on, as on a GPU host. Throughout the hang /metrics and /api/v1/status answer within a
second; a server the same user starts meanwhile is discovered with its weights and its files are
watched; the hung target says its own file sources are down, and why, and recovers after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers.fakeservers import FakeServers, world_dir
from helpers.filesystems import require_filesystem, scratch
from helpers.hostile import ExporterProcess, discovering_exporter
from helpers.support import free_port, wait_for

from exporter.sim.shards import generate_shards
from exporter.trust.asprocess import Actor, own_rights

pytestmark = [pytest.mark.system, pytest.mark.requires("root", "setpriv")]

# The servers' user: a uid of this test's own, so that discovery.users keeps every other
# test's servers (root's, nobody's) out of this exporter's share of targets.
USER = 64917
SHARD = 1 << 20
ANSWER_WITHIN = 1.0  # seconds: what a scrape or the kubelet's probe may take, hang or not
HANG_SECONDS = 14.0  # past two abandoned walks (WALK_TIMEOUT 5 s each) and their refusals
POLL_EVERY = 0.2


@dataclass(frozen=True)
class Answer:
    path: str
    at: float  # monotonic
    seconds: float
    status: int | None  # None: no answer at all (timeout, refused)


class Poller:
    """GETs /metrics and /api/v1/status in turn every POLL_EVERY seconds, timing each."""

    def __init__(self, exporter: ExporterProcess) -> None:
        self.answers: list[Answer] = []
        self._exporter = exporter
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        paths = ("/metrics", "/api/v1/status")
        i = 0
        while not self._stop.wait(POLL_EVERY):
            path = paths[i % 2]
            i += 1
            started = time.monotonic()
            status: int | None
            try:
                status = self._exporter.get(path, timeout=30).status_code
            except OSError:
                status = None
            self.answers.append(Answer(path, started, time.monotonic() - started, status))

    def stop(self) -> list[Answer]:
        self._stop.set()
        self._thread.join(timeout=40)
        return self.answers


def target_of(status: dict[str, Any], port: int) -> dict[str, Any] | None:
    return next((t for t in status["targets"] if t["endpoint"].endswith(f":{port}")), None)


def source(target: dict[str, Any] | None, name: str) -> dict[str, Any] | None:
    return None if target is None else target["sources"].get(name)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """A FUSE daemon that stops answering; it answers again (and may be unmounted) after."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def vllm(model: Path, port: int) -> list[str]:
    return ["vllm", "serve", str(model), "--port", str(port)]


def actor_threads() -> int:
    return sum(thread.name == "as-process" for thread in threading.enumerate())


def test_an_actors_threads_are_one_while_quiet_and_none_once_closed_and_answered(
    tmp_path: Path,
) -> None:
    """An actor per target costs a thread per quiet target, and a dropped target's threads
    end, the one left in a hung mount too once the mount answers."""
    require_filesystem("fuse")
    with scratch(tmp_path / "fs") as s:
        mount, daemon = s.bindfs(s.path("source"))
        before = actor_threads()
        actor, mine = Actor(timeout=0.5), own_rights()
        for _ in range(3):
            actor.call(mine, lambda: os.stat(mount))
        assert actor_threads() == before + 1
        with stopped(daemon):
            with pytest.raises(TimeoutError, match="did not finish in time"):
                actor.call(mine, lambda: os.stat(mount / "absent"))  # no cache answers for it
            actor.call(mine, lambda: None)  # a replacement took over
            assert actor_threads() == before + 2
            actor.close()
            wait_for(lambda: actor_threads() == before + 1)  # the one still in the mount
            time.sleep(0.5)
            assert actor_threads() == before + 1
        wait_for(lambda: actor_threads() == before, timeout=10)


def test_a_hung_fuse_mount_under_one_servers_weights_holds_nothing_else(tmp_path: Path) -> None:
    require_filesystem("fuse")
    base = world_dir("hung-mount-")
    control_model = base / "control" / "model"
    generate_shards(control_model, 2, SHARD)
    hung_port, control_port = free_port(), free_port()
    with (
        scratch(base / "fs") as s,
        discovering_exporter(tmp_path, users=[USER]) as exporter,
    ):
        source_dir = s.path("weights") / "model"
        generate_shards(source_dir, 2, SHARD)
        mount, daemon = s.bindfs(source_dir.parent)
        hung = FakeServers([vllm(mount / "model", hung_port)], uid=USER)
        control: FakeServers | None = None
        try:
            # Before the hang: the server on the mount is watched, its weights walked.
            wait_for(
                lambda: (src := source(target_of(exporter.get("/api/v1/status").json(),
                                                 hung_port), "weight_files")) and src["up"],
                timeout=30,
            )  # fmt: skip
            poller = Poller(exporter)
            with stopped(daemon):
                hang_began = time.monotonic()
                time.sleep(2.0)  # the exporter's threads are in the mount by now
                control = FakeServers([vllm(control_model, control_port)], uid=USER)

                seen: list[dict[str, Any] | None] = [None]

                def control_watched() -> dict[str, Any] | None:
                    target = target_of(exporter.get("/api/v1/status").json(), control_port)
                    seen[0] = target
                    files = source(target, "weight_files")
                    return target if files is not None and files["up"] else None

                try:
                    watched = wait_for(control_watched, timeout=HANG_SECONDS - 3)
                except AssertionError:
                    last = seen[0] or {}
                    raise AssertionError(
                        f"the server started during the hang: sources {last.get('sources')}, "
                        f"discovered {last.get('discovered')}"
                    ) from None
                # Its files were found as its user sees them, not given up on as hung.
                assert watched["discovered"]["weights"] == [str(control_model)], watched
                refused = [w for w in watched["discovered"]["why"] if w["what"] == "weights"]
                assert all("hung" not in w["source"] for w in refused), refused

                def hung_says_why() -> str | None:
                    target = target_of(exporter.get("/api/v1/status").json(), hung_port)
                    files = source(target, "weight_files")
                    return None if files is None or files["up"] else str(files["error"])

                why = wait_for(hung_says_why, timeout=HANG_SECONDS - 3)
                assert "did not finish in time" in why or "hung" in why, why
                time.sleep(max(0.0, HANG_SECONDS - (time.monotonic() - hang_began)))
                # Still watched, the other target's files, at the end of the hang too.
                final = exporter.get("/api/v1/status").json()
                files = source(target_of(final, control_port), "weight_files")
                assert files is not None and files["up"], final
            answers = poller.stop()
            # The daemon answers again: the threads it held come back, the target's files too.
            wait_for(
                lambda: (src := source(target_of(exporter.get("/api/v1/status").json(),
                                                 hung_port), "weight_files")) and src["up"],
                timeout=20,
            )  # fmt: skip
        finally:
            hung.stop()
            if control is not None:
                control.stop()
    during = [a for a in answers if hang_began <= a.at <= hang_began + HANG_SECONDS]
    assert len(during) >= HANG_SECONDS / (2 * POLL_EVERY), len(during)  # it polled throughout
    slow = [a for a in during if a.status != 200 or a.seconds > ANSWER_WITHIN]
    worst = max(a.seconds for a in during)
    print(f"\n{len(during)} answers during a {HANG_SECONDS:g}-s hang, slowest {worst:.3f} s")
    assert not slow, slow
