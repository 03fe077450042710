"""Which model servers become targets, how a target follows its server, and with whose rights
its files are touched.

Targets come from the config, and, with discovery on, from the model servers found in /proc:
a discovered target is added when its server first appears, follows it across restarts (same
name, same tracker and history, a new process is a new load) and is dropped `keep_for` after
its process went away. Discovery scans every `discovery.interval`, and every sample interval
while a discovered server is gone, so its restart is seen at once. Any local user can start a
process that looks like a server, so a target's name is its user's (targetnames.py: a
target follows only its own user's processes; root's and the system's servers take their name
from any other user's), discovered targets are bounded (`Admission._admit`: at most
`max_targets`, `max_targets_per_user` of one user, an ordinary user's gone targets make room
first, and for root's or the system's server the most-represented ordinary user's newest), and
their files are only ever touched with their process's rights (`on_behalf`).

A discovered server is watched as the targets `targets_of` names: one, and one more per model of
a repository server holding several (Triton's). Admission counts, follows and drops targets by
name. Building a target's sources is the runtime's (`Wiring`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import quote

from exporter.config.schema import DEFAULT_STALL_AFTER, Config, ProcessConfig, TargetConfig
from exporter.discovery.found import (
    DiscoveredServer,
    endpoint_config,
    model_target_name,
    weights_config,
)
from exporter.discovery.refusals import Refusals
from exporter.discovery.scan import Discoverer
from exporter.discovery.serverargs import Evidence
from exporter.runtime.target import WatchedTarget
from exporter.runtime.targetnames import TargetNames, uid_of, who
from exporter.sources.endpoint import EndpointProber
from exporter.sources.process import read_stat
from exporter.trust.asprocess import Actor, OnBehalf, rights_of
from exporter.vocabulary import TargetRole

log = logging.getLogger(__name__)


class Wiring(Protocol):
    """What admission asks of the runtime that runs the targets' sources."""

    def new_target(self, config: TargetConfig, found: DiscoveredServer | None) -> WatchedTarget:
        """A target's tracker, prober and pace, its sources not built yet."""
        ...

    def wire(self, target: WatchedTarget) -> None:
        """(Re)build a target's sources from its config and register their loops."""
        ...

    def unwire(self, target: WatchedTarget) -> None:
        """Stop a dropped target's sources and forget what was measured of it."""
        ...

    def pids_watched(self, name: str) -> Collection[int]:
        """The processes a target's tree holds now (none known: empty)."""
        ...


class Filed(Protocol):
    """What admission asks of the runtime's filing of finished loads."""

    def read_past_loads(self) -> None:
        """Read what history says of every target afresh (one was added)."""
        ...

    def past_owner(self, name: str) -> int | None:
        """The user whose server's load history filed last under `name` (None: none known)."""
        ...


@dataclass(frozen=True)
class _Claim:
    """A discovered server, watched as one target with this config."""

    server: DiscoveredServer
    config: TargetConfig


