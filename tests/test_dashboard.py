"""The committed dashboard and rules, checked without a running Prometheus: the JSON is what the
generator builds, Grafana's own SDK reads it back unchanged, every query honours the variables,
and promtool accepts and unit-tests the rules and the example config."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.cog.plugins import register_default_plugins
from grafana_foundation_sdk.models import prometheus as prometheus_model
from grafana_foundation_sdk.models.dashboard import Dashboard, Panel

from exporter.vocabulary import Cache, Phase

REPO = Path(__file__).resolve().parents[1]
DASHBOARD = REPO / "grafana" / "dashboards" / "model-load.json"
RULES = REPO / "prometheus" / "rules" / "model-load.yml"
# Grafana's import envelope: read by the import dialog, not part of the dashboard model.
ENVELOPE = ("__inputs", "__requires")


def load_generator() -> ModuleType:
    """grafana/generate.py as a module (grafana/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "grafana_generate", REPO / "grafana" / "generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def committed() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def panel_queries(dashboard: dict[str, Any]) -> list[tuple[str, str, str, bool]]:
    """(panel title, refId, expr, instant) of every query in the dashboard JSON."""
    return [
        (panel["title"], target["refId"], target["expr"], bool(target.get("instant")))
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    ]


def datasource_refs(node: Any) -> Any:
    """Every datasource reference in the dashboard JSON (the datasource variable's own type
    is a plain string and not a reference)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "datasource" and isinstance(value, dict):
                yield value
            else:
                yield from datasource_refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from datasource_refs(item)


def test_committed_json_is_what_the_generator_builds() -> None:
    generator = load_generator()
    dashboard, _ = generator.build()
    assert DASHBOARD.read_text() == generator.render(dashboard), "run `make dashboards`"


def test_check_flag_reports_a_stale_json(tmp_path: Path) -> None:
    generator = load_generator()
    assert generator.main(["--check"]) == 0
    stale = tmp_path / "model-load.json"
    stale.write_text("{}\n")
    setattr(generator, "OUTPUT", stale)  # noqa: B010 (a module loaded from its file)
    assert generator.main(["--check"]) == 1


def test_json_round_trips_through_the_sdk_model() -> None:
    register_default_plugins()
    data = committed()
    body = {key: value for key, value in data.items() if key not in ENVELOPE}
    model = Dashboard.from_json(body)
    assert json.loads(JSONEncoder().encode(model)) == body
    # Typed all the way down: the SDK recognised every panel and every Prometheus query,
    # rather than carrying unknown dicts through.
    panels = [p for p in model.panels or [] if isinstance(p, Panel)]
    assert panels and all(not isinstance(p.options, dict) for p in panels)
    queries = [q for p in panels for q in p.targets or []]
    assert len(queries) == len(panel_queries(data))
    assert all(isinstance(q, prometheus_model.Dataquery) for q in queries)


def test_every_query_is_tagged_with_a_moment_and_honours_the_variables() -> None:
    """Per host, every query honours both variables; the fleet row shows every host whatever
    is selected, its aggregates read from the shipped recording rules (cheap at any size)."""
    generator = load_generator()
    _, tagged = generator.build()
    data = committed()
    in_json = panel_queries(data)
    assert [(q.panel, q.ref_id, q.expr, q.instant) for q in tagged] == in_json
    titles = [p["title"] for p in data["panels"]]
    assert len(titles) == len(set(titles)), "panel titles identify queries: keep them unique"
    rules = yaml.safe_load(RULES.read_text())
    recorded = {r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r}
    fleet = [q for q in tagged if q.row == generator.FLEET]
    assert fleet and len(fleet) < len(tagged)
    for query in tagged:
        where = (query.panel, query.ref_id)
        if query.row != generator.FLEET:
            assert '=~"$instance"' in query.expr and '=~"$target"' in query.expr, where
            continue
        assert "$" not in query.expr, where
        read = set(re.findall(r"[a-z_]*:[a-z0-9_:]+", query.expr))
        assert read <= recorded, where
        assert read or " by " not in query.expr, f"{where}: aggregate it in a recording rule"


def test_one_host_by_default_and_all_its_targets() -> None:
    variables = {v["name"]: v for v in committed()["templating"]["list"]}
    assert "current" not in variables["instance"]  # Grafana selects the first host
    assert variables["target"]["current"]["value"] == "$__all"


def test_state_panels_know_every_phase_and_cache_temperature() -> None:
    generator = load_generator()
    assert list(generator.PHASE_COLORS) == list(Phase)
    assert list(generator.CACHE_COLORS) == list(Cache)


def test_importable_into_a_fresh_grafana() -> None:
    data = committed()
    inputs = data["__inputs"]
    assert [(i["name"], i["type"], i["pluginId"]) for i in inputs] == [
        ("DS_PROMETHEUS", "datasource", "prometheus")
    ]
    variables = {v["name"]: v for v in data["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "target"):
        assert variables[name]["multi"] and variables[name]["includeAll"]
    refs = list(datasource_refs(data))
    assert len(refs) > len(data["panels"])  # panels, their queries, the two query variables
    assert all(ref == {"type": "prometheus", "uid": "${datasource}"} for ref in refs), refs
    assert "id" not in data  # Grafana assigns its own on import


def test_provisioning_points_at_the_dashboards() -> None:
    provisioning = REPO / "grafana" / "provisioning"
    source = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())
    [datasource] = source["datasources"]
    assert datasource["type"] == "prometheus" and datasource["isDefault"]
    providers = yaml.safe_load((provisioning / "dashboards" / "model-load.yml").read_text())
    [provider] = providers["providers"]
    assert provider["type"] == "file"
    assert provider["options"]["path"].endswith("/dashboards")


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    "args",
    [
        ("check", "rules", str(RULES)),
        ("test", "rules", str(REPO / "prometheus" / "tests" / "model-load.test.yml")),
        ("check", "config", str(REPO / "prometheus" / "prometheus.yml")),
    ],
    ids=["check-rules", "test-rules", "check-config"],
)
def test_promtool(args: tuple[str, ...]) -> None:
    result = promtool(*args)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_is_tested_firing_and_quiet() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"] if "alert" in r}
    tests = yaml.safe_load((REPO / "prometheus" / "tests" / "model-load.test.yml").read_text())
    firing: set[str] = set()
    quiet: set[str] = set()
    for case in tests["tests"]:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else quiet).add(check["alertname"])
    assert firing == set(alerts) and quiet == set(alerts)
    for name, rule in alerts.items():
        assert "for" in rule and rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description", "runbook"} <= set(rule["annotations"]), name


def test_readme_lists_every_panel_and_alert() -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Dashboard and alerts", 1)[1].split("\n## ", 1)[0]
    titles = [p["title"] for p in committed()["panels"] if p["type"] != "row"]
    rules = yaml.safe_load(RULES.read_text())
    names = [r.get("alert") or r["record"] for g in rules["groups"] for r in g["rules"]]
    missing = [name for name in titles + names if name not in section]
    assert not missing, f"README's 'Dashboard and alerts' does not mention {missing}"
