"""The config read from its dataclasses: keys, types and defaults come from the fields, so a
section of any shape reads with the same one-line errors, and no config key is spelled twice."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated

import pytest
import yaml

from exporter.config.reader import load_config, parse_config, read_section
from exporter.config.schema import Config, TargetConfig
from exporter.config.values import NOT_IN_YAML, ConfigError, Count, Duration, Seconds, read_by
from exporter.vocabulary import LogEncoding, ProbeKind


def _upper(value: object, where: str, env: object) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{where}: expected a word")
    return value.upper()


@dataclass(frozen=True)
class Leaf:
    rate: Seconds = 1.0
    names: tuple[str, ...] = ("a",)
    probe: ProbeKind = ProbeKind.HEALTH
    colour: LogEncoding = LogEncoding.PLAIN
    shout: str = field(default="x", metadata=read_by(_upper))


@dataclass(frozen=True)
class Branch:
    leaf: Leaf = Leaf()
    spare: Leaf | None = None
    count: Count = 3
    short: Annotated[float, Duration(60.0)] = 5.0
    label: str | None = None
    kept: int = field(default=7, metadata=NOT_IN_YAML)


@dataclass(frozen=True)
class Tree:
    name: str
    branch: Branch = Branch()
    on: bool = False


@pytest.fixture
def weights(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 4096)
    return folder


def read(document: object) -> Tree:
    return read_section(Tree, document, "tree", {})


def test_a_nested_shape_reads_into_its_dataclasses() -> None:
    tree = read(
        {
            "name": "oak",
            "on": True,
            "branch": {
                "leaf": {"rate": "2m", "names": ["x", "y"], "probe": "tcp", "shout": "hey"},
                "spare": {"colour": "cri"},
                "count": 9,
                "short": "1m",
            },
        }
    )
    assert tree == Tree(
        "oak",
        Branch(
            leaf=Leaf(rate=120.0, names=("x", "y"), probe=ProbeKind.TCP, shout="HEY"),
            spare=Leaf(colour=LogEncoding.CRI),
            count=9,
            short=60.0,
        ),
        on=True,
    )
    assert isinstance(tree.branch.leaf.probe, ProbeKind)


def test_defaults_come_from_the_fields_and_null_is_not_given() -> None:
    assert read({"name": "elm"}) == Tree("elm")
    assert read({"name": "elm", "branch": None, "on": None}) == Tree("elm")
    assert read({"name": "elm", "branch": {"leaf": {"names": "one"}}}).branch.leaf.names == ("one",)


# (case, document, the whole message)
BAD: list[tuple[str, object, str]] = [
    ("unknown nested key", {"name": "a", "branch": {"leaf": {"rates": "1s"}}},
     "tree.branch.leaf: unknown key 'rates' (allowed: rate, names, probe, colour, shout)"),
    ("a key the file may not set", {"name": "a", "branch": {"kept": 1}},
     "tree.branch: unknown key 'kept' (allowed: leaf, spare, count, short, label)"),
    ("wrong type in a list", {"name": "a", "branch": {"leaf": {"names": ["x", 3]}}},
     "tree.branch.leaf.names[1]: expected a non-empty string, got 3"),
    ("empty string in a list", {"name": "a", "branch": {"spare": {"names": ["x", "y", ""]}}},
     "tree.branch.spare.names[2]: expected a non-empty string, got ''"),
    ("a list where a section goes", {"name": "a", "branch": [1, 2]},
     "tree.branch: expected a mapping, got list"),
    ("a string where a list goes", {"name": "a", "branch": {"leaf": {"names": {"x": 1}}}},
     "tree.branch.leaf.names: expected a non-empty list of strings"),
    ("missing required", {"branch": {}}, "tree.name: required"),
    ("number for a name", {"name": 5}, "tree.name: expected a non-empty string, got 5"),
    ("string for a flag", {"name": "a", "on": "yes"}, "tree.on: expected true or false, got 'yes'"),
    ("flag for a count", {"name": "a", "branch": {"count": True}},
     "tree.branch.count: expected a whole number from 1 to 1000000000, got True"),
    ("over a duration's maximum", {"name": "a", "branch": {"short": "2m"}},
     "tree.branch.short: '2m' is too long (at most 1m)"),
    ("not one of", {"name": "a", "branch": {"leaf": {"colour": "blue"}}},
     "tree.branch.leaf.colour: must be one of plain, docker, cri, got 'blue'"),
    ("not an enum member", {"name": "a", "branch": {"spare": {"probe": "ping"}}},
     "tree.branch.spare.probe: must be one of completion, health, models, tcp, got 'ping'"),
    ("a field's own reader", {"name": "a", "branch": {"leaf": {"shout": 1}}},
     "tree.branch.leaf.shout: expected a word"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "document", "expected"), BAD, ids=[c[0] for c in BAD])
def test_each_mistake_is_one_line_naming_the_key(
    case: str, document: object, expected: str
) -> None:
    with pytest.raises(ConfigError) as info:
        read(document)
    assert str(info.value) == expected


def test_a_type_no_rule_covers_is_a_programming_error_at_first_read() -> None:
    @dataclass(frozen=True)
    class Odd:
        ratio: complex = 0j

    with pytest.raises(TypeError, match=r"no config reader for .*complex"):
        read_section(Odd, {}, "odd", {})


def _sections(root: type) -> list[type]:
    """The config's dataclasses, from the root down."""
    found = [root]
    for f in dataclasses.fields(root):
        for inner in _hint_classes(root, f.name):
            if inner not in found:
                found += [c for c in _sections(inner) if c not in found]
    return found


