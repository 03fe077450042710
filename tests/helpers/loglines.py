"""A process that writes a scripted server log in real time, then serves: the shape of a log
(which lines, in which order, how far apart) chosen by a test, with real stamps and a real
process, port and log file for the exporter to follow.

    python loglines.py PORT PIDFILE SCRIPT_JSON

SCRIPT_JSON is a list of `[seconds_after_start, line]`; `{vllm}` in a line becomes vLLM's stamp
(`MM-DD HH:MM:SS`), `{sglang}` SGLang's (`YYYY-MM-DD HH:MM:SS`), both local time, as the
servers write them. Lines go to stdout (the test redirects it into the log file), flushed one by
one. After the last line the port answers every GET with 200 until the process is killed.
"""

from __future__ import annotations

import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any


class _Ready(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"object":"list","data":[]}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


def stamped(line: str, now: float) -> str:
    local = time.localtime(now)
    return line.replace("{vllm}", time.strftime("%m-%d %H:%M:%S", local)).replace(
        "{sglang}", time.strftime("%Y-%m-%d %H:%M:%S", local)
    )


def main() -> None:
    port, pidfile, script = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    began = time.time()
    pidfile.write_text(f"{os.getpid()}\n")
    for after, line in script:
        time.sleep(max(0.0, began + after - time.time()))
        sys.stdout.write(stamped(line, time.time()) + "\n")
        sys.stdout.flush()
    HTTPServer(("127.0.0.1", port), _Ready).serve_forever()


if __name__ == "__main__":
    main()
