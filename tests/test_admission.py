"""exporter/runtime/admission.py without the runtime's threads: which discovered servers become
targets (one per server, one more per model of a repository server holding several), how a target
follows its server and when it is dropped, driven pass by pass with DiscoveredServer values as
discovery makes them, a small wiring of real trackers, probers and process finders, and real
processes where a configured target's process tree or a process's rights count. The same end to
end, with real processes discovered: tests/test_zero_config.py, tests/test_trust*.py.
"""

from __future__ import annotations

import contextlib
import subprocess
import threading
from collections.abc import Collection, Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from helpers.support import wait_for

from exporter.config.schema import (
    Config,
    DiscoveryConfig,
    EndpointConfig,
    ProcessConfig,
    TargetConfig,
    WeightsConfig,
)
from exporter.discovery.found import DiscoveredServer
from exporter.discovery.refusals import Refusals
from exporter.discovery.serverargs import Evidence
from exporter.load.tracker import Tracker
from exporter.runtime.admission import (
    Admission,
    model_of,
    models_apart,
    on_behalf,
    on_behalf_of,
    targets_of,
)
from exporter.runtime.logfollow import TargetLog
from exporter.runtime.pacing import ProbeCadence
from exporter.runtime.target import WatchedTarget
from exporter.sources.endpoint import EndpointProber
from exporter.sources.process import ProcessFinder, read_stat
from exporter.trust.asprocess import Actor, Borrowed, Rights
from exporter.vocabulary import ProbeKind

INTERVAL = 1.0  # sample interval: passes while a discovered server is gone come this often
PASS = 30.0  # discovery.interval
KEEP_FOR = 60.0
NOBODY = 65534


class Clock:
    def __init__(self) -> None:
        self.now = 1_800_000_000.0

    def __call__(self) -> float:
        return self.now


class Passes:
    """What discovery found on each pass: the servers set last, or the error it met."""

    def __init__(self) -> None:
        self.servers: tuple[DiscoveredServer, ...] = ()
        self.error: Exception | None = None
        self.scans = 0

    def scan(self) -> tuple[DiscoveredServer, ...]:
        self.scans += 1
        if self.error is not None:
            raise self.error
        return self.servers


class Wiring:
    """admission.Wiring and Filed as the runtime implements them, minus the sampler: real
    trackers, probers and process finders; what was wired and unwired is kept for the tests to
    read."""

    def __init__(self) -> None:
        self.targets: dict[str, WatchedTarget] = {}
        self.wired: list[tuple[str, int | None]] = []  # (target, discovered pid) per wire()
        self.unwired: list[str] = []
        self.past_loads_read = 0
        self.owners: dict[str, int] = {}  # what history says of who loaded last under a name

    def new_target(self, config: TargetConfig, found: DiscoveredServer | None) -> WatchedTarget:
        target = WatchedTarget(
            config=config,
            tracker=Tracker(config.name, config.stall_after, interval=INTERVAL),
            prober=EndpointProber(config.endpoint),
            cadence=ProbeCadence(INTERVAL, config.endpoint.ready_interval, True),
            finder=None,
            residency=None,
            log=TargetLog(config.name, config.log, lambda pid: None),
            discovered=found,
        )
        self.targets[config.name] = target
        return target

    def wire(self, target: WatchedTarget) -> None:
        process = target.config.process
        target.finder = ProcessFinder(process) if process is not None else None
        found = target.discovered
        self.wired.append((target.config.name, found.pid if found is not None else None))

    def unwire(self, target: WatchedTarget) -> None:
        target.prober.close()
        self.unwired.append(target.config.name)

    def pids_watched(self, name: str) -> Collection[int]:
        finder = self.targets[name].finder
        return finder.sample().pids if finder is not None else ()

    def read_past_loads(self) -> None:
        self.past_loads_read += 1

    def past_owner(self, name: str) -> int | None:
        return self.owners.get(name)


def found(
    name: str,
    pid: int,
    *,
    uid: int = 1000,
    start_ticks: int = 5000,
    port: int = 8000,
    reachable: bool = True,
    weights: tuple[str, ...] = ("/models/m",),
) -> DiscoveredServer:
    """A server as discovery describes one (exporter/discovery/scan.py)."""
    return DiscoveredServer(
        kind="vllm",
        name=name,
        pid=pid,
        start_ticks=start_ticks,
        start_time=1_799_999_000.0,
        url=f"http://127.0.0.1:{port}",
        probe=ProbeKind.HEALTH,
        probe_path="/health",
        model=name,
        weights=weights,
        weights_include=("*.safetensors",),
        reachable=reachable,
        evidence=() if reachable else (Evidence("probe host", "10.0.0.5", "--host"),),
        rights=Rights(uid, uid, ()),
    )


