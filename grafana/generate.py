"""Generate grafana/dashboards/model-load.json with Grafana's own SDK (grafana-foundation-sdk).

    python grafana/generate.py            # rewrite the committed JSON (`make dashboards`)
    python grafana/generate.py --check    # exit 1 when the committed JSON is not what this builds

The dashboard is code so that every panel's query can be tested: each query carries the moment
of a model's life at which it must return data (`Moment`), and tests/test_dashboard_prometheus.py
runs every query of the committed JSON against a real Prometheus scraping the exporter at that
moment. No datasource UID is hard-coded: panels use the `datasource` variable, and the import
envelope (`__inputs`) makes Grafana's import dialog ask which Prometheus to use.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from importlib import metadata
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import (
    bargauge,
    heatmap,
    prometheus,
    stat,
    statetimeline,
    table,
    timeseries,
)
from grafana_foundation_sdk.builders.common import (
    HideSeriesConfig,
    ReduceDataOptions,
    TableSortByFieldState,
    VizLegendOptions,
)
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models import dashboard as model
from grafana_foundation_sdk.models.prometheus import PromQueryFormat

from exporter.vocabulary import Cache, Phase

OUTPUT = Path(__file__).resolve().parent / "dashboards" / "model-load.json"
DS_INPUT = "DS_PROMETHEUS"
DATASOURCE = model.DataSourceRef(type_val="prometheus", uid="${datasource}")
# Every query but the fleet row's filters on both variables. Host-wide series (disks, memory,
# GPUs) have no target label: they are kept to the hosts that run a selected target.
SEL = 'instance=~"$instance", target=~"$target"'
HOSTS = f"and on (instance) model_load_target_info{{{SEL}}}"
# The row that shows every host whatever is selected, from the shipped recording rules
# (prometheus/rules/model-load.yml): at 1,000 hosts a join over every target at each refresh
# would cost seconds, the recorded series per model or per job cost nothing.
FLEET = "Fleet"
PHASE_COLORS: dict[str, str] = {
    Phase.DOWN: "text",
    Phase.STARTING: "blue",
    Phase.LOADING_WEIGHTS: "purple",
    Phase.INITIALIZING: "yellow",
    Phase.READY: "green",
    Phase.FAILED: "red",
}
CACHE_COLORS: dict[str, str] = {
    Cache.COLD: "blue",
    Cache.WARM: "orange",
    Cache.MIXED: "yellow",
    Cache.UNKNOWN: "text",
    Cache.BYPASS: "purple",
}
READY_COLORS = {"not ready": "orange", "ready": "green"}
ALL = model.VariableOption(text="All", value="$__all")
STALL_COLORS = {"moving": "green", "STALLED": "red"}
PER_TARGET = "{{target}} · {{instance}}"
S, TABLE, HEATMAP = "s", PromQueryFormat.TABLE, PromQueryFormat.HEATMAP


class Moment(StrEnum):
    """When in a model's life a query must return data (what the Prometheus test checks)."""

    WATCHING = "watching"  # the exporter is scraped and watches a target
    LOADING = "loading"  # a load's weights stream in (the target's first load: no history)
    RELOADING = "reloading"  # a later load of the target: history says how long it should take
    FINISHED = "finished"  # a load has finished
    GPU = "gpu"  # NVML sees the host's GPUs
    SERVING = "serving"  # a ready server holds GPU memory
    FORECAST = "forecast"  # history holds a cold and a warm load: a restart has a forecast


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str
    moment: Moment
    instant: bool
    fmt: PromQueryFormat | None = None

    def build(self, ref_id: str) -> prometheus.Dataquery:
        query = prometheus.Dataquery().ref_id(ref_id).expr(self.expr).datasource(DATASOURCE)
        query = query.legend_format(self.legend)
        query = query.instant() if self.instant else query.range()
        return query if self.fmt is None else query.format(self.fmt)


def now(expr: str, legend: str, moment: Moment, fmt: PromQueryFormat | None = None) -> Query:
    """An instant query: the value at the dashboard's end time."""
    return Query(expr, legend, moment, True, fmt)


def over(expr: str, legend: str, moment: Moment, fmt: PromQueryFormat | None = None) -> Query:
    """A range query over the dashboard's time range."""
    return Query(expr, legend, moment, False, fmt)


@dataclass(frozen=True)
class PanelQuery:
    """One query of the generated dashboard with its moment and row, as the tests read it."""

    panel: str
    ref_id: str
    expr: str
    instant: bool
    moment: Moment
    row: str


