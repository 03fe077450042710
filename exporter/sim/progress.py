"""The server's view of its ranks' weight load: the log's weights markers and the report's truth.

The weights begin when the first rank opens its first shard; a shard is done (the log's
per-shard progress) when every rank has finished its slice of it; the weights end when every
rank is done.
"""

from __future__ import annotations

from exporter.sim.events import Kind, RankEvent
from exporter.sim.serverlog import ServerLog


class WeightsProgress:
    """Folds the ranks' events into log lines and the totals `--report` states."""

    def __init__(self, log: ServerLog, shards: int, world: int) -> None:
        self._log = log
        self._world = world
        self._latest: dict[int, RankEvent] = {}  # by rank
        self._closed = [0] * shards  # ranks done with each shard
        self._shards_done = 0
        self._ranks_done: list[float] = []
        self.started_at: float | None = None  # the first weight-file open of any rank
        self.done_at: float | None = None  # the last rank's end

    @property
    def consumed(self) -> int:
        return sum(event.consumed for event in self._latest.values())

    @property
    def cached(self) -> int:
        return sum(event.cached for event in self._latest.values())

    @property
    def known(self) -> bool:
        return all(event.known for event in self._latest.values())

    def handle(self, event: RankEvent) -> None:
        self._latest[event.rank] = event
        if self.started_at is None:
            self._log.weights_begin()
        if event.kind is Kind.OPEN:  # ranks' events may arrive a little out of time order
            self.started_at = min(event.time, self.started_at or event.time)
        assert self.started_at is not None  # a rank's first event opens its first shard
        elapsed = event.time - self.started_at
        if event.kind is Kind.CHUNK:
            self._log.weights_bytes(self.consumed, elapsed)
        elif event.kind is Kind.CLOSE:
            self._closed[event.shard] += 1
            closed = self._closed
            while self._shards_done < len(closed) and closed[self._shards_done] == self._world:
                self._shards_done += 1
                self._log.shard_done(self._shards_done, elapsed)
        elif event.kind is Kind.DONE:
            self._ranks_done.append(event.time)
            if len(self._ranks_done) == self._world:
                self.done_at = max(self._ranks_done)
                self._log.weights_end(self.done_at - self.started_at)