class Setup:
    def __init__(self, config: Config) -> None:
        self.clock = Clock()
        self.passes = Passes()
        self.wiring = Wiring()
        self.refusals = Refusals()
        self.admission = Admission(
            config,
            self.wiring,
            self.wiring,
            discoverer=self.passes,  # type: ignore[arg-type]  # discovery's output, pass by pass
            refusals=self.refusals,
            clock=self.clock,
            lock=threading.Lock(),
        )
        for target in config.targets:
            self.admission.add(target)

    def discover(self, *servers: DiscoveredServer, after: float | None = None) -> None:
        """One pass once it is due (or `after` seconds on), finding `servers`."""
        self.clock.now += self.admission.wait() if after is None else after
        self.passes.servers = servers
        self.admission.discover()

    @property
    def names(self) -> set[str]:
        return set(self.admission.targets)

    def refused(self, reason: str) -> int:
        return self.refusals.counts()[reason]


def discovering(
    targets: tuple[TargetConfig, ...] = (), *, max_targets: int = 8, per_user: int = 4
) -> Setup:
    discovery = DiscoveryConfig(
        enabled=True,
        interval=PASS,
        keep_for=KEEP_FOR,
        max_targets=max_targets,
        max_targets_per_user=per_user,
    )
    return Setup(Config(targets=targets, sample_interval=INTERVAL, discovery=discovery))


@contextlib.contextmanager
def sleeping(pidfile: Path | None = None) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "60"], stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text() == "sleep\n")
        if pidfile is not None:
            pidfile.write_text(f"{proc.pid}\n")
        yield proc
    finally:
        proc.kill()
        proc.wait()


# -- admitting ------------------------------------------------------------------------------


def test_a_discovered_server_becomes_a_target_wired_with_its_process_and_its_history_read() -> None:
    setup = discovering()
    setup.discover(found("qwen", 101))
    target = setup.admission.targets["qwen"]
    mine = "an ordinary user: no other user's server takes this name"
    owner = Evidence("owner", "uid 1000", mine)
    assert target.discovered == replace(found("qwen", 101), evidence=(owner,))
    assert target.config == targets_of(found("qwen", 101))[0]
    assert target.config.process == ProcessConfig(pid=101, start_ticks=5000)
    assert target.config.weights == WeightsConfig(paths=("/models/m",), include=("*.safetensors",))
    assert setup.wiring.wired == [("qwen", 101)] and setup.wiring.past_loads_read == 1
    setup.discover(found("qwen", 101))  # the same server on the next pass: nothing to do
    assert setup.wiring.wired == [("qwen", 101)] and setup.wiring.past_loads_read == 1


def test_configured_targets_win_the_processes_and_endpoints_they_watch(tmp_path: Path) -> None:
    """A discovered server a configured target already watches, by its process tree or by its
    URL, is no second target; discovery waits a tick for those trees to be read."""
    pidfile = tmp_path / "server.pid"
    configured = (
        TargetConfig("mine", EndpointConfig("http://127.0.0.1:9000"),
                     process=ProcessConfig(pidfile=str(pidfile))),
        TargetConfig("by-url", EndpointConfig("http://127.0.0.1:9100/")),
    )  # fmt: skip
    with sleeping(pidfile) as proc:
        setup = discovering(configured)
        setup.clock.now += INTERVAL / 2
        setup.admission.discover()
        assert setup.passes.scans == 0  # not due: the configured trees are not read yet
        setup.discover(
            found("same-process", proc.pid, port=8000),
            found("same-url", 202, port=9100),
            found("other", 303, port=8300),
        )
    assert setup.names == {"mine", "by-url", "other"}
    assert setup.refused("max_targets") == setup.refused("user_share") == 0


def test_an_unreachable_server_is_refused_once_and_not_watched() -> None:
    setup = discovering()
    far = found("far", 404, reachable=False)
    setup.discover(far, found("near", 405, port=8100))
    setup.discover(far, found("near", 405, port=8100))
    assert setup.names == {"near"} and setup.refused("unreachable") == 1


