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
    #: The most leading blocks of the chain an engine can take from its cache, or None for all
    #: of them. Engines (vLLM, SGLang) always compute the prompt's last token, whose logits give
    #: the first output token, so a fully cached prompt of exactly ``k`` blocks hits ``k - 1``:
    #: matches are capped here, and the chain itself (what the engine will hold) is not.
    cacheable_blocks: int | None = None


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
    #: How many requests those pending tokens belong to: of the backend's load, the requests
    #: still queued for or in prefill; the rest are decoding (``decoding``).
    pending_prefill_requests: int = 0

    @property
    def load(self) -> int:
        """Outstanding requests on this backend.

        The router's own in-flight count reacts instantly but misses traffic from other
        routers; the engine's running + waiting covers everyone but lags by a scrape. The
        larger of the two is the best single estimate of what a new request queues behind.
        """
        engine = (self.engine_running or 0) + (self.engine_waiting or 0)
        return max(self.in_flight, engine)

    @property
    def decoding(self) -> int:
        """Outstanding requests past their prefill: the decode batch a new request joins.

        The load less the requests this router knows are still before their first byte.
        """
        return max(0, self.load - self.pending_prefill_requests)


@dataclass(frozen=True, slots=True)
class Warmup:
    """Copy the request's first ``blocks`` blocks to ``backend`` ahead of need: the router sends
    that engine the prompt's leading part with ``max_tokens`` 1 beside the request itself, so
    the next request sent there finds the prefix cached instead of paying for its prefill."""

    backend: str
    blocks: int


@dataclass(frozen=True, slots=True)
class Decision:
    """A routing choice. ``reason`` is a small fixed vocabulary: it becomes a metric label."""

    backend: str
    reason: str
    matched_blocks: int = 0
    #: A prefix copy the router should make in the background (the policy does no I/O itself).
    warmup: Warmup | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """How one attempt of a routed request ended, shown to the policy that chose its backend
    (``RoutingPolicy.on_outcome``) once per attempt: a request retried on another backend gives
    each backend it tried an outcome of its own."""

    backend: str
    request: RequestView
    #: Prompt tokens the index believed cached on ``backend`` at the pick (the decision's
    #: matched blocks in tokens: the ``x-kvroute-matched-tokens`` header).
    matched_tokens: int
    #: Prompt tokens the engine reported it found cached (``usage.prompt_tokens_details
    #: .cached_tokens``). None unless the router reads engines' reports, which it does with
    #: ``index.closed_loop: true`` for requests whose prompt it looked up, and only when the
    #: response carried them.
    cached_tokens: int | None
    #: Seconds from sending this attempt to the stream's first byte (None: not a stream, whose
    #: first byte is its last, or no byte came). An earlier failed attempt's wait is not in it.
    ttft_s: float | None
    #: The engine's HTTP status as passed to the client (None: the client got none from it).
    status: int | None
    #: Why the attempt failed, or None when the engine's answer reached the client whole.
    #: ``client_gone`` (the client left: not the backend's doing), ``stream_error`` (the stream
    #: broke after the client got bytes), or how the backend failed before the client got any,
    #: after which the request was retried elsewhere when allowed: ``connect``, ``disconnect``,
    #: ``timeout``, ``first_byte_timeout``, ``protocol``, ``http_502``/``503``/``504``, ``other``.
    error: str | None = None

    @property
    def success(self) -> bool:
        """The engine served the request: its answer (below 500) reached the client whole."""
        return self.error is None and self.status is not None and self.status < 500
