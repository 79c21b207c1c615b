"""Typed parameters and settings, validated from YAML with every error named by its path.

A policy declares its parameters, and each router wing its config sections, as a frozen
dataclass with defaults; :func:`parse_params` checks a mapping against it, so every policy and
section gets the same strict, well-worded validation without writing any:

* unknown keys and missing required ones are refused;
* each value must have its field's type: ``int`` (not a bool, not 2.0), ``float`` (an int is
  taken and stored as a float), ``str``, ``bool``, ``Literal[...]`` (one of the values),
  ``X | None``, ``list[X]``, ``tuple[X, ...]``, ``dict[K, X]``, and a dataclass, which is parsed
  the same way, recursively (a dataclass field given as null, an empty YAML section, means its
  defaults); a field ``X | UnsetType = msgspec.UNSET`` may be left out, which differs
  from giving null (a tenant's override of one limit, the others inherited);
* ranges and lengths are declarations, ``Annotated[int, msgspec.Meta(ge=1)]``: ``gt``, ``ge``,
  ``lt``, ``le``, ``min_length``, ``max_length`` and ``pattern`` are checked, and
  ``Meta(extra={"expected": "an http:// URL"})`` words what a value must be;
* rules that tie fields together stay in a small ``validate()`` method of the dataclass, run
  once its fields are valid: it returns the messages of the rules broken (``"key: what is
  wrong"``, an iterable, empty or None when all hold) or raises ValueError with one.

Every error of the document is collected, not only the first, each named by its path
(``backends[1].url: expected an http:// or https:// URL, got 'ftp://x'``), and raised as one
ParamError, one error per line.

Why not ``msgspec.convert``, which reads the same declarations: it stops at the first error,
and its messages are its own ("Expected `int` >= 1 - at `$.backends[0].capacity_blocks`").
Keeping the declarations in msgspec's vocabulary still pays twice: ``msgspec.json.schema``
turns the very same types into the config's JSON Schema (``kvroute config schema``), so one
declaration gives both the validation and the schema, and they cannot disagree.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, TypeVar

import msgspec

P = TypeVar("P")

#: What a value that failed is replaced with while the rest of the document is checked.
_INVALID: Any = object()
#: Longest repr of a bad value shown in a message.
_SHOWN = 80

#: Declarations shared by policies and settings.
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegativeInt = Annotated[int, msgspec.Meta(ge=0)]
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


class ParamError(ValueError):
    """Parameters are unknown, of the wrong type or out of range; one message per line, each
    naming its key by path. ``errors`` holds the messages."""

    def __init__(self, errors: str | Sequence[str]) -> None:
        self.errors = [errors] if isinstance(errors, str) else list(errors)
        super().__init__("\n".join(self.errors))


def parse_params(cls: type[P], raw: Mapping[str, Any] | None, where: str = "params") -> P:
    """Build ``cls`` (a dataclass) from ``raw``; ParamError with every error found, each named
    by its path below ``where`` (``""``: the document's top level)."""
    report = _Report()
    result = _dataclass(cls, {} if raw is None else raw, where, report)
    if report.lines:
        raise ParamError(report.lines)
    return result


class _Report:
    """The errors found so far. Inside a secret (a field declared ``repr=False``: a key, a
    password) the bad value is never shown, only what was expected."""

    def __init__(self, secret: bool = False) -> None:
        self.lines: list[str] = []
        self.secret = secret

    def expected(self, path: str, expected: str, value: Any) -> None:
        shown = "" if self.secret else f", got {_shown(value)}"
        self.lines.append(f"{path}: expected {expected}{shown}")

    def trial(self) -> _Report:
        return _Report(self.secret)


def _join(where: str, key: object) -> str:
    return f"{where}.{key}" if where else str(key)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _options(tp: Any) -> list[Any]:
    """The members of a union (``X | None``) but msgspec's UnsetType (a key left out), or ``[tp]``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return [o for o in typing.get_args(tp) if o is not msgspec.UnsetType]
    return [tp]


def _strip(tp: Any) -> Any:
    """The type under ``Annotated``."""
    return typing.get_args(tp)[0] if typing.get_origin(tp) is Annotated else tp


def _dataclass(cls: Any, raw: Any, where: str, report: _Report) -> Any:
    if not isinstance(raw, Mapping):
        report.expected(where, "a mapping", raw)
        return _INVALID
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    found = len(report.lines)
    for key in sorted((k for k in raw if k not in fields), key=str):
        report.lines.append(f"{_join(where, key)}: unknown key; expected one of {sorted(fields)}")
    values: dict[str, Any] = {}
    for name, field in fields.items():
        path = _join(where, name)
        if name not in raw:
            if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
                report.lines.append(f"{path}: required, expected {_describe(hints[name])}")
            continue
        value = raw[name]
        if value is None and dataclasses.is_dataclass(_strip(hints[name])):
            value = {}  # an empty YAML section: its defaults
        secret, report.secret = report.secret, report.secret or not field.repr
        values[name] = _convert(hints[name], value, path, report)
        report.secret = secret
    if len(report.lines) > found:
        return _INVALID
    result = cls(**values)
    report.lines.extend(_join(where, message) for message in _rules_broken(result))
    return result if len(report.lines) == found else _INVALID


def _rules_broken(result: Any) -> list[str]:
    check = getattr(result, "validate", None)
    if check is None:
        return []
    try:
        broken = check()
    except ValueError as exc:
        return [str(exc)]
    # A rule may return its messages, one message, nothing, or a bare verdict (True: all good).
    if isinstance(broken, str):
        return [broken]
    if broken is False:
        return ["validate: returned False (the values break a rule of their own)"]
    if broken is None or broken is True:
        return []
    return list(broken)


def _convert(tp: Any, value: Any, path: str, report: _Report) -> Any:
    """``value`` as ``tp`` (floats from ints, tuples from lists), or _INVALID with its errors reported."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        if not _shape_fits(tp, value):
            report.expected(path, _describe(tp), value)
            return _INVALID
        result = _convert(typing.get_args(tp)[0], value, path, report)
        if result is not _INVALID and _violates(tp, result):
            report.expected(path, _describe(tp), value)
            return _INVALID
        return result
    if origin in (typing.Union, types.UnionType):
        return _union(tp, value, path, report)
    if dataclasses.is_dataclass(tp):
        return _dataclass(tp, value, path, report)
    if origin in (list, tuple) or tp in (list, tuple):
        return _sequence(tp, value, path, report)
    if origin is dict or tp is dict:
        return _mapping(tp, value, path, report)
    if _accepts(tp, value):
        return float(value) if tp is float else value
    report.expected(path, _describe(tp), value)
    return _INVALID


def _accepts(tp: Any, value: Any) -> bool:
    """Whether ``value`` is of the scalar type ``tp`` (bools are not numbers here)."""
    if tp is Any:
        return True
    if tp is type(None):
        return value is None
    if typing.get_origin(tp) is Literal:
        return any(value == choice and type(value) is type(choice) for choice in typing.get_args(tp))
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(tp, type) and isinstance(value, tp)


def _shape_fits(tp: Any, value: Any) -> bool:
    """Whether ``value`` has ``tp``'s shape (a mapping, a list, a scalar of its type), whatever is inside."""
    tp = _strip(tp)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_shape_fits(option, value) for option in _options(tp))
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return isinstance(value, Mapping)
    if origin in (list, tuple) or tp in (list, tuple):
        return isinstance(value, (list, tuple))
    return _accepts(tp, value)


