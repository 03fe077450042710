"""Find the model servers running on this host from /proc, with no configuration at all.

A pass lists /proc and reads the command line only of processes it has not seen (and of each
new one once more on the next pass, in case it was caught between fork and exec); the rest are
re-read a slice at a time, so a wrapper that execs into a server late is still found within
`refresh_passes` passes. Only the top-most recognised process of a tree is a server: vLLM's
EngineCore, SGLang's schedulers or multiprocessing children that kept their parent's command
line are part of their parent's server, not more servers.

For each server found, its endpoint, probe, served model and weight paths come from its own
arguments, config file and environment (see exporter/serverargs.py), resolved the way the
process sees its files: relative paths against its working directory, hub ids in its own
Hugging Face cache, and everything through /proc/PID/root when it lives in another mount
namespace (a container), so that the paths returned are ones this exporter can open.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import yaml

from exporter.config import DISCOVERY_SERVERS, EndpointConfig, WeightsConfig
from exporter.serverargs import Evidence, Recognised, find_launch, recognise
from exporter.sources.process import boot_time, read_stat
from exporter.vocabulary import ProbeKind, ServerKind

DEFAULT_REFRESH_PASSES = 12
MAX_CONFIG_BYTES = 1 << 20
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

    kind: ServerKind
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
    # Values are secrets (the server's API key): never in repr, logs or evidence.
    headers: Mapping[str, str] = field(default_factory=dict, repr=False, compare=False)

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

    Keeps what it read between passes, so one instance is called from one thread.
    """

    def __init__(
        self,
        servers: Sequence[str] = DISCOVERY_SERVERS,
        proc_root: str = "/proc",
        refresh_passes: int = DEFAULT_REFRESH_PASSES,
    ) -> None:
        self._kinds = tuple(servers)
        self._proc_root = proc_root
        self._refresh = max(1, refresh_passes)
        self._passes = 0
        self._seen: dict[int, _Seen] = {}
        self._known: dict[tuple[int, int], DiscoveredServer] = {}
        self._clock_ticks = os.sysconf("SC_CLK_TCK")
        self._boot: float | None = None

    def scan(self) -> tuple[DiscoveredServer, ...]:
        """The servers running now, sorted by name."""
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
        found = [
            server
            for pid, start_ticks in self._tops(candidates)
            if (server := self._server(pid, start_ticks, candidates[pid])) is not None
        ]
        found = _unique_names(found)
        self._known = {server.key: server for server in found}
        return tuple(sorted(found, key=lambda s: s.name))

    def _tops(self, candidates: Mapping[int, tuple[str, ...]]) -> list[tuple[int, int]]:
        """(pid, start ticks) of candidates with no recognised ancestor: workers are no servers."""
        stats: dict[int, tuple[int, int] | None] = {}  # pid -> (ppid, start ticks)

        def stat(pid: int) -> tuple[int, int] | None:
            if pid not in stats:
                proc = read_stat(self._proc_root, pid)
                stats[pid] = None if proc is None or proc.zombie else (proc.ppid, proc.start_ticks)
            return stats[pid]

        tops = []
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
        return tops

    def _server(self, pid: int, start_ticks: int, argv: tuple[str, ...]) -> DiscoveredServer | None:
        known = self._known.get((pid, start_ticks))
        if known is not None and (known.weights or not _awaits_weights(known)):
            return known
        return self._describe(pid, start_ticks, argv)

    def _describe(
        self, pid: int, start_ticks: int, argv: tuple[str, ...]
    ) -> DiscoveredServer | None:
        base = f"{self._proc_root}/{pid}"
        environ = _read_environ(base)
        view = _View.of(self._proc_root, pid, environ)
        recognised = recognise(
            argv, environ, self._kinds, read_config=lambda path: _read_config(view, path)
        )
        if recognised is None:
            return None
        evidence = list(recognised.evidence)
        if environ is None:
            evidence.append(Evidence("environment", "unreadable", f"{base}/environ"))
        evidence.extend(view.evidence)
        same_netns = _same_namespace(self._proc_root, pid, "net")
        addresses = [] if same_netns is not False else _local_addresses(base)
        host, reachable, note = _probe_host(recognised.host, same_netns is not False, addresses)
        if note:
            evidence.append(Evidence("probe host", host, note))
        weights, weight_evidence = _weights(recognised, view, environ)
        evidence.extend(weight_evidence)
        spec = recognised.spec
        model = recognised.served_model_name or (
            recognised.model if spec.model_is != "repository" else None
        )
        headers = {"Authorization": f"Bearer {recognised.api_key}"} if recognised.api_key else {}
        return DiscoveredServer(
            kind=spec.kind,
            name=target_name(spec.kind, model or recognised.model, recognised.port),
            pid=pid,
            start_ticks=start_ticks,
            start_time=self._start_time(start_ticks),
            url=f"http://{_url_host(host)}:{recognised.port}",
            probe=spec.probe,
            probe_path=spec.probe_path,
            model=model,
            weights=weights,
            weights_include=spec.include,
            reachable=reachable,
            evidence=tuple(evidence),
            headers=headers,
        )

    def _argv(self, pid: int) -> tuple[str, ...] | None:
        try:
            with open(f"{self._proc_root}/{pid}/cmdline", "rb") as f:
                raw = f.read()
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


