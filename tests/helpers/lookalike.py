"""A process that looks like a model server and writes a captured real log as it goes.

`install(root)` writes a `vllm` console script; started as `vllm serve MODEL ...` it has the
command line the real server would have (so discovery reads it as the real one), and it writes
the lines of the log `LOOKALIKE_LOG` names to its stdout at the pace of their own stamps,
`LOOKALIKE_SPEED` times faster, after `LOOKALIKE_IMPORTS` seconds of silence (a server's
imports), each stamp rewritten to the moment it is written. Between the log's weights-begin and
weights-end lines it reads every safetensors file of MODEL and holds them open (a second at
least, whatever the speed), as the real worker does. It stops after the first line matching
`LOOKALIKE_UNTIL` (a regex) and then sits quiet until signalled, as a server does once it
started; `LOOKALIKE_MARKS` receives, as JSON, the time each line matching a `LOOKALIKE_MARK_*`
regex was written. With `--port P` it listens there and appends to `LOOKALIKE_ACCEPTED` the pid
of each process that connected: a test can show that no probe came from the exporter it runs
(others on the host may probe anything).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SCRIPT = r'''
import json, os, re, signal, socket, sys, threading, time
from pathlib import Path

STAMP = re.compile(r"\b(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d)\b")
args = sys.argv[1:]
assert args.pop(0) == "serve"
model = Path(args[0])
port = int(args[args.index("--port") + 1]) if "--port" in args else None
if port is not None:
    listener = socket.create_server(("127.0.0.1", port))

    def connecting_pid(peer_port: int) -> str:
        """The process holding the connecting socket (a host runs other exporters that may
        probe anything that looks like a server): its inode in /proc/net/tcp, then its fd."""
        inode = None
        for row in Path("/proc/net/tcp").read_text().splitlines()[1:]:
            fields = row.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == peer_port and fields[9] != "0":
                inode = fields[9]
        for fd in Path("/proc").glob("[0-9]*/fd/*"):
            try:
                if inode and os.readlink(fd) == f"socket:[{inode}]":
                    return fd.parts[2]
            except OSError:
                continue
        return "?"

    def accept() -> None:
        while True:
            conn, (_, peer_port) = listener.accept()
            pid = connecting_pid(peer_port)
            with open(os.environ["LOOKALIKE_ACCEPTED"], "a") as out:
                out.write(pid + "\n")
            conn.close()

    threading.Thread(target=accept, daemon=True).start()

time.sleep(float(os.environ.get("LOOKALIKE_IMPORTS", "0")))  # before a server's first line
speed = float(os.environ.get("LOOKALIKE_SPEED", "1"))
HOLD = 1.0  # seconds the weight files stay open at least
until = re.compile(os.environ["LOOKALIKE_UNTIL"])
marks = {key[len("LOOKALIKE_MARK_"):].lower(): re.compile(value)
         for key, value in os.environ.items() if key.startswith("LOOKALIKE_MARK_")}
written: dict[str, float] = {}
began = time.time()
first = None
for line in Path(os.environ["LOOKALIKE_LOG"]).read_text().splitlines(keepends=True):
    stamp = STAMP.search(line[:80])
    if stamp is not None:
        h, m, s = (int(stamp.group(i)) for i in (3, 4, 5))
        at = h * 3600 + m * 60 + s
        first = at if first is None else first
        delay = began + (at - first) / speed - time.time()
        if delay > 0:
            time.sleep(delay)
        line = line[: stamp.start()] + time.strftime("%m-%d %H:%M:%S") + line[stamp.end():]
    sys.stdout.write(line)
    sys.stdout.flush()
    for name, pattern in marks.items():
        if name not in written and pattern.search(line):
            written[name] = time.time()
    if "Starting to load model" in line:
        held = [open(shard, "rb") for shard in sorted(model.glob("*.safetensors"))]
        for f in held:
            while f.read(1 << 20):
                pass
        opened = time.monotonic()
    if "Loading weights took" in line:
        # As vLLM's loader holds its shards' mappings until it is done: long enough for the
        # exporter's file view (a few looks a second) to see them held.
        time.sleep(max(0.0, HOLD - (time.monotonic() - opened)))
        for f in held:
            f.close()
    if until.search(line):
        break
Path(os.environ["LOOKALIKE_MARKS"]).write_text(json.dumps(written))
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
while True:
    signal.pause()
'''


def install(root: Path) -> Path:
    """Write the `vllm` look-alike under root/bin; returns its path."""
    path = root / "bin" / "vllm"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!{sys.executable}\n{SCRIPT}")
    os.chmod(path, 0o755)
    return path