class Admission:
    """The set of targets: configured ones added once, discovered ones admitted, followed and
    dropped by `discover()`, one pass when due."""

    def __init__(
        self,
        config: Config,
        wiring: Wiring,
        filed: Filed,
        *,
        discoverer: Discoverer | None,
        refusals: Refusals,
        clock: Callable[[], float],
        lock: threading.Lock,
        own_uid: int | None = None,
    ) -> None:
        """`lock` guards `targets` against the snapshot reading them; `own_uid`: the user the
        exporter runs as (its servers rank with root's), by default this process's."""
        self.config = config
        self.targets: dict[str, WatchedTarget] = {}
        self.discoverer = discoverer
        self._wiring = wiring
        self._filed = filed
        self._refusals = refusals
        self._clock = clock
        self._lock = lock
        self._names = TargetNames(
            config.discovery.keep_for,
            config.discovery.max_targets,
            clock=clock,
            own_uid=os.geteuid() if own_uid is None else own_uid,
            past_owner=filed.past_owner,
        )
        # With configured targets, discovery waits a tick: their process trees say which
        # servers they already watch.
        self._due = clock() + config.sample_interval if config.targets else 0.0

    def add(self, config: TargetConfig, found: DiscoveredServer | None = None) -> None:
        """Watch a target: configured (`found` None) or a discovered server's."""
        target = self._wiring.new_target(config, found)
        with self._lock:
            self.targets[config.name] = target
        self._wiring.wire(target)

    def drop(self, name: str, why: str | None = None) -> None:
        with self._lock:
            target = self.targets.pop(name)
        self._wiring.unwire(target)
        log.info("target %s: %s, no longer watched", name, why or
                 f"its server has been gone for {self.config.discovery.keep_for:g}s")  # fmt: skip

    def wait(self) -> float:
        """Seconds until the next discovery pass is due."""
        return max(0.0, self._due - self._clock())

    def look_now(self) -> None:
        """A discovered target's process went away: its restart may be up before the next pass
        is due, so the next pass is due now."""
        self._due = self._clock()

    def discover(self) -> None:
        """One discovery pass when due: add, follow and, after keep_for, drop discovered targets.

        The next pass is due on time whatever this one met: a pass that fails must not run
        again at once (a loop on /dev/zero would take a core).
        """
        assert self.discoverer is not None
        now = self._clock()
        if now < self._due:
            return
        self._due = now + self.config.discovery.interval
        try:
            servers = self._claimable(self.discoverer.scan())
        except Exception as exc:
            self._refusals.note("error", "pass", "a discovery pass failed: %s", exc)
            log.debug("discovery pass failed", exc_info=True)
            return
        self._names.present({server.key for server in servers}, now)
        for target in list(self.targets.values()):
            gone = target.gone_since
            if gone is not None and now - gone >= self.config.discovery.keep_for:
                self.drop(target.config.name)
        self._names.expire(now, kept=self.targets.keys())  # what the gaps over held is free
        found: set[str] = set()
        routers: dict[int, tuple[str, str]] = {}  # pid: the name its command line gives, its own
        for server in sorted(servers, key=self._precedence):
            router = routers.get(server.router_pid or 0)
            if router is not None and server.name.startswith(router[0] + "/"):
                # A router's model server is named after its router as the router is named.
                server = replace(server, name=router[1] + server.name[len(router[0]) :])
            named = self._named(server)
            if named is None:
                continue
            routers[server.pid] = (server.name, named.name)
            claims = [
                _Claim(named, config)
                for config in targets_of(named, self.config.discovery.stall_after)
            ]
            found.update(claim.config.name for claim in claims)
            if self._watch(claims, now):
                self._names.hold(named.name, server)
        for target in self.targets.values():
            gone = target.discovered is not None and target.config.name not in found
            if gone and target.gone_since is None:
                target.gone_since = now
        waiting = any(target.gone_since is not None for target in self.targets.values())
        interval = self.config.sample_interval if waiting else self.config.discovery.interval
        self._due = now + interval

    def _precedence(self, server: DiscoveredServer) -> tuple[bool, int, int]:
        """Root's and the system's servers first, then the elder: who claims a name first."""
        return (not self._names.privileged(uid_of(server)), server.start_ticks, server.pid)

    def _named(self, server: DiscoveredServer) -> DiscoveredServer | None:
        """`server` under the name it may have (targetnames.py), the name's owner in
        its evidence; None when another user's server owns the name (refused and said)."""
        claim = self._names.claim(server)
        uid = uid_of(server)
        if claim.name is None:
            self._refusals.note("name_owned", server.key, "%s (pid %d, %s): the name is %s's "
                                "server's; not watched", server.name, server.pid, who(uid),
                                who(claim.owner))  # fmt: skip
            return None
        rank = "root or a system user" if self._names.privileged(uid) else "an ordinary user"
        evidence = [Evidence("owner", who(uid), f"{rank}: no other user's server takes this name")]
        count, last = self._names.refusals(claim.name)
        if last is not None:
            asked = f"{count} process(es) of other users asked for it"
            evidence.append(Evidence("name refused", f"pid {last[0]} of {who(last[1])}", asked))
        return replace(server, name=claim.name, evidence=(*server.evidence, *evidence))

    def _watch(self, claims: list[_Claim], now: float) -> bool:
        """Add or follow the targets of a named server; whether its own target is watched."""
        watched = False
        for claim in claims:
            server = claim.server
            target = self.targets.get(claim.config.name)
            if target is not None and target.discovered is None:
                continue  # a configured target of that name
            if target is None or _owner(target) != uid_of(server):
                if not self._admit(server, now, leaving=target):
                    continue
                if target is not None:
                    self._give_way(target, server)
                log.info("target %s: discovered %s server, pid %d", claim.config.name,
                         server.kind, server.pid)  # fmt: skip
                self.add(claim.config, server)
                self._filed.read_past_loads()
            else:
                target.gone_since = None
                if target.discovered != server:
                    self._follow(target, claim)
            watched = watched or claim.config.name == server.name
        return watched

    def _give_way(self, target: WatchedTarget, server: DiscoveredServer) -> None:
        """A server of root's or the system's takes the name from another user's server: that
        one's targets end, its loads stay its own in history, it is watched no more."""
        lost = target.discovered
        assert lost is not None
        self._refusals.note("name_owned", lost.key, "%s (pid %d, %s) gives the name up to pid %d "
                            "of %s; not watched", lost.name, lost.pid, who(uid_of(lost)),
                            server.pid, who(uid_of(server)))  # fmt: skip
        for other in list(self.targets.values()):
            if other.discovered is not None and other.discovered.key == lost.key:
                self.drop(other.config.name, f"its name is {who(uid_of(server))}'s server's")

    def _admit(
        self, server: DiscoveredServer, now: float, leaving: WatchedTarget | None = None
    ) -> bool:
        """Room for one more discovered target: under `max_targets` and the user's share, another
        target giving way when needed (`_room`); else refused. `leaving`: a target whose
        server gives its name up to this one (its room is this one's)."""
        limits = self.config.discovery
        owner = uid_of(server)
        going = leaving.discovered.key if leaving is not None and leaving.discovered else None
        discovered = [
            target
            for target in self.targets.values()
            if target.discovered is not None and target.discovered.key != going
        ]
        same_user = [target for target in discovered if _owner(target) == owner]
        for pool, limit, reason in (
            (same_user, limits.max_targets_per_user, "user_share"),
            (discovered, limits.max_targets, "max_targets"),
        ):
            live = [target for target in pool if target.config.name in self.targets]
            if len(live) < limit:
                continue
            room = self._room(live, self._names.privileged(owner))
            if room is None:
                self._refusals.note(reason, server.key, "%s (pid %d, %s): %d targets already",
                                    server.name, server.pid, who(owner), limit)  # fmt: skip
                return False
            name = room.config.name
            if room.gone_since is None:  # another user's server, still running
                lost = room.discovered
                assert lost is not None
                self._refusals.note(reason, lost.key, "%s (pid %d, %s): gives way to %s's server",
                                    name, lost.pid, who(_owner(room)), who(owner))  # fmt: skip
                self._names.release(name, now)
            self.drop(name, f"making room for {server.name}")
        return True

    def _room(self, pool: list[WatchedTarget], privileged: bool) -> WatchedTarget | None:
        """Which target gives way to a newcomer: an ordinary user's gone one, the longest gone
        first; for root's or the system's server then the newest of the ordinary user holding
        most targets, then a gone one of root's or the system's. Never the other way: root's
        and the system's servers, and their restart gaps, are never crowded out."""
        ordinary = [target for target in pool if not self._names.privileged(_owner(target))]
        gone = sorted((target for target in ordinary if target.gone_since is not None),
                      key=lambda target: target.gone_since or 0.0)  # fmt: skip
        if gone or not privileged:
            return gone[0] if gone else None
        if ordinary:
            held = Counter(_owner(target) for target in ordinary)
            return max(ordinary, key=lambda target: (held[_owner(target)], _started(target)))
        ours = sorted((target for target in pool if target.gone_since is not None),
                      key=lambda target: target.gone_since or 0.0)  # fmt: skip
        return ours[0] if ours else None

    def _claimable(self, servers: tuple[DiscoveredServer, ...]) -> list[DiscoveredServer]:
        """The discovered servers no configured target watches (configured ones win) and that
        can be probed."""
        configured = [target for target in self.targets.values() if target.discovered is None]
        pids: set[int] = set()
        for target in configured:
            pids.update(self._wiring.pids_watched(target.config.name))
        urls = {target.config.endpoint.url.rstrip("/") for target in configured}
        claimable = []
        for server in servers:
            if server.pid in pids or server.url in urls:
                continue
            if not server.reachable and not server.follower:  # a follower is never probed
                why = next((e.source for e in server.evidence if e.what == "probe host"), "")
                self._refusals.note("unreachable", server.key, "%s at pid %d is not probed (%s); "
                                    "not watched", server.name, server.pid, why)  # fmt: skip
                continue
            claimable.append(server)
        return claimable

    def _follow(self, target: WatchedTarget, claim: _Claim) -> None:
        """The same server, changed: restarted (a new process, so a new load) or new weights;
        only its evidence changed (a name refused to another user): nothing to wire."""
        before, target.discovered = target.discovered, claim.server
        if before is not None and _but_evidence(before) == _but_evidence(claim.server):
            return
        fresh = claim.config
        if fresh.endpoint != target.config.endpoint:
            target.prober.close()
            target.prober = EndpointProber(fresh.endpoint)
        target.config = replace(target.config, endpoint=fresh.endpoint, weights=fresh.weights,
                                process=fresh.process, role=fresh.role)  # fmt: skip
        self._wiring.wire(target)