def _awaits_weights(server: DiscoveredServer) -> bool:
    """Weights named but not found yet (a hub download in progress): look again next pass."""
    return any(e.what == "weights" and e.value == "not found" for e in server.evidence)


def _unique_names(servers: list[DiscoveredServer]) -> list[DiscoveredServer]:
    """Two servers with one name (same model and port in two containers): the elder keeps it."""
    taken: set[str] = set()
    result = []
    for server in sorted(servers, key=lambda s: (s.start_ticks, s.pid)):
        if server.name in taken:
            server = replace(server, name=f"{server.name}-{server.pid}")
        taken.add(server.name)
        result.append(server)
    return result


@dataclass(frozen=True)
class _View:
    """Paths as one process sees them, turned into paths this exporter can open."""

    prefix: str  # "" or /proc/PID/root when the process has another root or mount namespace
    cwd: str | None
    home: str | None
    evidence: tuple[Evidence, ...]

    @classmethod
    def of(cls, proc_root: str, pid: int, environ: Mapping[str, str] | None) -> _View:
        base = f"{proc_root}/{pid}"
        same_mounts = _same_namespace(proc_root, pid, "mnt")
        evidence: list[Evidence] = []
        if same_mounts is False or not _same_root(proc_root, pid):
            prefix, cwd = f"{base}/root", f"{base}/cwd"
            evidence.append(
                Evidence("files", prefix, "another mount namespace or root: paths go through it")
            )
        else:
            prefix = ""
            try:
                cwd = os.readlink(f"{base}/cwd")
            except OSError:
                cwd = None
            if same_mounts is None:
                evidence.append(Evidence("files", "as on this host", "mount namespace unreadable"))
        home = (environ or {}).get("HOME") or _passwd_home(base, prefix)
        return cls(prefix, cwd, home, tuple(evidence))

    def host_path(self, path: str) -> str | None:
        if path == "~" or path.startswith("~/"):
            if self.home is None:
                return None
            path = self.home + path[1:]
        if path.startswith("/"):
            return self.prefix + path
        return None if self.cwd is None else os.path.join(self.cwd, path)


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


