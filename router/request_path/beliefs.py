"""Closed-loop beliefs: engines say what they found cached; the index corrects itself.

The index only guesses what each engine still holds (a capacity and an eviction policy).
Engines report the truth for every request they serve: ``usage.prompt_tokens_details
.cached_tokens``, the prompt tokens found in their prefix cache. At dispatch the router
predicted ``matched_blocks`` for the chosen backend; when the engine reports less than
``tolerance`` of that, the engine has evicted part of the chain the router believed it held.

Two inferences follow, both exact for an engine that evicts in the belief's order (LRU):

* every block ranked below the first lost one is gone too: the index forgets them. Ranks
  are taken at dispatch, because the chain is touched again once the request is sent;
* the engine cannot hold more than the beliefs that remain (had it room for one more block
  than it used since, the lost one would still be there): the believed capacity is lowered
  to that. Engines' caches shrink and grow with their running load, so each confirmed
  prediction lets a lowered capacity grow back by the blocks it confirmed, up to the
  configured capacity.

The tolerance absorbs the difference between the router's estimated tokens (characters per
token) and the engine's real ones. No report, no correction. Predicted and reported tokens
are exported, so ``reported / predicted`` is the belief's measured accuracy per backend.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from router.index import PrefixIndex
from router.request_path.usage import UsageTap, cached_tokens, request_usage


class BeliefMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.predicted = Counter(
            "kvroute_belief_predicted_tokens",
            "Prompt tokens the index predicted cached on the chosen backend, for requests whose "
            "engine reported its cached tokens",
            ["backend"],
            registry=registry,
        )
        self.reported = Counter(
            "kvroute_belief_reported_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens)",
            ["backend"],
            registry=registry,
        )
        self.overestimates = Counter(
            "kvroute_belief_overestimates",
            "Responses whose engine held less than the tolerated share of the predicted prefix",
            ["backend"],
            registry=registry,
        )
        self.forgotten = Counter(
            "kvroute_belief_forgotten_blocks",
            "Beliefs dropped because an engine reported it no longer held them",
            ["backend"],
            registry=registry,
        )


@dataclass(frozen=True, slots=True)
class Prediction:
    """What the index believed of one request's chosen backend when it was sent."""

    backend: str
    predicted_tokens: int
    #: Rank of each predicted block at dispatch, in chain order (empty: nothing was predicted).
    ranks: tuple[Any, ...]


class ClosedLoop:
    """Compares predictions with engine reports and corrects the index (the simulator uses it too)."""

    def __init__(
        self, index: PrefixIndex, block_tokens: int, tolerance: float, metrics: BeliefMetrics | None = None
    ) -> None:
        self.index = index
        self.block_tokens = block_tokens
        self.tolerance = tolerance
        self.metrics = metrics
        #: Beliefs dropped since start (all backends).
        self.forgotten = 0

    def predict(
        self, backend: str, chain: Sequence[int], matched_blocks: int, prompt_tokens: int
    ) -> Prediction:
        rank = self.index.belief_rank
        ranks = tuple(rank(backend, block) for block in chain[:matched_blocks])
        return Prediction(backend, min(matched_blocks * self.block_tokens, prompt_tokens), ranks)

    def report(self, prediction: Prediction, cached_tokens: int) -> int:
        """The engine's cached tokens for a predicted request; returns the beliefs forgotten."""
        backend = prediction.backend
        if self.metrics is not None:
            self.metrics.predicted.labels(backend).inc(prediction.predicted_tokens)
            self.metrics.reported.labels(backend).inc(cached_tokens)
        if not prediction.ranks:
            return 0
        if cached_tokens >= self.tolerance * prediction.predicted_tokens:
            self.index.regrow(backend, len(prediction.ranks))
            return 0
        # The first block the engine did not have: it and all ranked below it are gone.
        lost = prediction.ranks[min(cached_tokens // self.block_tokens, len(prediction.ranks) - 1)]
        dropped = self.index.forget_through(backend, lost) if lost is not None else 0
        self.forgotten += dropped
        if self.metrics is not None:
            self.metrics.overestimates.labels(backend).inc()
            self.metrics.forgotten.labels(backend).inc(dropped)
        return dropped


class BeliefCheck:
    """One request's prediction, the body to forward, and the tap that reads the engine's report."""

    __slots__ = ("_loop", "body", "prediction", "tap")

    def __init__(
        self,
        loop: ClosedLoop,
        backend: str,
        chain: Sequence[int],
        matched_blocks: int,
        prompt_tokens: int,
        body: bytes,
        stream: bool,
    ) -> None:
        self._loop = loop
        self.prediction = loop.predict(backend, chain, matched_blocks, prompt_tokens)
        asked = request_usage(body) if stream else None
        self.body = asked if asked is not None else body
        self.tap = UsageTap(strip=asked is not None)

    def settle(self) -> int | None:
        """After the response: compare what the engine reported (if it did) with the prediction;
        returns the reported cached tokens (None: no report)."""
        cached = cached_tokens(self.tap.usage)
        if cached is not None:
            self._loop.report(self.prediction, cached)
        return cached
