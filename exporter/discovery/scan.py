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
arguments, config file and environment (see exporter/serverargs.py), resolved the way the
process sees its files: relative paths against its working directory, hub ids in its own
Hugging Face cache, and everything through /proc/PID/root when it lives in another mount
namespace (a container), so that the paths returned are ones this exporter can open.

Trust: any local user can start a process that looks like a server, so what its command line,
environment and files say is believed only as far as that user's own rights reach, as the
exporter's namespace sees them: a setuid program or a process that is not dumpable is no server
(refused, `borrowed_rights`), capabilities of another user namespace count for nothing. Every file
looked at for a process is opened on a thread holding the process's credentials
(exporter/asprocess.py), regular files only and bounded (exporter/safeio.py), never on /proc,
/sys or /dev; what the user could not read is neither read, counted nor named. Probes go only to
loopback or an address of the process's own network namespace; text shown anywhere is cleaned
(exporter/untrusted.py); what is refused is counted by reason (exporter/refusals.py).
"""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from urllib.parse import quote

import yaml

from exporter.config.schema import DISCOVERY_SERVERS, EndpointConfig, WeightsConfig
from exporter.discovery.refusals import Refusals
from exporter.discovery.serverargs import Evidence, Recognised, find_launch, recognise
from exporter.servers.server import Role
from exporter.sources.process import boot_time, read_stat
from exporter.trust.asprocess import Actor, Borrowed, Rights, RightsError, rights_of
from exporter.trust.safeio import Refused, open_checked, pseudo_path, read_regular, resolve_in_root
from exporter.trust.untrusted import clean
from exporter.vocabulary import ProbeKind

log = logging.getLogger(__name__)

DEFAULT_REFRESH_PASSES = 12
MAX_CONFIG_BYTES = 1 << 20
MAX_CMDLINE_BYTES = 1 << 20
MAX_ENVIRON_BYTES = 1 << 20
MAX_REF_BYTES = 4096
MAX_PASSWD_BYTES = 4 << 20
MAX_NET_BYTES = 4 << 20
MAX_SNAPSHOTS = 1024  # snapshot directories looked at for the newest
# Cloud metadata services: never probed, whatever a command line says.
_METADATA = frozenset(
    ipaddress.ip_address(a)
    for a in ("169.254.169.254", "169.254.170.2", "100.100.100.200", "fd00:ec2::254")
)
_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:-]+")
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?\Z")
_COMMIT = re.compile(r"[0-9a-f]{40}\Z")
_SNAPSHOT_PATH = re.compile(r"models--[^/]+--([^/]+)/snapshots/[^/]+\Z")
_GGUF_SPLIT = re.compile(r"(.*)-(\d{5})-of-(\d{5})\.gguf\Z")
# Where huggingface_hub looks, in its own order; TRANSFORMERS_CACHE for older transformers.
_HUB_CACHE_VARS = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "TRANSFORMERS_CACHE")


@dataclass(frozen=True)
class DiscoveredServer:
    """One running model server, described as a target: what to probe and which files to watch."""

    kind: str  # a server kind of exporter/servers
    name: str
    pid: int
    start_ticks: int
    start_time: float | None
    url: str
    probe: ProbeKind
    probe_path: str
    model: str | None
    weights: tuple[str, ...]
    weights_include: tuple[str, ...]
    reachable: bool
    evidence: tuple[Evidence, ...]
    # The process's credentials: its files are looked at with these rights, and no others.
    rights: Rights | None = None
    # Values are secrets (the server's API key): never in repr, logs or evidence.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)
    # A repository server's models (Triton's: its directories with a config.pbtxt), and the
    # path of one model's own ready answer (`{model}`): with several, each is a target of its
    # own (exporter/admission.py: targets_of).
    models: tuple[str, ...] = ()
    model_ready_path: str | None = None
    # A model server its router started (llama-server's router mode): the router's process
    # and start, whose log carries this one's lines.
    router_pid: int | None = None
    router_start: float | None = None

    @property
    def key(self) -> tuple[int, int]:
        """Identity of the process, safe against pid reuse."""
        return (self.pid, self.start_ticks)


def endpoint_config(server: DiscoveredServer) -> EndpointConfig:
    """The endpoint a discovered server is probed at, as if it had been configured."""
    return EndpointConfig(
        url=server.url,
        probe=server.probe,
        path=server.probe_path,
        model=server.model,
        headers=dict(server.headers),
    )


def weights_config(server: DiscoveredServer) -> WeightsConfig | None:
    """The weights to watch, or None while they are unknown (a hub id not downloaded yet)."""
    if not server.weights:
        return None
    return WeightsConfig(paths=server.weights, include=server.weights_include)


def target_name(kind: str, model: str | None, port: int) -> str:
    """A name stable across restarts: server kind, model (directory or file name) and port.

    Only letters, digits and `_ . : -`, as the config's target names.
    """
    label = _model_label(model) if model else ""
    return f"{kind}-{label}-{port}" if label else f"{kind}-{port}"


def model_target_name(server: str, model: str | None) -> str:
    """The target of one model of a server that serves several (its own process or not):
    `<server's target>/<model>`, the same name for as long as the server keeps its own."""
    label = _model_label(model) if model else ""
    return f"{server}/{label or 'model'}"


def _model_label(model: str) -> str:
    text = model.rstrip("/")
    snapshot = _SNAPSHOT_PATH.search(text)
    base = snapshot.group(1) if snapshot else text.rsplit("/", 1)[-1]
    split = _GGUF_SPLIT.match(base)
    if split:
        base = split.group(1)
    elif base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    return _NAME_BAD.sub("-", base).strip("-._:")[:80].rstrip("-._:")


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
        environ = _read_environ(base)
        view = _View.of(self._proc_root, pid, environ)
        refuse = _Refuser(self.refusals, key)
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
        same_netns = _same_namespace(self._proc_root, pid, "net")
        host, reachable, note = _probe_host(
            recognised.host, same_netns is not False, lambda: _local_addresses(base)
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
            url=f"http://{_url_host(host)}:{recognised.port}",
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


@dataclass(frozen=True)
class _Refuser:
    """Notes refusals about one process (from the actor's thread too: Refusals is thread-safe)."""

    refusals: Refusals
    key: tuple[int, int]

    def __call__(self, reason: str, what: str, message: str) -> None:
        self.refusals.note(reason, (self.key, what), "pid %d: %s", self.key[0], clean(message))

    def of(self, exc: OSError, what: str) -> None:
        """An OSError from looking at `what`: a refusal, or a plain absence (not counted)."""
        if isinstance(exc, Refused):
            self(exc.reason, what, str(exc))
        elif exc.errno in (errno.EACCES, errno.EPERM):
            self("unreadable", what, f"{what}: not readable with the process's rights")
        elif exc.errno in (errno.ELOOP, errno.EMLINK):
            self("not_regular", what, f"{what}: {exc.strerror}")


def _on_behalf(
    argv: tuple[str, ...],
    environ: Mapping[str, str] | None,
    view: _View,
    kinds: Sequence[str],
    refuse: _Refuser,
) -> tuple[Recognised | None, tuple[str, ...], list[Evidence], tuple[str, ...]]:
    """What needs the process's files: its config, home, weights, and the models of a model
    repository. Runs with its rights."""
    view = replace(view, home=(environ or {}).get("HOME") or _passwd_home(view, refuse))
    recognised = recognise(
        argv, environ, kinds, read_config=lambda path: _read_config(view, path, refuse)
    )
    if recognised is None:
        return None, (), [], ()
    weights, evidence = _weights(recognised, view, environ, refuse)
    repository = recognised.command.model_is == "repository"
    models = _repository_models(weights[0]) if repository and len(weights) == 1 else ()
    return recognised, weights, evidence, models


def _repository_models(path: str) -> tuple[str, ...]:
    """The models of a model repository (Triton's): its directories holding a config.pbtxt or
    a numbered version directory, at most MAX_SNAPSHOTS entries looked at."""
    models = []
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SNAPSHOTS:
                    break
                if entry.is_dir(follow_symlinks=False) and _is_model_dir(entry.path):
                    models.append(entry.name)
    except OSError:
        return ()
    return tuple(sorted(models))


def _is_model_dir(path: str) -> bool:
    try:
        with os.scandir(path) as entries:
            for i, entry in enumerate(entries):
                if i >= MAX_SNAPSHOTS:
                    break
                if entry.name == "config.pbtxt" or (entry.name.isdigit() and entry.is_dir()):
                    return True
    except OSError:
        pass
    return False


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


@dataclass(frozen=True)
class _View:
    """Paths as one process sees them, turned into paths this exporter can open."""

    prefix: str  # "" or /proc/PID/root when the process has another root or mount namespace
    cwd: str | None  # its working directory, as the process sees it
    home: str | None
    evidence: tuple[Evidence, ...]
    uid: int | None = None

    @classmethod
    def of(cls, proc_root: str, pid: int, environ: Mapping[str, str] | None) -> _View:
        base = f"{proc_root}/{pid}"
        same_mounts = _same_namespace(proc_root, pid, "mnt")
        evidence: list[Evidence] = []
        prefix = ""
        if same_mounts is False or not _same_root(proc_root, pid):
            prefix = f"{base}/root"
            evidence.append(
                Evidence("files", prefix, "another mount namespace or root: paths go through it")
            )
        elif same_mounts is None:
            evidence.append(Evidence("files", "as on this host", "mount namespace unreadable"))
        try:
            cwd: str | None = os.readlink(f"{base}/cwd")
            uid: int | None = os.stat(base).st_uid
        except OSError:
            cwd = uid = None
        return cls(prefix, cwd, None, tuple(evidence), uid)

    def host_path(self, path: str) -> str | None:
        """The path this exporter opens for one the process names; symlinks resolved inside the
        process's root, Refused for /proc, /sys and /dev, OSError when a step is refused."""
        if path == "~" or path.startswith("~/"):
            if self.home is None:
                return None
            path = self.home + path[1:]
        if not path.startswith("/"):
            if self.cwd is None:
                return None
            path = os.path.join(self.cwd, path)
        if pseudo_path(path):
            raise Refused("pseudo_filesystem", f"{path}: /proc, /sys and /dev are never read")
        resolved = resolve_in_root(self.prefix, path)
        if pseudo_path(resolved[len(self.prefix) :]):
            raise Refused("pseudo_filesystem", f"{path}: leads into /proc, /sys or /dev")
        return resolved


def _same_namespace(proc_root: str, pid: int, kind: str) -> bool | None:
    try:
        theirs = os.readlink(f"{proc_root}/{pid}/ns/{kind}")
        ours = os.readlink(f"{proc_root}/self/ns/{kind}")
    except OSError:
        return None
    return theirs == ours


def _same_root(proc_root: str, pid: int) -> bool:
    try:
        theirs = os.stat(f"{proc_root}/{pid}/root")
        ours = os.stat(f"{proc_root}/self/root")
    except OSError:
        return True
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def _passwd_home(view: _View, refuse: _Refuser) -> str | None:
    """The process owner's home from the passwd file the process itself sees."""
    if view.uid is None:
        return None
    try:
        text = read_regular(f"{view.prefix}/etc/passwd", MAX_PASSWD_BYTES)
    except OSError as exc:
        refuse.of(exc, "/etc/passwd")
        return None
    for line in text.decode("utf-8", "surrogateescape").splitlines():
        fields = line.split(":")
        if len(fields) >= 6 and fields[2] == str(view.uid):
            return fields[5] or None
    return None


def _read_environ(base: str) -> dict[str, str] | None:
    """The process's initial environment; None when we may not read it (another user's)."""
    try:
        raw = read_regular(f"{base}/environ", MAX_ENVIRON_BYTES)
    except OSError:
        return None
    environ = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            environ[os.fsdecode(name)] = os.fsdecode(value)
    return environ


def _read_config(view: _View, path: str, refuse: _Refuser) -> Mapping[str, object] | None:
    """A server's own --config file (YAML), read through the process's view of the files."""
    try:
        host = view.host_path(path)
        if host is None:
            return None
        document = yaml.safe_load(read_regular(host, MAX_CONFIG_BYTES))
    except OSError as exc:
        refuse.of(exc, path)
        return None
    except (yaml.YAMLError, RecursionError):
        return None
    return document if isinstance(document, dict) else None


def _local_addresses(base: str) -> list[str]:
    """The addresses local to a process's network namespace, loopback excluded: IPv4 from
    fib_trie, IPv6 from if_inet6."""
    addresses: dict[str, None] = {}  # ordered, each once (Main and Local tables repeat them)
    try:
        lines = read_regular(f"{base}/net/fib_trie", MAX_NET_BYTES).decode("ascii", "replace")
    except OSError:
        lines = ""
    current = ""
    for line in lines.splitlines():
        text = line.strip()
        if text.startswith("|-- "):
            current = text[4:]
        elif text.startswith("/32 host LOCAL") and current and not current.startswith("127."):
            addresses[current] = None
    try:
        inet6 = read_regular(f"{base}/net/if_inet6", MAX_NET_BYTES).decode("ascii", "replace")
    except OSError:
        inet6 = ""
    for line in inet6.splitlines():
        digits = line.split()[0] if line.split() else ""
        if len(digits) == 32:
            ip = ipaddress.ip_address(int(digits, 16).to_bytes(16, "big"))
            if not ip.is_loopback:
                addresses[str(ip)] = None
    return list(addresses)


def _probe_host(
    host: str, same_netns: bool, addresses: Sequence[str] | Callable[[], Sequence[str]]
) -> tuple[str, bool, str]:
    """(address to probe, reachable from here, why that address) for a server's listen host.

    Only where the server is: loopback of our own namespace, or an address of the process's
    network namespace (`addresses`, asked only when needed); never link-local or a metadata
    service. An IPv4-mapped address is its IPv4 address, so `::ffff:127.0.0.1` is loopback.
    """
    local = addresses if not callable(addresses) else None

    def namespace_addresses() -> Sequence[str]:
        nonlocal local
        if local is None:
            local = addresses() if callable(addresses) else addresses
        return local

    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None = ipaddress.ip_address(
            "127.0.0.1" if host == "localhost" else host.strip("[]")
        )
    except ValueError:
        ip = None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    loopback = "::1" if ip is not None and ip.version == 6 else "127.0.0.1"
    if ip is not None and (ip.is_link_local or ip in _METADATA):
        return str(ip), False, "a link-local or metadata address: never probed"
    if ip is not None and ip.is_loopback:
        if same_netns:
            return str(ip), True, ""
        return str(ip), False, "listens on loopback in its own network namespace: not reachable"
    if ip is not None and not ip.is_unspecified:
        if str(ip) in namespace_addresses():
            return str(ip), True, ""
        return str(ip), False, "not an address of the server's network namespace: not probed"
    if same_netns:
        why = "listens on every interface" if ip is not None else f"{host!r} is a host name"
        return loopback, True, f"{why}: probed on loopback"
    usable = [a for a in namespace_addresses() if not ipaddress.ip_address(a).is_link_local]
    if usable:
        return usable[0], True, "in its own network namespace: probed on that namespace's address"
    return loopback, False, "in its own network namespace with no address reachable from here"


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _usable(path: str, what: str, refuse: _Refuser) -> bool | None:
    """Whether the process may open `path` (True), it is missing (None), or refused (False)."""
    try:
        fd, _ = open_checked(path)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR) and not isinstance(exc, Refused):
            return None
        refuse.of(exc, what)
        return False
    os.close(fd)
    return True