def t(metric: str, extra: str = "") -> str:
    """`metric` of the selected targets on the selected hosts."""
    return f"{metric}{{{extra}{', ' if extra else ''}{SEL}}}"


def host(metric: str) -> str:
    """A host-wide `metric` of the hosts that run a selected target."""
    return f'{metric}{{instance=~"$instance"}} {HOSTS}'


def codes(metric: str, label: str, values: Iterable[str]) -> str:
    """A state set as one number per target: the index of the value that is 1 (see `mapping`)."""
    states = []
    for code, value in enumerate(values):
        selector = t(metric, f'{label}="{value}"')
        states.append(f"({selector} == 1) * {code}")
    return f"max by (instance, target) ({' or '.join(states)})"


SHARE_CACHED = (
    f"{t('model_load_weights_resident_bytes')} / on (job, instance, target) "
    f"{t('model_load_weights_bytes')}"
)
# The median of recent loads of the cache temperature the current (or last) load has.
EXPECTED_NOW = (
    f"{t('model_load_expected_duration_seconds')} * on (job, instance, target, cache) "
    f"({t('model_load_cache_temperature')} == 1)"
)


def mapping(colors: Mapping[str, str]) -> list[model.ValueMapping]:
    """Value i shows as the i-th name (underscores as spaces) in its color."""
    return [
        model.ValueMap(
            options={
                str(i): model.ValueMappingResult(text=name.replace("_", " "), color=color, index=i)
                for i, (name, color) in enumerate(colors.items())
            }
        )
    ]


def steps(*pairs: tuple[float | None, str]) -> ThresholdsConfig:
    thresholds = [model.Threshold(value=value, color=color) for value, color in pairs]
    return ThresholdsConfig().mode(model.ThresholdsMode.ABSOLUTE).steps(thresholds)


def big(unit: str = "none") -> stat.Panel:
    return (
        stat.Panel()
        .unit(unit)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .text_mode(common.BigValueTextMode.VALUE_AND_NAME)
        .graph_mode(common.BigValueGraphMode.NONE)
    )


def bars(unit: str) -> bargauge.Panel:
    return (
        bargauge.Panel()
        .unit(unit)
        .display_mode(common.BarGaugeDisplayMode.GRADIENT)
        .orientation(common.VizOrientation.HORIZONTAL)
        .reduce_options(ReduceDataOptions().calcs(["lastNotNull"]).values(False))
    )


def graph(unit: str, **right_axis: str) -> timeseries.Panel:
    """A time series panel; `right_axis` maps query refIds to the unit of a right-hand axis."""
    legend = VizLegendOptions().show_legend(True).display_mode(common.LegendDisplayMode.LIST)
    panel = timeseries.Panel().unit(unit).min(0).fill_opacity(10).legend(legend)
    for ref_id, axis_unit in right_axis.items():
        panel = panel.override_by_query(
            ref_id,
            [
                field_unit(axis_unit),
                model.DynamicConfigValue(id_val="custom.axisPlacement", value="right"),
            ],
        )
    return panel


def rows(exclude: Sequence[str], rename: dict[str, str] | None = None) -> table.Panel:
    """A table of instant results: labels as columns, without the columns in `exclude`."""
    organize = {"excludeByName": dict.fromkeys(exclude, True), "renameByName": rename or {}}
    return (
        table.Panel()
        .align(common.FieldTextAlignment.AUTO)
        .inspect(False)
        .with_transformation(model.DataTransformerConfig(id_val="merge", options={}))
        .with_transformation(model.DataTransformerConfig(id_val="organize", options=organize))
    )


class Board:
    """The dashboard being built, and every query added to it with its moment."""

    def __init__(self) -> None:
        self.builder = (
            Dashboard("Model loads")
            .uid("model-load")
            .description(
                "What model servers do while they load: phase, weights progress, ETA, stalls, "
                "page-cache residency, GPU memory and load durations (model-load-exporter)."
            )
            .tags(["model-load-exporter", "gpu", "inference"])
            .time("now-1h", "now")
            .refresh("10s")
            .tooltip(model.DashboardCursorSync.CROSSHAIR)
            .with_variable(
                DatasourceVariable("datasource")
                .label("Data source")
                .type("prometheus")
                .current(model.VariableOption(text=f"${{{DS_INPUT}}}", value=f"${{{DS_INPUT}}}"))
            )
            # One host by default (the first): at 1,000 hosts every line of every target is
            # neither readable nor cheap; the fleet row shows them all.
            .with_variable(label_values("instance", "Host", "model_load_target_info"))
            .with_variable(
                label_values(
                    "target", "Target", 'model_load_target_info{instance=~"$instance"}'
                ).current(ALL)
            )
        )
        self.queries: list[PanelQuery] = []
        self._ids = 0
        self._row = ""

    def row(self, title: str) -> None:
        self.builder.with_row(Row(title).id(self._id()))
        self._row = title

    def add(self, title: str, panel: Any, w: int, h: int, *queries: Query) -> None:
        panel.id(self._id()).title(title).datasource(DATASOURCE).span(w).height(h)
        for ref_id, query in zip("ABCDEFGH", queries, strict=False):
            panel.with_target(query.build(ref_id))
            self.queries.append(
                PanelQuery(title, ref_id, query.expr, query.instant, query.moment, self._row)
            )
        self.builder.with_panel(panel)

    def _id(self) -> int:
        self._ids += 1
        return self._ids


