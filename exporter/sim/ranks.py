"""Tensor parallelism: every rank a child process of the server, as vLLM's and SGLang's workers are.

The server starts its ranks after its own start-up, gives each its spec on stdin and hears its
events on its stdout pipe. Like torch.distributed's set-up, the ranks wait for each other: each
says it is ready, and the server lets all of them load at once by closing their stdin. A rank
never outlives the server: it asks the kernel for SIGTERM when
its parent dies, and the server stops its ranks on every way out. A rank that exits before it is
told to is the server's crash. Run as `python -m exporter.sim.ranks`, this module is a rank.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress

from exporter.sim.events import Kind, RankEvent
from exporter.sim.loaders import RankSpec, load_rank
from exporter.sim.stopper import Crash, Stopped, Stopper

STOP_GRACE_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1


def _exit_reason(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} was killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


class RankGroup:
    """The running ranks, read through their pipes: `fds` to wait on, `read` what they said."""

    def __init__(self) -> None:
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # by rank
        self._open: dict[int, int] = {}  # stdout fd -> rank, until the rank closes it
        self._pending: dict[int, bytes] = {}  # a line not yet complete, by fd

    def start(self, spec: RankSpec) -> None:
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "exporter.sim.ranks"], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )  # fmt: skip
        except OSError as exc:
            raise Crash("weights", f"cannot start rank {spec.rank}: {exc.strerror}") from None
        assert proc.stdin is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        self._procs[spec.rank], self._open[fd], self._pending[fd] = proc, spec.rank, b""
        proc.stdin.write(spec.to_json().encode() + b"\n")
        proc.stdin.flush()

    def barrier(self, stopper: Stopper) -> None:
        """Wait until every rank is ready, then let them all go."""
        waiting = set(self._procs)
        while waiting:
            for event in self.read(stopper.wait(math.inf, self.fds)):
                if event.kind is Kind.CRASH:
                    raise Crash("weights", event.reason)
                waiting.discard(event.rank)
        for proc in self._procs.values():
            assert proc.stdin is not None
            proc.stdin.close()

    @property
    def fds(self) -> list[int]:
        return list(self._open)

    def read(self, fds: Sequence[int]) -> list[RankEvent]:
        """The events the ranks behind the readable `fds` sent; a crash for each that exited."""
        events = []
        for fd in fds:
            data = os.read(fd, 1 << 16)
            *lines, self._pending[fd] = (self._pending[fd] + data).split(b"\n")
            events += [RankEvent.parse(line) for line in lines]
            if not data:
                rank = self._open.pop(fd)
                code = self._procs[rank].wait(STOP_GRACE_SECONDS)
                reason = _exit_reason(rank, code)
                events.append(RankEvent(Kind.CRASH, rank, time.time(), reason=reason))
        return events

    def stop(self) -> None:
        """SIGTERM every rank, SIGKILL those still there after the grace period; reap them all."""
        running = [proc for proc in self._procs.values() if proc.poll() is None]
        for proc in running:
            proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for proc in running:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for proc in self._procs.values():
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.close()
            proc.stdout.close()


@contextmanager
def started(specs: Sequence[RankSpec], stopper: Stopper) -> Iterator[RankGroup]:
    """The ranks, started and past their barrier; stopped however the context ends."""
    group = RankGroup()
    try:
        for spec in specs:
            group.start(spec)
        group.barrier(stopper)
        yield group
    finally:
        group.stop()


def _die_with_parent(parent: int) -> bool:
    """Ask for SIGTERM when the server dies; False if it already has (we were reparented)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    return os.getppid() == parent


def main() -> int:
    spec = RankSpec.from_json(sys.stdin.buffer.readline().decode())
    if not _die_with_parent(spec.parent):
        return 0
    out = sys.stdout.fileno()

    def send(event: RankEvent) -> None:
        try:
            os.write(out, event.line())
        except BrokenPipeError:
            raise Stopped from None  # the server is gone

    with Stopper().installed(interrupt=False) as stopper:
        try:
            send(RankEvent(Kind.READY, spec.rank, time.time()))
            stopper.wait(math.inf, [sys.stdin.fileno()])  # the server closes it: go
            load_rank(spec, send, stopper)
            stopper.sleep(math.inf)  # hold the weights until the server stops
        except Stopped:
            pass
        except Crash as crash:
            with suppress(Stopped):
                send(RankEvent(Kind.CRASH, spec.rank, time.time(), reason=crash.reason))
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