def targets_of(
    server: DiscoveredServer, stall_after: float = DEFAULT_STALL_AFTER
) -> tuple[TargetConfig, ...]:
    """A discovered server as if it had been configured, its process matched by identity: one
    target per server, and one more per model of a repository server holding several
    (`<server's target>/<model>`: its own ready answer, its model's directory of weights; the
    server's own target keeps the process's start). Two models loading at once are then two
    loads, never one of the server's target."""
    process = ProcessConfig(pid=server.pid, start_ticks=server.start_ticks)
    own = TargetConfig(
        name=server.name,
        endpoint=endpoint_config(server),
        weights=weights_config(server),
        process=process,
        stall_after=stall_after,
        role=TargetRole.FOLLOWER if server.follower else TargetRole.SERVER,
    )
    if not models_apart(server):
        return (own,)
    assert server.model_ready_path is not None
    weights = weights_config(server)
    return (
        own,
        *(
            TargetConfig(
                name=model_target_name(server.name, model),
                endpoint=replace(
                    endpoint_config(server),
                    path=server.model_ready_path.format(model=quote(model, safe="")),
                    model=model,
                ),
                weights=None
                if weights is None
                else replace(weights, paths=tuple(os.path.join(p, model) for p in weights.paths)),
                process=process,
                stall_after=stall_after,
            )
            for model in server.models
        ),
    )


