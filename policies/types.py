"""The views a routing policy is shown, and the decision it returns.

A policy is a pure function of these values: it does no I/O, so the same code runs in the
proxy, in the offline simulator and in unit tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestView:
    """What routing may know about one request, parsed once from its body and headers."""

    model: str
    tenant: str
    #: Sticky key for session affinity: a configured header, else the body's ``user`` field.
    session_key: str | None
    #: Estimated prompt length in tokens (exact when the hasher tokenizes).
    prompt_tokens: int
    #: Number of full blocks in the prompt's hash chain.
    block_count: int
    #: Tokens per block (estimated in character mode), to turn matched blocks into tokens.
    block_tokens: int
    #: Requested output length, when the client gave one.
    max_tokens: int | None = None
    stream: bool = False
    #: The prompt's chained block hashes (empty unless the policy ``uses_prefix_match``):
    #: ``chain[k - 1]`` identifies the first ``k`` blocks, which hash-based policies key on.
    chain: Sequence[int] = ()


@dataclass(frozen=True, slots=True)
class BackendView:
    """One healthy candidate serving the request's model, as the router sees it now."""

    name: str
    #: Leading blocks of the request's chain this backend is believed to hold.
    matched_blocks: int = 0
    #: Requests the router itself has sent there and not finished: the instant signal. With
    #: the shared load view (``index.store: redis``) the other replicas' are added.
    in_flight: int = 0
    #: Engine-reported queue (waiting) and running requests, or None when not scraped/stale.
    engine_waiting: int | None = None
    engine_running: int | None = None
    #: Engine-reported KV cache usage in [0, 1], or None when unknown.
    kv_usage: float | None = None
    #: Blocks the index believes this backend holds in total.
    cached_blocks: int = 0
    #: Estimated prompt tokens still to prefill there: the uncached part of each request this
    #: router sent that has not produced its first byte yet. The queue a new prefill waits behind.
    pending_prefill_tokens: int = 0

    @property
    def load(self) -> int:
        """Outstanding requests on this backend.

        The router's own in-flight count reacts instantly but misses traffic from other
        routers; the engine's running + waiting covers everyone but lags by a scrape. The
        larger of the two is the best single estimate of what a new request queues behind.
        """
        engine = (self.engine_running or 0) + (self.engine_waiting or 0)
        return max(self.in_flight, engine)


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice. ``reason`` is a small fixed vocabulary: it becomes a metric label."""

    backend: str
    reason: str
    matched_blocks: int = 0