def _passwd_home(base: str, prefix: str) -> str | None:
    """The process owner's home from the passwd file the process itself sees."""
    try:
        uid = os.stat(base).st_uid
        with open(f"{prefix}/etc/passwd", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.rstrip("\n").split(":")
                if len(fields) >= 6 and fields[2] == str(uid):
                    return fields[5] or None
    except OSError:
        return None
    return None


def _read_environ(base: str) -> dict[str, str] | None:
    """The process's initial environment; None when we may not read it (another user's)."""
    try:
        with open(f"{base}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    environ = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep:
            environ[os.fsdecode(name)] = os.fsdecode(value)
    return environ


def _read_config(view: _View, path: str) -> Mapping[str, object] | None:
    """A server's own --config file (YAML), read through the process's view of the files."""
    host = view.host_path(path)
    if host is None:
        return None
    try:
        with open(host, "rb") as f:
            document = yaml.safe_load(f.read(MAX_CONFIG_BYTES))
    except (OSError, yaml.YAMLError):
        return None
    return document if isinstance(document, dict) else None


def _local_addresses(base: str) -> list[str]:
    """The IPv4 addresses local to a process's network namespace, loopback excluded."""
    try:
        with open(f"{base}/net/fib_trie", encoding="ascii", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    addresses: dict[str, None] = {}  # ordered, each once (Main and Local tables repeat them)
    current = ""
    for line in lines:
        text = line.strip()
        if text.startswith("|-- "):
            current = text[4:]
        elif text.startswith("/32 host LOCAL") and current and not current.startswith("127."):
            addresses[current] = None
    return list(addresses)


def _probe_host(host: str, same_netns: bool, addresses: Sequence[str]) -> tuple[str, bool, str]:
    """(address to probe, reachable from here, why that address) for a server's listen host."""
    try:
        ip = ipaddress.ip_address("127.0.0.1" if host == "localhost" else host.strip("[]"))
    except ValueError:
        ip = None
    loopback = "::1" if ip is not None and ip.version == 6 else "127.0.0.1"
    if ip is not None and not ip.is_unspecified and not (ip.is_loopback and not same_netns):
        return str(ip), True, ""
    if same_netns:
        why = "listens on every interface" if ip is not None else f"{host!r} is a host name"
        return loopback, True, f"{why}: probed on loopback"
    if (ip is None or ip.is_unspecified) and addresses:
        return (
            addresses[0],
            True,
            "in its own network namespace: probed on that namespace's address",
        )
    return (
        loopback,
        False,
        "listens on loopback in its own network namespace: not reachable from here",
    )


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _weights(
    recognised: Recognised, view: _View, environ: Mapping[str, str] | None
) -> tuple[tuple[str, ...], list[Evidence]]:
    """The weight paths a server loads, as paths this exporter can open, and why."""
    model = recognised.model
    if model is None:
        return (), [Evidence("weights", "unknown", "no model argument")]
    path = view.host_path(model)
    if path is not None and os.path.exists(path):
        if recognised.spec.model_is == "file":
            return _gguf_parts(path), [Evidence("weights", path, "the model file")]
        return (path,), [Evidence("weights", path, "local path")]
    if recognised.spec.model_is == "model" and _HUB_ID.match(model):
        return _hub_snapshot(model, recognised, view, environ)
    return (), [Evidence("weights", "not found", f"{model} does not exist (yet)")]


def _gguf_parts(path: str) -> tuple[str, ...]:
    """All files of a split GGUF (`x-00001-of-00003.gguf`); llama.cpp loads them together."""
    split = _GGUF_SPLIT.match(path)
    if not split:
        return (path,)
    stem, total = split.group(1), int(split.group(3))
    parts = (f"{stem}-{i:05d}-of-{total:05d}.gguf" for i in range(1, total + 1))
    return tuple(p for p in parts if os.path.exists(p))


def _hub_snapshot(
    repo_id: str, recognised: Recognised, view: _View, environ: Mapping[str, str] | None
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
        host = view.host_path(cache)
        if host is None or not os.path.isdir(f"{host}/{folder}"):
            continue
        snapshot, how = _snapshot(f"{host}/{folder}", recognised.revision)
        if snapshot is not None:
            return (snapshot,), [Evidence("weights", snapshot, f"hub cache from {source}; {how}")]
    searched = ", ".join(cache for cache, _ in caches) or "no cache directory known"
    return (), [Evidence("weights", "not found", f"hub id {repo_id} in none of: {searched}")]


def _snapshot(repo: str, revision: str | None) -> tuple[str | None, str]:
    """The snapshot a revision names (refs/<revision>, default main), as huggingface_hub does."""
    rev = revision or "main"
    commit: str | None = rev if _COMMIT.match(rev) else None
    if commit is None:
        try:
            with open(f"{repo}/refs/{rev}", encoding="ascii") as f:
                commit = f.read().strip()
        except (OSError, UnicodeDecodeError):
            commit = None
    if commit and os.path.isdir(f"{repo}/snapshots/{commit}"):
        return f"{repo}/snapshots/{commit}", f"refs/{rev} -> {commit}"
    try:
        snapshots = [e for e in os.scandir(f"{repo}/snapshots") if e.is_dir()]
    except OSError:
        return None, "no snapshots"
    if not snapshots:
        return None, "no snapshots"
    newest = max(snapshots, key=lambda e: e.stat().st_mtime)
    return newest.path, f"refs/{rev} missing: newest of {len(snapshots)} snapshot(s)"
