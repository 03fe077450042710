"""Which descriptors one process holds, followed at the cost of what changed, not of what it holds.

Shared by every source that looks at a tree's descriptors (the weight files' view, the
environment's learning), so that none of them pays per descriptor per look: a user's process
holding 19,500 descriptors and churning one cost a quarter of a core when each look listed and
identified them all (issue 27 row 7, and again issue 37 row 5 for the environment).

Listing /proc/PID/fd costs about 1 ms per 1,000 descriptors, so a process holding many is listed
at most once every LIST_EVERY_FDS of them looks (`now` counts the caller's looks); a look first
asks the count (`st_size` of /proc/PID/fd, Linux >= 6.2: one stat), and only when it moved looks
for what changed: between listings where the kernel numbers a new descriptor (the lowest free
one), the lowest numbers the caller does not hold, as many as the count moved and PROBE_SLACK
more, one lstat each; at a listing, the names diffed with the numbers the caller holds. A number
closed and reused for another file while the count stayed the same (or moved between listings)
is not seen that way, so `rechecks` names the numbers worth identifying again at a look: those
new for YOUNG_LOOKS looks (numbers are reused soonest), and a slice of the others, so that every
one is looked at again within ROTATE_LOOKS looks.
"""

from __future__ import annotations

import bisect
import os
from collections.abc import Collection
from dataclasses import dataclass, field

LIST_EVERY_FDS = 1000  # a process is listed at most once every (descriptors / this) looks
PROBE_SLACK = 8  # numbers looked at beyond a changed count's difference, between listings
YOUNG_LOOKS = 5  # a descriptor this new is identified again at each look: reused soonest
ROTATE_LOOKS = 300  # every older descriptor is identified again within this many looks


@dataclass(frozen=True)
class Changes:
    """What moved in a process's descriptor table since the caller's last look."""

    appeared: list[int]  # numbers the caller does not hold yet, highest (latest opened) first
    gone: set[int]  # numbers the caller holds that a listing no longer showed
    listed: bool  # the whole table was listed (so `gone` is complete)


@dataclass
class DescriptorTable:
    """Where one process's descriptor numbers stood at the last look."""

    count: int | None = None  # the count as last looked at; None before the first look
    listed_at: int = -LIST_EVERY_FDS  # the look /proc/PID/fd was last listed at
    free: list[int] = field(default_factory=list)  # numbers free below `top` at that listing
    top: int = -1  # the highest number seen
    young: dict[int, int] = field(default_factory=dict)  # new since a look: number -> look
    old: list[int] | None = None  # the other numbers, in order, for the slice of re-checks
    rotate: int = 0

    def look(self, fd_dir: str, held: Collection[int], now: int) -> Changes | None:
        """What changed against the numbers the caller `held`; None when the count did not
        move. OSError as the stat or the listing raised it (PermissionError: may not look;
        FileNotFoundError: the process is gone)."""
        count = os.stat(fd_dir).st_size or None  # 0 before Linux 6.2: unknown
        if count is not None and count == self.count:
            return None
        if count is None or now - self.listed_at >= len(held) // LIST_EVERY_FDS:
            return self._list(fd_dir, held, now, count is not None)
        wanted = abs(count - len(held)) + PROBE_SLACK
        self.count = count
        return Changes(self._probe(fd_dir, held, wanted), set(), listed=False)

    def _list(self, fd_dir: str, held: Collection[int], now: int, counted: bool) -> Changes:
        numbers = {int(n) for n in os.listdir(fd_dir) if n.isdigit()}
        top = max(numbers, default=-1)
        self.free = sorted(set(range(top)) - numbers)
        self.top, self.listed_at = top, now
        # As listed: the count may have moved since the stat, and then the next look looks again.
        self.count = len(numbers) if counted else None
        gone = {n for n in held if n not in numbers}
        appeared = sorted((n for n in numbers if n not in held), reverse=True)
        if gone or appeared:
            self.old = None
        return Changes(appeared, gone, listed=True)

    def born(self, number: int, now: int) -> None:
        """`number` is new at look `now`: its number may soon be another file's."""
        self.young[number] = now

    def rechecks(self, held: Collection[int], now: int) -> list[int]:
        """The numbers held that may name another file than when they were identified: the
        young ones (past the look they were born at) and this look's slice of the others."""
        out = []
        for number, born in list(self.young.items()):
            if now - born >= YOUNG_LOOKS or number not in held:
                del self.young[number]
                if self.old is not None and number in held:
                    bisect.insort(self.old, number)
            elif born < now:
                out.append(number)
        if self.old is None:
            self.old = sorted(n for n in held if n not in self.young)
        old = self.old
        if old:
            share = -(-len(old) // ROTATE_LOOKS)
            start = self.rotate % len(old)
            wrapped = old[start : start + share] + old[: max(0, start + share - len(old))]
            out += [n for n in wrapped if n in held]
            self.rotate = start + share
        return out

    def _probe(self, fd_dir: str, held: Collection[int], wanted: int) -> list[int]:
        """The numbers a changed count most likely took, where the kernel gives them: the
        lowest free ones of the last listing, then above the highest; those that exist."""
        candidates = [n for n in self.free[:wanted] if n not in held]
        candidates += range(self.top + 1, self.top + 1 + wanted - len(candidates))
        appeared = []
        for number in candidates:
            if os.path.lexists(f"{fd_dir}/{number}"):
                appeared.append(number)
                self.top = max(self.top, number)
        return sorted(appeared, reverse=True)
