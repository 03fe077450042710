"""What discovery declined: counted by reason for `model_load_discovery_refused_total`.

Each refused thing (a process, a file, a probe address) is counted and logged once, not on every
pass that meets it again; the memory of what was already said is bounded, so a flood of fake
servers cannot grow it (a thing forgotten and met again is counted again).
"""

from __future__ import annotations

import errno
import logging
import threading
from collections import Counter, OrderedDict
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from exporter.trust.safeio import Refused
from exporter.trust.untrusted import clean

log = logging.getLogger(__name__)

MAX_REMEMBERED = 4096
# Every reason, so that each series exists (at 0) from the first scrape and rate() sees its
# first increase.
REASONS = (
    "max_targets",  # discovery.max_targets discovered targets already, none of them gone
    "user_share",  # the process's user has discovery.max_targets_per_user already
    "name_owned",  # its target name is another user's server's (exporter/runtime/targetnames.py)
    "user",  # its user is not in discovery.users
    "borrowed_rights",  # a setuid/setgid program, or a process that is not dumpable
    "unreadable",  # a file its own rights do not let it read (or its credentials not takeable)
    "not_regular",  # a FIFO, a device, a socket where a file was named
    "too_large",  # a config, ref or environment file over its size bound
    "pseudo_filesystem",  # a path into /proc, /sys or /dev
    "too_many_files",  # a weights tree over discovery.max_files entries
    "unreachable",  # a listen address that is neither loopback nor its namespace's own
    "hung",  # a file access that did not finish in time (a hung NFS or FUSE mount)
    "error",  # an unexpected failure: that process skipped, the pass went on
)


class Refusals:
    """A counter by reason, shared by discovery, the runtime and residency passes (thread-safe)."""

    def __init__(self, remembered: int = MAX_REMEMBERED) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._said: OrderedDict[Hashable, None] = OrderedDict()
        self._remembered = remembered

    def note(self, reason: str, key: Hashable, message: str, *args: object) -> None:
        """Count one refusal of `key` for `reason`, and log it, unless it was noted already."""
        assert reason in REASONS, reason
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
        """Refusals so far by reason, every reason present."""
        with self._lock:
            return {reason: self._counts[reason] for reason in REASONS}


@dataclass(frozen=True)
class Refuser:
    """Notes refusals about one process (from the actor's thread too: Refusals is thread-safe)."""

    refusals: Refusals
    key: tuple[int, int]

    def __call__(self, reason: str, what: str, message: str) -> None:
        self.refusals.note(reason, (self.key, what), "pid %d: %s", self.key[0], clean(message))

    def of(self, exc: OSError, what: str) -> None:
        """An OSError from looking at `what`: a refusal, or a plain absence (not counted)."""
        if isinstance(exc, Refused):
            self(exc.reason, what, str(exc))
        elif exc.errno in (errno.EACCES, errno.EPERM):
            self("unreadable", what, f"{what}: not readable with the process's rights")
        elif exc.errno in (errno.ELOOP, errno.EMLINK):
            self("not_regular", what, f"{what}: {exc.strerror}")
