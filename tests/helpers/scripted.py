"""A stand-in exporter answering /api/v1/status from a script: for the states a real exporter
cannot be made to show on demand (asked just before it saw a restart, a field a newer exporter
carries)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Script = Callable[[float, float], dict[str, Any]]  # (seconds since start, start) -> status


class ScriptedExporter:
    """A real HTTP server on loopback whose every GET answers the script's document now."""

    def __init__(self, script: Script) -> None:
        self.began = time.time()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = json.dumps(script(time.time() - outer.began, outer.began)).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