def _hint_classes(owner: type, name: str) -> list[type]:
    hint = typing.get_type_hints(owner)[name]
    stack, out = [hint], []
    while stack:
        h = stack.pop()
        if isinstance(h, type) and dataclasses.is_dataclass(h):
            out.append(h)
        stack.extend(typing.get_args(h))
    return out


def test_every_field_of_every_section_is_a_key_or_marked_not_in_yaml() -> None:
    """A field added to any config dataclass is a YAML key at once (or says why not): the
    `allowed` list an unknown key's message shows is the fields'."""
    sections = _sections(Config)
    assert TargetConfig in sections and len(sections) >= 9
    for section in sections:
        with pytest.raises(ConfigError) as info:
            read_section(section, {"no_such_key": 1}, "x", {})
        shown = str(info.value).split("(allowed: ")[1].rstrip(")").split(", ")
        fields = [f.name for f in dataclasses.fields(section) if f.metadata.get("yaml", True)]
        assert shown == fields, section


# Shapes of the real config: nested sections, a key unknown deep down, a wrong type in a list.
REAL: list[tuple[str, dict[str, object], str]] = [
    ("unknown key three deep", {"targets": [{"name": "a", "endpoint": {"url": "http://h:1"},
     "log": {"file": "/x", "encodnig": "cri"}}]}, "targets[0].log: unknown key 'encodnig'"),
    ("wrong type in include", {"targets": [{"name": "a", "endpoint": {"url": "http://h:1"},
     "weights": {"paths": ["WEIGHTS"], "include": ["*.gguf", ["*.bin"]]}}]},
     "targets[0].weights.include[1]: expected a non-empty string, got ['*.bin']"),
    ("number in servers", {"discovery": {"servers": ["vllm", 3]}},
     "discovery.servers[1]: expected a non-empty string, got 3"),
    ("string in gpus", {"targets": [{"name": "a", "endpoint": {"url": "http://h:1"},
     "gpus": [0, "1"]}]}, "targets[0].gpus: expected auto or a list of GPU indexes"),
    ("float in users", {"discovery": {"users": [0, 1.5]}},
     "discovery.users[1]: expected a user name or uid, got 1.5"),
    ("list for a section in a list", {"targets": [["name", "a"]]},
     "targets[0]: expected a mapping, got list"),
    ("the probe's own key where the file sets it", {"targets": [{"name": "a",
     "endpoint": {"url": "http://h:1"}, "process": {"pid": 1}}]},
     "targets[0].process: unknown key 'pid' (allowed: systemd_unit, pidfile, cmdline)"),
    ("source is not a key", {"source": "x"}, "unknown key 'source'"),  # not ": : unknown key"
    ("more_files is not a key", {"targets": [{"name": "a", "endpoint": {"url": "http://h:1"},
     "log": {"file": "/x", "more_files": ["/y"]}}]}, "targets[0].log: unknown key 'more_files'"),
]  # fmt: skip


@pytest.mark.parametrize(("case", "document", "expected"), REAL, ids=[c[0] for c in REAL])
def test_real_config_shapes(
    tmp_path: Path, weights: Path, case: str, document: dict[str, object], expected: str
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(document).replace("WEIGHTS", str(weights)))
    with pytest.raises(ConfigError) as info:
        load_config(str(path), env={})
    message = str(info.value)
    assert message.startswith(f"{path}: {expected}"), message
    assert "\n" not in message


def test_a_log_file_list_and_the_nested_defaults(weights: Path) -> None:
    config = parse_config(
        {
            "targets": [
                {
                    "name": "a",
                    "endpoint": {"url": "tcp://h:1", "probe": "tcp"},
                    "weights": {"paths": [str(weights)]},
                    "log": {"file": ["/out", "/err"], "encoding": "docker", "format": None},
                }
            ],
            "history_retention": {"max_age": "1d"},
        },
        source="here",
    )
    target = config.targets[0]
    assert (target.endpoint.path, target.endpoint.timeout) == ("", 8.0)
    assert target.log is not None and target.log.files == ("/out", "/err")
    assert target.log.format == "auto" and target.weights is not None
    assert target.weights.include == ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
    assert (config.history_retention.max_age, config.history_retention.max_rows) == (
        86400.0,
        100_000,
    )
    assert config.source == "here"


def test_a_top_level_mistake_names_the_file_once(tmp_path: Path) -> None:
    """The file's name is the whole place of a top-level key: no empty key path after it (it
    read `config.yaml: : unknown key` before)."""
    path = tmp_path / "config.yaml"
    for text, expected in (("sample_intervall: 1s\n", "unknown key 'sample_intervall'"),
                           ("- a\n- b\n", "expected a mapping, got list")):  # fmt: skip
        path.write_text(text)
        with pytest.raises(ConfigError) as info:
            load_config(str(path))
        assert str(info.value).startswith(f"{path}: {expected}"), info.value