def label_values(name: str, label: str, series: str) -> QueryVariable:
    return (
        QueryVariable(name)
        .label(label)
        .datasource(DATASOURCE)
        .query(f"label_values({series}, {name})")
        .refresh(model.VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(model.VariableSort.NATURAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".*")
    )


def load_progress(b: Board) -> None:
    """Per target, now: where each load stands."""
    b.row("Load progress")
    phase = codes("model_load_phase", "phase", PHASE_COLORS)
    b.add(
        "Phase",
        big()
        .mappings(mapping(PHASE_COLORS))
        .color_mode(common.BigValueColorMode.BACKGROUND),
        6, 5,
        now(phase, PER_TARGET, Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Weights loaded",
        bars("percentunit").min(0).max(1).thresholds(steps((None, "blue"), (1, "green"))),
        6, 5,
        now(t("model_load_weights_progress_ratio"), PER_TARGET, Moment.LOADING),
    )  # fmt: skip
    b.add(
        "ETA", big(S), 4, 5,
        now(t("model_load_eta_seconds"), "ready {{target}}", Moment.RELOADING),
        now(t("model_load_weights_eta_seconds"), "weights {{target}}", Moment.LOADING),
    )  # fmt: skip
    b.add(
        "Elapsed vs expected", big(S), 4, 5,
        now(t("model_load_elapsed_seconds"), "elapsed {{target}}", Moment.WATCHING),
        now(EXPECTED_NOW, "expected {{target}} ({{cache}})", Moment.FINISHED),
    )  # fmt: skip
    b.add(
        "Weights throughput", big("Bps"), 4, 5,
        now(t("model_load_weights_throughput_bytes_per_second"), PER_TARGET, Moment.LOADING),
    )  # fmt: skip
    b.add(
        "Stalled",
        big()
        .mappings(mapping(STALL_COLORS))
        .color_mode(common.BigValueColorMode.BACKGROUND),
        4, 4,
        now(t("model_load_stalled"), PER_TARGET, Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Since last progress", big(S), 4, 4,
        now(t("model_load_seconds_since_progress"), PER_TARGET, Moment.LOADING),
    )  # fmt: skip
    b.add(
        "Cache temperature of this load", big().mappings(mapping(CACHE_COLORS)), 6, 4,
        now(
            codes("model_load_cache_temperature", "cache", CACHE_COLORS),
            PER_TARGET,
            Moment.LOADING,
        ),
    )  # fmt: skip
    b.add(
        "Endpoint", big().mappings(mapping(READY_COLORS)), 5, 4,
        now(t("model_load_endpoint_up"), PER_TARGET, Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Weights cached now",
        bars("percentunit").min(0).max(1).thresholds(
            steps((None, "red"), (0.1, "orange"), (0.9, "green"))
        ),
        5, 4,
        now(SHARE_CACHED, PER_TARGET, Moment.WATCHING),
    )  # fmt: skip


def fleet(b: Board) -> None:
    """Every host, whatever is selected: a model served tensor-parallel over several hosts is
    ready when all are. Aggregates come recorded (one series per job or model)."""
    b.row(FLEET)
    b.add(
        "Loads in progress", big(), 5, 6,
        now("sum(job:model_load_in_progress:sum)", "loading", Moment.WATCHING),
        now("sum(job:model_load_hosts_loading:count)", "hosts loading", Moment.LOADING),
    )  # fmt: skip
    b.add(
        "Models ready on every host",
        big().mappings(mapping(READY_COLORS)),
        7, 6,
        now("model:model_load_ready:min", "{{model}}", Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Slowest ETA per model", bars(S), 6, 6,
        now("model:model_load_eta_seconds:max", "{{model}}", Moment.RELOADING),
    )  # fmt: skip
    b.add(
        "Targets not ready", rows(("Time", "Value", "__name__", "job")), 6, 6,
        now("target:model_load_phase:not_ready", "", Moment.LOADING, TABLE),
    )  # fmt: skip
    b.add(
        "Models stalled on a host",
        big().mappings(mapping(STALL_COLORS)).color_mode(common.BigValueColorMode.BACKGROUND),
        5, 6,
        now("model:model_load_stalled:max", "{{model}}", Moment.WATCHING),
    )  # fmt: skip
    placement(b)


def placement(b: Board) -> None:
    """Where each model would start warm (docs/placement.md): per model, its best hosts by the
    share of its weights in their page cache, then by their own restart forecast."""
    b.add(
        "Hosts that would start each model warm",
        bars("none").min(0).thresholds(steps((None, "orange"), (1, "green"))),
        6, 8,
        now("model:model_load_hosts_warm:count", "{{model}}", Moment.WATCHING),
    )  # fmt: skip
    renamed = {"instance": "host", "Value #A": "weights cached", "Value #B": "restart forecast"}
    # Each model's five best hosts, recorded: every host of every model would be 8,000 rows at
    # 1,000 hosts, and choosing the five at each refresh took seconds there.
    cached = "model_instance:model_load_weights_cached:ratio_top5"
    forecast = "model_instance:model_load_restart_forecast_seconds:min_top5"
    b.add(
        "Where each model would start warm",
        rows(("Time", "__name__", "job"), renamed)
        .sort_by([TableSortByFieldState().display_name("weights cached").desc(True)])
        .override_by_name("weights cached", [field_unit("percentunit")])
        .override_by_name("restart forecast", [field_unit(S)]),
        13, 8,
        now(cached, "", Moment.WATCHING, TABLE),
        now(forecast, "", Moment.FORECAST, TABLE),
    )  # fmt: skip


def field_unit(name: str) -> model.DynamicConfigValue:
    """A field override's unit."""
    return model.DynamicConfigValue(id_val="unit", value=name)


def over_time(b: Board) -> None:
    """How the loads went: phases, progress, throughput, residency, GPU memory, probes."""
    b.row("Over time")
    b.add(
        "Phases",
        statetimeline.Panel()
        .mappings(mapping(PHASE_COLORS))
        .show_value(common.VisibilityMode.NEVER)
        .merge_values(True)
        .line_width(0)
        .fill_opacity(70),
        24, 7,
        over(codes("model_load_phase", "phase", PHASE_COLORS), PER_TARGET, Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Weights progress and ETA", graph("percentunit", B=S, C=S), 12, 8,
        over(t("model_load_weights_progress_ratio"), "progress {{target}}", Moment.LOADING),
        over(t("model_load_weights_eta_seconds"), "weights ETA {{target}}", Moment.LOADING),
        over(t("model_load_eta_seconds"), "ready ETA {{target}}", Moment.RELOADING),
    )  # fmt: skip
    b.add(
        "Weights read throughput", graph("Bps"), 12, 8,
        over(
            t("model_load_weights_throughput_bytes_per_second"),
            "weights {{target}}",
            Moment.LOADING,
        ),
        over(
            f'rate(model_load_disk_read_bytes_total{{instance=~"$instance"}}[$__rate_interval])'
            f" {HOSTS}",
            "disk {{device}} · {{instance}}",
            Moment.WATCHING,
        ),
    )  # fmt: skip
    b.add(
        "Weights in page cache", graph("bytes", B="percentunit"), 12, 8,
        over(t("model_load_weights_resident_bytes"), "cached {{target}}", Moment.WATCHING),
        over(SHARE_CACHED, "share {{target}}", Moment.WATCHING),
        over(t("model_load_weights_bytes"), "size {{target}}", Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "Host memory", graph("bytes"), 12, 8,
        over(host("model_load_host_memory_page_cache_bytes"), "page cache · {{instance}}",
             Moment.WATCHING),
        over(host("model_load_host_memory_available_bytes"), "available · {{instance}}",
             Moment.WATCHING),
    )  # fmt: skip
    b.add(
        "GPU memory per device", graph("bytes"), 12, 8,
        over(host("model_load_gpu_memory_used_bytes"), "used GPU {{gpu}} · {{instance}}",
             Moment.GPU),
        over(host("model_load_gpu_memory_total_bytes"), "total GPU {{gpu}} · {{instance}}",
             Moment.GPU),
    )  # fmt: skip
    b.add(
        "GPU memory per target", graph("bytes"), 12, 8,
        over(f"sum by (instance, target) ({t('model_load_process_gpu_memory_bytes')})",
             PER_TARGET, Moment.SERVING),
    )  # fmt: skip
    b.add(
        "Endpoint probes", graph("ops", B=S), 24, 7,
        over(
            "sum by (instance, target, result) "
            f"(rate({t('model_load_endpoint_probes_total')}[$__rate_interval])) > 0",
            "{{result}} {{target}}",
            Moment.WATCHING,
        ),
        over(t("model_load_endpoint_probe_duration_seconds"), "probe time {{target}}",
             Moment.WATCHING),
    )  # fmt: skip


def history(b: Board) -> None:
    """Finished loads: durations by cache temperature and outcome, and where the time went."""
    b.row("History")
    b.add(
        "Load durations",
        heatmap.Panel()
        .calculate(False)
        .y_axis(heatmap.YAxisConfig().unit(S))
        .rows_frame(heatmap.RowsHeatmapOptions().layout(common.HeatmapCellLayout.LE))
        .hide_from(HideSeriesConfig().legend(False).tooltip(False).viz(False)),
        12, 8,
        over(
            f"sum by (le) (increase({t('model_load_duration_seconds_bucket')}[$__rate_interval]))",
            "{{le}}",
            Moment.FINISHED,
            HEATMAP,
        ),
    )  # fmt: skip
    buckets = "sum by (instance, target, cache, outcome, le) ({})".format(
        t("model_load_duration_seconds_bucket")
    )
    b.add(
        "Loads by cache temperature and outcome",
        rows(("Time", "job"), {"Value #A": "loads", "Value #B": "p50", "Value #C": "p90"}).unit(S),
        12, 8,
        now(
            f"sum by (instance, target, cache, outcome) ({t('model_load_duration_seconds_count')})",
            "", Moment.FINISHED, TABLE,
        ),
        now(f"histogram_quantile(0.5, {buckets})", "", Moment.FINISHED, TABLE),
        now(f"histogram_quantile(0.9, {buckets})", "", Moment.FINISHED, TABLE),
    )  # fmt: skip
    b.add(
        "Last load", big(S), 6, 6,
        now(t("model_load_last_duration_seconds"), PER_TARGET, Moment.FINISHED),
    )  # fmt: skip
    b.add(
        "Expected load by cache temperature", bars(S), 6, 6,
        now(t("model_load_expected_duration_seconds"), "{{target}} {{cache}}", Moment.FINISHED),
    )  # fmt: skip
    phases = "sum by (instance, target, phase) ({})"
    b.add(
        "Mean time per phase", bars(S), 12, 6,
        now(
            phases.format(t("model_load_phase_duration_seconds_sum"))
            + " / "
            + phases.format(t("model_load_phase_duration_seconds_count")),
            "{{target}} {{phase}}",
            Moment.FINISHED,
        ),
    )  # fmt: skip


def build() -> tuple[dict[str, Any], list[PanelQuery]]:
    """The dashboard as Grafana's import JSON, and every query in it with its moment."""
    board = Board()
    for section in (load_progress, fleet, over_time, history):
        section(board)
    body = json.loads(JSONEncoder().encode(board.builder.build()))
    return {**envelope(body), **body}, board.queries


def envelope(body: dict[str, Any]) -> dict[str, Any]:
    """Grafana's export envelope: the datasource to ask for on import, and what the JSON needs."""
    grafana = metadata.version("grafana-foundation-sdk").rsplit("!", 1)[-1]
    panels = sorted({p["type"] for p in body["panels"] if p["type"] != "row"})
    return {
        "__inputs": [
            {
                "name": DS_INPUT,
                "label": "Prometheus",
                "description": "The Prometheus that scrapes model-load-exporter",
                "type": "datasource",
                "pluginId": "prometheus",
                "pluginName": "Prometheus",
            }
        ],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": grafana},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            *({"type": "panel", "id": p, "name": p, "version": ""} for p in panels),
        ],
    }


def render(dashboard: dict[str, Any]) -> str:
    return json.dumps(dashboard, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Generate the Grafana dashboard JSON.")
    parser.add_argument("--check", action="store_true", help="compare with the committed JSON")
    args = parser.parse_args(argv)
    text = render(build()[0])
    if args.check:
        if not OUTPUT.exists() or OUTPUT.read_text() != text:
            print(f"{OUTPUT} is out of date: run `make dashboards`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
