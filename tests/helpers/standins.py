"""Stand-ins for real model servers: their real command lines, the simulator underneath.

`install(root)` writes packages and console scripts whose names are the servers' own
(`sglang/launch_server.py`, `vllm/entrypoints/openai/api_server.py`, a `vllm` script, ...), so a
process started through them has exactly the command line the real server would have. Each one
parses its server's flags the way that server does (deliberately apart from
exporter/discovery/serverargs.py, so the two can disagree and a test catch it), then runs
`python -m exporter simulate` as its child on that port and those weights, forwarding signals.

`STANDIN_SIM_ARGS` adds simulator flags (speed); `STANDIN_FORK_WORKERS=N` forks N children that
keep the parent's command line, like multiprocessing workers started with fork.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

RUNNER = r'''
"""Run the model-load-exporter simulator under a model server's own command line."""
import os
import shlex
import signal
import subprocess
import sys

# kind -> (flag -> what), env fallbacks, defaults, simulator log format, port style
SERVERS = {
    "sglang": ({"--model-path": "model", "--model": "model", "--port": "port", "--host": "host",
                "--served-model-name": "served"}, {}, {"host": "127.0.0.1", "port": "30000"},
               "sglang", "closed"),
    "vllm": ({"--model": "model", "--port": "port", "--host": "host",
              "--served-model-name": "served"}, {}, {"host": "0.0.0.0", "port": "8000"},
             "vllm", "closed"),
    "llama-server": ({"-m": "model", "--model": "model", "--port": "port", "--host": "host",
                      "-a": "served", "--alias": "served"},
                     {"model": "LLAMA_ARG_MODEL", "port": "LLAMA_ARG_PORT",
                      "host": "LLAMA_ARG_HOST"},
                     {"host": "127.0.0.1", "port": "8080"}, "llamacpp", "503"),
    "llama_cpp.server": ({"--model": "model", "--port": "port", "--host": "host",
                          "--model_alias": "served"}, {"port": "PORT", "host": "HOST"},
                         {"host": "localhost", "port": "8000"}, "llamacpp", "closed"),
    "tgi": ({"--model-id": "model", "--port": "port", "-p": "port", "--hostname": "host",
             "--served-model-name": "served"}, {"port": "PORT"},
            {"host": "0.0.0.0", "port": "3000"}, "tgi", "closed"),
    "triton": ({"--model-repository": "model", "--model-store": "model", "--http-port": "port",
                "--http-address": "host"}, {}, {"host": "0.0.0.0", "port": "8000"},
               "tgi", "closed"),
}


def parse(kind, args, positional):
    flags, env, defaults, _, _ = SERVERS[kind]
    values = {}
    if positional and args and not args[0].startswith("-"):
        values["model"] = args[0]
    i = 0
    while i < len(args):
        name, eq, value = args[i].partition("=")
        what = flags.get(name if not name.startswith("--") else name.replace("_", "-"))
        what = what or flags.get(name)
        if what is not None:
            if not eq:
                i += 1
                value = args[i]
            if what != "model" or not (positional and kind == "vllm" and "model" in values):
                values[what] = value
        i += 1
    for what, var in env.items():
        if what not in values and os.environ.get(var):
            values[what] = os.environ[var]
    for what, value in defaults.items():
        values.setdefault(what, value)
    return values


def weights_dir(model):
    """The directory of safetensors the simulator reads, found the way the server would."""
    if os.path.isfile(model):
        return os.path.dirname(os.path.abspath(model))
    if os.path.isdir(model):
        return model
    home = os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface"))
    repo = os.path.join(home, "hub", "models--" + model.replace("/", "--"))
    with open(os.path.join(repo, "refs", "main")) as f:
        return os.path.join(repo, "snapshots", f.read().strip())


def fork_workers(count):
    """Children that keep this command line, like multiprocessing fork workers."""
    for _ in range(count):
        read_end, write_end = os.pipe()
        if os.fork() == 0:
            os.close(write_end)
            os.read(read_end, 1)  # returns at EOF: when the parent is gone
            os._exit(0)
        os.close(read_end)


def run(kind, positional=False):
    args = sys.argv[1:]
    values = parse(kind, args, positional)
    _, _, _, log_format, port_style = SERVERS[kind]
    fork_workers(int(os.environ.get("STANDIN_FORK_WORKERS", "0")))
    command = [
        sys.executable, "-m", "exporter", "simulate",
        "--host", values["host"], "--port", values["port"],
        "--weights", weights_dir(values["model"]),
        "--log-format", log_format, "--port-style", port_style,
        "--model", values.get("served") or values["model"],
        *shlex.split(os.environ.get("STANDIN_SIM_ARGS", "")),
    ]
    child = subprocess.Popen(command)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    sys.exit(child.wait())
'''

# Path under the stand-in root -> Python source (console scripts get a #! line and +x).
MODULES = {
    "sglang/__init__.py": "",
    "sglang/launch_server.py": "import standin_runner\nstandin_runner.run('sglang')\n",
    "vllm/__init__.py": "",
    "vllm/entrypoints/__init__.py": "",
    "vllm/entrypoints/openai/__init__.py": "",
    "vllm/entrypoints/openai/api_server.py": "import standin_runner\nstandin_runner.run('vllm')\n",
    "llama_cpp/__init__.py": "",
    "llama_cpp/server/__init__.py": "",
    "llama_cpp/server/__main__.py": (
        "import standin_runner\nstandin_runner.run('llama_cpp.server')\n"
    ),
}
SCRIPTS = {
    "sglang": "import sys, standin_runner\nassert sys.argv.pop(1) == 'serve'\n"
    "standin_runner.run('sglang', positional=True)\n",
    "vllm": "import sys, standin_runner\nassert sys.argv.pop(1) == 'serve'\n"
    "standin_runner.run('vllm', positional=True)\n",
    "llama-server": "import standin_runner\nstandin_runner.run('llama-server')\n",
    "text-generation-launcher": "import standin_runner\nstandin_runner.run('tgi')\n",
    "tritonserver": "import standin_runner\nstandin_runner.run('triton')\n",
}


def install(root: Path) -> tuple[Path, Path]:
    """Write the stand-ins under root; returns (dir for PYTHONPATH, dir for PATH)."""
    packages, scripts = root / "site", root / "bin"
    for relative, source in {"standin_runner.py": RUNNER, **MODULES}.items():
        path = packages / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    scripts.mkdir(parents=True, exist_ok=True)
    for name, source in SCRIPTS.items():
        path = scripts / name
        path.write_text(f"#!{sys.executable}\n{source}")
        os.chmod(path, 0o755)
    return packages, scripts
