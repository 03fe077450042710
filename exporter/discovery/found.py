"""What discovery found: one running model server, described as a target (its endpoint and
weights as a configured target's would be, and the name it goes by)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.config.schema import EndpointConfig, WeightsConfig
from exporter.discovery.serverargs import Evidence
from exporter.discovery.weights import GGUF_SPLIT
from exporter.trust.asprocess import Rights
from exporter.vocabulary import ProbeKind

_NAME_BAD = re.compile(r"[^A-Za-z0-9_.:-]+")
_SNAPSHOT_PATH = re.compile(r"models--[^/]+--([^/]+)/snapshots/[^/]+\Z")


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
    # own (exporter/runtime/admission.py: targets_of).
    models: tuple[str, ...] = ()
    model_ready_path: str | None = None
    # A model server its router started (llama-server's router mode): the router's process
    # and start, whose log carries this one's lines.
    router_pid: int | None = None
    router_start: float | None = None
    # It runs no API server (vLLM's --headless, SGLang's --node-rank 1): one node of a model
    # served over several hosts. Never probed, so where it could be probed does not matter.
    follower: bool = False

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
    split = GGUF_SPLIT.match(base)
    if split:
        base = split.group(1)
    elif base.endswith(".gguf"):
        base = base[: -len(".gguf")]
    return _NAME_BAD.sub("-", base).strip("-._:")[:80].rstrip("-._:")