def models_apart(server: DiscoveredServer | None) -> bool:
    """Whether the server's models are targets of their own (a repository of several)."""
    return server is not None and server.model_ready_path is not None and len(server.models) > 1


def model_of(config: TargetConfig, found: DiscoveredServer | None) -> str | None:
    """The one model a target watches, of a server whose models are targets of their own
    (`targets_of`); None for the server's own target and any other."""
    if not models_apart(found) or config.name == found.name:  # type: ignore[union-attr]
        return None
    return config.endpoint.model


def on_behalf(actor: Actor, proc_root: str, found: DiscoveredServer | None) -> OnBehalf | None:
    """How a discovered target's sources touch its files: with its process's rights."""
    if found is None or found.rights is None:
        return None
    same = _same_process(proc_root, found.pid, found.start_ticks)
    return OnBehalf(actor, found.rights, found.pid, same, proc_root)


def on_behalf_of(actor: Actor, proc_root: str, pid: int) -> OnBehalf:
    """A configured target's process, read for with its own rights as a discovered one's
    (ProcessLookupError, Borrowed)."""
    rights = rights_of(pid, proc_root)
    proc = read_stat(proc_root, pid)
    if proc is None:
        raise ProcessLookupError(f"pid {pid} is gone")
    same = _same_process(proc_root, pid, proc.start_ticks)
    return OnBehalf(actor, rights, pid, same, proc_root)


def _same_process(proc_root: str, pid: int, start_ticks: int) -> Callable[[], bool]:
    """Whether `pid` is still the process that started at `start_ticks` (pids are reused)."""

    def same() -> bool:
        proc = read_stat(proc_root, pid)
        return proc is not None and proc.start_ticks == start_ticks

    return same


def _owner(target: WatchedTarget) -> int | None:
    return uid_of(target.discovered) if target.discovered is not None else None


def _but_evidence(server: DiscoveredServer) -> DiscoveredServer:
    return replace(server, evidence=())


def _started(target: WatchedTarget) -> tuple[int, int]:
    found = target.discovered
    return (found.start_ticks, found.pid) if found is not None else (0, 0)
