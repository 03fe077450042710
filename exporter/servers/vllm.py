"""vLLM (cli/serve.py, config/model.py): `vllm serve`, or `python -m` its entrypoints.

Its port stays closed while loading (bound, not listening: probes are refused); /health is 200
once the engine is up and needs neither the model name (older vLLM rejects a completion without
one) nor the API key (vLLM guards /v1 only). Logs to stdout with `(Proc pid=N) LEVEL MM-DD
HH:MM:SS [file.py:line] ` prefixes; tqdm bars go to stderr, unprefixed.
"""

from __future__ import annotations

import re

from exporter.load.events import EventKind
from exporter.servers.logformat import CAUSE_RULES, TQDM, LogFormat, rule, stamp_local_no_year
from exporter.servers.server import Answers, Command, Role, Server, switched_on, whole_number
from exporter.vocabulary import ProbeKind, ServerKind


def _below(number: int | None, limit: int) -> bool:
    return number is not None and number < limit


COMMAND = Command(
    label="vLLM",
    consoles={"vllm": "serve"},
    modules={"vllm.entrypoints.openai.api_server": None, "vllm.entrypoints.cli.main": "serve"},
    flags={
        Role.MODEL: ("--model",),
        Role.SERVED: ("--served-model-name",),
        Role.HOST: ("--host",),
        Role.PORT: ("--port",),
        Role.API_KEY: ("--api-key",),
        Role.REVISION: ("--revision",),
        Role.CACHE_DIR: ("--download-dir",),
        Role.CONFIG: ("--config",),
        Role.HEADLESS: ("--headless",),
        Role.API_SERVERS: ("--api-server-count", "-asc"),
    },
    switches=frozenset({Role.HEADLESS}),
    # cli/serve.py: `--headless`, or fewer than one API server, runs `run_headless`: a node of a
    # model over several hosts (its workers, `--node-rank` above 0) or data-parallel engines
    # (`--data-parallel-start-rank`), whose API server runs on the head. `--node-rank` alone
    # still starts an API server.
    follower={
        Role.HEADLESS: switched_on,
        Role.API_SERVERS: lambda count: _below(whole_number(count), 1),
    },
    env={Role.API_KEY: ("VLLM_API_KEY",)},
    # host None: uvicorn listens on every interface.
    defaults={Role.HOST: "0.0.0.0", Role.PORT: "8000", Role.MODEL: "Qwen/Qwen3-0.6B"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
    positional_wins=True,
)

LOG = LogFormat(
    signature=re.compile(
        r"(?:\([^()]*? pid=\d+\) (?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d )?"
        r"|(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d )"
    ),
    prefix=re.compile(
        r"(?:\((?P<who>[^()]*?) pid=\d+\) )?"
        r"(?:(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) (?P<mo>\d\d)-(?P<d>\d\d) (?P<H>\d\d):(?P<M>\d\d)"
        r":(?P<S>\d\d)(?:\.(?P<f>\d+))? (?:\[[^\]]*\] |[\w.]+:\d+\] ))?"
    ),
    stamp=stamp_local_no_year,
    rules=(
        rule(EventKind.WEIGHTS_BEGIN, "Starting to load model", r"^Starting to load model "),
        rule(EventKind.WEIGHTS_BEGIN, "Loading model from scratch", r"^Loading model from scratch"),
        rule(
            EventKind.WEIGHTS_PROGRESS,
            "checkpoint shards",
            r"Loading (?:safetensors|pt) checkpoint shards(?: \(eager\))?" + TQDM,
        ),
        rule(EventKind.WEIGHTS_END, "Loading weights took", r"^Loading weights took (?P<seconds>[\d.]+) s"),
        rule(EventKind.WEIGHTS_END, "Model loading took", r"^Model loading took [\d.]+ GiB(?: memory)? and (?P<seconds>[\d.]+) s"),
        rule(EventKind.WEIGHTS_END, "Loading model weights took", r"^Loading model weights took [\d.]+ GB"),
        rule(EventKind.COMPILE_BEGIN, "Starting torch.compile", r"^Starting torch\.compile"),
        # The CPU runner (0.32): compile and the profiling run, then dummy runs until "Warming up
        # done." and the KV cache.
        rule(EventKind.COMPILE_BEGIN, "Warming up model for the compilation", r"^Warming up model for the compilation"),
        rule(EventKind.WARMUP_BEGIN, "Initial profiling/warmup run took", r"^(?:\[\w+\] )?Initial profiling/warmup run took [\d.]+ s"),
        rule(EventKind.COMPILE_BEGIN, "torch.compile", r"^Using cache directory: .* for vLLM's torch\.compile"),
        rule(EventKind.COMPILE_BEGIN, "Dynamo bytecode transform", r"^Dynamo bytecode transform time: "),
        rule(
            EventKind.COMPILE_END,
            "torch.compile t",
            r"^torch\.compile (?:and initial profiling/warmup run together )?(?:took|takes) (?P<seconds>[\d.]+) s in total",
        ),
        rule(EventKind.KV_CACHE, "Available KV cache memory", r"^Available KV cache memory: "),
        rule(EventKind.KV_CACHE, "KV cache size", r"KV cache size: [\d,]+ tokens"),
        # 0.6: "# GPU blocks: N"; 0.7 and later name the device: "# cuda blocks: N".
        rule(EventKind.KV_CACHE, " blocks: ", r"^# \w+ blocks: \d+"),
        rule(EventKind.CUDA_GRAPH_BEGIN, "Capturing cudagraphs", r"^Capturing cudagraphs for decoding"),
        rule(EventKind.CUDA_GRAPH_BEGIN, "Capturing the model for CUDA graphs", r"^Capturing the model for CUDA graphs"),
        rule(EventKind.CUDA_GRAPH_PROGRESS, "Capturing CUDA graph", r"Capturing CUDA graph(?:s| shapes)[^:]*" + TQDM),
        rule(
            EventKind.CUDA_GRAPH_END,
            "Graph capturing finished",
            r"^Graph capturing finished in (?P<seconds>[\d.]+) secs?",
        ),
        rule(EventKind.READY, "Application startup complete", r"Application startup complete\."),
        rule(EventKind.FATAL, "Engine core initialization failed", r"^\w*Error: Engine core initialization failed"),
        rule(EventKind.FATAL, "Engine process failed to start", r"^\w*Error: Engine process failed to start"),
        # 0.32's executor, the moment a worker (a tensor-parallel rank) dies before the engine is
        # up, or the engine stops while loading: the load will not finish. vLLM then waits 5 s
        # and 4 s for the other ranks before "Engine core initialization failed" (14 s after a
        # rank's SIGKILL here); after ready the line is a shutdown's, no part of any load.
        rule(EventKind.FATAL, "waiting for worker exit", r"^\[shutdown\] Executor: waiting for worker exit"),
        *CAUSE_RULES,
    ),
    # A follower node's worker (`--headless`): no engine summary or API server lines follow
    # its own last step. On CPU (0.32, observed over two hosts) that is its KV cache's size,
    # after its warm-up: cpu_worker.py's determine_available_memory; on GPUs (read from the
    # source, not run here) the CUDA graphs it captures last, which each node's first local
    # worker reports (`info_once`). An eager GPU worker (`--enforce-eager`) reports no end.
    node_up=(
        rule(EventKind.NODE_UP, "GiB for KV cache on node",
             r"^(?:Explicitly|Auto) set \([\d./]+\) GiB for KV cache on node"),
        rule(EventKind.NODE_UP, "Graph capturing finished", r"^Graph capturing finished in "),
    ),
)  # fmt: skip

SERVER = Server(
    kind=ServerKind.VLLM, commands=(COMMAND,), log=LOG, answers=Answers(owned_by="vllm")
)
