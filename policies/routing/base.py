"""The routing policy interface.

A policy is constructed once from its YAML parameters and then asked, per request, to
choose among the healthy backends that serve the request's model. ``choose`` is called
with at least one candidate and must return one of them; it does no I/O. A policy that
learns online overrides ``on_outcome``: it hears how each attempt it chose ended.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from policies.params import parse_params
from policies.types import BackendView, Decision, Outcome, RequestView

T = TypeVar("T")


@dataclass(frozen=True)
class NoParams:
    """For policies without parameters of their own (``seed`` is handled by the base)."""


class RoutingPolicy(ABC):
    """Base class of every routing policy, built-in or a user's own."""

    #: The name used in YAML (``routing.policy``) and as the ``policy`` metric label.
    name: ClassVar[str] = ""
    #: The parameter dataclass; its fields are the keys accepted under ``routing.params``.
    Params: ClassVar[type] = NoParams
    #: Whether the router must look the prompt's chain up in the prefix index for this policy.
    uses_prefix_match: ClassVar[bool] = False
    #: Whether the policy overrides ``on_outcome`` (set when a subclass is defined): the router
    #: and the simulator build outcomes only for a policy that hears them.
    learns: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.learns = cls.on_outcome is not RoutingPolicy.on_outcome

    def __init__(self, params: Mapping[str, Any] | None = None, *, seed: int | None = None) -> None:
        self.params = parse_params(self.Params, params, where="routing.params")
        #: Seeded in tests and the simulator so decisions are reproducible.
        self.rng = random.Random(seed)

    @abstractmethod
    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        """Pick one of ``backends`` (never empty) for ``request``."""

    def on_outcome(self, outcome: Outcome) -> None:  # noqa: B027 -- optional hook, off by default
        """How one attempt this policy chose ended: called once per attempt, on every path
        (served, failed and retried, stream broken, client gone), after its response ended.

        The default does nothing, and the router then builds no Outcome at all. Like
        ``choose``, it runs on the request path and does no I/O; an exception it raises is
        logged and the request is not affected.
        """

    def pick_min(self, backends: Sequence[BackendView], key: Callable[[BackendView], Any]) -> BackendView:
        """The backend with the smallest ``key``; ties broken at random, never by position.

        Always taking the first of equals is how peers pile load onto replica 0.
        """
        best = min(key(b) for b in backends)
        return self.rng.choice([b for b in backends if key(b) == best])
