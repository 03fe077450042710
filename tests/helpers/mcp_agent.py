"""`model-load-exporter mcp` as a subprocess, driven by the MCP SDK's own stdio client the way an
agent's host drives it, behind a blocking facade so synchronous tests can share one session."""

from __future__ import annotations

import sys
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mcp.types import CallToolResult, Tool


class Agent:
    """One MCP session with `model-load-exporter mcp ARGS...`; its stderr goes to `stderr`.
    Like a host, the client passes the server only a safe few variables (PATH, HOME...) + `env`.

    Every stdout line that is not a JSON-RPC message reaches the session's message handler as
    an exception: `stray_output` keeps them, so a test can hold stdout to the protocol alone.
    """

    def __init__(self, stderr: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.stderr_path = stderr
        self.stray_output: list[Exception] = []
        self._stack = ExitStack()
        try:
            self._open(args, env)
        except BaseException:
            self._stack.close()
            raise

    def _open(self, args: tuple[str, ...], env: dict[str, str] | None) -> None:
        # Imported here, not at the top: the SDK takes seconds to import, paid otherwise by each
        # test worker that collects test_mcp.py.
        from anyio.from_thread import start_blocking_portal
        from mcp import ClientSession
        from mcp.client.stdio import StdioServerParameters, stdio_client

        errlog = self._stack.enter_context(self.stderr_path.open("w"))
        self._portal = self._stack.enter_context(start_blocking_portal())
        params = StdioServerParameters(
            command=sys.executable, args=["-m", "exporter", "mcp", *args], env=env or {}
        )
        read, write = self._stack.enter_context(
            self._portal.wrap_async_context_manager(stdio_client(params, errlog=errlog))
        )

        async def keep(message: Any) -> None:
            if isinstance(message, Exception):
                self.stray_output.append(message)

        self.session = self._stack.enter_context(
            self._portal.wrap_async_context_manager(
                ClientSession(read, write, message_handler=keep)
            )
        )
        self._portal.call(self.session.initialize)

    def tools(self) -> list[Tool]:
        return list(self._portal.call(self.session.list_tools).tools)

    def call(self, name: str, arguments: dict[str, Any] | None = None) -> CallToolResult:
        return self._portal.call(self.session.call_tool, name, arguments or {})

    def answer(self, name: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        """The structured answer of a call that must succeed."""
        result = self.call(name, arguments)
        assert not result.is_error, result.content
        assert result.structured_content is not None
        return dict(result.structured_content)

    def error(self, name: str, arguments: dict[str, Any] | None = None) -> str:
        """The one line of a call that must fail as a tool error."""
        result = self.call(name, arguments)
        assert result.is_error, result.structured_content
        (content,) = result.content
        text = getattr(content, "text", "")
        assert text and "\n" not in text and "Traceback" not in text, text
        return str(text)

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def close(self) -> None:
        self._stack.close()
