"""`model-load-exporter mcp` as a subprocess, driven over stdio by the MCP SDK's own client as an
agent's host drives it, against a real exporter (`serve`) watching the real simulator load real
(evicted) shard files, whose log gives the server's fatal line."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pytest
from helpers.documents import status, target
from helpers.mcp_agent import Agent
from helpers.processes import Host
from helpers.scripted import ScriptedExporter
from helpers.support import free_port

from exporter.exposition import api
from exporter.exposition.http.webconfig import WebConfig

pytestmark = pytest.mark.system

AGENTS_DOC = Path(__file__).parent.parent / "docs" / "agents.md"
SHARDS, SHARD_SIZE = 4, 16 << 20  # 64 MiB at 40 MB/s: under two seconds of weights
TOOLS = {"list_targets", "wait_for_target", "restart_forecast", "recent_loads", "where_to_start"}


def assert_spoke_only_the_protocol(agent: Agent) -> None:
    """Nothing but JSON-RPC on stdout, and no traceback on stderr either."""
    assert agent.stray_output == []
    assert "Traceback" not in agent.stderr(), agent.stderr()


@pytest.fixture(scope="module")
def host(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Host]:
    tmp = tmp_path_factory.mktemp("mcp")
    running = Host(tmp, SHARDS, SHARD_SIZE, "--log.source", f"file:{tmp / 'server.log'}")
    yield running
    running.close()


@pytest.fixture(scope="module")
def agent(host: Host) -> Iterator[Agent]:
    session = Agent(host.tmp / "mcp.stderr", "--exporter", host.exporter.url)
    yield session
    session.close()
    assert_spoke_only_the_protocol(session)


@pytest.fixture
def agent_for(tmp_path: Path) -> Iterator[Any]:
    """Another MCP server, with other flags or environment, closed (and checked) after the test."""
    started: list[Agent] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Agent:
        started.append(Agent(tmp_path / f"mcp-{len(started)}.stderr", *args, env=env))
        return started[-1]

    yield start
    for session in started:
        session.close()
        assert_spoke_only_the_protocol(session)


def test_tools_are_listed_with_their_schemas(agent: Agent) -> None:
    tools = {tool.name: tool for tool in agent.tools()}
    assert set(tools) == TOOLS
    for tool in tools.values():
        assert tool.description and len(tool.description) > 60, tool.name
        assert tool.annotations is not None and tool.annotations.read_only_hint
        assert tool.output_schema is not None and tool.output_schema["type"] == "object"
    wait = tools["wait_for_target"].input_schema
    assert wait["required"] == ["target"]
    assert wait["properties"]["max_seconds"]["type"] == "number"
    assert wait["properties"]["max_seconds"]["exclusiveMinimum"] == 0
    assert wait["properties"]["max_seconds"]["default"] < 120  # inside an agent's tool limit
    result = tools["wait_for_target"].output_schema["properties"]["result"]  # type: ignore[index]
    assert result["enum"] == ["ready", "failed", "loading"]
    loads = tools["recent_loads"].input_schema
    assert "required" not in loads
    assert (loads["properties"]["limit"]["minimum"], loads["properties"]["limit"]["maximum"]) == (
        1,
        1000,
    )
    assert tools["restart_forecast"].input_schema["required"] == ["target"]
    assert tools["list_targets"].input_schema["properties"] == {}


def test_the_agents_doc_registers_the_server_and_lists_every_tool(agent: Agent) -> None:
    section = AGENTS_DOC.read_text()
    snippet = section.split("```json\n", 1)[1].split("```", 1)[0]
    (server,) = json.loads(snippet)["mcpServers"].values()
    assert server["command"] == "model-load-exporter" and server["args"][0] == "mcp"
    rows = re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)
    assert sorted(rows) == sorted(tool.name for tool in agent.tools())


@pytest.fixture(scope="module")
def load(host: Host, agent: Agent) -> dict[str, Any]:
    """One cold load as an agent follows it: a short wait while the weights stream in, the list
    then, and a second wait through to ready."""
    sim = host.simulate()
    host.exporter.until("loading_weights")
    first = agent.answer("wait_for_target", {"target": "sim", "max_seconds": 0.3})
    listed = agent.answer("list_targets")
    second = agent.answer("wait_for_target", {"target": "sim"})
    return {"first": first, "listed": listed, "second": second, "report": sim.result()}


def test_wait_returns_loading_with_progress_then_ready(load: dict[str, Any]) -> None:
    first, second, report = load["first"], load["second"], load["report"]
    assert (first["result"], first["phase"], first["in_progress"]) == (
        "loading",
        "loading_weights",
        True,
    )
    assert 0 < first["progress_ratio"] < 1
    assert 0.3 <= first["waited_seconds"] < 1.5
    assert first["elapsed_seconds"] > 0 and first["load_seconds"] is None
    assert re.fullmatch(
        r"still loading: sim loading_weights \d+ %, (ETA \S+|no ETA), elapsed \d+\.\ds; "
        r"call wait_for_target again to keep waiting",
        first["summary"],
    ), first["summary"]
    assert (second["result"], second["phase"], second["cache"]) == ("ready", "ready", "cold")
    assert second["progress_ratio"] == 1.0 and second["server_text"] is None
    assert abs(second["load_seconds"] - report["load_seconds"]) < 1.0
    assert re.fullmatch(
        r"sim: ready after \d+\.\ds, cold cache; waited \d+\.\ds", second["summary"]
    ), second["summary"]


def test_list_targets_while_loading_and_after(load: dict[str, Any], agent: Agent) -> None:
    (during,) = load["listed"]["targets"]
    assert during["target"] == "sim" and during["phase"] in ("loading_weights", "initializing")
    assert during["in_progress"] and during["elapsed_seconds"] > 0 and not during["stalled"]
    assert during["summary"].startswith(f"sim: {during['phase']} ")
    (after,) = agent.answer("list_targets")["targets"]
    assert (after["phase"], after["server"], after["cache"]) == ("ready", "sglang", "cold")
    assert after["in_progress"] is False and after["eta_seconds"] is None
    assert after["elapsed_seconds"] is None
    assert re.fullmatch(r"sim: ready after \d+\.\ds, cold cache", after["summary"])


def test_recent_loads_after_the_load(load: dict[str, Any], agent: Agent) -> None:
    (newest,) = agent.answer("recent_loads", {"target": "sim", "limit": 1})["loads"]
    assert (newest["target"], newest["outcome"], newest["cache"]) == ("sim", "ready", "cold")
    assert abs(newest["duration_seconds"] - load["report"]["load_seconds"]) < 1.0
    # The exporter's record as it carries it, whatever fields it has, plus a summary line.
    assert {"phase_seconds", "weights_bytes", "partial", "server_text"} <= set(newest)
    assert newest["phase_seconds"]["loading_weights"] > 0
    assert re.fullmatch(
        r"sim: ready after \d+\.\ds, cold cache, started \d{4}-\d\d-\d\d \d\d:\d\d:\d\d",
        newest["summary"],
    ), newest["summary"]
    assert agent.answer("recent_loads")["loads"][0] == newest


def test_restart_forecast_says_why_there_is_none(agent: Agent) -> None:
    """Before any load finished: the residency is measured, the rates to go with it are not."""
    answer = agent.answer("restart_forecast", {"target": "sim"})
    assert (answer["available"], answer["seconds"]) == (False, None)
    assert 0.0 <= answer["resident_share"] <= 1.0
    # None finished yet, or one cold load that cannot say how fast the page cache delivers.
    assert answer["reason"] in (
        "no finished load of this target in history",
        "no warm load in history to time the page cache",
    )
    assert answer["summary"] == f"sim: no restart forecast: {answer['reason']}"


def forecasts(elapsed: float, began: float) -> dict[str, Any]:
    """A status as the exporter will write it once restart forecasts exist."""
    known = api.RestartForecast(seconds=42.5, resident_share=0.97, reason="warm: 97 % resident")
    unknown = api.RestartForecast(seconds=None, resident_share=None, reason="no past load to go by")
    return status(
        began + elapsed,
        target("warm", "ready", restart_forecast=known),
        target("new", "ready", restart_forecast=unknown),
    )


def test_restart_forecast_when_the_exporter_has_one(agent_for: Any) -> None:
    server = ScriptedExporter(forecasts)
    try:
        agent = agent_for("--exporter", server.url)
        warm = agent.answer("restart_forecast", {"target": "warm"})
        new = agent.answer("restart_forecast", {"target": "new"})
    finally:
        server.close()
    assert (warm["available"], warm["seconds"], warm["resident_share"]) == (True, 42.5, 0.97)
    assert warm["summary"] == (
        "warm: a restart now would be ready in about 42s, 97 % of the weights in page cache "
        "(warm: 97 % resident)"
    )
    assert (new["available"], new["seconds"], new["reason"]) == (
        False,
        None,
        "no past load to go by",
    )
    assert new["summary"] == "new: no restart forecast: no past load to go by"


@pytest.fixture(scope="module")
def failed_load(load: dict[str, Any], host: Host, agent: Agent) -> dict[str, Any]:
    host.simulate("--crash-at", "0.5")
    return agent.answer("wait_for_target", {"target": "sim", "max_seconds": 30})


def test_a_failed_load_comes_with_the_servers_fatal_line(failed_load: dict[str, Any]) -> None:
    assert (failed_load["result"], failed_load["phase"]) == ("failed", "failed")
    fatal = failed_load["server_text"]["fatal"]
    assert fatal.startswith("Rank 0 scheduler died during initialization"), fatal
    assert "simulated crash after loading 50% of weights" in fatal
    assert failed_load["load_seconds"] > 0 and "fatal" not in failed_load
    assert re.fullmatch(  # the exporter's words only: the server's are in server_text
        r"sim: failed after \d+\.\ds, cold cache \(the server's own words: server_text\.fatal\); "
        r"waited \d+\.\ds",
        failed_load["summary"],
    ), failed_load["summary"]


def test_a_settled_outcome_answers_at_once_even_to_a_long_ask(
    failed_load: dict[str, Any], agent: Agent
) -> None:
    """Past the cap is not an error; the failure already there counts once the exporter had two
    sample intervals (0.5 s here) to see a restart, so the answer comes well before any cap."""
    again = agent.answer("wait_for_target", {"target": "sim", "max_seconds": 1000})
    assert (again["result"], again["server_text"]) == ("failed", failed_load["server_text"])
    assert 0.5 <= again["waited_seconds"] < 2.0


@pytest.mark.parametrize(
    ("tool", "arguments", "message"),
    [
        ("wait_for_target", {"target": "nope"},
         "unknown target 'nope' (the exporter watches: sim)"),
        ("restart_forecast", {"target": "nope"}, "unknown target 'nope'"),
        ("recent_loads", {"target": "nope"}, "unknown target 'nope'"),
        ("wait_for_target", {"target": "sim", "max_seconds": -1},
         "invalid arguments: max_seconds: Input should be greater than 0 (got -1)"),
        ("wait_for_target", {"target": "sim", "max_seconds": 0},
         "max_seconds: Input should be greater than 0"),
        ("wait_for_target", {"target": "sim", "max_seconds": "soon"},
         "max_seconds: Input should be a valid number, unable to parse string as a number "
         "(got 'soon')"),
        ("wait_for_target", {"target": "sim", "max_seconds": "inf"}, "max_seconds: Input should "),
        ("wait_for_target", {"max_seconds": 5}, "invalid arguments: target: required"),
        ("recent_loads", {"limit": 0}, "limit: Input should be greater than or equal to 1"),
        ("recent_loads", {"limit": 1001}, "limit: Input should be less than or equal to 1000"),
        ("list_everything", {}, "Unknown tool: list_everything"),
    ],
)  # fmt: skip
def test_errors_are_one_line_tool_errors(
    agent: Agent, tool: str, arguments: dict[str, Any], message: str
) -> None:
    assert message in agent.error(tool, arguments)
    (target,) = agent.answer("list_targets")["targets"]  # still answering
    assert target["target"] == "sim"


def test_exporter_down_is_a_tool_error(agent_for: Any) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    agent = agent_for("--exporter", url)
    refused = f"cannot reach the exporter at {url}: connection refused"
    for tool, arguments in [
        ("list_targets", {}),
        ("wait_for_target", {"target": "sim"}),
        ("restart_forecast", {"target": "sim"}),
        ("recent_loads", {}),
        ("where_to_start", {}),
    ]:
        assert agent.error(tool, arguments).endswith(refused)
    assert {tool.name for tool in agent.tools()} == TOOLS  # the server itself is fine


def test_where_to_start_with_prometheus_down_is_a_tool_error(agent: Agent, agent_for: Any) -> None:
    """The fleet's answer is Prometheus's: with it down, no host's answer stands in for it."""
    url = f"http://127.0.0.1:{free_port()}"
    fleet = agent_for("--exporter", "http://127.0.0.1:9", "--prometheus", url)
    message = fleet.error("where_to_start", {"model": "sim"})
    assert message.endswith(f"cannot reach Prometheus at {url}: connection refused")
    # Without --prometheus: this host's own answer, said to be that.
    own = agent.answer("where_to_start", {"model": "sim"})
    assert own["scope"] == "host" and [h["model"] for h in own["hosts"]] == ["sim"]
    assert own["summary"].endswith("[this host only: " + own["source"] + "]")


