"""The prefill this router has queued on each backend: the wait a new request's prefill joins.

A request sent to a backend first queues for, then runs, its prefill; only then does the
first byte of a stream come back. Until that byte, the part of its prompt the backend was
not believed to hold is work standing in front of any prefill sent there next. The router
knows that work exactly for its own requests and at once, where an engine's scraped queue
lags by a scrape and counts requests, not tokens. The ``cost`` policy reads it as
``BackendView.pending_prefill_tokens``. A non-streamed response has no first byte before
its end, so its share is held until the response is complete: an overestimate, never a leak.
"""

from __future__ import annotations

from typing import Protocol


class _HoldsPrefill(Protocol):
    pending_prefill_tokens: int


class PendingPrefill:
    """One request's share of its backend's pending prefill, released exactly once."""

    __slots__ = ("_backend", "_tokens")

    def __init__(self, backend: _HoldsPrefill, tokens: int) -> None:
        self._backend = backend
        self._tokens = max(0, tokens)
        backend.pending_prefill_tokens += self._tokens

    def release(self) -> None:
        """At the first byte, or when the request ends on any path; later calls do nothing."""
        self._backend.pending_prefill_tokens -= self._tokens
        self._tokens = 0
