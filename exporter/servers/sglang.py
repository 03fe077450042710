"""SGLang (server_args.py, cli/serve.py): `python -m sglang.launch_server` or `sglang serve`.

Its port stays closed until the scheduler is ready (weights, KV cache, CUDA graphs), then it
answers generations at once. Its status paths do not say so: /health, /ready and /ping say 503
until SGLang's own warm-up request (8 tokens) has been answered, seconds later on a slow host
(5 s on 2 CPU cores), and /health sleeps a second and runs a 1-token generation of its own on
every call while serving. /v1/models answers as soon as HTTP is up, before any generation has
run. So the zero-config probe is what a client does: a 1-token completion of the served name
(which SGLang takes from --served-model-name, else the model path, as discovery does). It costs
a serving instance what /health costs it, one token per probe, and is answered the moment SGLang
serves. Logs to stderr, with `[date time TPn] ` prefixes.
"""

from __future__ import annotations

import re

from exporter.load.events import EventKind
from exporter.servers.logformat import CAUSE_RULES, TQDM, LogFormat, rule, stamp_local
from exporter.servers.server import Answers, Command, Role, Server, whole_number
from exporter.vocabulary import ProbeKind, ServerKind

COMMAND = Command(
    label="SGLang",
    consoles={"sglang": "serve"},
    modules={"sglang.launch_server": None},
    flags={
        Role.MODEL: ("--model-path", "--model"),
        Role.SERVED: ("--served-model-name",),
        Role.HOST: ("--host",),
        Role.PORT: ("--port",),
        Role.API_KEY: ("--api-key",),
        Role.REVISION: ("--revision",),
        Role.CACHE_DIR: ("--download-dir",),
        Role.CONFIG: ("--config",),
        Role.NODE_RANK: ("--node-rank",),
    },
    # entrypoints/engine.py: a node ranked above 0 runs its schedulers and no tokenizer or HTTP
    # server (only a dummy /health that says 200 from the moment its schedulers are ready).
    follower={Role.NODE_RANK: lambda rank: (whole_number(rank) or 0) > 0},  # None: refused
    defaults={Role.HOST: "127.0.0.1", Role.PORT: "30000"},
    probe=ProbeKind.COMPLETION,
    probe_path="/v1/completions",
)

LOG = LogFormat(
    signature=re.compile(r"\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d{3})?(?: [A-Z_]+\d+)*\] "),
    prefix=re.compile(
        r"\[(?P<y>\d{4})-(?P<mo>\d\d)-(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d):(?P<S>\d\d)"
        r"(?:\.(?P<f>\d{3}))?(?: (?P<who>[A-Z_]+\d+(?: [A-Z_]+\d+)*))?\] "
    ),
    stamp=stamp_local,
    rules=(
        rule(EventKind.WEIGHTS_BEGIN, "Load weight begin", r"^Load weight begin\."),
        rule(
            EventKind.WEIGHTS_PROGRESS,
            "checkpoint shards",
            r"Loading (?:safetensors|pt) checkpoint shards" + TQDM,
        ),
        rule(EventKind.WEIGHTS_PROGRESS, "Multi-thread loading", r"Multi-thread loading[^:]*" + TQDM),
        rule(
            EventKind.WEIGHTS_END,
            "Load weight end",
            r"^Load weight end\. (?:elapsed=(?P<seconds>[\d.]+) s, )?",
        ),
        rule(EventKind.KV_CACHE, "KV Cache is allocated", r"^KV Cache is allocated\."),
        rule(
            EventKind.KV_CACHE_TIMED,
            "Engine startup timings",
            r"^Engine startup timings \(s\): .*?\bkv_cache_allocation=(?P<seconds>[\d.]+)",
        ),
        rule(EventKind.COMPILE_BEGIN, "Compiling num tokens", r"Compiling num tokens \("),
        rule(EventKind.COMPILE_BEGIN, "DeepGEMM", r"Entering DeepGEMM JIT Pre-Compile|DeepGEMM warmup"),
        rule(EventKind.CUDA_GRAPH_BEGIN, "graph begin", r"^Capture (?:\S+ ){0,3}(?:cuda|[A-Z]{2,}) graph begin\."),
        rule(
            EventKind.CUDA_GRAPH_PROGRESS,
            "Capturing batches",
            r"Capturing batches \([^)]*\)" + TQDM,
        ),
        rule(
            EventKind.CUDA_GRAPH_END,
            "graph end",
            r"^Capture (?:\S+ ){0,3}(?:cuda|[A-Z]{2,}) graph end\.(?:.*?elapsed[:=] ?(?P<seconds>[\d.]+) s)?",
        ),
        # The port opens and the warm-up request is sent: uvicorn's own lines.
        rule(EventKind.WARMUP_BEGIN, "startup", r"Waiting for application startup\.|Application startup complete\."),
        rule(EventKind.WARMUP_BEGIN, "Uvicorn running", r"Uvicorn running on"),
        rule(EventKind.READY, "fired up", r"The server is fired up and ready to roll!"),
        rule(EventKind.FATAL, "scheduler died", r"^Rank \d+ scheduler died during initialization"),
        rule(EventKind.FATAL, "scheduler is dead", r"^Rank \d+ scheduler is dead"),
        rule(EventKind.FATAL, "Initialization failed", r"^Initialization failed\."),
        *CAUSE_RULES,
    ),
    # A node ranked above 0 (entrypoints/engine.py, read from the source: its CPU engine runs
    # no tensor parallelism here): once its schedulers are ready it starts the /health that
    # answers 200 whatever happens after, and says so.
    node_up=(
        rule(EventKind.NODE_UP, "Dummy health check server started",
             r"^Dummy health check server started"),
    ),
)  # fmt: skip

SERVER = Server(
    kind=ServerKind.SGLANG, commands=(COMMAND,), log=LOG, answers=Answers(owned_by="sglang")
)