def test_at_most_max_targets_are_discovered_and_a_gone_one_makes_room() -> None:
    setup = discovering(max_targets=2, per_user=10)
    a, b, c = (
        found(n, pid, uid=1000 + pid, port=8000 + pid) for n, pid in (("a", 1), ("b", 2), ("c", 3))
    )
    setup.discover(a, b, c)
    assert setup.names == {"a", "b"} and setup.refused("max_targets") == 1
    setup.discover(a, b, c)
    assert setup.names == {"a", "b"} and setup.refused("max_targets") == 1  # said once
    setup.discover(b)  # a went away: kept for keep_for, counting against the limit
    assert setup.names == {"a", "b"} and setup.admission.targets["a"].gone_since is not None
    setup.discover(b, c)  # c is let in: the gone a makes room
    assert setup.names == {"b", "c"} and setup.wiring.unwired == ["a"]


def test_one_user_gets_at_most_their_share_of_the_discovered_targets() -> None:
    setup = discovering(max_targets=10, per_user=2)
    mine = [found(f"m{i}", 10 + i, uid=1000, port=8000 + i) for i in range(3)]
    theirs = found("t", 20, uid=1001, port=8100)
    setup.discover(*mine, theirs)
    assert setup.names == {"m0", "m1", "t"}
    assert setup.refused("user_share") == 1 and setup.refused("max_targets") == 0


def test_a_restarted_server_is_followed_by_its_target_with_a_new_process() -> None:
    """Same name, same tracker and history; a new process (and weights) wired anew; the prober
    kept while the endpoint is the same and replaced when it changed."""
    setup = discovering()
    setup.discover(found("qwen", 101))
    target = setup.admission.targets["qwen"]
    tracker, prober = target.tracker, target.prober
    setup.discover(found("qwen", 111, start_ticks=9000, weights=("/models/m2",)))
    assert setup.admission.targets["qwen"] is target and target.tracker is tracker
    assert target.prober is prober
    assert target.config.process == ProcessConfig(pid=111, start_ticks=9000)
    assert target.config.weights is not None and target.config.weights.paths == ("/models/m2",)
    assert setup.wiring.wired == [("qwen", 101), ("qwen", 111)]
    moved = replace(found("qwen", 121, start_ticks=9900), probe_path="/v1/models")
    setup.discover(moved)
    assert target.prober is not prober and target.config.endpoint.path == "/v1/models"
    assert setup.wiring.past_loads_read == 1  # one target all along


def test_a_gone_server_is_kept_for_keep_for_looked_for_every_interval_then_dropped() -> None:
    setup = discovering()
    setup.discover(found("qwen", 101))
    assert setup.admission.wait() == PASS
    setup.discover()  # gone
    target = setup.admission.targets["qwen"]
    assert target.gone_since == setup.clock.now
    assert setup.admission.wait() == INTERVAL  # its restart is looked for every interval
    setup.discover(found("qwen", 111, start_ticks=9000))  # back within keep_for
    assert target.gone_since is None and setup.admission.targets["qwen"] is target
    assert setup.admission.wait() == PASS
    setup.discover()
    setup.discover(after=KEEP_FOR - INTERVAL)
    assert setup.names == {"qwen"} and setup.wiring.unwired == []
    setup.discover()  # keep_for after it went
    assert setup.names == set() and setup.wiring.unwired == ["qwen"]


def test_a_configured_target_is_never_dropped_by_discovery() -> None:
    setup = discovering((TargetConfig("mine", EndpointConfig("http://127.0.0.1:9000")),))
    for _ in range(3):
        setup.discover(after=KEEP_FOR)
    assert setup.names == {"mine"} and setup.admission.targets["mine"].gone_since is None


def test_a_failed_pass_is_counted_and_the_next_is_due_on_time() -> None:
    """A pass that fails must not run again at once (a loop on /dev/zero would take a core)."""
    setup = discovering()
    setup.discover(found("qwen", 101))
    setup.passes.error = OSError("/proc: Input/output error")
    setup.clock.now += setup.admission.wait()
    setup.admission.discover()
    assert setup.refused("error") == 1 and setup.admission.wait() == PASS
    assert setup.names == {"qwen"}  # nothing is concluded from a pass that failed
    assert setup.admission.targets["qwen"].gone_since is None
    setup.admission.look_now()  # a target's process went away: look now, once
    assert setup.admission.wait() == 0


