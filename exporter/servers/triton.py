"""Triton Inference Server: `tritonserver --model-repository DIR`.

Its port stays closed during the initial model load; /v2/health/ready is 200 when every model is
ready and 400 before, as is each model's /v2/models/NAME/ready. Logs glog-style `IMMDD HH:MM:SS.uuuuuu PID file.cc:line] ` lines.
"""

from __future__ import annotations

import re

from exporter.load.events import EventKind
from exporter.servers.logformat import CAUSE_RULES, LogFormat, rule, stamp_local_no_year
from exporter.servers.server import DEFAULT_INCLUDE, Command, Role, Server
from exporter.vocabulary import ProbeKind, ServerKind

COMMAND = Command(
    label="Triton",
    consoles={"tritonserver": None},
    flags={
        Role.MODEL: ("--model-repository", "--model-store"),
        Role.HOST: ("--http-address",),
        Role.PORT: ("--http-port",),
        Role.MODEL_CONTROL: ("--model-control-mode",),
    },
    defaults={Role.HOST: "0.0.0.0", Role.PORT: "8000", Role.MODEL_CONTROL: "none"},
    probe=ProbeKind.HEALTH,
    probe_path="/v2/health/ready",
    # In the default mode every model loads before the ports open, and the model's own ready
    # answer is what its clients wait for; in explicit or poll mode models load on request.
    model_ready_path="/v2/models/{model}/ready",
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
        # Since 2.4x the message is a quoted string. The weights are read when an instance is
        # made (a Python model's initialize(), a backend's session): `loading: NAME:1` comes
        # first, before the backend's own start (1.7 s for a Python stub on 2 cores).
        # An instance is `NAME_G_I` (older `NAME_I`); a model's trailing `_N` is read off both
        # sides alike, so its begin and end name one rank.
        # A model's load begins; after the server is up (explicit or poll mode), a load of its
        # own inside the running server.
        rule(EventKind.LOAD_BEGIN, "loading: ", r'^"?loading: (?P<who>[^:\s"]+):\d+'),
        rule(EventKind.UNLOADED, "successfully unloaded", r"""^"?successfully unloaded '(?P<who>[^']+)'"""),
        rule(EventKind.WEIGHTS_BEGIN, "TRITONBACKEND_ModelInstanceInitialize: ",
             r'^"?TRITONBACKEND_ModelInstanceInitialize: (?P<who>.+?)(?:_\d+)* \('),
        rule(EventKind.WEIGHTS_END, "successfully loaded", r"""^"?successfully loaded '(?P<who>.+?)(?:_\d+)*'"""),
        rule(EventKind.READY, "Started HTTPService", r'^"?Started HTTPService at '),
        rule(EventKind.FATAL, "failed to load", r"""^"?failed to load '(?P<who>[^']+)' version \d+: .+"""),
        rule(EventKind.FATAL, "creating server", r"^error: creating server: .+"),
        *CAUSE_RULES,
    ),
)  # fmt: skip

SERVER = Server(kind=ServerKind.TRITON, commands=(COMMAND,), log=LOG, loads_in_place=True)