def _union(tp: Any, value: Any, path: str, report: _Report) -> Any:
    options = _options(tp)
    if value is None and type(None) in options:
        return None
    candidates = [o for o in options if o is not type(None)]
    for option in candidates:
        trial = report.trial()
        result = _convert(option, value, path, trial)
        if not trial.lines:
            return result
    # The one option the value is shaped like says best what is wrong inside it.
    fitting = [o for o in candidates if _shape_fits(o, value)]
    if len(fitting) == 1:
        return _convert(fitting[0], value, path, report)
    report.expected(path, _describe(tp), value)
    return _INVALID


def _sequence(tp: Any, value: Any, path: str, report: _Report) -> Any:
    if not isinstance(value, (list, tuple)):
        report.expected(path, _describe(tp), value)
        return _INVALID
    args = typing.get_args(tp)
    item = args[0] if args else Any
    items = [_convert(item, v, f"{path}[{i}]", report) for i, v in enumerate(value)]
    if any(i is _INVALID for i in items):
        return _INVALID
    return tuple(items) if tp is tuple or typing.get_origin(tp) is tuple else items


def _mapping(tp: Any, value: Any, path: str, report: _Report) -> Any:
    if not isinstance(value, Mapping):
        report.expected(path, _describe(tp), value)
        return _INVALID
    key_type, item = typing.get_args(tp) or (Any, Any)
    result: dict[Any, Any] = {}
    failed = False
    for key, v in value.items():
        if not _accepts(key_type, key):
            if typing.get_origin(key_type) is Literal:
                report.lines.append(f"{_join(path, key)}: unknown key; expected {_describe(key_type)}")
            elif key_type is str and isinstance(key, (int, float, bool)):
                # YAML reads an unquoted 5, 1.5 or yes as a number or a boolean, not a name.
                report.lines.append(f"{path}: keys must be strings, got {key!r}; quote it: '{key}'")
            else:
                report.lines.append(f"{path}: keys must be {_describe(key_type)}, got {_shown(key)}")
            failed = True
            continue
        result[key] = _convert(item, v, _join(path, key), report)
        failed = failed or result[key] is _INVALID
    return _INVALID if failed else result


