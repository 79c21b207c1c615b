"""Typed parameters for policies, validated from YAML with errors that name the key.

A policy declares its parameters as a frozen dataclass with defaults; :func:`parse_params`
checks a mapping against it, so every policy gets the same strict, well-worded validation
without writing any.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

P = TypeVar("P")


class ParamError(ValueError):
    """A policy parameter is unknown or of the wrong type; the message names it."""


def _accepts(expected: Any, value: Any) -> bool:
    origin = typing.get_origin(expected)
    if origin in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(expected))
    if expected is type(None):
        return value is None
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        (item,) = typing.get_args(expected)[:1] or (Any,)
        return isinstance(value, (list, tuple)) and all(item is Any or _accepts(item, v) for v in value)
    if origin is dict or expected is dict:
        return isinstance(value, dict)
    if expected is Any:
        return True
    return isinstance(value, expected)


def _type_name(expected: Any) -> str:
    if typing.get_origin(expected) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(expected))
    if expected is type(None):
        return "null"
    return getattr(expected, "__name__", str(expected))


def parse_params(cls: type[P], raw: Mapping[str, Any] | None, where: str = "params") -> P:
    """Build ``cls`` (a dataclass) from ``raw``, refusing unknown keys and wrong types."""
    raw = dict(raw or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        raise ParamError(f"{where}.{unknown[0]}: unknown key; expected one of {sorted(fields)}")
    for name, field in fields.items():
        no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        if no_default and name not in raw:
            raise ParamError(f"{where}.{name}: required, expected {_type_name(hints[name])}")
    for name, value in raw.items():
        expected = hints[name]
        if not _accepts(expected, value):
            raise ParamError(f"{where}.{name}: expected {_type_name(expected)}, got {value!r}")
        if expected is float and isinstance(value, int):
            raw[name] = float(value)
    params = cls(**raw)
    check = getattr(params, "validate", None)
    if check is not None:
        try:
            check()
        except ValueError as exc:
            raise ParamError(f"{where}.{exc}") from None
    return params
