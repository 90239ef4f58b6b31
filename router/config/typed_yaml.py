"""Typed YAML: a frozen dataclass built from a parsed mapping, every value checked against its
field's annotation (int, float, str, bool, Literal, X | None, dict[str, T], list[int], nested
dataclasses). "off" means None where a field allows None. The first problem raises ConfigError
naming the key and what it expected; unknown keys are refused with the known ones listed.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad cluster.yaml; the message names the key and the reason."""


def build(cls, raw: Any, prefix: str, where: str):
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: {prefix.rstrip('.') or 'top level'}: expected a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"{where}: {prefix}{unknown[0]}: unknown key (known: {', '.join(sorted(names))})")
    values = {}
    for key, value in raw.items():
        hint = hints[key]
        if dataclasses.is_dataclass(hint):
            values[key] = build(hint, value if value is not None else {}, f"{prefix}{key}.", where)
        else:
            values[key] = _coerce(hint, value, f"{prefix}{key}", where)
    return cls(**values)


def _coerce(hint, value: Any, key: str, where: str):
    if value == "off" and _allows_none(hint) and "off" not in _literal_values(hint):
        value = None
    if _matches(hint, value):
        return float(value) if hint in (float, float | None) and isinstance(value, int) else value
    raise ConfigError(f"{where}: {key}: expected {_describe(hint)}, got {value!r}")


def _is_union(hint) -> bool:
    return isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union  # X | None, Literal | None


def _allows_none(hint) -> bool:
    return _is_union(hint) and type(None) in hint.__args__


def _literal_values(hint) -> tuple:
    return hint.__args__ if typing.get_origin(hint) is Literal else ()


def _matches(hint, value: Any) -> bool:
    if _is_union(hint):
        return any(_matches(h, value) for h in hint.__args__)
    if hint is type(None):
        return value is None
    if typing.get_origin(hint) is Literal:
        return value in hint.__args__
    if typing.get_origin(hint) is dict:
        return isinstance(value, dict) and all(isinstance(k, str) and _matches(typing.get_args(hint)[1], v)
                                               for k, v in value.items())
    if typing.get_origin(hint) is list:
        return isinstance(value, list) and all(_matches(typing.get_args(hint)[0], v) for v in value)
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint) -> str:
    if _is_union(hint):
        return " or ".join(_describe(h) for h in hint.__args__)
    if hint is type(None):
        return "null"
    if typing.get_origin(hint) is Literal:
        return "one of " + ", ".join(repr(v) for v in hint.__args__)
    if typing.get_origin(hint) is dict:
        return f"a mapping of name to {_describe(typing.get_args(hint)[1])}"
    if typing.get_origin(hint) is list:
        return {int: "a list of integers", str: "a list of strings"}[typing.get_args(hint)[0]]
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(hint, str(hint))
