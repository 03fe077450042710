"""Who owns a discovered target's name.

A kubelet's config names a target (`/probe/alive?target=vllm-llama-8000`) and a failed answer
restarts that server, so a name must keep meaning the same user's server across its restarts,
whatever other users start meanwhile. Any local user can start a process whose command line
yields the name of root's server; what keeps it from speaking for that name is who owns it:

- A name belongs to the user (uid, as the exporter's namespace sees it) whose watched server
  holds it, while that server runs and for `keep_for` after it went (the restart gap), and after
  an exporter restart to the user whose load history filed last under it, for `keep_for` from
  the start (the exporter cannot know when that server was last up).
- Root, the system's users (uid <= SYSTEM_UID_MAX) and the exporter's own user outrank the
  others: their server takes a name another user holds, whoever came first; the other user's
  server gives way and is not watched.
- Otherwise a server of another user is refused the name (`name_owned`): never renamed to a name
  that would change at each of its restarts. Two servers of one user with one name (two
  replicas in two network namespaces) are both that user's: the first keeps the name, the
  second is `NAME-PID` for as long as it runs.
- A process keeps the name it was given while it runs with the same base name: another of its
  user's servers going away does not rename it.

Only watched servers hold names (one refused for the bounds holds none), so the names held are
bounded by `discovery.max_targets`; names whose server went are kept at most `bound` (of the
lowest rank, the longest gone forgotten first).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from exporter.discovery.found import DiscoveredServer

# uids up to this are the system's (systemd's and the distributions' SYS_UID_MAX, 999): its
# services' servers, like root's, are no local user's to crowd out or take over.
SYSTEM_UID_MAX = 999
MAX_LOOKED_UP = 4096  # names whose history was asked for an owner, remembered in the first keep_for
MAX_REFUSED_KEPT = 64  # processes refused one name, remembered so that each counts once

Key = tuple[int, int]  # a process: pid and start ticks


def uid_of(server: DiscoveredServer) -> int | None:
    """The user a discovered server runs as (None: credentials unknown, ranked lowest)."""
    return server.rights.uid if server.rights is not None else None


def privileged(uid: int | None, own_uid: int) -> bool:
    """Root's, a system user's or the exporter's own user's."""
    return uid is not None and (uid <= SYSTEM_UID_MAX or uid == own_uid)


def who(uid: int | None) -> str:
    """A user as log lines and evidence name one."""
    return "unknown user" if uid is None else f"uid {uid}"


@dataclass
class _Hold:
    """Who holds one name: the process holding it now (None once it went), since when gone, and
    the other users' processes it was refused to (the last one's pid and uid)."""

    uid: int | None
    key: Key | None
    base: str = ""  # the name the holder's command line gives (its name is NAME-PID if taken)
    went: float | None = None
    refused: int = 0
    last_refused: tuple[int, int | None] | None = None
    refused_keys: dict[Key, None] = field(default_factory=dict)  # the last few, oldest first


@dataclass(frozen=True)
class Claim:
    """The name a server may have, or None (refused, `owner` holding it); `displaces` is the
    user of lower rank whose server gives the name up."""

    name: str | None
    owner: int | None = None
    displaces: int | None = None


class TargetNames:
    """The names discovered targets hold, and what a new server may claim. One discovery
    thread calls it."""

    def __init__(
        self,
        keep_for: float,
        bound: int,
        *,
        clock: Callable[[], float],
        own_uid: int,
        past_owner: Callable[[str], int | None],
    ) -> None:
        """`past_owner(name)`: the user whose load history filed last under `name`."""
        self._keep_for = keep_for
        self._bound = bound
        self._clock = clock
        self._own_uid = own_uid
        self._past_owner = past_owner
        self._started = clock()
        self._held: dict[str, _Hold] = {}
        self._by_key: dict[Key, str] = {}
        self._looked_up: set[str] = set()

    def privileged(self, uid: int | None) -> bool:
        """Root's, a system user's or the exporter's own user's (module docstring)."""
        return privileged(uid, self._own_uid)

    def present(self, keys: Collection[Key], now: float) -> None:
        """The processes a pass found: a holder not among them went now (its gap begins)."""
        for name, hold in self._held.items():
            if hold.key is not None and hold.key not in keys:
                self._went(name, hold, now)

    def claim(self, server: DiscoveredServer) -> Claim:
        """The name `server` may have (module docstring). Nothing changes until `hold` but
        the count of the processes refused a name."""
        uid, base = uid_of(server), server.name
        mine = self._by_key.get(server.key)
        if mine is not None and self._held[mine].base == base:
            return Claim(mine)
        hold = self._held.get(base) or self._from_history(base)
        if hold is not None and hold.uid == uid and hold.key not in (None, server.key):
            base = f"{base}-{server.pid}"  # a second server of that user with one name
            hold = self._held.get(base)
        if hold is None or hold.uid == uid:
            return Claim(base)
        if self.privileged(uid) and not self.privileged(hold.uid):
            return Claim(base, displaces=hold.uid)
        self._refused(hold, server)
        return Claim(None, owner=hold.uid)

    def _refused(self, hold: _Hold, server: DiscoveredServer) -> None:
        """Count `server`'s refusal once, for the name's holder to show."""
        if server.key in hold.refused_keys:
            return
        hold.refused += 1
        hold.last_refused = (server.pid, uid_of(server))
        hold.refused_keys[server.key] = None
        if len(hold.refused_keys) > MAX_REFUSED_KEPT:
            del hold.refused_keys[next(iter(hold.refused_keys))]

    def hold(self, name: str, server: DiscoveredServer) -> None:
        """`server` (named by its command line), now watched as `name`, holds it."""
        before = self._by_key.get(server.key)
        if before is not None and before != name:  # its command line names another now
            self._went(before, self._held[before], self._clock())
        hold = self._held.get(name)
        if hold is not None and hold.key not in (None, server.key):
            self._by_key.pop(hold.key, None)  # a server of lower rank gives it up
        if hold is None or hold.uid != uid_of(server):
            hold = self._held[name] = _Hold(uid_of(server), None)
        hold.key, hold.went, hold.base = server.key, None, server.name
        self._by_key[server.key] = name

    def release(self, name: str, now: float) -> None:
        """The server holding `name` is no longer watched (dropped for room): its user keeps
        the name for `keep_for`, as after its exit."""
        hold = self._held.get(name)
        if hold is not None and hold.key is not None:
            self._went(name, hold, now)

    def expire(self, now: float, kept: Collection[str]) -> None:
        """Forget names gone for `keep_for`, and beyond `bound` the longest gone of the lowest
        rank, but never one a target still has (`kept`: its restart gap)."""
        for name in [n for n, h in self._held.items() if h.went is not None]:
            if now - (self._held[name].went or now) >= self._keep_for:
                del self._held[name]
        gone = sorted(
            (n for n, h in self._held.items() if h.key is None and n not in kept),
            key=lambda n: (self.privileged(self._held[n].uid), self._held[n].went or 0.0),
        )
        for name in gone[: max(0, len(gone) - self._bound)]:
            del self._held[name]
        if now - self._started >= self._keep_for:
            self._looked_up.clear()

    def refusals(self, name: str) -> tuple[int, tuple[int, int | None] | None]:
        """How many processes of other users asked for `name` and were refused, the last one's
        pid and uid."""
        hold = self._held.get(name)
        return (hold.refused, hold.last_refused) if hold is not None else (0, None)

    def _went(self, name: str, hold: _Hold, now: float) -> None:
        if hold.key is not None and self._by_key.get(hold.key) == name:
            del self._by_key[hold.key]
        hold.key, hold.went = None, now

    def _from_history(self, name: str) -> _Hold | None:
        """After a restart of the exporter, the user who held `name` when it stopped: the owner
        of its last load in history, for `keep_for` from the start."""
        now = self._clock()
        if now - self._started >= self._keep_for or name in self._looked_up:
            return None
        if len(self._looked_up) < MAX_LOOKED_UP:
            self._looked_up.add(name)
        uid = self._past_owner(name)
        if uid is None:
            return None
        hold = self._held[name] = _Hold(uid, None, base=name, went=self._started)
        return hold
