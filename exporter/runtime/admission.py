"""Which model servers become targets, how a target follows its server, and with whose rights
its files are touched.

Targets come from the config, and, with discovery on, from the model servers found in /proc:
a discovered target is added when its server first appears, follows it across restarts (same
name, same tracker and history, a new process is a new load) and is dropped `keep_for` after
its process went away. Discovery scans every `discovery.interval`, and every sample interval
while a discovered server is gone, so its restart is seen at once. Any local user can start a
process that looks like a server, so discovered targets are bounded (`Admission._admit`: at most
`max_targets`, `max_targets_per_user` of one user, gone targets make room first) and their
files are only ever touched with their process's rights (`on_behalf`).

A discovered server is watched as the targets `targets_of` names: one, and one more per model of
a repository server holding several (Triton's). Admission counts, follows and drops targets by
name. Building a target's sources is the runtime's (`Wiring`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Protocol
from urllib.parse import quote

from exporter.config.schema import Config, ProcessConfig, TargetConfig
from exporter.discovery.refusals import Refusals
from exporter.discovery.scan import (
    DiscoveredServer,
    Discoverer,
    endpoint_config,
    model_target_name,
    weights_config,
)
from exporter.runtime.target import TargetRuntime
from exporter.sources.endpoint import EndpointProber
from exporter.sources.process import read_stat
from exporter.trust.asprocess import Actor, OnBehalf, rights_of

log = logging.getLogger(__name__)


class Wiring(Protocol):
    """What admission asks of the runtime that runs the targets' sources."""

    def new_target(self, config: TargetConfig, found: DiscoveredServer | None) -> TargetRuntime:
        """A target's tracker, prober and pace, its sources not built yet."""
        ...

    def wire(self, target: TargetRuntime) -> None:
        """(Re)build a target's sources from its config and register their loops."""
        ...

    def unwire(self, target: TargetRuntime) -> None:
        """Stop a dropped target's sources and forget what was measured of it."""
        ...

    def pids_watched(self, name: str) -> Collection[int]:
        """The processes a target's tree holds now (none known: empty)."""
        ...

    def read_histories(self) -> None:
        """Read what history says of every target afresh (one was added)."""
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
        *,
        discoverer: Discoverer | None,
        refusals: Refusals,
        clock: Callable[[], float],
        lock: threading.Lock,
    ) -> None:
        """`lock` guards `targets` against the snapshot reading them."""
        self.config = config
        self.targets: dict[str, TargetRuntime] = {}
        self.discoverer = discoverer
        self._wiring = wiring
        self._refusals = refusals
        self._clock = clock
        self._lock = lock
        # With configured targets, discovery waits a tick: their process trees say which
        # servers they already watch.
        self._due = clock() + config.sample_interval if config.targets else 0.0

    def add(self, config: TargetConfig, found: DiscoveredServer | None = None) -> None:
        """Watch a target: configured (`found` None) or a discovered server's."""
        runtime = self._wiring.new_target(config, found)
        with self._lock:
            self.targets[config.name] = runtime
        self._wiring.wire(runtime)

    def drop(self, name: str, why: str | None = None) -> None:
        with self._lock:
            runtime = self.targets.pop(name)
        self._wiring.unwire(runtime)
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
            found = self._claimable(self.discoverer.scan())
        except Exception as exc:
            self._refusals.note("error", "pass", "a discovery pass failed: %s", exc)
            log.debug("discovery pass failed", exc_info=True)
            return
        for name, claim in found.items():
            server = claim.server
            runtime = self.targets.get(name)
            if runtime is None:
                if not self._admit(server):
                    continue
                log.info("target %s: discovered %s server, pid %d", name, server.kind, server.pid)
                self.add(claim.config, server)
                self._wiring.read_histories()
            elif runtime.discovered is not None:
                runtime.gone_since = None
                if runtime.discovered != server:
                    self._follow(runtime, claim)
        for runtime in list(self.targets.values()):
            if runtime.discovered is None or runtime.config.name in found:
                continue
            if runtime.gone_since is None:
                runtime.gone_since = now
            elif now - runtime.gone_since >= self.config.discovery.keep_for:
                self.drop(runtime.config.name)
        waiting = any(rt.gone_since is not None for rt in self.targets.values())
        interval = self.config.sample_interval if waiting else self.config.discovery.interval
        self._due = now + interval

    def _admit(self, server: DiscoveredServer) -> bool:
        """Room for one more discovered target: under `max_targets` and the user's share, a
        gone target (the longest gone first) making room when needed; else refused."""
        limits = self.config.discovery
        owner = server.rights.uid if server.rights is not None else None
        discovered = [rt for rt in self.targets.values() if rt.discovered is not None]
        same_user = [rt for rt in discovered if _owner(rt) == owner]
        for pool, limit, reason in (
            (same_user, limits.max_targets_per_user, "user_share"),
            (discovered, limits.max_targets, "max_targets"),
        ):
            live = [rt for rt in pool if rt.config.name in self.targets]
            if len(live) < limit:
                continue
            gone = sorted(
                (rt for rt in live if rt.gone_since is not None), key=lambda rt: rt.gone_since or 0
            )
            if not gone:
                self._refusals.note(reason, server.key, "%s (pid %d, uid %s): %d targets already",
                                    server.name, server.pid, owner, limit)  # fmt: skip
                return False
            self.drop(gone[0].config.name, f"gone, making room for {server.name}")
        return True

    def _claimable(self, servers: tuple[DiscoveredServer, ...]) -> dict[str, _Claim]:
        """The discovered servers no configured target watches, by target name; configured
        ones win."""
        configured = [rt for rt in self.targets.values() if rt.discovered is None]
        pids: set[int] = set()
        for runtime in configured:
            pids.update(self._wiring.pids_watched(runtime.config.name))
        urls = {rt.config.endpoint.url.rstrip("/") for rt in configured}
        claimable = {}
        for server in servers:
            if server.pid in pids or server.url in urls:
                continue
            if not server.reachable:
                why = next((e.source for e in server.evidence if e.what == "probe host"), "")
                self._refusals.note("unreachable", server.key, "%s at pid %d is not probed (%s); "
                                    "not watched", server.name, server.pid, why)  # fmt: skip
                continue
            for config in targets_of(server):
                claimable[config.name] = _Claim(server, config)
        return claimable

    def _follow(self, runtime: TargetRuntime, claim: _Claim) -> None:
        """The same server, changed: restarted (a new process, so a new load) or new weights."""
        runtime.discovered = claim.server
        fresh = claim.config
        if fresh.endpoint != runtime.config.endpoint:
            runtime.prober.close()
            runtime.prober = EndpointProber(fresh.endpoint)
        runtime.config = replace(runtime.config, endpoint=fresh.endpoint,
                                 weights=fresh.weights, process=fresh.process)  # fmt: skip
        self._wiring.wire(runtime)


def targets_of(server: DiscoveredServer) -> tuple[TargetConfig, ...]:
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


def _owner(runtime: TargetRuntime) -> int | None:
    found = runtime.discovered
    return found.rights.uid if found is not None and found.rights is not None else None