# -- whose a name is (exporter/runtime/targetnames.py) ----------------------------------------

ROOT = 0


def test_another_users_server_in_the_restart_gap_is_refused_the_name() -> None:
    """Root's server restarts; a look-alike of nobody's with its name comes in the gap: refused
    (said once), root's target stays gone until root's own next process, which it follows."""
    setup = discovering()
    setup.discover(found("qwen", 101, uid=ROOT))
    target = setup.admission.targets["qwen"]
    setup.discover()  # root's server went: the gap
    fake = found("qwen", 202, uid=NOBODY, start_ticks=7000)
    for _ in range(3):
        setup.discover(fake)
    assert setup.admission.targets["qwen"] is target and target.discovered is not None
    assert target.discovered.pid == 101 and target.gone_since is not None
    assert setup.refused("name_owned") == 1 and setup.wiring.wired == [("qwen", 101)]
    setup.discover(fake, found("qwen", 111, uid=ROOT, start_ticks=9000))
    assert setup.admission.targets["qwen"] is target and target.gone_since is None
    assert setup.wiring.wired == [("qwen", 101), ("qwen", 111)]
    why = {e.what: e for e in target.discovered.evidence}
    assert why["owner"].value == "uid 0"
    assert why["name refused"].value == "pid 202 of uid 65534"


def test_roots_server_takes_its_name_from_a_look_alike_that_came_first() -> None:
    """The name of root's server does not depend on who started first: the look-alike's target
    ends (its state, tracker and history's owner with it), root's starts afresh under the name,
    and the look-alike is refused from then on, never renamed."""
    setup = discovering()
    fake = found("qwen", 202, uid=NOBODY, start_ticks=4000)
    setup.discover(fake)
    lookalike = setup.admission.targets["qwen"]
    server = found("qwen", 101, uid=ROOT, start_ticks=5000)
    setup.discover(fake, server)
    target = setup.admission.targets["qwen"]
    assert target is not lookalike and target.tracker is not lookalike.tracker
    assert target.discovered is not None and target.discovered.pid == 101
    assert setup.wiring.unwired == ["qwen"] and setup.names == {"qwen"}
    for _ in range(3):
        setup.discover(fake, server)
    assert setup.names == {"qwen"} and setup.refused("name_owned") == 1
    setup.discover(fake)  # root's server restarts: the look-alike waits, refused
    setup.discover(fake, after=KEEP_FOR / 2)
    assert setup.admission.targets["qwen"] is target and target.discovered.pid == 101


def test_between_ordinary_users_a_name_is_its_first_holders_until_keep_for_after() -> None:
    setup = discovering()
    theirs = found("qwen", 202, uid=1001, start_ticks=7000)
    setup.discover(found("qwen", 101, uid=1000), theirs)
    assert setup.admission.targets["qwen"].discovered.pid == 101  # type: ignore[union-attr]
    assert setup.refused("name_owned") == 1
    setup.discover(theirs)  # the holder went: its gap
    setup.discover(theirs, after=KEEP_FOR - INTERVAL)
    assert setup.admission.targets["qwen"].discovered.pid == 101  # type: ignore[union-attr]
    setup.discover(theirs)  # keep_for after it went: the name is free
    setup.discover(theirs)
    assert setup.admission.targets["qwen"].discovered.pid == 202  # type: ignore[union-attr]


def test_two_servers_of_one_user_with_one_name_keep_theirs_across_each_others_restarts() -> None:
    """The elder keeps the name, the younger is NAME-PID while it runs; the elder's restart gap
    renames neither, and its next process takes the name back."""
    setup = discovering()
    elder, younger = found("qwen", 101, start_ticks=1000), found("qwen", 102, start_ticks=2000)
    setup.discover(younger, elder)
    assert setup.names == {"qwen", "qwen-102"}
    setup.discover(younger)  # the elder restarts
    setup.discover(younger)
    assert setup.admission.targets["qwen-102"].gone_since is None
    assert setup.admission.targets["qwen"].gone_since is not None
    setup.discover(younger, found("qwen", 111, start_ticks=3000))
    assert setup.names == {"qwen", "qwen-102"} and setup.refused("name_owned") == 0
    assert setup.admission.targets["qwen"].discovered.pid == 111  # type: ignore[union-attr]


