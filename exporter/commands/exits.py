"""What every command exits with, and the one error that means "bad input" (DESIGN's table).

0 ok; 1 failure (the load failed, the config is invalid, prewarm refused a path, no MCP SDK);
2 usage (one line saying what is wrong and where, never a traceback); 124 `wait --timeout` ran
out; 75 `wait --max-wait` ran out while the load goes on (call again to keep waiting).
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    USAGE = 2
    STILL_LOADING = 75
    TIMED_OUT = 124


class UsageError(Exception):
    """Input a command cannot act on: its message is the one line the user sees (exit 2)."""
