"""What the runtime holds for one target between ticks: its sources, its tracker, what the last
tick found and what its past loads say. Admission makes one, the runtime wires and ticks it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.config.schema import TargetConfig
from exporter.discovery.found import DiscoveredServer
from exporter.history.explain import Counters
from exporter.history.pastloads import PastLoads
from exporter.load.records import LoadState
from exporter.load.tracker import Tracker
from exporter.runtime.logfollow import TargetLog
from exporter.runtime.observe import FilesNews, Marked
from exporter.runtime.pacing import ProbeCadence
from exporter.sources.endpoint import EndpointProber
from exporter.sources.environment import EnvironmentSource
from exporter.sources.gpu import PcieMarks
from exporter.sources.process import ProcessFinder
from exporter.sources.residency import ResidencySource
from exporter.sources.storage import WeightStorage
from exporter.sources.weightfiles import WeightFilesSource
from exporter.trust.asprocess import Actor
from exporter.vocabulary import Phase, ProbeResult

# Distinct readings of the storage's read counters kept per target: more than the 2 intervals
# and 1 s after its process started within which a load is seen from its start.
READS_KEPT = 16


@dataclass
class WatchedTarget:
    """What the runtime holds for one target: its sources, its tracker, what the tick found."""

    config: TargetConfig
    tracker: Tracker
    prober: EndpointProber
    cadence: ProbeCadence
    finder: ProcessFinder | None
    residency: ResidencySource | None
    log: TargetLog  # which log it follows, and what of it the tracker has seen
    # Its own threads for reads with its process's rights (started at its first read): a hang
    # under its files holds no other target's (exporter/trust/asprocess.py: Actor).
    actor: Actor = field(default_factory=Actor)
    storage: WeightStorage | None = None  # what holds the weights; residency asks it too
    discovered: DiscoveredServer | None = None  # how discovery found it; None when configured
    gone_since: float | None = None  # a discovered server's process went away at this time
    started_at: float | None = None  # start of the load the tick last saw
    state: LoadState | None = None
    gpu_memory: Mapping[int, int] = field(default_factory=dict)
    pcie_at_start: PcieMarks = field(default_factory=dict)  # each GPU's counter as the load began
    hung: bool = False  # ready, process running, endpoint failing: logged once
    watched_pid: int | None = None  # the server process whose exit a pidfd reports
    last_result: ProbeResult | None = None  # the last probe's answer, to notice a change
    # The weight files' first open, last let-go and whether all were consumed, as last acted on.
    files_news: FilesNews = (None, None, False)
    residency_seen: float | None = None  # when the residency pass the loops acted on ran
    # The read counters of the devices, mounts and pools under the weights (explain.Counters)
    # the last ticks saw (a load is first seen a tick or two after its process started), and
    # as the current (or last) load began: None when unknown.
    reads_seen: deque[Marked] = field(default_factory=lambda: deque(maxlen=READS_KEPT))
    reads_at_start: Counters | None = None
    files: WeightFilesSource | None = None  # the weight-file view, restarted for in-server loads
    past: PastLoads = field(default_factory=PastLoads)  # what its past loads say
    # The server's own files and their residency, learned from its tree (sources/environment.py).
    environment: EnvironmentSource | None = None

    @property
    def settled(self) -> bool:
        """Ready, and nothing can end that unseen: its process's exit is watched (or there is
        no process to watch, and the probe paces itself)."""
        ready = self.state is not None and self.state.phase is Phase.READY
        return ready and (self.finder is None or self.watched_pid is not None)
