"""Which model server a command line starts, and what its own arguments say about it.

Pure functions of argv and environment, so every rule can be tested without a process. A server
is recognised by what sits in the executable, module or console-script position of argv, never
by a substring anywhere: `grep sglang`, `vim launch_server.py` or `python -c "import vllm"` are
not servers. Each server's names, flag spellings, environment variables and defaults are the
`Command` rows of its module in exporter/servers/, read from the servers' own sources.

Precedence, as in the servers themselves: argv, then a `--config` file (vLLM, SGLang; YAML, keys
are flag names), then the environment, then the server's default. `--flag=value` and `--flag
value` both count, the last occurrence wins (argparse and clap), and `_` and `-` in long flags
are the same (vLLM's parser accepts both; llama-cpp-python spells its flags with `_`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from exporter.config.schema import DISCOVERY_SERVERS
from exporter.servers import SERVERS
from exporter.servers.server import SWITCH_ON, Command, Role, Server

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
class Launch:
    """A recognised start: the server, the command, its own arguments, and how it was started."""

    server: Server
    command: Command
    args: tuple[str, ...]
    how: str
    positional_model: bool

    @property
    def kind(self) -> str:
        return self.server.kind


@dataclass(frozen=True)
class Recognised:
    """What a server's command line, config file and environment say; secrets kept out of repr."""

    server: Server = field(repr=False)
    command: Command = field(repr=False)
    how: str
    port: int
    host: str
    model: str | None
    served_model_name: str | None
    revision: str | None
    hub_cache: str | None
    evidence: tuple[Evidence, ...]
    api_key: str | None = field(default=None, repr=False)
    model_control: str | None = None
    follower: bool = False  # it runs no API server: one node of a model over several hosts

    @property
    def kind(self) -> str:
        return self.server.kind


# A server, the command of it that a name starts, and the subcommand that command needs.
_Entry = tuple[Server, Command, str | None]


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
            entry = _module_entry(lambda module: module == name)
            how = f"{exe} -m {name}"
        else:
            entry = _script_entry(name)
            how = f"{exe} {name}"
    else:
        entry, start, how = _console_entry(exe), 1, exe
    if entry is None:
        return None
    server, command, subcommand = entry
    if server.kind not in kinds:
        return None
    args = tuple(argv[start:])
    if subcommand is not None:
        if not args or args[0] != subcommand:
            return None
        args = args[1:]
        how = f"{how} {subcommand}"
    if any(arg in _HELP_FLAGS for arg in args):
        return None  # `vllm serve --help` prints and exits; it never serves
    return Launch(server, command, args, how, positional_model=subcommand is not None)


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


def _console_entry(name: str) -> _Entry | None:
    """The command an executable or console script of this name is."""
    for server in SERVERS.values():
        for command in server.commands:
            if name in command.consoles:
                return server, command, command.consoles[name]
    return None


def _module_entry(matches: Callable[[str], bool]) -> _Entry | None:
    """The command whose module `matches`."""
    for server in SERVERS.values():
        for command in server.commands:
            for module, subcommand in command.modules.items():
                if matches(module):
                    return server, command, subcommand
    return None


def _script_entry(path: str) -> _Entry | None:
    """A script run by the interpreter: a console script (via its #! line) or a module's file."""
    entry = _console_entry(os.path.basename(path))
    if entry is not None:
        return entry

    def is_file_of(module: str) -> bool:
        suffix = module.replace(".", "/") + ".py"
        return path == suffix or path.endswith("/" + suffix)

    return _module_entry(is_file_of)


def _normal_flag(name: str) -> str:
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def _flag_roles(command: Command) -> dict[str, Role]:
    """Flag (normalised) -> role."""
    return {_normal_flag(flag): role for role, flags in command.flags.items() for flag in flags}


