"""llama.cpp (common/arg.cpp): `llama-server`; and llama-cpp-python's server
(server/settings.py): `python -m llama_cpp.server`. Both load one GGUF file (or its split parts).

llama-server's port is open from the start: every path answers 503 `Loading model` until the
model is in, then /health is 200. llama-cpp-python has no /health, but it loads the model before
uvicorn listens, so any answer of /v1/models means ready (a completion would run the model).
Both log to stderr; llama-server stamps each line with the time since it started. In router
mode a llama-server without a model starts one llama-server per model it loads, and forwards
their lines into its own log (`[PORT] ` before each); it says which model it stops.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from exporter.load.events import EventKind
from exporter.servers.logformat import CAUSE, CAUSE_RULES, LogFormat, elapsed_since_start, rule
from exporter.servers.server import Answers, Command, Role, Server
from exporter.vocabulary import ProbeKind, ServerKind

LLAMA_SERVER = Command(
    label="llama.cpp server",
    consoles={"llama-server": None},
    flags={
        Role.MODEL: ("-m", "--model"),
        Role.SERVED: ("-a", "--alias"),
        Role.HOST: ("--host",),
        Role.PORT: ("--port",),
        Role.API_KEY: ("--api-key",),
    },
    env={
        Role.MODEL: ("LLAMA_ARG_MODEL",),
        Role.SERVED: ("LLAMA_ARG_ALIAS",),
        Role.HOST: ("LLAMA_ARG_HOST",),
        Role.PORT: ("LLAMA_ARG_PORT",),
        Role.API_KEY: ("LLAMA_API_KEY",),
    },
    defaults={Role.HOST: "127.0.0.1", Role.PORT: "8080"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
    include=("*.gguf",),
    comma_lists=frozenset({Role.SERVED, Role.API_KEY}),
    model_is="file",
    # Router mode (no model; `--models-dir`, `--models-preset` or the cache) starts a child
    # `llama-server --model FILE --alias NAME --port P` per model it loads (on a request naming
    # it or `POST /models/load`), which answers 503 `Loading model` until it is in.
    router_env="LLAMA_SERVER_ROUTER_PORT",
)

LLAMA_CPP_PYTHON = Command(
    label="llama-cpp-python server",
    modules={"llama_cpp.server": None},
    flags={
        Role.MODEL: ("--model",),
        Role.SERVED: ("--model-alias",),
        Role.HOST: ("--host",),
        Role.PORT: ("--port",),
        Role.API_KEY: ("--api-key",),
        Role.CONFIG: ("--config-file",),
    },
    # pydantic-settings: the field names, case-insensitive.
    env={
        Role.MODEL: ("MODEL", "model"),
        Role.SERVED: ("MODEL_ALIAS", "model_alias"),
        Role.HOST: ("HOST", "host"),
        Role.PORT: ("PORT", "port"),
        Role.API_KEY: ("API_KEY", "api_key"),
        Role.CONFIG: ("CONFIG_FILE",),
    },
    defaults={Role.HOST: "localhost", Role.PORT: "8000"},
    probe=ProbeKind.MODELS,
    probe_path="/v1/models",
    include=("*.gguf",),
    model_is="file",
)

LOG = LogFormat(
    signature=re.compile(
        r"(?:\d+\.\d\d\.\d{3}\.\d{3} [IWEDN] )?(?:build: \d+ \(|llama_model_loader: |load_tensors: "
        r"|llm_load_\w+: |llama_(?:model_load|context|kv_cache|new_context)\w*: |print_info: "
        r"|srv\s+\w+: |gguf_init_from_file)"
    ),
    # llama-server stamps each line with the time since its start (`0.00.007.654 I `): with the
    # process's start time, an exact time whenever the line was read.
    prefix=re.compile(r"(?:(?P<em>\d+)\.(?P<es>\d\d)\.(?P<ems>\d{3})\.(?P<eus>\d{3}) [IWEDN] )?"),
    stamp=None,
    elapsed=elapsed_since_start,
    rules=(
        # llama-server's own line as it opens the GGUF (the only one at its default verbosity
        # since it stamps its lines); llama-cpp-python's first is load_tensors.
        rule(EventKind.WEIGHTS_BEGIN, "load_model: loading model", r"^srv\s+load_model: loading model '"),
        rule(EventKind.WEIGHTS_BEGIN, "load_tensors: ", r"^(?:llm_)?load_tensors: "),
        # Progress: a line of dots that grows while the tensors load and ends at 100 %.
        rule(EventKind.WEIGHTS_PROGRESS, "..", r"^(?P<dots>\.{2,})$"),
        rule(EventKind.WEIGHTS_END, "llama_context: constructing", r"^llama_context: constructing"),
        # At its default verbosity, the first line once the model is in (its file mapped and
        # populated, or read) and its context made; the warm-up run follows.
        rule(EventKind.WEIGHTS_END, "llama threadpool init", r"^(?:cmn\s+)?init: llama threadpool init"),
        rule(EventKind.WEIGHTS_END, "llama_new_context_with_model", r"^llama_new_context_with_model: "),
        rule(EventKind.KV_CACHE, "KV buffer size", r"^llama_kv_cache\w*:\s+\S+ KV buffer size"),
        rule(EventKind.WARMUP_BEGIN, "warming up the model", r"warming up the model"),
        rule(EventKind.READY, "model loaded", r"^(?:srv\s+)?\w+: model loaded$"),
        rule(EventKind.READY, "server is listening on", r"^main: server is listening on "),
        # llama-cpp-python's server: uvicorn starts once the model is in.
        rule(EventKind.READY, "Uvicorn running on", r"Uvicorn running on"),
        # Router mode: it stops a model's server (unloaded on request, evicted for another
        # under --models-max, or at its own exit).
        rule(EventKind.UNLOADED, "stopping model instance", r"^srv\s+\w+: stopping model instance name=(?P<who>\S+)"),
        rule(EventKind.FATAL, "exiting due to model loading error", r"^(?:srv\s+)?\w+: exiting due to model loading error"),
        rule(EventKind.FATAL, "failed to load model", r"^llama_model_load_from_file\w*: failed to load model"),
        *CAUSE_RULES,
        # Its own words for what went wrong, kept as the fatal's cause.
        rule(CAUSE, "error loading model", r"error loading model: "),
        rule(CAUSE, "failed to initialize the context", r"failed to initialize the context: "),
    ),
)  # fmt: skip


def _loading(document: Mapping[str, object]) -> bool:
    """llama-server's 503 while it loads."""
    error = document.get("error")
    return (
        isinstance(error, dict)
        and error.get("type") == "unavailable_error"
        and error.get("message") == "Loading model"
    )


SERVER = Server(
    kind=ServerKind.LLAMACPP,
    loads_in_place=True,  # a router's models come and go while it runs
    commands=(LLAMA_SERVER, LLAMA_CPP_PYTHON),
    log=LOG,
    answers=Answers(
        server_header="llama.cpp",
        owned_by="llamacpp",
        error=_loading,
        body=(b"Loading model", b"unavailable_error"),
    ),
)
