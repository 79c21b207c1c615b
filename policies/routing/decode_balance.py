"""Decode balance: the decode engine of a prefill/decode pair, by load, KV usage and transfer.

A decode engine's work is the batch it generates for and the KV memory that batch holds;
its prefill is somebody else's. So the decode side is chosen for balance, not for cache
hits, in token-equivalents like ``cost``::

    score = load_tokens x outstanding requests
          + kv_tokens x KV cache usage (0..1, as the engine reports it)
          + prompt tokens the engine would have to receive (those beyond its believed match)

The last term is equal everywhere unless the decode engines keep what they received in a
prefix cache of their own (``disaggregation.decode_caches_prefixes``: vLLM decode with prefix
caching pulls only the blocks it lacks); then an engine already holding the conversation
saves that transfer. KV usage weighs heavily because a decode engine out of KV memory
preempts running sequences. Ties go at random, never to the first of equals (the tie-break
that sent one PD router's every request to its first worker).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from policies.params import NonNegativeFloat
from policies.routing.base import RoutingPolicy
from policies.scoring import uncached_tokens
from policies.types import BackendView, Decision, RequestView


@dataclass(frozen=True)
class DecodeBalanceParams:
    #: Transfer tokens one outstanding request on a decode engine is worth.
    load_tokens: NonNegativeFloat = 512.0
    #: Transfer tokens a full KV cache is worth (scaled by the engine's reported usage).
    kv_tokens: NonNegativeFloat = 4096.0


class DecodeBalance(RoutingPolicy):
    name = "decode_balance"
    Params = DecodeBalanceParams
    uses_prefix_match = True
    params: DecodeBalanceParams

    def score(self, request: RequestView, backend: BackendView) -> float:
        p = self.params
        kv = backend.kv_usage or 0.0
        return p.load_tokens * backend.load + p.kv_tokens * kv + uncached_tokens(request, backend)

    def choose(self, request: RequestView, backends: Sequence[BackendView]) -> Decision:
        chosen = self.pick_min(backends, lambda b: self.score(request, b))
        reason = "decode_cached" if chosen.matched_blocks else "decode_balance"
        return Decision(chosen.name, reason, chosen.matched_blocks)
