"""Per-tenant limits: requests per second, prompt tokens per second, requests at once.

Each tenant gets two token buckets and a concurrency counter, configured in ``limits``
(``tenant_default`` for everyone, ``tenants.<name>`` overriding it key by key). A request
over any of them is refused at once with 429 and ``Retry-After`` in the OpenAI shape, before
it costs the fleet anything; the router never queues on a tenant's behalf (a queue would
hold connections and memory for a client that is already over its share).

The prompt-token bucket admits a request when the bucket holds its prompt's tokens (or is
full, for a prompt larger than the whole burst) and may then run into debt: a huge prompt
is never refused forever, it just pays before the tenant's next request. Prompt tokens are
the router's estimate (``index.chars_per_token``), the same one the policies see.

Tenants are unbounded (without ``auth`` keys any bearer key is a tenant), so state is only
kept for tenants with limits, and idle state (buckets full again, nothing in flight, i.e.
indistinguishable from a fresh tenant) is swept from time to time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, Counter

from router.errors import OpenAIError
from router.http.settings import TenantLimits

#: Admissions between two sweeps of idle tenant state.
SWEEP_EVERY = 4096


class TokenBucket:
    """Holds up to ``burst`` tokens, refilled at ``rate`` per second."""

    def __init__(self, rate: float, burst: float, now: float) -> None:
        self.rate = rate
        self.burst = burst
        self.level = burst
        self.updated = now

    def _refill(self, now: float) -> None:
        self.level = min(self.burst, self.level + (now - self.updated) * self.rate)
        self.updated = now

    def wait_for(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` may be taken (0: now); ``amount`` beyond the burst needs a full bucket."""
        self._refill(now)
        missing = min(amount, self.burst) - self.level
        return max(0.0, missing / self.rate)

    def take(self, amount: float) -> None:
        self.level -= amount

    def full(self, now: float) -> bool:
        return self.level + (now - self.updated) * self.rate >= self.burst


def _bucket(rate: float | None, burst: float | None, default_burst: float, now: float) -> TokenBucket | None:
    return None if rate is None else TokenBucket(rate, burst if burst is not None else default_burst, now)


class _TenantState:
    def __init__(self, limits: TenantLimits, now: float) -> None:
        self.in_flight = 0
        self.requests: TokenBucket | None = None
        self.tokens: TokenBucket | None = None
        self.limits = limits
        self.configure(limits, now)

    def configure(self, limits: TenantLimits, now: float) -> None:
        """New limits; a bucket that stays keeps its level, capped at its new burst (a reload resets
        no debt and grants no fresh burst)."""
        self.limits = limits
        requests = _bucket(
            limits.requests_per_s, limits.request_burst, max(1.0, limits.requests_per_s or 0.0), now
        )
        tokens = _bucket(
            limits.prompt_tokens_per_s, limits.prompt_token_burst, limits.prompt_tokens_per_s or 0, now
        )
        for old, new in ((self.requests, requests), (self.tokens, tokens)):
            if old is not None and new is not None:
                old._refill(now)
                new.level = min(new.burst, old.level)
        self.requests, self.tokens = requests, tokens

    def idle(self, now: float) -> bool:
        return self.in_flight == 0 and all(b is None or b.full(now) for b in (self.requests, self.tokens))


class RateLimiter:
    """Every tenant's buckets and in-flight count; ``admit`` is the one call on the request path."""

    def __init__(
        self,
        tenant_default: TenantLimits,
        tenants: Mapping[str, TenantLimits],
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._states: dict[str, _TenantState] = {}
        self._admitted = 0
        self.refused = Counter(
            "kvroute_rate_limited",
            "Requests refused with 429 by a per-tenant limit, by the limit that refused them.",
            ["limit"],
            registry=registry,
        )
        self.configure(tenant_default, tenants)

    def configure(self, tenant_default: TenantLimits, tenants: Mapping[str, TenantLimits]) -> None:
        """Apply (new) limits: the default and each named tenant's own (``LimitsConfig.tenant_limits``,
        already merged over the default); tenants' in-flight counts and bucket levels carry over."""
        self._default = tenant_default
        self._overrides = dict(tenants)
        now = self._clock()
        for name, state in self._states.items():
            state.configure(self.limits_of(name), now)

    def limits_of(self, tenant: str) -> TenantLimits:
        return self._overrides.get(tenant, self._default)

    @property
    def tracked_tenants(self) -> int:
        return len(self._states)

    @contextmanager
    def admit(self, tenant: str, prompt_tokens: int) -> Iterator[None]:
        """Hold one of the tenant's slots for the ``with`` block, or raise a 429 at once."""
        limits = self.limits_of(tenant)
        state = self._states.get(tenant)
        if state is None:
            if limits.unlimited:
                yield
                return
            state = self._states[tenant] = _TenantState(limits, self._clock())
        self._check(tenant, state, prompt_tokens)
        state.in_flight += 1
        self._admitted += 1
        if self._admitted % SWEEP_EVERY == 0:
            self._sweep()
        try:
            yield
        finally:
            state.in_flight -= 1

    def _check(self, tenant: str, state: _TenantState, prompt_tokens: int) -> None:
        now = self._clock()
        limits = state.limits
        if limits.max_concurrent is not None and state.in_flight >= limits.max_concurrent:
            self._refuse(
                "concurrency",
                f"Tenant '{tenant}' already has {state.in_flight} requests in flight "
                f"(limit {limits.max_concurrent}).",
                1.0,
            )
        request_wait = state.requests.wait_for(1, now) if state.requests is not None else 0.0
        if request_wait > 0:
            self._refuse(
                "requests", f"Tenant '{tenant}' is over {limits.requests_per_s:g} requests/s.", request_wait
            )
        token_wait = state.tokens.wait_for(prompt_tokens, now) if state.tokens is not None else 0.0
        if token_wait > 0:
            self._refuse(
                "prompt_tokens",
                f"Tenant '{tenant}' is over {limits.prompt_tokens_per_s:g} prompt tokens/s.",
                token_wait,
            )
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(prompt_tokens)

    def _refuse(self, limit: str, message: str, wait_s: float) -> None:
        self.refused.labels(limit).inc()
        retry_after = max(1, math.ceil(wait_s))
        raise OpenAIError(
            429,
            f"{message} Retry after {retry_after} s.",
            code="rate_limit_exceeded",
            retry_after=retry_after,
        )

    def _sweep(self) -> None:
        now = self._clock()
        for name in [n for n, s in self._states.items() if s.idle(now)]:
            del self._states[name]
