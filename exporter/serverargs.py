"""Which model server a command line starts, and what its own arguments say about it.

Pure functions of argv and environment, so every rule can be tested without a process. A server
is recognised by what sits in the executable, module or console-script position of argv, never
by a substring anywhere: `grep sglang`, `vim launch_server.py` or `python -c "import vllm"` are
not servers. Each server's flag spellings, environment variables and defaults are one row of the
spec table below, read from the servers' own sources (SGLang server_args.py and cli/serve.py,
vLLM cli/serve.py and config/model.py, llama.cpp common/arg.cpp, llama-cpp-python
server/settings.py, TGI launcher/src/main.rs, Triton's command line options).

Precedence, as in the servers themselves: argv, then a `--config` file (vLLM, SGLang; YAML, keys
are flag names), then the environment, then the server's default. `--flag=value` and `--flag
value` both count, the last occurrence wins (argparse and clap), and `_` and `-` in long flags
are the same (vLLM's parser accepts both; llama-cpp-python spells its flags with `_`).

The readiness probe a zero-configuration target gets:

| server           | probe  | path             |
|------------------|--------|------------------|
| SGLang           | health | /health          |
| vLLM             | health | /health          |
| llama.cpp        | health | /health          |
| llama-cpp-python | models | /v1/models       |
| TGI              | health | /health          |
| Triton           | health | /v2/health/ready |

- SGLang keeps its port closed during the weight load, then /health is 503 until the warmup
  request passed and 200 after. /v1/models answers 200 as soon as HTTP is up, so it is no
  readiness signal; a completion needs the served name right and runs a generation on every
  probe of a serving instance.
- vLLM keeps its port closed while loading; /health is 200 once the engine is up and needs
  neither the model name (older vLLM rejects a completion without one) nor the API key (vLLM
  guards /v1 only).
- llama.cpp's port is open from the start: /health is 503 "Loading model" until loaded, then 200.
- llama-cpp-python has no /health, but it loads the model before uvicorn listens, so any answer
  of /v1/models means ready; a completion would run the model.
- TGI opens its port after warmup; /health is 200 when ready.
- Triton keeps its port closed during the initial load; /v2/health/ready is 200 when every model
  is ready and 400 before.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from exporter.config import DEFAULT_INCLUDE, DISCOVERY_SERVERS
from exporter.vocabulary import ProbeKind, ServerKind

# Roles: what an argument means, whatever a server calls it.
MODEL = "model"
SERVED = "served_model_name"
HOST = "host"
PORT = "port"
API_KEY = "api_key"
REVISION = "revision"
CACHE_DIR = "hub_cache"
CONFIG = "config_file"
SECRET = "(secret)"  # what evidence shows instead of an API key

_HELP_FLAGS = frozenset({"-h", "--help", "-V", "--version"})
_PYTHON_RE = re.compile(r"(?:python|pypy)(?:\d+(?:\.\d+)*)?(?:-dbg)?\Z")


@dataclass(frozen=True)
class Evidence:
    """One reason: which argument, config key, environment variable or default gave a value."""

    what: str
    value: str
    source: str


@dataclass(frozen=True)
class ServerSpec:
    """How one server reads its arguments: flag spellings, environment and defaults per role."""

    kind: ServerKind
    label: str
    flags: Mapping[str, tuple[str, ...]]
    probe: ProbeKind
    probe_path: str
    env: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    defaults: Mapping[str, str] = field(default_factory=dict)
    include: tuple[str, ...] = DEFAULT_INCLUDE
    # Roles whose value is a comma-separated list of which the server uses the first.
    comma_lists: frozenset[str] = frozenset()
    # Whether the model argument is a file (GGUF) or a model repository (Triton), not a model.
    model_is: str = "model"
    # `vllm serve MODEL --model X` serves MODEL; `sglang serve MODEL --model-path X` serves X.
    positional_wins: bool = False


SGLANG = ServerSpec(
    kind=ServerKind.SGLANG,
    label="SGLang",
    flags={
        MODEL: ("--model-path", "--model"),
        SERVED: ("--served-model-name",),
        HOST: ("--host",),
        PORT: ("--port",),
        API_KEY: ("--api-key",),
        REVISION: ("--revision",),
        CACHE_DIR: ("--download-dir",),
        CONFIG: ("--config",),
    },
    defaults={HOST: "127.0.0.1", PORT: "30000"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
)
VLLM = ServerSpec(
    kind=ServerKind.VLLM,
    label="vLLM",
    flags={
        MODEL: ("--model",),
        SERVED: ("--served-model-name",),
        HOST: ("--host",),
        PORT: ("--port",),
        API_KEY: ("--api-key",),
        REVISION: ("--revision",),
        CACHE_DIR: ("--download-dir",),
        CONFIG: ("--config",),
    },
    env={API_KEY: ("VLLM_API_KEY",)},
    # host None: uvicorn listens on every interface.
    defaults={HOST: "0.0.0.0", PORT: "8000", MODEL: "Qwen/Qwen3-0.6B"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
    positional_wins=True,
)
LLAMA_SERVER = ServerSpec(
    kind=ServerKind.LLAMACPP,
    label="llama.cpp server",
    flags={
        MODEL: ("-m", "--model"),
        SERVED: ("-a", "--alias"),
        HOST: ("--host",),
        PORT: ("--port",),
        API_KEY: ("--api-key",),
    },
    env={
        MODEL: ("LLAMA_ARG_MODEL",),
        SERVED: ("LLAMA_ARG_ALIAS",),
        HOST: ("LLAMA_ARG_HOST",),
        PORT: ("LLAMA_ARG_PORT",),
        API_KEY: ("LLAMA_API_KEY",),
    },
    defaults={HOST: "127.0.0.1", PORT: "8080"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
    include=("*.gguf",),
    comma_lists=frozenset({SERVED, API_KEY}),
    model_is="file",
)
LLAMA_CPP_PYTHON = ServerSpec(
    kind=ServerKind.LLAMACPP,
    label="llama-cpp-python server",
    flags={
        MODEL: ("--model",),
        SERVED: ("--model-alias",),
        HOST: ("--host",),
        PORT: ("--port",),
        API_KEY: ("--api-key",),
        CONFIG: ("--config-file",),
    },
    # pydantic-settings: the field names, case-insensitive.
    env={
        MODEL: ("MODEL", "model"),
        SERVED: ("MODEL_ALIAS", "model_alias"),
        HOST: ("HOST", "host"),
        PORT: ("PORT", "port"),
        API_KEY: ("API_KEY", "api_key"),
        CONFIG: ("CONFIG_FILE",),
    },
    defaults={HOST: "localhost", PORT: "8000"},
    probe=ProbeKind.MODELS,
    probe_path="/v1/models",
    include=("*.gguf",),
    model_is="file",
)
TGI = ServerSpec(
    kind=ServerKind.TGI,
    label="TGI",
    flags={
        MODEL: ("--model-id",),
        SERVED: ("--served-model-name",),
        HOST: ("--hostname",),
        PORT: ("--port", "-p"),
        API_KEY: ("--api-key",),
        REVISION: ("--revision",),
        CACHE_DIR: ("--huggingface-hub-cache",),
    },
    env={
        MODEL: ("MODEL_ID",),
        SERVED: ("SERVED_MODEL_NAME",),
        HOST: ("HOSTNAME",),
        PORT: ("PORT",),
        API_KEY: ("API_KEY",),
        REVISION: ("REVISION",),
        CACHE_DIR: ("HUGGINGFACE_HUB_CACHE",),
    },
    defaults={HOST: "0.0.0.0", PORT: "3000", MODEL: "bigscience/bloom-560m"},
    probe=ProbeKind.HEALTH,
    probe_path="/health",
)
TRITON = ServerSpec(
    kind=ServerKind.TRITON,
    label="Triton",
    flags={
        MODEL: ("--model-repository", "--model-store"),
        HOST: ("--http-address",),
        PORT: ("--http-port",),
    },
    defaults={HOST: "0.0.0.0", PORT: "8000"},
    probe=ProbeKind.HEALTH,
    probe_path="/v2/health/ready",
    include=(*DEFAULT_INCLUDE, "*.plan", "*.onnx", "*.engine"),
    model_is="repository",
)

# Executable or console-script name -> (spec, required subcommand).
_CONSOLE: Mapping[str, tuple[ServerSpec, str | None]] = {
    "sglang": (SGLANG, "serve"),
    "vllm": (VLLM, "serve"),
    "llama-server": (LLAMA_SERVER, None),
    "text-generation-launcher": (TGI, None),
    "tritonserver": (TRITON, None),
}
# `python -m MODULE` -> (spec, required subcommand).
_MODULES: Mapping[str, tuple[ServerSpec, str | None]] = {
    "sglang.launch_server": (SGLANG, None),
    "vllm.entrypoints.openai.api_server": (VLLM, None),
    "vllm.entrypoints.cli.main": (VLLM, "serve"),
    "llama_cpp.server": (LLAMA_CPP_PYTHON, None),
}


@dataclass(frozen=True)
class Launch:
    """A recognised start: the server, its own arguments, and how it was started."""

    spec: ServerSpec
    args: tuple[str, ...]
    how: str
    positional_model: bool


@dataclass(frozen=True)
class Recognised:
    """What a server's command line, config file and environment say; secrets kept out of repr."""

    spec: ServerSpec = field(repr=False)
    how: str
    port: int
    host: str
    model: str | None
    served_model_name: str | None
    revision: str | None
    hub_cache: str | None
    evidence: tuple[Evidence, ...]
    api_key: str | None = field(default=None, repr=False)

    @property
    def kind(self) -> ServerKind:
        return self.spec.kind