def _weights(
    recognised: Recognised, view: _View, environ: Mapping[str, str] | None, refuse: _Refuser
) -> tuple[tuple[str, ...], list[Evidence]]:
    """The weight paths a server loads, as paths this exporter can open, and why."""
    model = recognised.model
    if model is None:
        return (), [Evidence("weights", "unknown", "no model argument")]
    try:
        path = view.host_path(model)
    except OSError as exc:
        refuse.of(exc, model)
        return (), [Evidence("weights", "refused", _refusal(exc))]
    usable = _usable(path, model, refuse) if path is not None else None
    if usable is False:
        return (), [Evidence("weights", "refused", "not readable with the process's rights")]
    if path is not None and usable:
        if recognised.command.model_is == "file":
            return _gguf_parts(path, refuse), [Evidence("weights", path, "the model file")]
        return (path,), [Evidence("weights", path, "local path")]
    if recognised.command.model_is == "model" and _HUB_ID.match(model):
        return _hub_snapshot(model, recognised, view, environ, refuse)
    return (), [Evidence("weights", "not found", f"{model} does not exist (yet)")]


def _refusal(exc: OSError) -> str:
    return exc.reason.replace("_", " ") if isinstance(exc, Refused) else str(exc.strerror)


def _gguf_parts(path: str, refuse: _Refuser) -> tuple[str, ...]:
    """All files of a split GGUF (`x-00001-of-00003.gguf`); llama.cpp loads them together."""
    split = _GGUF_SPLIT.match(path)
    if not split:
        return (path,)
    stem, total = split.group(1), min(int(split.group(3)), MAX_SNAPSHOTS)
    parts = (f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1))
    return tuple(p for p in parts if _usable(p, p, refuse))


