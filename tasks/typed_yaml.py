"""Strict conversion of layered YAML settings into typed frozen dataclasses, and back out to YAML / MLflow params.

Conversion is driven by the dataclasses' type hints (dataclass, Optional/Union, Literal, Enum, list/tuple,
bool/int/float/str): an unknown key or a value of the wrong type fails with a :class:`ConfigError` naming the
dotted key and the layer (preset, file, override) it came from. ``tasks.config`` defines the pipeline's
sections and loads them through this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml

DEFAULT_SOURCE = "defaults"
#: ``dataclasses.field`` metadata key of a derived field (``init=False``): how it is computed, for error messages.
DERIVED = "derived_from"


class ConfigError(ValueError):
    """A setting is unknown or invalid; the message names the dotted key, its source and the fix."""

    def __init__(self, message: str, reason: str | None = None) -> None:
        super().__init__(message)
        self.reason = reason or message
        """The bare cause, without key and source (used to combine the failures of Union arms)."""


def derived(formula: str) -> dict[str, str]:
    """Metadata of an ``init=False`` field computed in ``__post_init__``: setting it names ``formula`` instead.

    ``total_updates: int = field(init=False, metadata=derived("ppo.iterations x ppo.updates_per_iteration"))``
    """
    return {DERIVED: formula}


def settable_fields(cls_or_instance: Any) -> list[dataclasses.Field]:
    """The fields a config file may set (``init=True``); derived ones are neither read nor written."""
    return [f for f in dataclasses.fields(cls_or_instance) if f.init]


# --------------------------------------------------------------------------------------------- loading


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names the same key twice (plain YAML would keep the last one without a word)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that refuses a key given twice in one mapping."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # '<<: *anchor': keys given next to it override the merged ones, as YAML means
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in seen:
                raise DuplicateKeyError(f"key {key!r} appears twice in one mapping (lines {seen[key]} and {line}); "
                                        "keep one")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKeyError as err:
        raise ConfigError(f"{path}: {err}") from None
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {err}") from err
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of settings at the top level, got {type(data).__name__}")
    return data


def parse_override(item: str) -> dict[str, Any]:
    key, sep, raw = item.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"override {item!r} must look like 'section.key=value' (e.g. ppo.kl.coef=0.1)")
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        value = raw  # not YAML (e.g. 'a: b: c'): the plain text is the only sensible reading
    for part in reversed(parts):
        value = {part: value}
    return value


def merge_layer(base: dict[str, Any], layer: Mapping[Any, Any], source: str, origins: dict[str, str],
           prefix: str = "") -> None:
    """Deep-merge ``layer`` into ``base`` (mappings merge, everything else replaces); record each key's source."""
    for key, value in layer.items():
        if not isinstance(key, str):
            raise ConfigError(f"{source}: key {key!r} under '{prefix.rstrip('.') or '<top>'}' must be a string")
        dotted = prefix + key
        origins[dotted] = source
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            merge_layer(base[key], value, source, origins, dotted + ".")
        elif isinstance(value, Mapping):
            base[key] = {}
            merge_layer(base[key], value, source, origins, dotted + ".")
        else:
            base[key] = value


def one_line(text: str) -> str:
    """``text`` with its control characters escaped (``\\n``, ``\\t``), so a message quoting it stays on one line."""
    return "".join(char if char.isprintable() else repr(char)[1:-1] for char in text)


def source_of(key: str, origins: Mapping[str, str]) -> str:
    while key:
        if key in origins:
            return origins[key]
        key = key.rpartition(".")[0]
    return DEFAULT_SOURCE


def bad_value(key: str, value: Any, origins: Mapping[str, str], why: str) -> ConfigError:
    return ConfigError(f"bad value {value!r} for '{key}' (from {source_of(key, origins)}): {why}", why)


def section_from_dict(cls: type, data: Mapping[str, Any], name: str = "") -> Any:
    """One settings dataclass (e.g. ``RewardTrainingConfig``) from plain data, strictly (as ``load_config``)."""
    return build(cls, dict(data), name, {})


