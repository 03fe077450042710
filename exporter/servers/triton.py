"""Triton Inference Server: `tritonserver --model-repository DIR`.

Its port stays closed during the initial model load; /v2/health/ready is 200 when every model is
ready and 400 before. Logs glog-style `IMMDD HH:MM:SS.uuuuuu PID file.cc:line] ` lines.
"""

from __future__ import annotations

import re

from exporter.servers.logformat import (
    CAUSE_RULES,
    EventKind,
    LogFormat,
    rule,
    stamp_local_no_year,
)
from exporter.servers.server import DEFAULT_INCLUDE, Command, Role, Server
from exporter.vocabulary import ProbeKind, ServerKind

COMMAND = Command(
    label="Triton",
    consoles={"tritonserver": None},
    flags={
        Role.MODEL: ("--model-repository", "--model-store"),
        Role.HOST: ("--http-address",),
        Role.PORT: ("--http-port",),
    },
    defaults={Role.HOST: "0.0.0.0", Role.PORT: "8000"},
    probe=ProbeKind.HEALTH,
    probe_path="/v2/health/ready",
    include=(*DEFAULT_INCLUDE, "*.plan", "*.onnx", "*.engine"),
    model_is="repository",
)

LOG = LogFormat(
    signature=re.compile(r"[IWEF]\d{4} \d\d:\d\d:\d\d\.\d{6}\s+\d+ [\w.]+:\d+\] "),
    prefix=re.compile(
        r"[IWEF](?P<mo>\d\d)(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)\.(?P<f>\d{6})"
        r"\s+\d+ [\w.]+:\d+\] "
    ),
    stamp=stamp_local_no_year,
    rules=(
        rule(EventKind.WEIGHTS_BEGIN, "loading: ", r"^loading: (?P<who>[^:\s]+):\d+"),
        rule(EventKind.WEIGHTS_END, "successfully loaded", r"^successfully loaded '(?P<who>[^']+)'"),
        rule(EventKind.READY, "Started HTTPService", r"^Started HTTPService at "),
        rule(EventKind.FATAL, "failed to load", r"^failed to load '[^']+' version \d+: .+"),
        rule(EventKind.FATAL, "creating server", r"^error: creating server: .+"),
        *CAUSE_RULES,
    ),
)  # fmt: skip

SERVER = Server(kind=ServerKind.TRITON, commands=(COMMAND,), log=LOG)