def find_launch(argv: Sequence[str], kinds: Sequence[str] = DISCOVERY_SERVERS) -> Launch | None:
    """The server that argv starts, from its executable, module or console-script position."""
    if not argv:
        return None
    exe = os.path.basename(argv[0])
    if _PYTHON_RE.match(exe):
        target = _python_target(argv)
        if target is None:
            return None
        what, name, start = target
        if what == "module":
            entry = _MODULES.get(name)
            how = f"{exe} -m {name}"
        else:
            entry = _script_entry(name)
            how = f"{exe} {name}"
    else:
        entry, start, how = _CONSOLE.get(exe), 1, exe
    if entry is None:
        return None
    spec, subcommand = entry
    if spec.kind not in kinds:
        return None
    args = tuple(argv[start:])
    if subcommand is not None:
        if not args or args[0] != subcommand:
            return None
        args = args[1:]
        how = f"{how} {subcommand}"
    if any(arg in _HELP_FLAGS for arg in args):
        return None  # `vllm serve --help` prints and exits; it never serves
    return Launch(spec, args, how, positional_model=subcommand is not None)


def _python_target(argv: Sequence[str]) -> tuple[str, str, int] | None:
    """('module', name, next index) or ('script', path, next index); None for -c, stdin, REPL.

    Walks the interpreter's own options the way CPython does: single-letter flags may be
    combined (`-um sglang.launch_server`), and -W / -X take a value, attached or separate.
    """
    i = 1
    while i < len(argv):
        arg = argv[i]
        if arg == "--check-hash-based-pycs":
            i += 2
            continue
        if arg == "--":
            return ("script", argv[i + 1], i + 2) if i + 1 < len(argv) else None
        if arg.startswith("--") or arg == "-":
            return None  # --help, --version, or a program on stdin
        if not arg.startswith("-"):
            return ("script", arg, i + 1)
        for j in range(1, len(arg)):
            letter = arg[j]
            if letter in "WX":
                if j == len(arg) - 1:
                    i += 1  # the value is the next argument
                break
            if letter == "c":
                return None
            if letter == "m":
                if j < len(arg) - 1:
                    return ("module", arg[j + 1 :], i + 1)
                return ("module", argv[i + 1], i + 2) if i + 1 < len(argv) else None
        i += 1
    return None


