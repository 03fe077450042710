"""Container runtimes' log files as the runtimes write them, for tests with no runtime installed.

`docker_record` and `cri_record` are one record of Docker's json-file driver and of the CRI format
the kubelet keeps under /var/log/pods (containerd and CRI-O write it). `LogShim` does what
dockerd or containerd-shim does with a container's output: it reads the process's stdout and
stderr pipes and appends each line to the log file as a record stamped when it was read, a line
longer than 16 KiB split over several records, a line without its `\\n` held until it ends.
Run as a script, it is that shim in a process of its own (`main`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

LINE_LIMIT = 16 * 1024  # Docker's and containerd's buffer: longer lines become partial records
# Between a crashed process's last line and its restart: Docker waits 100 ms, then the runtime
# starts the process; long enough for the reader's skew, well inside the tracker's.
RESTART_DELAY = 0.5


def rfc3339nano(when: float, offset_minutes: int = 0) -> str:
    """Go's time.RFC3339Nano, as both runtimes format: trailing zeros of the fraction dropped."""
    nanos = round(when * 1e9)
    seconds, fraction = divmod(nanos + offset_minutes * 60 * 10**9, 10**9)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
    digits = f".{fraction:09d}".rstrip("0").rstrip(".")
    if offset_minutes == 0:
        return f"{stamp}{digits}Z"
    sign = "+" if offset_minutes > 0 else "-"
    hours, minutes = divmod(abs(offset_minutes), 60)
    return f"{stamp}{digits}{sign}{hours:02d}:{minutes:02d}"


def docker_record(text: bytes, stream: str, when: float) -> bytes:
    """One json-file line; `text` ends with `\\n` unless it is a split line's part."""
    log = text.decode("utf-8", "replace")
    entry = {"log": log, "stream": stream, "time": rfc3339nano(when)}
    return (json.dumps(entry, separators=(",", ":")) + "\n").encode()


def cri_record(text: bytes, stream: str, when: float) -> bytes:
    """One CRI line: `F` with the line's text (its `\\n` dropped), `P` for a part of one."""
    full = text.endswith(b"\n")
    body = text[:-1] if full else text
    return f"{rfc3339nano(when)} {stream} {'F' if full else 'P'} ".encode() + body + b"\n"


Record = Callable[[bytes, str, float], bytes]
RECORDS: dict[str, Record] = {"docker": docker_record, "cri": cri_record}


class LogShim:
    """Runs `command` with its stdout and stderr on pipes, written to `log` as `record`s."""

    def __init__(self, command: Sequence[str], log: Path, record: Record) -> None:
        self._record = record
        self._lock = threading.Lock()
        self._out = open(log, "ab", buffering=0)  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen(
            list(command), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self._pumps = [
            threading.Thread(target=self._pump, args=(name, pipe), daemon=True)
            for name, pipe in (("stdout", self.proc.stdout), ("stderr", self.proc.stderr))
        ]
        for pump in self._pumps:
            pump.start()

    def _pump(self, stream: str, pipe: IO[bytes]) -> None:
        held = b""
        while data := os.read(pipe.fileno(), 65536):
            held += data
            while True:
                end = held.find(b"\n")
                if 0 <= end < LINE_LIMIT:
                    self._write(held[: end + 1], stream)
                    held = held[end + 1 :]
                elif len(held) >= LINE_LIMIT:
                    self._write(held[:LINE_LIMIT], stream)
                    held = held[LINE_LIMIT:]
                else:
                    break
        if held:
            self._write(held, stream)

    def _write(self, text: bytes, stream: str) -> None:
        with self._lock:
            self._out.write(self._record(text, stream, time.time()))

    def wait(self) -> int:
        """The command's exit code, once every line it wrote is in the log."""
        code = self.proc.wait()
        for pump in self._pumps:
            pump.join()
        self._out.close()
        return code


def main(argv: Sequence[str]) -> int:
    """`containerlog.py docker|cri LOG [--restarted-after OUTPUT] -- COMMAND...`: the shim as its
    own process (outside the container's cgroup, as containerd-shim is), passing SIGTERM and
    SIGINT on to the command. With `--restarted-after`, the file OUTPUT is the previous process's
    stderr, written as its records first; the command starts RESTART_DELAY later, as Docker
    restarts a crashed container into the same log file."""
    encoding, log, *rest = argv
    separator = rest.index("--")
    options, command = rest[:separator], rest[separator + 1 :]
    record = RECORDS[encoding]
    Path(log).parent.mkdir(parents=True, exist_ok=True)
    if options[:1] == ["--restarted-after"]:
        with open(log, "ab") as out:
            for line in Path(options[1]).read_bytes().splitlines(keepends=True):
                out.write(record(line, "stderr", time.time()))
        time.sleep(RESTART_DELAY)
    shim = LogShim(command, Path(log), record)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda sig, frame: shim.proc.send_signal(sig))
    return shim.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