def test_a_routers_model_servers_are_named_after_their_router_as_it_is_named() -> None:
    """Two routers of one user with one name (`NAME`, `NAME-PID`): each router's model server
    is `<its router's name>/<model>`, never the other router's."""
    setup = discovering()
    first, second = found("llamacpp-8080", 101, start_ticks=1000), found("llamacpp-8080", 102)
    models = [
        replace(found("llamacpp-8080/tiny", pid, start_ticks=6000 + pid), router_pid=router)
        for pid, router in ((201, 101), (202, 102))
    ]
    setup.discover(first, second, *models)
    watched = {name: target.discovered.pid for name, target in setup.admission.targets.items()}  # type: ignore[union-attr]
    assert watched == {
        "llamacpp-8080": 101,
        "llamacpp-8080/tiny": 201,
        "llamacpp-8080-102": 102,
        "llamacpp-8080-102/tiny": 202,
    }


def test_after_an_exporter_restart_history_says_whose_a_name_was_for_keep_for() -> None:
    setup = discovering()
    setup.wiring.owners["qwen"] = 1000  # its last load was uid 1000's server's
    theirs = found("qwen", 202, uid=1001)
    setup.discover(theirs)
    setup.discover(theirs, after=KEEP_FOR - INTERVAL - PASS)
    assert setup.names == set() and setup.refused("name_owned") == 1
    setup.discover(theirs, after=PASS + INTERVAL)  # keep_for since the start: free
    assert setup.names == {"qwen"}
    later = discovering()
    later.wiring.owners["qwen"] = 1000
    later.discover(found("qwen", 303, uid=1000))  # its owner's own server: its name
    assert later.names == {"qwen"} and later.refused("name_owned") == 0


def test_roots_server_is_never_crowded_out_by_other_users_targets() -> None:
    """max_targets full of two users' servers: root's is admitted, the newest target of the
    user holding most gives way (said), and no ordinary user's newcomer takes the place of
    root's gone server in its restart gap."""
    setup = discovering(max_targets=5, per_user=3)
    many = [found(f"a{i}", 10 + i, uid=1000, start_ticks=100 + i, port=8000 + i) for i in range(3)]
    few = [found(f"b{i}", 20 + i, uid=1001, start_ticks=200 + i, port=8100 + i) for i in range(2)]
    setup.discover(*many, *few)
    assert len(setup.names) == 5
    server = found("root-model", 1, uid=ROOT, start_ticks=50, port=9000)
    setup.discover(*many, *few, server)
    assert setup.names == {"a0", "a1", "b0", "b1", "root-model"}  # a2, the newest of uid 1000's
    assert setup.refused("max_targets") == 1
    setup.discover(*many, *few)  # root's server restarts
    newcomer = found("c0", 30, uid=1002, start_ticks=300, port=8200)
    setup.discover(*many, *few, newcomer)
    assert "root-model" in setup.names and "c0" not in setup.names
    setup.discover(*many, *few, newcomer, replace(server, pid=2, start_ticks=60))
    assert setup.admission.targets["root-model"].discovered.pid == 2  # type: ignore[union-attr]


# -- which targets a server is watched as ---------------------------------------------------

READY = "/v2/models/{model}/ready"


def triton(
    models: tuple[str, ...], weights: tuple[str, ...] = ("/models/repo",)
) -> DiscoveredServer:
    return DiscoveredServer(
        kind="triton",
        name="triton-repo-8000",
        pid=4242,
        start_ticks=99,
        start_time=1.0e9,
        url="http://127.0.0.1:8000",
        probe=ProbeKind.HEALTH,
        probe_path="/v2/health/ready",
        model=models[0] if len(models) == 1 else None,
        weights=weights,
        weights_include=("*.safetensors",),
        reachable=True,
        evidence=(),
        models=models,
        model_ready_path=READY,
    )


@pytest.mark.parametrize("models", [(), ("tiny",)])
def test_a_server_of_one_model_or_none_is_one_target(models: tuple[str, ...]) -> None:
    server = triton(models)
    [own] = targets_of(server)
    assert own.name == server.name and own.endpoint.path == "/v2/health/ready"
    assert not models_apart(server) and model_of(own, server) is None


