"""What a kubelet asks of a target: is it alive, is it ready; each answer with one line a person
reads in `kubectl describe`.

A failed liveness probe restarts the server, and a restart of a large model costs a whole load
(minutes of weights read again), so *alive* fails only on evidence: a load stalled for the
target's `stall_after`, a load that failed, a watched process that exited, a ready server whose
process runs on while its endpoint stopped answering. Wherever the exporter has no basis (it
just started, the target was not seen yet, the name is not one it watches) alive answers yes
and says why. *Ready* is the opposite: yes only on the evidence of a ready endpoint, or, for a
follower node of a model over several hosts (which has none), of its log's end of start-up; a
follower whose end the exporter cannot see is neither stalled by its quiet nor ever ready.

The stall's line names what stopped and what still moves (exporter/load/activity.py), from the
measured signals only: bytes and logs quiet while the CPU spins reads as a compile or a hung
collective, everything quiet with the tree in uninterruptible I/O as a dead mount.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from http import HTTPStatus
from typing import Protocol

from exporter.load.activity import CPU_BUSY_SHARE
from exporter.runtime.snapshot import TargetView
from exporter.sources import ENDPOINT
from exporter.trust.untrusted import clean
from exporter.units import age
from exporter.vocabulary import Activity, Phase, TargetRole

ACTIVE_SECONDS = 10.0  # a signal that moved this recently (or within 3 intervals) still moves
MAX_LINE = 300  # kubelet keeps a probe's body for its event; a line, not a page
# A follower (a node of a model over several hosts) has no endpoint: what its answers rest on.
FOLLOWER_READY = "ready: a follower, its part of the model is up (the model serves from its head)"
END_UNSEEN = (
    "a follower, whose end of start-up only its log tells, and no log is read from its start"
)

# Each signal once it stopped ("... for 2m10s") and while it moves.
_WORDS = {
    Activity.WEIGHT_BYTES: ("no weight bytes", "weight bytes"),
    Activity.STORAGE_READS: ("no storage reads", "storage reads"),
    Activity.LOG_LINES: ("no log lines", "log lines"),
    Activity.GPU_MEMORY: ("GPU memory unchanged", "GPU memory"),
}
_STATES = {
    "T": "the server is stopped (SIGSTOP or a debugger)",
    "t": "the server is stopped by a debugger",
    "D": "the server waits in uninterruptible I/O (storage not answering?)",
}


class Question(StrEnum):
    """The two probe paths: /probe/alive and /probe/ready."""

    ALIVE = "alive"
    READY = "ready"


@dataclass(frozen=True)
class Verdict:
    """One probe's answer: success or not, and why in one line."""

    ok: bool
    line: str
    code: HTTPStatus | None = None  # None: 200 when ok, else 503

    @property
    def status(self) -> str:
        code = self.code or (HTTPStatus.OK if self.ok else HTTPStatus.SERVICE_UNAVAILABLE)
        return f"{code.value} {code.phrase}"


def answer(
    question: Question,
    views: Sequence[TargetView],
    name: str | None,
    now: float,
    interval: float,
) -> tuple[Verdict, bool]:
    """The answer for the target `name` (None: the only one), and whether the name was unknown.

    A name the exporter does not watch, or no name with several targets, is a question it
    cannot answer: alive says yes (a typo must not restart a server in a loop; the exporter
    logs it), ready says no (404 or 400: no evidence of readiness).
    """
    if name is None:
        if len(views) == 1:
            return _judge(question, views[0], now, interval), False
        if not views:
            why = "no model server found yet"
            return _doubt(question, why, HTTPStatus.SERVICE_UNAVAILABLE), False
        names = ", ".join(clean(v.name, 64) for v in views[:8])
        more = f" and {len(views) - 8} more" if len(views) > 8 else ""
        why = f"{len(views)} targets watched ({names}{more}): name one with ?target="
        return _doubt(question, why, HTTPStatus.BAD_REQUEST), False
    for view in views:
        if view.name == name:
            return _judge(question, view, now, interval), False
    why = f"no target {clean(name, 64)!r} watched (yet)"
    return _doubt(question, why, HTTPStatus.NOT_FOUND), True


def _judge(question: Question, view: TargetView, now: float, interval: float) -> Verdict:
    return alive(view, now, interval) if question is Question.ALIVE else ready(view)


def _doubt(question: Question, why: str, refusal: HTTPStatus) -> Verdict:
    """A question without a basis: alive on doubt, never ready."""
    if question is Question.ALIVE:
        return Verdict(True, f"no basis yet: {why}")
    return Verdict(False, f"not ready: {why}", refusal)