def _metas(tp: Any) -> list[msgspec.Meta]:
    return [m for m in typing.get_args(tp)[1:] if isinstance(m, msgspec.Meta)]


def _violates(tp: Any, value: Any) -> bool:
    """Whether ``value`` breaks a constraint declared by ``Annotated`` ``tp``."""
    return any(
        (meta.gt is not None and not value > meta.gt)
        or (meta.ge is not None and not value >= meta.ge)
        or (meta.lt is not None and not value < meta.lt)
        or (meta.le is not None and not value <= meta.le)
        or (meta.min_length is not None and len(value) < meta.min_length)
        or (meta.max_length is not None and len(value) > meta.max_length)
        or (meta.pattern is not None and re.search(meta.pattern, value) is None)
        for meta in _metas(tp)
    )


def _number(value: float) -> str:
    return f"{value:g}"


def _constraint(noun: str, meta: msgspec.Meta) -> str:
    """``noun`` with the constraints of ``meta``: ``a number in (0, 1]``, ``an integer >= 1``."""
    expected = (meta.extra or {}).get("expected")
    if expected:
        return str(expected)
    low = ("(", meta.gt) if meta.gt is not None else ("[", meta.ge) if meta.ge is not None else None
    high = (")", meta.lt) if meta.lt is not None else ("]", meta.le) if meta.le is not None else None
    if low is not None and high is not None:
        return f"{noun} in {low[0]}{_number(low[1])}, {_number(high[1])}{high[0]}"
    if low is not None:
        return f"{noun} {'>' if low[0] == '(' else '>='} {_number(low[1])}"
    if high is not None:
        return f"{noun} {'<' if high[0] == ')' else '<='} {_number(high[1])}"
    if meta.pattern is not None:
        return f"{noun} matching {meta.pattern!r}"
    unit = "characters" if noun == "a string" else "entries"
    shortest, longest = meta.min_length, meta.max_length
    if shortest == 1 and longest is None:
        return f"a non-empty {noun.partition(' ')[2]}"
    if shortest is not None and longest is not None:
        return f"{noun} of {shortest} to {longest} {unit}"
    if shortest is not None:
        return f"{noun} of at least {shortest} {unit}"
    if longest is not None:
        return f"{noun} of at most {longest} {unit}"
    return noun


def _describe(tp: Any) -> str:
    """What a value of ``tp`` is, in words: ``an integer >= 1 or null``."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        described = _describe(typing.get_args(tp)[0])
        for meta in _metas(tp):
            described = _constraint(described, meta)
        return described
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(o) for o in _options(tp))
    if origin is Literal:
        return f"one of {list(typing.get_args(tp))}"
    if dataclasses.is_dataclass(tp) or origin is dict or tp is dict:
        return "a mapping"
    if origin in (list, tuple) or tp in (list, tuple):
        return "a list"
    names = {int: "an integer", float: "a number", str: "a string", bool: "true or false", type(None): "null"}
    return names.get(tp, "any value" if tp is Any else getattr(tp, "__name__", str(tp)))