def _scan_flags(args: Sequence[str], command: Command) -> dict[Role, tuple[str, str]]:
    """role -> (value, flag as written), for the last occurrence of each role's flags."""
    wanted = _flag_roles(command)
    found: dict[Role, tuple[str, str]] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            break
        if arg.startswith("-") and len(arg) > 1:
            name, eq, value = arg.partition("=")
            role = wanted.get(_normal_flag(name))
            if role in command.switches:
                if not eq:  # a switch takes no value; `--headless=x` is refused by argparse
                    found[role] = (SWITCH_ON, name)
            elif role is not None:
                if not eq:
                    if i + 1 >= len(args) or args[i + 1].startswith("--"):
                        i += 1
                        continue
                    value = args[i + 1]
                    i += 1
                found[role] = (value, name)
        i += 1
    return found


def _config_values(document: Mapping[str, object], command: Command) -> dict[Role, tuple[str, str]]:
    """role -> (value, key) from a vLLM / SGLang YAML config: keys are flag names without --."""
    wanted = _flag_roles(command)
    found: dict[Role, tuple[str, str]] = {}
    for key, value in document.items():
        role = wanted.get(_normal_flag(f"--{key}"))
        if isinstance(value, list):
            value = value[0] if value else None
        if role in command.switches and isinstance(value, bool):
            value = SWITCH_ON if value else None  # `headless: false` is a switch not given
        if role is None or role == Role.CONFIG or value is None or isinstance(value, bool | dict):
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
    command = launch.command
    evidence = [Evidence("server", str(launch.kind), f"{command.label} started as `{launch.how}`")]
    values: dict[Role, str] = {}

    def take(role: Role, value: str, source: str) -> None:
        if role in command.comma_lists:
            value = value.split(",")[0].strip()
        values[role] = value
        shown = SECRET if role == Role.API_KEY else value
        evidence.append(Evidence(role, shown, source))

    found = {
        role: (value, f"argument {flag}")
        for role, (value, flag) in _scan_flags(launch.args, command).items()
    }
    first = launch.args[0] if launch.args else ""
    positional = launch.positional_model and first and not first.startswith("-")
    if positional and (command.positional_wins or Role.MODEL not in found):
        found[Role.MODEL] = (first, f"positional argument after `{launch.how}`")
    for role, (value, source) in found.items():
        take(role, value, source)
    config_file = values.get(Role.CONFIG) or _from_env(Role.CONFIG, command, environ)
    if config_file and read_config is not None:
        document = read_config(config_file)
        if document is None:
            unread = "not readable; its settings unknown"
            evidence.append(Evidence(Role.CONFIG, config_file, unread))
        else:
            for role, (value, key) in _config_values(document, command).items():
                if role not in values:
                    take(role, value, f"config file {config_file}, key {key}")
    if environ is not None:
        for role, names in command.env.items():
            if role in values:
                continue
            for name in names:
                if environ.get(name):
                    take(role, environ[name], f"environment {name}")
                    break
    for role, value in command.defaults.items():
        if role in values:
            continue
        if role == Role.MODEL and config_file:
            continue  # the model may be in a config file we could not read: do not guess
        take(role, value, f"default of {command.label}")
    try:
        port = int(values[Role.PORT])
    except ValueError:
        return None  # the server would refuse this port too
    if not 0 < port < 65536:
        return None
    said = next((role for role, says in command.follower.items()
                 if role in values and says(values[role])), None)  # fmt: skip
    if said is not None:
        why = f"{said}={values[said]}: it runs no API server, its model's head node serves"
        evidence.append(Evidence("role", "follower", why))
    return Recognised(
        server=launch.server,
        command=command,
        how=launch.how,
        port=port,
        host=values[Role.HOST],
        model=values.get(Role.MODEL),
        served_model_name=values.get(Role.SERVED),
        revision=values.get(Role.REVISION),
        hub_cache=values.get(Role.CACHE_DIR),
        evidence=tuple(evidence),
        api_key=values.get(Role.API_KEY),
        model_control=values.get(Role.MODEL_CONTROL),
        follower=said is not None,
    )


def _from_env(role: Role, command: Command, environ: Mapping[str, str] | None) -> str | None:
    if environ is None:
        return None
    for name in command.env.get(role, ()):
        if environ.get(name):
            return environ[name]
    return None