def _script_entry(path: str) -> tuple[ServerSpec, str | None] | None:
    """A script run by the interpreter: a console script (via its #! line) or a module's file."""
    entry = _CONSOLE.get(os.path.basename(path))
    if entry is not None:
        return entry
    for module, module_entry in _MODULES.items():
        suffix = module.replace(".", "/") + ".py"
        if path == suffix or path.endswith("/" + suffix):
            return module_entry
    return None


def _normal_flag(name: str) -> str:
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _scan_flags(args: Sequence[str], spec: ServerSpec) -> dict[str, tuple[str, str]]:
    """role -> (value, flag as written), for the last occurrence of each role's flags."""
    wanted = {_normal_flag(flag): role for role, flags in spec.flags.items() for flag in flags}
    found: dict[str, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("-") and len(arg) > 1:
            name, eq, value = arg.partition("=")
            role = wanted.get(_normal_flag(name))
            if role is not None:
                if not eq:
                    if i + 1 >= len(args) or args[i + 1].startswith("--"):
                        i += 1
                        continue
                    value = args[i + 1]
                    i += 1
                found[role] = (value, name)
        i += 1
    return found


def _config_values(document: Mapping[str, object], spec: ServerSpec) -> dict[str, tuple[str, str]]:
    """role -> (value, key) from a vLLM / SGLang YAML config: keys are flag names without --."""
    wanted = {_normal_flag(flag): role for role, flags in spec.flags.items() for flag in flags}
    found: dict[str, tuple[str, str]] = {}
    for key, value in document.items():
        role = wanted.get(_normal_flag(f"--{key}"))
        if isinstance(value, list):
            value = value[0] if value else None
        if role is None or role == CONFIG or value is None or isinstance(value, bool | dict):
            continue
        found[role] = (str(value), str(key))
    return found


def recognise(
    argv: Sequence[str],
    environ: Mapping[str, str] | None = None,
    kinds: Sequence[str] = DISCOVERY_SERVERS,
    read_config: Callable[[str], Mapping[str, object] | None] | None = None,
) -> Recognised | None:
    """The server argv starts and where it listens, what it serves, and why we think so.

    `environ` is the process's own environment (None when it cannot be read); `read_config`
    loads a `--config` file as the process would see it (None when unreadable).
    """
    launch = find_launch(argv, kinds)
    if launch is None:
        return None
    spec = launch.spec
    evidence = [Evidence("server", str(spec.kind), f"{spec.label} started as `{launch.how}`")]
    values: dict[str, str] = {}

    def take(role: str, value: str, source: str) -> None:
        if role in spec.comma_lists:
            value = value.split(",")[0].strip()
        values[role] = value
        shown = SECRET if role == API_KEY else value
        evidence.append(Evidence(role, shown, source))

    found = {
        role: (value, f"argument {flag}")
        for role, (value, flag) in _scan_flags(launch.args, spec).items()
    }
    first = launch.args[0] if launch.args else ""
    positional = launch.positional_model and first and not first.startswith("-")
    if positional and (spec.positional_wins or MODEL not in found):
        found[MODEL] = (first, f"positional argument after `{launch.how}`")
    for role, (value, source) in found.items():
        take(role, value, source)
    config_file = values.get(CONFIG) or _from_env(CONFIG, spec, environ)
    if config_file and read_config is not None:
        document = read_config(config_file)
        if document is None:
            evidence.append(Evidence(CONFIG, config_file, "not readable; its settings unknown"))
        else:
            for role, (value, key) in _config_values(document, spec).items():
                if role not in values:
                    take(role, value, f"config file {config_file}, key {key}")
    if environ is not None:
        for role, names in spec.env.items():
            if role in values:
                continue
            for name in names:
                if environ.get(name):
                    take(role, environ[name], f"environment {name}")
                    break
    for role, value in spec.defaults.items():
        if role in values:
            continue
        if role == MODEL and config_file:
            continue  # the model may be in a config file we could not read: do not guess
        take(role, value, f"default of {spec.label}")
    try:
        port = int(values[PORT])
    except ValueError:
        return None  # the server would refuse this port too
    if not 0 < port < 65536:
        return None
    return Recognised(
        spec=spec,
        how=launch.how,
        port=port,
        host=values[HOST],
        model=values.get(MODEL),
        served_model_name=values.get(SERVED),
        revision=values.get(REVISION),
        hub_cache=values.get(CACHE_DIR),
        evidence=tuple(evidence),
        api_key=values.get(API_KEY),
    )


def _from_env(role: str, spec: ServerSpec, environ: Mapping[str, str] | None) -> str | None:
    if environ is None:
        return None
    for name in spec.env.get(role, ()):
        if environ.get(name):
            return environ[name]
    return None
