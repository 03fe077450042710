"""What one model server is, as the rows a server module fills in.

A server module (exporter/servers/sglang.py ...) holds one `Server`: the command lines that
start it and how each reads its arguments (`Command`, read by exporter/discovery/serverargs.py),
its log format (`LogFormat`, read by exporter/logs/markers.py) and what its HTTP answers give
away (`Answers`, read by exporter/sources/endpoint.py). The engines know no server by name.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from exporter.servers.logformat import LogFormat
from exporter.vocabulary import ProbeKind

# The files weights are loaded from, unless a server loads others (`weights.include`).
DEFAULT_INCLUDE: tuple[str, ...] = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
# The value of a switch (`Command.switches`) that is given: `--headless`, or `headless: true`.
SWITCH_ON = "true"


def switched_on(value: str) -> bool:
    """Whether a switch's value says it is given."""
    return value == SWITCH_ON


def whole_number(value: str) -> int | None:
    """An argument's whole number, or None where the server would refuse it."""
    try:
        return int(value)
    except ValueError:
        return None


class Role(StrEnum):
    """What an argument means, whatever a server calls it (and `what` in discovery evidence)."""

    MODEL = "model"
    SERVED = "served_model_name"
    HOST = "host"
    PORT = "port"
    API_KEY = "api_key"
    REVISION = "revision"
    CACHE_DIR = "hub_cache"
    CONFIG = "config_file"
    MODEL_CONTROL = "model_control_mode"  # Triton: whether models load at start or on request
    # One node of a model served over several hosts (`Command.follower` reads them):
    HEADLESS = "headless"  # vLLM: start no API server
    API_SERVERS = "api_server_count"  # vLLM: how many API server processes (below 1: none)
    NODE_RANK = "node_rank"  # SGLang: this node's index (0: the head, which serves)


@dataclass(frozen=True)
class Command:
    """One program that starts the server, and how it reads its arguments.

    Recognised only by what sits in the executable, console-script or `python -m` position of
    argv (exporter/discovery/serverargs.py says how). Per role: its flag spellings, environment
    variables and the program's default.
    """

    label: str  # in evidence: "llama.cpp server started as `llama-server`"
    flags: Mapping[Role, tuple[str, ...]]
    probe: ProbeKind  # the readiness probe a discovered server gets
    probe_path: str
    # Executable or console-script name -> the subcommand it needs to serve (None: none).
    consoles: Mapping[str, str | None] = field(default_factory=dict)
    # `python -m MODULE`, or the module's file run as a script -> the subcommand it needs.
    modules: Mapping[str, str | None] = field(default_factory=dict)
    env: Mapping[Role, tuple[str, ...]] = field(default_factory=dict)
    defaults: Mapping[Role, str] = field(default_factory=dict)  # HOST and PORT at least
    include: tuple[str, ...] = DEFAULT_INCLUDE
    # Roles whose value is a comma-separated list of which the server uses the first.
    comma_lists: frozenset[Role] = frozenset()
    # Roles whose flag takes no value (argparse's store_true): given, its value is "true".
    switches: frozenset[Role] = frozenset()
    # A start that runs no API server of its own: one node of a model served over several
    # hosts, whose head serves (a follower, vocabulary.TargetRole). Per role, whether its value
    # says so, as the server's own source decides; any one that does makes it a follower.
    follower: Mapping[Role, Callable[[str], bool]] = field(default_factory=dict)
    # Whether the model argument is a file (GGUF) or a model repository (Triton), not a model.
    model_is: str = "model"
    # `vllm serve MODEL --model X` serves MODEL; `sglang serve MODEL --model-path X` serves X.
    positional_wins: bool = False
    # A repository server's readiness of one model (`{model}`): probed where discovery finds the
    # repository holds one model and the server loads it at start (MODEL_CONTROL is its default).
    model_ready_path: str | None = None
    # The environment variable a router of this command (a server started without a model that
    # starts one child server per model it loads: llama-server's router mode) sets in each
    # child to its own port: such a child is a model server of its own, not a worker.
    router_env: str | None = None


@dataclass(frozen=True)
class Answers:
    """What only this server puts in its HTTP answers, field by field from the strongest
    evidence to the weakest; the prober tries each field across all servers before the next."""

    server_header: str | None = None  # a word of its `Server` header
    owned_by: str | None = None  # `owned_by` of an entry of its /v1/models list
    error: Callable[[Mapping[str, object]], bool] | None = None  # is a JSON object its error?
    headers: frozenset[str] = frozenset()  # response headers (lower case) it sends together
    body: tuple[bytes, ...] = ()  # byte strings that together appear in its bodies


@dataclass(frozen=True)
class Server:
    """Everything one model server is: its name, how it starts, logs and answers."""

    kind: str  # `model_load_target_info{server}`, `log.format`, `discovery.servers`
    commands: tuple[Command, ...]
    log: LogFormat
    answers: Answers = Answers()
    # Loads and unloads models while it runs (Triton's explicit and poll modes, llama-server's
    # router), which only its log announces at once: its log is read every interval even while
    # the target is settled (a pread of nothing new, some microseconds).
    loads_in_place: bool = False

    @property
    def default_port(self) -> int:
        """Where its first command listens unless told otherwise."""
        return int(self.commands[0].defaults[Role.PORT])
