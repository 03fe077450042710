"""Find the model servers running on this host from /proc, with no configuration at all.

A pass lists /proc and reads the command line only of processes it has not seen (and of each
new one once more on the next pass, in case it was caught between fork and exec); the rest are
re-read a slice at a time, so a wrapper that execs into a server late is still found within
`refresh_passes` passes. Only the top-most recognised process of a tree is a server: vLLM's
EngineCore, SGLang's schedulers or multiprocessing children that kept their parent's command
line are part of their parent's server, not more servers. The exception is a router's child
(llama-server's router mode starts one llama-server per model it loads, its environment naming
the router's port): a model server of its own, named `<router's name>/<model>`, so each model's
loads, however often the router starts and stops it, are loads of one target.

For each server found, its endpoint, probe, served model and weight paths come from its own
arguments, config file and environment (serverargs.py), resolved the way the process sees its
files (view.py): relative paths against its working directory, hub ids in its own Hugging Face
cache (weights.py), and everything through /proc/PID/root when it lives in another mount
namespace (a container), so that the paths returned are ones this exporter can open. What is
found is a DiscoveredServer (found.py), probed where probehost.py says.

Trust: any local user can start a process that looks like a server, so what its command line,
environment and files say is believed only as far as that user's own rights reach, as the
exporter's namespace sees them: a setuid program or a process that is not dumpable is no server
(refused, `borrowed_rights`), capabilities of another user namespace count for nothing. Every file
looked at for a process is opened on a thread holding the process's credentials
(trust/asprocess.py), regular files only and bounded (trust/safeio.py), never on /proc, /sys or
/dev; what the user could not read is neither read, counted nor named. Probes go only to loopback
or an address of the process's own network namespace; text shown anywhere is cleaned
(trust/untrusted.py); what is refused is counted by reason (refusals.py).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from urllib.parse import quote

from exporter.config.schema import DISCOVERY_SERVERS
from exporter.discovery.found import DiscoveredServer, model_target_name, target_name
from exporter.discovery.probehost import local_addresses, probe_host, url_host
from exporter.discovery.refusals import Refusals, Refuser
from exporter.discovery.serverargs import Evidence, Recognised, find_launch, recognise
from exporter.discovery.view import (
    ProcessView,
    passwd_home,
    read_environ,
    read_server_config,
    same_namespace,
)
from exporter.discovery.weights import repository_models, weights_of
from exporter.servers.server import Role
from exporter.sources.process import boot_time, read_stat
from exporter.trust.asprocess import Actor, Borrowed, Rights, RightsError, rights_of
from exporter.trust.safeio import read_regular
from exporter.trust.untrusted import clean

log = logging.getLogger(__name__)

DEFAULT_REFRESH_PASSES = 12
MAX_CMDLINE_BYTES = 1 << 20


@dataclass
class _Seen:
    """What the last read of one pid's command line said; argv kept only for servers."""

    argv: tuple[str, ...] | None
    looks: int