def test_a_repository_of_several_models_is_a_target_per_model_beside_the_servers() -> None:
    """Each model: `<server>/<model>`, its own ready answer (the name quoted in the path), its
    model's directory under every weight path (one seen through /proc/PID/root too), the
    server's process; the server's own target is unchanged."""
    server = triton(("llama 3#8b", "tiny"), ("/proc/4242/root/models/repo",))
    own, llama, tiny = targets_of(server)
    assert own.name == server.name and own.weights is not None
    assert own.weights.paths == server.weights  # the whole repository: the process's load
    assert own.endpoint.path == "/v2/health/ready" and model_of(own, server) is None
    assert (llama.name, tiny.name) == ("triton-repo-8000/llama-3-8b", "triton-repo-8000/tiny")
    assert llama.endpoint.path == "/v2/models/llama%203%238b/ready"
    assert llama.endpoint.url == own.endpoint.url and llama.endpoint.probe is ProbeKind.HEALTH
    assert llama.weights is not None and tiny.weights is not None
    assert llama.weights.paths == ("/proc/4242/root/models/repo/llama 3#8b",)
    assert tiny.weights.include == ("*.safetensors",)
    assert llama.process == tiny.process == own.process
    assert (model_of(llama, server), model_of(tiny, server)) == ("llama 3#8b", "tiny")
    assert model_of(tiny, None) is None  # a configured target is no model's


# -- with whose rights a target's files are touched -----------------------------------------


def test_a_discovered_process_is_read_for_with_its_rights_while_it_is_that_process() -> None:
    actor = Actor()
    try:
        assert on_behalf(actor, "/proc", None) is None  # configured: the exporter's own rights
        assert on_behalf(actor, "/proc", replace(found("x", 1), rights=None)) is None
        with sleeping() as proc:
            stat = read_stat("/proc", proc.pid)
            assert stat is not None
            server = found("x", proc.pid, uid=NOBODY, start_ticks=stat.start_ticks)
            behalf = on_behalf(actor, "/proc", server)
            assert behalf is not None and behalf.rights == Rights(NOBODY, NOBODY, ())
            assert behalf.same()
            reused = on_behalf(actor, "/proc", replace(server, start_ticks=stat.start_ticks - 1))
            assert reused is not None and not reused.same()  # a reused pid: another process
        assert not behalf.same()  # gone
        assert behalf.current() == Rights(NOBODY, NOBODY, ())  # the rights it last had
    finally:
        actor.close()


def test_a_configured_targets_process_lends_its_own_rights_or_none() -> None:
    actor = Actor()
    try:
        with sleeping() as proc:
            behalf = on_behalf_of(actor, "/proc", proc.pid)
            assert behalf.pid == proc.pid and behalf.same()
            assert behalf.rights.uid == Path(f"/proc/{proc.pid}").stat().st_uid
        with pytest.raises(ProcessLookupError):
            on_behalf_of(actor, "/proc", proc.pid)
    finally:
        actor.close()


def test_a_process_gone_between_its_credentials_and_its_start_lends_none(tmp_path: Path) -> None:
    """A /proc tree where a process's status was read and its stat is gone (it exited in
    between): no start to tell a reused pid by, so nothing is read for it."""
    actor = Actor()
    try:
        with sleeping() as proc:
            entry = tmp_path / str(proc.pid)
            entry.mkdir()
            (entry / "status").write_bytes(Path(f"/proc/{proc.pid}/status").read_bytes())
            with pytest.raises(ProcessLookupError):
                on_behalf_of(actor, str(tmp_path), proc.pid)
            (entry / "stat").write_bytes(Path(f"/proc/{proc.pid}/stat").read_bytes())
            assert on_behalf_of(actor, str(tmp_path), proc.pid).same()
    finally:
        actor.close()


@pytest.mark.requires("root", "setpriv")
def test_a_process_holding_lent_rights_lends_none() -> None:
    """Real uid nobody, effective root, as a setuid program runs: Borrowed."""
    actor = Actor()
    proc = subprocess.Popen(["setpriv", f"--ruid={NOBODY}", "sleep", "60"])
    try:
        wait_for(lambda: Path(f"/proc/{proc.pid}/comm").read_text() == "sleep\n")
        with pytest.raises(Borrowed):
            on_behalf_of(actor, "/proc", proc.pid)
    finally:
        proc.kill()
        proc.wait()
        actor.close()