def build(tp: Any, value: Any, key: str, origins: Mapping[str, str]) -> Any:
    """Convert a YAML value to type ``tp`` (dataclass, Optional/Union, Literal, Enum, list/tuple, scalar)."""
    if dataclasses.is_dataclass(tp):
        return _build_dataclass(tp, {} if value is None else value, key, origins)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Annotated:  # a type with marks: a Range to hold (rlhf_core.ranges), a path mark (run_store.keys)
        if args[0] is float and any(getattr(mark, "allow_inf", False) for mark in args[1:]):
            if value is None:  # 'no limit' is spelled inf where a setting allows it, never null
                notes = "; ".join(mark.note for mark in args[1:] if getattr(mark, "note", ""))
                raise bad_value(key, value, origins, f"expected a number ({notes})" if notes else "expected a number")
            result = _build_float(value, key, origins, allow_inf=True)
        else:
            result = build(args[0], value, key, origins)
        for mark in args[1:]:
            why = mark.problem(result) if hasattr(mark, "problem") else None
            if why is not None:
                raise bad_value(key, value, origins, why)
        return result
    if origin is Literal:
        if any(value == a and type(value) is type(a) for a in args):
            return value
        raise bad_value(key, value, origins, f"choose one of {', '.join(map(repr, args))}")
    if origin in (Union, types.UnionType):
        return _build_union(args, value, key, origins)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise bad_value(key, value, origins, "expected a list")
        item_type = args[0] if args else Any
        items = [build(item_type, v, f"{key}[{i}]", origins) for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if isinstance(tp, type) and issubclass(tp, Enum):
        choices = [m.value for m in tp]
        if isinstance(value, tp) or value in choices:
            return tp(value)
        raise bad_value(key, value, origins, f"choose one of {', '.join(map(repr, choices))}")
    return _build_scalar(tp, value, key, origins)


def _build_union(args: tuple[Any, ...], value: Any, key: str, origins: Mapping[str, str]) -> Any:
    if value is None:
        if type(None) in args:
            return None
        raise bad_value(key, value, origins, "a value is required here (None is not allowed)")
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return build(arm, value, key, origins)
        except ConfigError as err:
            errors.append(err.reason)
    raise bad_value(key, value, origins, " / ".join(errors) + (" (or null)" if type(None) in args else ""))


def _build_scalar(tp: Any, value: Any, key: str, origins: Mapping[str, str]) -> Any:
    if tp is Any:
        return value
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad_value(key, value, origins, "expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise bad_value(key, value, origins, "expected an integer")
    if tp is float:
        return _build_float(value, key, origins)
    if tp is str:
        if isinstance(value, str):
            return value
        raise bad_value(key, value, origins, "expected a string (quote it in YAML)")
    raise TypeError(f"tasks.typed_yaml cannot convert settings of type {tp!r} (at '{key}')")


def _build_float(value: Any, key: str, origins: Mapping[str, str], allow_inf: bool = False) -> float:
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):  # PyYAML reads '1e-6' (no dot) as a string; accept it rather than surprise
        with contextlib.suppress(ValueError):
            number = float(value)
    if number is None:
        raise bad_value(key, value, origins, "expected a number")
    if math.isnan(number) or (math.isinf(number) and not allow_inf):
        raise bad_value(key, value, origins, "expected a finite number (NaN is never valid; infinity only where a "
                                             "setting says what it means)")
    return number


def _build_dataclass(cls: type, value: Any, key: str, origins: Mapping[str, str]) -> Any:
    where = key or "<top level>"
    if not isinstance(value, Mapping):
        raise bad_value(key, value, origins, f"expected a mapping of {cls.__name__} settings")
    hints = typing.get_type_hints(cls, include_extras=True)
    names = [f.name for f in settable_fields(cls)]
    computed = {f.name: f.metadata.get(DERIVED, "computed from other settings") for f in dataclasses.fields(cls)
                if not f.init}
    prefix = f"{key}." if key else ""
    for name in value:
        if name in computed:
            raise ConfigError(f"'{prefix}{name}' (from {source_of(prefix + str(name), origins)}) is derived, not a "
                              f"setting: it is {computed[name]}; set those instead and drop '{prefix}{name}'")
        if name not in names:
            close = _did_you_mean(str(name), value[name], names, key)
            hint = f"did you mean '{prefix}{close}'? " if close else ""
            dotted = prefix + str(name)
            raise ConfigError(f"unknown setting '{one_line(dotted)}' (from {source_of(dotted, origins)}); "
                              f"{hint}valid keys under '{where}': {', '.join(names)}")
    kwargs = {name: build(hints[name], value[name], prefix + name, origins) for name in names if name in value}
    try:
        return cls(**kwargs)
    except ValueError as err:
        raise ConfigError(f"invalid settings under '{where}': {err}{_given(kwargs, prefix, origins)}") from err


def _closest(name: str, names: list[str]) -> str | None:
    """The valid key ``name`` most likely means: a near spelling, or the key it abbreviates ('lr')."""
    close = difflib.get_close_matches(name, names, n=1)
    if close:
        return close[0]
    return next((n for n in names if "_" in n and name == "".join(part[:1] for part in n.split("_"))), None)


def _did_you_mean(name: str, value: Any, names: list[str], key: str) -> str | None:
    """Suggestion for an unknown key, relative to its section. A key that repeats its section's name (a
    section nested in itself, ``ppo: {ppo: {kl: {coef: 0.1}}}``) points at the same setting one level up
    (``ppo.kl.coef``)."""
    if key and name == key.rpartition(".")[2] and isinstance(value, Mapping) and value:
        inner, rest = next(iter(value.items()))
        inner = str(inner) if str(inner) in names else _closest(str(inner), names)
        if inner is not None:
            while isinstance(rest, Mapping) and rest:
                sub, rest = next(iter(rest.items()))
                inner += f".{sub}"
            return inner
    return _closest(name, names)


def _given(kwargs: Mapping[str, Any], prefix: str, origins: Mapping[str, str]) -> str:
    """'; values: a=1, b=2 from <source>; c=3 from <source>' for the scalar settings given in a section."""
    by_source: dict[str, list[str]] = {}
    for name, value in kwargs.items():
        if prefix and not dataclasses.is_dataclass(value):
            by_source.setdefault(source_of(prefix + name, origins), []).append(f"{prefix}{name}={_plain(value)!r}")
    parts = [f"{', '.join(items)} from {source}" for source, items in by_source.items()]
    return f"; values: {'; '.join(parts)}" if parts else ""


# --------------------------------------------------------------------------------------------- output


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in settable_fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def config_to_dict(cfg: Any) -> Any:
    """Plain YAML/JSON-able data of a config (or any section): dicts, lists, enum values. Derived fields are left
    out, so ``build`` of the result gives back an equal config."""
    return _plain(cfg)


def dump_config_text(cfg: Any) -> str:
    """The full config as YAML text; ``load_config`` of it gives back an equal config."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def dump_config(cfg: Any, path: str | Path) -> str:
    """Write the full config as YAML (see :func:`dump_config_text`). Returns the path."""
    from tasks.io import atomic_write  # deferred: tasks.io pulls in pyarrow, which loading a config never needs

    text = dump_config_text(cfg)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text, encoding="utf-8"))


def flatten_for_params(cfg: Any) -> dict[str, str]:
    """Dotted keys to string values (``{'ppo.kl.coef': '0.05', ...}``), for MLflow params (no derived fields)."""
    flat: dict[str, str] = {}

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{prefix}.{k}" if prefix else k)
        else:
            flat[prefix] = json.dumps(node) if isinstance(node, list) else str(node)

    walk(config_to_dict(cfg), "")
    return flat
