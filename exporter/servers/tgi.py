"""Text Generation Inference (launcher/src/main.rs): `text-generation-launcher`.

Its port opens after the warm-up; /health is 200 when ready, 503 `{"error":"unhealthy",...}`
when not. Logs `<RFC 3339>Z  LEVEL target: message rank=N`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from exporter.load.events import EventKind
from exporter.servers.logformat import CAUSE_RULES, LogFormat, rule, stamp_utc
from exporter.servers.server import Answers, Command, Role, Server
from exporter.vocabulary import ProbeKind, ServerKind

COMMAND = Command(
    label="TGI",
    consoles={"text-generation-launcher": None},
    flags={
        Role.MODEL: ("--model-id",),
        Role.SERVED: ("--served-model-name",),
        Role.HOST: ("--hostname",),
        Role.PORT: ("--port", "-p"),
        Role.API_KEY: ("--api-key",),
        Role.REVISION: ("--revision",),
        Role.CACHE_DIR: ("--huggingface-hub-cache",),
    },
    env={
        Role.MODEL: ("MODEL_ID",),
        Role.SERVED: ("SERVED_MODEL_NAME",),
        Role.HOST: ("HOSTNAME",),
        Role.PORT: ("PORT",),
        Role.API_KEY: ("API_KEY",),
        Role.REVISION: ("REVISION",),
        Role.CACHE_DIR: ("HUGGINGFACE_HUB_CACHE",),
    },
    defaults={Role.HOST: "0.0.0.0", Role.PORT: "3000", Role.MODEL: "bigscience/bloom-560m"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
)

LOG = LogFormat(
    signature=re.compile(
        r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z\s+(?:TRACE|DEBUG|INFO|WARN|ERROR) "
    ),
    prefix=re.compile(
        r"(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d)T(?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)(?:\.(?P<f>\d+))?Z"
        r"\s+(?:TRACE|DEBUG|INFO|WARN|ERROR) "
    ),
    stamp=stamp_utc,
    rank_in_message=re.compile(r"\brank=\d+"),
    rules=(
        rule(EventKind.WEIGHTS_BEGIN, "Starting shard", r"Starting shard\b"),
        rule(EventKind.WEIGHTS_END, "Shard ready in", r"Shard ready in (?P<seconds>[\d.]+)s"),
        rule(EventKind.WARMUP_BEGIN, "Warming up model", r"Warming up model"),
        rule(EventKind.KV_CACHE, "KV-cache blocks", r"KV-cache blocks: \d+"),
        rule(EventKind.CUDA_GRAPH_BEGIN, "Cuda Graphs are enabled", r"Cuda Graphs are enabled for sizes"),
        rule(EventKind.CUDA_GRAPH_END, "Setting max batch total tokens", r"Setting max batch total tokens to \d+"),
        rule(EventKind.READY, "Connected", r"\bConnected$"),
        rule(EventKind.FATAL, "failed to start", r"(?:^|: )Shard \d+ failed to start"),
        rule(EventKind.FATAL, "Error: ", r"^Error: \w+"),
        *CAUSE_RULES,
    ),
)  # fmt: skip


def _error(document: Mapping[str, object]) -> bool:
    """TGI's error document: `{"error": "...", "error_type": "..."}`."""
    return isinstance(document.get("error"), str) and isinstance(document.get("error_type"), str)


SERVER = Server(
    kind=ServerKind.TGI,
    commands=(COMMAND,),
    log=LOG,
    answers=Answers(error=_error, headers=frozenset({"x-compute-type", "x-compute-time"})),
)