def test_bad_auth_is_a_tool_error(
    start_exporter: Any, model_server: Any, agent_for: Any, tmp_path: Path
) -> None:
    web = WebConfig(basic_auth_users={"ops": bcrypt.hashpw(b"s3cret", bcrypt.gensalt(rounds=4))})
    running = start_exporter(
        {"targets": [{"name": "m", "endpoint": {"url": model_server.url}}]}, web
    )
    url = running.url.replace("http://", "http://ops@")
    wrong = agent_for("--exporter", url, env={"MODEL_LOAD_EXPORTER_PASSWORD": "nope"})
    message = wrong.error("list_targets")
    assert "401 Unauthorized" in message and "nope" not in message
    right = agent_for("--exporter", url, env={"MODEL_LOAD_EXPORTER_PASSWORD": "s3cret"})
    assert [t["target"] for t in right.answer("list_targets")["targets"]] == ["m"]


def test_without_the_sdk_mcp_exits_1_with_one_line() -> None:
    code = "import sys; sys.modules['mcp'] = None; from exporter.cli import main; sys.exit(main())"
    result = subprocess.run(
        [sys.executable, "-c", code, "mcp"], capture_output=True, text=True, timeout=30
    )
    assert result.returncode == 1
    assert result.stdout == ""
    assert result.stderr == (
        "model-load-exporter mcp: error: the MCP SDK is not installed (no module mcp): "
        "pip install 'model-load-exporter[mcp]'\n"
    )
