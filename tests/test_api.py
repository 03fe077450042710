"""The /api/v1 documents read back (exporter/exposition/api.py): what the exporter writes reads as
it was written, a malformed answer is one line naming the key, and a newer exporter's extra keys are
no error."""

from __future__ import annotations

import copy
import dataclasses
import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.documents import load

from exporter.exposition import api

GOLDEN = Path(__file__).with_name("fixtures") / "status.json"


@pytest.fixture
def golden() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(GOLDEN.read_text())
    return document


def test_the_golden_status_reads_back_as_written(golden: dict[str, Any]) -> None:
    assert api.Status.from_json(golden).to_json() == golden


def parts(document: object) -> Iterator[api.Document]:
    """Every document part inside `document`, itself included."""
    if isinstance(document, api.Document):
        yield document
        for f in dataclasses.fields(document):
            yield from parts(getattr(document, f.name))
    elif isinstance(document, tuple | list):
        for item in document:
            yield from parts(item)
    elif isinstance(document, dict):
        for item in document.values():
            yield from parts(item)


def classes(document: type) -> set[type]:
    """Every document class a document may hold, by its fields' types."""
    found = {document}
    for hint in typing.get_type_hints(document).values():
        for inner in _types_in(hint):
            if issubclass(inner, api.Document) and inner not in found:
                found |= classes(inner)
    return found


def _types_in(hint: Any) -> Iterator[type]:
    if isinstance(hint, type):
        yield hint
    for arg in typing.get_args(hint):
        yield from _types_in(arg)


def test_the_golden_status_holds_every_part_of_the_document(golden: dict[str, Any]) -> None:
    """A key renamed in a part the golden lacks would go unseen."""
    status = api.Status.from_json(golden)
    present = {type(p) for p in parts(status)}
    assert classes(api.Status) == present
    target = status.targets[1]
    optional = [f.name for f in dataclasses.fields(target) if f.metadata.get("optional")]
    written = {name for t in status.targets for name in optional if getattr(t, name) is not None}
    assert set(optional) - written == set()


def edited(document: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """A copy with the key at `path` ("targets.0.log.up") set to `value` (removed for `...`)."""
    out = copy.deepcopy(document)
    *parents, key = path.split(".")
    node: Any = out
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is ...:
        del node[key]
    else:
        node[key] = value
    return out


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        ("version", ..., "no 'version'"),
        ("targets", {"kimi-k2": {}}, "targets: expected a list, got an object"),
        ("targets.0.phase", 3, "targets[0].phase: expected a string, got 3"),
        ("targets.0.in_progress", ..., "targets[0]: no 'in_progress'"),
        ("targets.0.progress_ratio", "25 %", "targets[0].progress_ratio: expected a number or "
         "null, got '25 %'"),
        ("targets.0.stalled", 0, "targets[0].stalled: expected true or false, got 0"),
        ("targets.0.residency.files", 2.5, "targets[0].residency.files: expected a whole number"),
        ("targets.0.residency.files", True, "targets[0].residency.files: expected a whole number, "
         "got true"),
        ("targets.0.residency.method", ..., "targets[0].residency: no 'method'"),
        ("targets.0.sources.endpoint.up", None, "targets[0].sources.endpoint.up: expected true "
         "or false, got null"),
        ("targets.0.log.weights_shards", [16], "targets[0].log.weights_shards: expected a list "
         "of 2, got a list of 1"),
        ("targets.0.log.format_reason", ..., "targets[0].log: no 'format_reason'"),
        ("targets.0.storage.mounts.0.read_rate.value", "yes",
         "targets[0].storage.mounts[0].read_rate.value: expected true or false or null"),
        ("targets.1.last_record.phase_seconds.loading_weights", "12s",
         "targets[1].last_record.phase_seconds.loading_weights: expected a number, got '12s'"),
        ("host_sources.zfs.age_seconds", ..., "host_sources.zfs: no 'age_seconds'"),
        ("history", [], "history: expected an object, got a list of 0"),
    ],
)  # fmt: skip
def test_a_malformed_status_is_one_line_naming_the_key(
    golden: dict[str, Any], path: str, value: object, message: str
) -> None:
    with pytest.raises(api.DocumentError) as raised:
        api.Status.from_json(edited(golden, path, value))
    assert str(raised.value).startswith(message)
    assert "\n" not in str(raised.value)


def test_an_answer_that_is_no_object_is_one_line() -> None:
    with pytest.raises(api.DocumentError, match=r"^expected an object, got a list of 2$"):
        api.Status.from_json([1, 2])


@pytest.mark.parametrize(
    "path",
    ["report", "targets.0.restart_forecast_v2", "targets.0.storage.mounts.0.quota",
     "targets.1.last_record.report.cost", "host_sources.disk.cost", "targets.0.log.encoding"],
)  # fmt: skip
def test_keys_of_a_newer_exporter_are_no_error(golden: dict[str, Any], path: str) -> None:
    newer = edited(golden, path, {"anything": [1, "two"]})
    assert api.Status.from_json(newer) == api.Status.from_json(golden)


def test_parts_absent_together_or_present_together(golden: dict[str, Any]) -> None:
    """Before the tracker's first tick a target has no load state; before its log is sampled,
    no reading: every key of the part is then absent, and none may be missing otherwise."""
    entry = golden["targets"][0]
    state = api.LoadState.from_json(entry)
    bare = {k: v for k, v in entry.items() if k not in state.to_json()}
    bare["log"] = {"source": None, "found_by": "configured"}
    target = api.Target.from_json(bare)
    assert (target.state, target.log) == (None, api.Log(None, "configured"))
    assert target.to_json() == bare
    # A value that may be null is still a key that must be there.
    with pytest.raises(api.DocumentError, match=r"^log: no 'found_by'$"):
        api.Target.from_json({**bare, "log": {"source": None}})


def test_loads_say_their_duration_and_read_back() -> None:
    loads = api.Loads((load("qwen", 100.0, 150.5, cache="warm", phase_seconds={"starting": 0.5}),))
    written = loads.to_json()
    assert written["loads"][0]["duration_seconds"] == 50.5
    assert written["loads"][0]["cache"] == "warm"
    assert api.Loads.from_json(json.loads(json.dumps(written))) == loads
    with pytest.raises(api.DocumentError, match=r"^loads\[0\]: no 'outcome'$"):
        api.Loads.from_json(edited(written, "loads.0.outcome", ...))


def test_a_load_with_its_id_and_report_reads_back_and_one_without_has_neither_key() -> None:
    report = api.LoadReport(
        expected_seconds=100.0,
        phases=(api.PhaseTime("loading_weights", 300.0, 90.0),),
        page_cache_bytes=0,
        storage_bytes=24 * 10**9,
        storage_reads=(api.StorageRead("disk", "nvme0n1", 25 * 10**9),),
        read_rate=api.ReadRate("storage", 80e6, 240e6),
        reason="weights took 3.3x their cold median: storage delivered 80 MB/s against 240 MB/s",
    )
    slow = load("kimi", 0.0, 320.0, id=7, report=report)
    written = api.Loads((slow, load("kimi", 400.0, 500.0))).to_json()
    assert written["loads"][0]["id"] == 7 and written["loads"][0]["report"]["reason"]
    assert {"id", "report"}.isdisjoint(written["loads"][1])  # what an older exporter wrote
    assert api.Loads.from_json(json.loads(json.dumps(written))).loads[0] == slow
    with pytest.raises(api.DocumentError, match=r"^loads\[0\]\.report\.read_rate: no 'source'$"):
        api.Loads.from_json(edited(written, "loads.0.report.read_rate.source", ...))