def _hub_snapshot(
    repo_id: str,
    recognised: Recognised,
    view: _View,
    environ: Mapping[str, str] | None,
    refuse: _Refuser,
) -> tuple[tuple[str, ...], list[Evidence]]:
    """A hub id's snapshot in the process's own Hugging Face cache."""
    env = environ or {}
    caches: list[tuple[str, str]] = []
    if recognised.hub_cache:
        caches.append((recognised.hub_cache, "the server's cache directory argument"))
    caches.extend((env[var], f"environment {var}") for var in _HUB_CACHE_VARS if env.get(var))
    if env.get("HF_HOME"):
        caches.append((f"{env['HF_HOME']}/hub", "environment HF_HOME"))
    if env.get("XDG_CACHE_HOME"):
        caches.append((f"{env['XDG_CACHE_HOME']}/huggingface/hub", "environment XDG_CACHE_HOME"))
    if view.home:
        caches.append((f"{view.home}/.cache/huggingface/hub", "default under the owner's home"))
    folder = "models--" + repo_id.replace("/", "--")
    for cache, source in caches:
        try:
            host = view.host_path(f"{cache}/{folder}")
        except OSError as exc:
            refuse.of(exc, cache)
            continue
        if host is None or not _usable(host, cache, refuse) or not os.path.isdir(host):
            continue
        snapshot, how = _revision_snapshot(host, recognised.revision, refuse)
        if snapshot is not None:
            return (snapshot,), [Evidence("weights", snapshot, f"hub cache from {source}; {how}")]
    searched = ", ".join(cache for cache, _ in caches) or "no cache directory known"
    return (), [Evidence("weights", "not found", f"hub id {repo_id} in none of: {searched}")]