def alive(view: TargetView, now: float, interval: float) -> Verdict:
    """The liveness answer for one target (module docstring: fail only on evidence)."""
    state = view.state
    if state is None:
        return Verdict(True, "no basis yet: the exporter has not looked at this target yet")
    phase = state.phase
    if phase is Phase.READY:
        if state.hung:
            return Verdict(False, _hung(view, state.failed_probes))
        return Verdict(True, _ready_line(view))
    if phase is Phase.FAILED:
        return Verdict(False, _failed(state.fatal, state.exited_at, now))
    if phase is Phase.DOWN:
        if state.exited_at is not None:
            return Verdict(False, f"process exited {_ago(now - state.exited_at)} ago")
        if view.config.process is None:
            return Verdict(True, "no basis yet: endpoint not answering, no process to watch")
        return Verdict(True, "no basis yet: no server process seen yet")
    at = f" at {_percent(state.progress_ratio)}" if state.progress_ratio is not None else ""
    # Still moving: within 10 s (3 intervals), and never longer than the stall's own limit.
    window = min(max(ACTIVE_SECONDS, 3 * interval), view.config.stall_after)
    if state.stalled:
        since = age(state.seconds_since_progress or 0.0)
        head = f"stalled in {phase}{at}: nothing moved for {since}"
        return Verdict(False, _line(head, activity(state, window)))
    head = f"{phase}{at}"
    if state.end_unseen:  # quiet is no evidence here: it may have been up for hours
        return Verdict(True, _line(f"{head}: {END_UNSEEN}: quiet is not a stall", []))
    return Verdict(True, _line(head, activity(state, window)))


def ready(view: TargetView) -> Verdict:
    """The readiness answer: yes only when the target's endpoint answered ready."""
    state = view.state
    if state is None:
        return Verdict(False, "not ready: the exporter has not looked at this target yet")
    if state.phase is Phase.READY and not state.hung:
        return Verdict(True, _ready_line(view))
    if state.hung:
        return Verdict(False, _hung(view, state.failed_probes))
    ratio = state.progress_ratio if state.in_progress else None
    at = f" at {_percent(ratio)}" if ratio is not None else ""
    if state.end_unseen:
        return Verdict(False, f"not ready: {state.phase}{at}: {END_UNSEEN}")
    return Verdict(False, f"not ready: {state.phase}{at}")


def _ready_line(view: TargetView) -> str:
    return FOLLOWER_READY if view.config.role is TargetRole.FOLLOWER else "ready"


class Watched(Protocol):
    """What `activity` reads of a target's state."""

    @property
    def activity(self) -> Mapping[str, float]: ...
    @property
    def cpu_share(self) -> float | None: ...
    @property
    def process_state(self) -> str | None: ...


def activity(state: Watched, window: float) -> list[str]:
    """`no weight bytes for 2m10s`, `log lines still move`, `CPU busy (98 % of a core)`, the
    tree's telling state: the measured signals only, stopped ones first; a signal that moved
    within `window` seconds still moves."""
    stopped, moving = [], []
    for signal, (quiet_words, moving_words) in _WORDS.items():
        seconds = state.activity.get(signal)
        if seconds is None:
            continue
        if seconds >= window:
            stopped.append(f"{quiet_words} for {age(seconds)}")
        else:
            moving.append(moving_words)
    parts = stopped
    if moving:
        parts.append(", ".join(moving) + " still move")
    cpu_quiet, share = state.activity.get(Activity.CPU), state.cpu_share
    if cpu_quiet is not None and cpu_quiet >= window:
        parts.append(f"CPU idle for {age(cpu_quiet)}")
    elif share is not None and share < CPU_BUSY_SHARE:  # it ran within the window, not lately
        parts.append(f"CPU at {share * 100:.0f} % of a core")
    elif cpu_quiet is not None:
        busy = f" ({share * 100:.0f} % of a core)" if share is not None else ""
        parts.append(f"CPU busy{busy}")
    told = _STATES.get(state.process_state or "")
    if told is not None:
        parts.append(told)
    return parts


def _hung(view: TargetView, failed: int) -> str:
    probe = view.value(ENDPOINT)
    detail = f": {clean(probe.detail, 120)}" if probe is not None and probe.detail else ""
    how = f" ({probe.result}{detail})" if probe is not None else ""
    return _line(f"hung: process up, endpoint failed {failed} probes in a row{how}", [])


def _failed(fatal: str | None, exited_at: float | None, now: float) -> str:
    parts = []
    if exited_at is not None:
        parts.append(f"process exited {_ago(now - exited_at)} ago")
    if fatal:
        parts.append(f"the server's log: {clean(fatal, MAX_LINE)}")
    return _line("load failed", parts)


def _line(head: str, parts: list[str]) -> str:
    text = head + ("; " + "; ".join(parts) if parts else "")
    return text if len(text) <= MAX_LINE else text[: MAX_LINE - 1] + "\u2026"


def _ago(seconds: float) -> str:
    return age(max(0.0, seconds))


def _percent(ratio: float) -> str:
    return f"{int(ratio * 100 + 1e-9)} %"