class Discoverer:
    """Scans /proc for model servers; cheap to call every few seconds on a busy host.

    Keeps what it read between passes, so one instance is called from one thread. Files are
    looked at through `actor`, with each process's own rights; refusals go to `refusals`.
    """

    def __init__(
        self,
        servers: Sequence[str] = DISCOVERY_SERVERS,
        proc_root: str = "/proc",
        refresh_passes: int = DEFAULT_REFRESH_PASSES,
        *,
        actor: Actor | None = None,
        refusals: Refusals | None = None,
        users: Collection[int] | None = None,
    ) -> None:
        self._kinds = tuple(servers)
        self._proc_root = proc_root
        self._refresh = max(1, refresh_passes)
        self._passes = 0
        self._seen: dict[int, _Seen] = {}
        self._known: dict[tuple[int, int], DiscoveredServer] = {}
        self._clock_ticks = os.sysconf("SC_CLK_TCK")
        self._boot: float | None = None
        self._actor = actor or Actor()
        self.refusals = refusals or Refusals()
        self._users = frozenset(users) if users is not None else None

    def scan(self) -> tuple[DiscoveredServer, ...]:
        """The servers running now, sorted by name, each named by its own command line: two may
        share a name (same model and port in two containers, or another user's look-alike);
        which one holds it is admission's (exporter/runtime/targetnames.py)."""
        try:
            names = os.listdir(self._proc_root)
        except OSError:
            return ()
        self._passes += 1
        slot = self._passes % self._refresh
        seen: dict[int, _Seen] = {}
        candidates: dict[int, tuple[str, ...]] = {}
        for name in names:
            if not name.isdigit():
                continue
            pid = int(name)
            entry = self._seen.get(pid)
            if (
                entry is None
                or entry.argv is not None
                or entry.looks < 2
                or pid % self._refresh == slot
            ):
                argv = self._argv(pid)
                launched = argv if argv and find_launch(argv, self._kinds) else None
                entry = _Seen(launched, 1 if entry is None else entry.looks + 1)
            seen[pid] = entry
            if entry.argv is not None:
                candidates[pid] = entry.argv
        self._seen = seen
        tops, routed = self._tops(candidates)
        found = [
            server
            for pid, start_ticks in tops
            if (server := self._server(pid, start_ticks, candidates[pid])) is not None
        ]
        routers = {server.pid: server for server in found}
        found += [
            server
            for pid, start_ticks, parent in routed
            if parent in routers
            and (server := self._server(pid, start_ticks, candidates[pid], routers[parent]))
            is not None
        ]
        self._known = {server.key: server for server in found}
        return tuple(sorted(found, key=lambda s: s.name))

    def _tops(
        self, candidates: Mapping[int, tuple[str, ...]]
    ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
        """(pid, start ticks) of candidates with no recognised ancestor: workers are no servers;
        and (pid, start ticks, router pid) of those a router started, one server per model."""
        stats: dict[int, tuple[int, int] | None] = {}  # pid -> (ppid, start ticks)

        def stat(pid: int) -> tuple[int, int] | None:
            if pid not in stats:
                proc = read_stat(self._proc_root, pid)
                stats[pid] = None if proc is None or proc.zombie else (proc.ppid, proc.start_ticks)
            return stats[pid]

        tops, routed = [], []
        for pid in candidates:
            own = stat(pid)
            if own is None:
                continue  # gone, or a zombie
            ancestor, visited = own[0], {pid}
            while ancestor and ancestor not in candidates and ancestor not in visited:
                visited.add(ancestor)
                parent = stat(ancestor)
                ancestor = parent[0] if parent is not None else 0
            if not ancestor or ancestor in visited:
                tops.append((pid, own[1]))
            elif _routes(candidates[ancestor], candidates[pid], self._kinds):
                routed.append((pid, own[1], ancestor))
        return tops, routed

    def _server(
        self,
        pid: int,
        start_ticks: int,
        argv: tuple[str, ...],
        router: DiscoveredServer | None = None,
    ) -> DiscoveredServer | None:
        known = self._known.get((pid, start_ticks))
        settled = known is not None and (known.weights or not _awaits_weights(known))
        if settled and pid % self._refresh != self._passes % self._refresh:
            return known  # its rights are looked at again in its slice, and at every read
        try:
            rights = rights_of(pid, self._proc_root)
        except ProcessLookupError:
            return None
        except Borrowed as exc:
            self.refusals.note("borrowed_rights", (pid, start_ticks), "pid %d: %s", pid, exc.why)
            return None
        if known is not None and settled:
            return known
        try:
            return self._describe(pid, start_ticks, argv, rights, router)
        except Exception as exc:  # one bad process must not end the pass for the others
            log.debug("describing pid %d failed", pid, exc_info=True)
            self.refusals.note("error", (pid, start_ticks), "pid %d skipped: %s", pid, exc)
            return None

    def _describe(
        self,
        pid: int,
        start_ticks: int,
        argv: tuple[str, ...],
        rights: Rights,
        router: DiscoveredServer | None = None,
    ) -> DiscoveredServer | None:
        key = (pid, start_ticks)
        base = f"{self._proc_root}/{pid}"
        if self._users is not None and rights.uid not in self._users:
            self.refusals.note("user", key, "pid %d: uid %d is not in discovery.users",
                               pid, rights.uid)  # fmt: skip
            return None
        environ = read_environ(base)
        view = ProcessView.of(self._proc_root, pid, environ)
        refuse = Refuser(self.refusals, key)
        try:
            recognised, weights, weight_evidence, models = self._actor.call(
                rights, lambda: _on_behalf(argv, environ, view, self._kinds, refuse)
            )
        except (RightsError, TimeoutError) as exc:
            refuse("hung" if isinstance(exc, TimeoutError) else "unreadable", "", str(exc))
            recognised = recognise(argv, environ, self._kinds, read_config=lambda path: None)
            weights, weight_evidence = (), [Evidence("weights", "unknown", f"files: {exc}")]
            models = ()
        if recognised is None:
            return None
        evidence = list(recognised.evidence)
        if environ is None:
            evidence.append(Evidence("environment", "unreadable", f"{base}/environ"))
        evidence.extend(view.evidence)
        same_netns = same_namespace(self._proc_root, pid, "net")
        host, reachable, note = probe_host(
            recognised.host, same_netns is not False, lambda: local_addresses(base)
        )
        if note:
            evidence.append(Evidence("probe host", host, note))
        evidence.extend(weight_evidence)
        command = recognised.command
        only = models[0] if len(models) == 1 else None  # a repository's only model
        model = recognised.served_model_name or (
            recognised.model if command.model_is != "repository" else only
        )
        probe_path = command.probe_path
        default_control = command.defaults.get(Role.MODEL_CONTROL)
        if only and command.model_ready_path and recognised.model_control == default_control:
            probe_path = command.model_ready_path.format(model=quote(only, safe=""))
            why = "the repository's only model, loaded at start"
            evidence.append(Evidence("probe", probe_path, why))
        headers = {"Authorization": f"Bearer {recognised.api_key}"} if recognised.api_key else {}
        if headers and _HEADER_BAD.search(headers["Authorization"]):
            headers = {}  # a line break would forge the probe's request
        name = target_name(recognised.kind, model or recognised.model, recognised.port)
        if router is not None:
            routed = _routed_name(router, command.router_env, environ, model or recognised.model)
            if routed is None:
                return None  # a worker that kept its router's command line, not a model's server
            name = routed
            why = f"started by the router at pid {router.pid}, which loaded this model"
            evidence.append(Evidence("router", router.name, why))
        return DiscoveredServer(
            kind=recognised.kind,
            name=name,
            pid=pid,
            start_ticks=start_ticks,
            start_time=self._start_time(start_ticks),
            url=f"http://{url_host(host)}:{recognised.port}",
            probe=command.probe,
            probe_path=probe_path,
            model=clean(model) if model is not None else None,
            weights=weights,
            weights_include=command.include,
            reachable=reachable,
            evidence=tuple(
                Evidence(clean(e.what), clean(e.value), clean(e.source)) for e in evidence
            ),
            rights=rights,
            headers=headers,
            models=tuple(clean(m) for m in models),
            model_ready_path=command.model_ready_path,
            router_pid=router.pid if router is not None else None,
            router_start=router.start_time if router is not None else None,
            follower=recognised.follower,
        )

    def _argv(self, pid: int) -> tuple[str, ...] | None:
        try:
            raw = read_regular(f"{self._proc_root}/{pid}/cmdline", MAX_CMDLINE_BYTES)
        except OSError:
            return None
        if not raw:
            return None  # a kernel thread or a zombie
        # A process that rewrote its title (setproctitle) may have dropped the final NUL.
        return tuple(os.fsdecode(arg) for arg in raw.removesuffix(b"\0").split(b"\0"))

    def _start_time(self, start_ticks: int) -> float | None:
        if self._boot is None:
            self._boot = boot_time(self._proc_root)
        return None if self._boot is None else self._boot + start_ticks / self._clock_ticks


_HEADER_BAD = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _on_behalf(
    argv: tuple[str, ...],
    environ: Mapping[str, str] | None,
    view: ProcessView,
    kinds: Sequence[str],
    refuse: Refuser,
) -> tuple[Recognised | None, tuple[str, ...], list[Evidence], tuple[str, ...]]:
    """What needs the process's files: its config, home, weights, and the models of a model
    repository. Runs with its rights."""
    view = replace(view, home=(environ or {}).get("HOME") or passwd_home(view, refuse))
    recognised = recognise(
        argv, environ, kinds, read_config=lambda path: read_server_config(view, path, refuse)
    )
    if recognised is None:
        return None, (), [], ()
    weights, evidence = weights_of(recognised, view, environ, refuse)
    repository = recognised.command.model_is == "repository"
    models = repository_models(weights[0]) if repository and len(weights) == 1 else ()
    return recognised, weights, evidence, models


def _awaits_weights(server: DiscoveredServer) -> bool:
    """Weights named but not found yet (a hub download in progress): look again next pass."""
    return any(e.what == "weights" and e.value == "not found" for e in server.evidence)


def _routes(parent: tuple[str, ...], child: tuple[str, ...], kinds: Sequence[str]) -> bool:
    """Whether `child` may be a model server the router `parent` started: both the same
    command, one whose router starts a server per model (exporter/servers: `router_env`)."""
    started, by = find_launch(child, kinds), find_launch(parent, kinds)
    return (
        started is not None
        and by is not None
        and started.command is by.command
        and started.command.router_env is not None
    )


def _routed_name(
    router: DiscoveredServer,
    variable: str | None,
    environ: Mapping[str, str] | None,
    model: str | None,
) -> str | None:
    """`<router's name>/<model>` for a model server its router started (its environment names
    the router's port: the name stays the same however often the router starts it again, on
    whatever port); None when it is no such server."""
    if variable is None or environ is None:
        return None
    port = router.url.rsplit(":", 1)[-1]
    if environ.get(variable) != port:
        return None
    return model_target_name(router.name, model)