def _revision_snapshot(
    repo: str, revision: str | None, refuse: Callable[[str, str, str], None] | None = None
) -> tuple[str | None, str]:
    """The snapshot a revision names (refs/<revision>, default main), as huggingface_hub does.

    refs/<revision> must be a small regular file: a FIFO or /dev/zero there is refused.
    """
    rev = revision or "main"
    commit: str | None = rev if _COMMIT.match(rev) else None
    if commit is None and "/" not in rev and rev not in (".", ".."):
        try:
            text = read_regular(f"{repo}/refs/{rev}", MAX_REF_BYTES).decode("ascii").strip()
            commit = text if _COMMIT.match(text) else None
        except Refused as exc:
            if refuse is not None:
                refuse(exc.reason, f"{repo}/refs/{rev}", str(exc))
        except (OSError, UnicodeDecodeError):
            commit = None
    if commit and os.path.isdir(f"{repo}/snapshots/{commit}"):
        return f"{repo}/snapshots/{commit}", f"refs/{rev} -> {commit}"
    snapshots: list[tuple[float, str]] = []
    try:
        with os.scandir(f"{repo}/snapshots") as entries:
            for entry in entries:
                if len(snapshots) >= MAX_SNAPSHOTS:
                    break
                if entry.is_dir():
                    snapshots.append((entry.stat().st_mtime, entry.path))
    except OSError:
        return None, "no snapshots"
    if not snapshots:
        return None, "no snapshots"
    newest = max(snapshots)[1]
    return newest, f"refs/{rev} missing: newest of {len(snapshots)} snapshot(s)"
