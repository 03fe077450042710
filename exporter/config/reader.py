"""The reader: YAML -> the sections of exporter/config/schema.py, each key by its field.

A section's keys are its dataclass's fields: a type alone says how most keys read (`Seconds` a
duration, `tuple[str, ...]` a list of strings, a dataclass a nested section, a tuple of
dataclasses a list of them), a field whose rule is its own names its reader
(exporter/config/values.py, `read_by`), and a rule across keys of one section is the schema's
`FINISH`. Unknown keys are refused, a key given as null is a key not given.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar, Union, get_args, get_origin, get_type_hints

import yaml

from exporter.config.schema import FINISH, Config, Values
from exporter.config.values import (
    ConfigError,
    Duration,
    KeyReader,
    Whole,
    key_path,
    parse_duration,
    read_count,
    read_flag,
    read_one_of,
    read_strings,
    read_text,
    short,
)

_D = TypeVar("_D")


class _Key:
    """One YAML key of a section: its field's name, whether it must be given, how it reads."""

    def __init__(self, f: dataclasses.Field[Any], hint: Any) -> None:
        self.name = f.name
        no_default = dataclasses.MISSING
        self.required = f.default is no_default and f.default_factory is no_default
        self.read: KeyReader = f.metadata.get("read") or _reader(hint)


@functools.cache
def _keys(section: type) -> tuple[_Key, ...]:
    hints = get_type_hints(section, include_extras=True)
    return tuple(
        _Key(f, hints[f.name]) for f in dataclasses.fields(section) if f.metadata.get("yaml", True)
    )


def _reader(hint: Any) -> KeyReader:
    """How a value of this type reads from YAML; TypeError for a type no rule covers (a field
    that needs `read_by`), raised when its section is first read."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is Annotated:
        mark = hint.__metadata__[0]
        if isinstance(mark, Duration):
            return lambda v, where, env: parse_duration(v, where, mark.maximum)
        if isinstance(mark, Whole):
            return lambda v, where, env: read_count(v, where, mark.maximum)
    if origin in (types.UnionType, Union) and len(args) == 2 and types.NoneType in args:
        return _reader(next(a for a in args if a is not types.NoneType))  # null: not given
    if hint is str:
        return lambda v, where, env: read_text(v, where)
    if hint is bool:
        return lambda v, where, env: read_flag(v, where)
    if hint == tuple[str, ...]:
        return lambda v, where, env: read_strings(v, where)
    if isinstance(hint, type) and issubclass(hint, StrEnum):
        return lambda v, where, env: hint(read_one_of(v, where, tuple(hint)))
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return functools.partial(read_section, hint)
    section = args[0] if origin is tuple and len(args) == 2 and args[1] is Ellipsis else None
    if isinstance(section, type) and dataclasses.is_dataclass(section):
        return functools.partial(_read_sections, section)
    raise TypeError(f"no config reader for {hint!r}: give the field read_by(...)")


def _read_sections(
    section: type[_D], data: object, where: str, env: Mapping[str, str]
) -> tuple[_D, ...]:
    """A list of sections (`targets`), each read as one."""
    if not isinstance(data, list):
        raise ConfigError(f"{where}: expected a list of {where.rpartition('.')[2]}")
    return tuple(read_section(section, item, f"{where}[{i}]", env) for i, item in enumerate(data))


def read_section(section: type[_D], data: object, where: str, env: Mapping[str, str]) -> _D:
    """A dataclass from one YAML mapping: each field a key, unknown keys refused."""
    kind: type = section  # (mypy takes a class's type for unhashable)
    keys = _keys(kind)
    at = f"{where}: " if where else ""  # the top level: the file's name is all the place
    if not isinstance(data, Mapping):
        raise ConfigError(f"{at}expected a mapping, got {type(data).__name__}")
    names = [k.name for k in keys]
    unknown = [str(k) for k in data if k not in names]
    if unknown:
        raise ConfigError(f"{at}unknown key {unknown[0]!r} (allowed: {', '.join(names)})")
    values: Values = {}
    for key in keys:
        where_key = key_path(where, key.name)
        if data.get(key.name) is not None:
            values[key.name] = key.read(data[key.name], where_key, env)
        elif key.required:
            raise ConfigError(f"{where_key}: required")
    finish = FINISH.get(section)
    return section(**(finish(values, where) if finish else values))


def parse_config(
    data: object, source: str = "config", env: Mapping[str, str] | None = None
) -> Config:
    """Validate an already-loaded YAML document (an empty one means: discover everything)."""
    config = read_section(
        Config, {} if data is None else data, "", os.environ if env is None else env
    )
    return dataclasses.replace(config, source=source)


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice: YAML keeps the last silently, hiding the first."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)  # type: ignore[no-untyped-call]
            if isinstance(key, list | dict):
                continue  # unhashable: the base class reports it
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {short(key)}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: str) -> Any:
    """Read a YAML file; every failure (unreadable, not UTF-8, bad YAML) is one ConfigError line."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such file") from None
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path}: not UTF-8 text (byte 0x{raw[exc.start]:02x} on line {line})"
        ) from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or "invalid YAML"
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None


def load_config(path: str, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate a YAML file; every failure is one ConfigError line naming the file."""
    data = read_yaml(path)
    try:
        return parse_config(data, source=path, env=env)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
