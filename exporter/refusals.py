"""What discovery declined: counted by reason for `model_load_discovery_refused_total`.

Each refused thing (a process, a file, a probe address) is counted and logged once, not on every
pass that meets it again; the memory of what was already said is bounded, so a flood of fake
servers cannot grow it (a thing forgotten and met again is counted again).
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096


class Refusals:
    """A counter by reason, shared by discovery, the runtime and residency passes (thread-safe)."""

    def __init__(self, remembered: int = MAX_REMEMBERED) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._said: OrderedDict[Hashable, None] = OrderedDict()
        self._remembered = remembered

    def note(self, reason: str, key: Hashable, message: str, *args: object) -> None:
        """Count one refusal of `key` for `reason`, and log it, unless it was noted already."""
        with self._lock:
            said = (reason, key)
            if said in self._said:
                self._said.move_to_end(said)
                return
            self._said[said] = None
            if len(self._said) > self._remembered:
                self._said.popitem(last=False)
            self._counts[reason] += 1
        log.warning("discovery refused (%s): " + message, reason, *args)

    def counts(self) -> Mapping[str, int]:
        with self._lock:
            return dict(self._counts)
