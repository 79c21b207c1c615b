"""Routing policies by name, and the loader for a user's own ``module:Class``."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from policies.params import ParamError
from policies.routing.base import RoutingPolicy
from policies.routing.consistent_hash import ConsistentHash
from policies.routing.cost import Cost
from policies.routing.decode_balance import DecodeBalance
from policies.routing.latency import Latency
from policies.routing.least_load import LeastLoad
from policies.routing.power_of_two import PowerOfTwo
from policies.routing.prefix_aware import PrefixAware
from policies.routing.random_pick import RandomPick
from policies.routing.round_robin import RoundRobin
from policies.routing.session_affinity import SessionAffinity
from policies.routing.weighted import Weighted

BUILTIN: dict[str, type[RoutingPolicy]] = {
    cls.name: cls
    for cls in (
        RoundRobin,
        RandomPick,
        LeastLoad,
        PowerOfTwo,
        SessionAffinity,
        ConsistentHash,
        PrefixAware,
        Cost,
        Weighted,
        Latency,
        DecodeBalance,
    )
}


class PolicyLoadError(ValueError):
    """The policy named in YAML cannot be found, imported or built; the message says why."""


def resolve_policy(name: str) -> type[RoutingPolicy]:
    """The class for a built-in name or a ``module:Class`` reference."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        raise PolicyLoadError(
            f"routing.policy: unknown policy {name!r}; expected one of {sorted(BUILTIN)} or 'module:Class'"
        )
    module_name, _, class_name = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        # Any failure while importing the user's module (ImportError, a SyntaxError in it, an
        # exception it raises at import, a malformed or relative name) is a config error.
        raise PolicyLoadError(
            f"routing.policy: cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, RoutingPolicy)):
        raise PolicyLoadError(
            f"routing.policy: {name!r} is not a subclass of policies.routing.base.RoutingPolicy"
        )
    return cls


def build_policy(
    name: str, params: Mapping[str, Any] | None = None, *, seed: int | None = None
) -> RoutingPolicy:
    """Resolve ``name`` and construct it with ``params``; every failure is a PolicyLoadError."""
    cls = resolve_policy(name)
    try:
        return cls(params, seed=seed)
    except ParamError as exc:
        raise PolicyLoadError(str(exc)) from None
    except TypeError as exc:
        raise PolicyLoadError(f"routing.policy: cannot construct {name!r}: {exc}") from None
