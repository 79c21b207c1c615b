"""Keeping the prefixes that come back alive on LRU engines, by asking for them again.

The engines evict least recently used first, and a router cannot change that; but what an
engine used last is what it was last asked for, so a router can keep a prefix cached by
sending it again (a request of that prefix with one output token, as a warm-up is: the engine
touches its blocks and computes one token). The prompts that nobody reuses then age out first,
where LRU alone would let a burst of them flush the conversations that were about to continue.

Which prefixes: a request's leading blocks that an earlier request asked for too, wherever it
was sent (a conversation's history, once the conversation has continued; a shared document,
once it has been shared). Those are *kept* on the backend the request went to, replacing any
shorter kept prefix they extend there. A kept prefix that no request has asked for within
``refresh_share`` of its backend's *turnover* is due: refreshed while the router believes it
wholly cached there, and dropped once it is not (a refresh of an evicted prefix would be its
whole prefill). Kept prefixes hold at most ``kept_share`` of each backend's capacity, the one a
request asked for least recently dropped first, so that new conversations find room to live
until their next turn.

The turnover is the time in which a backend's uncached prompt tokens fill its capacity: how
long an LRU engine keeps what nobody asks for again. It is measured from the blocks the router
sends there uncached (its requests', not its warm-ups' or refreshes'), averaged over about
one turnover and at most a minute. A fixed period would refresh too late on a small cache
and for nothing on a large one, where what comes back survives anyway.

Kept prefixes are chains of block keys, each key hashing its predecessor's, so a block names
its prefix. A kept prefix that another one on the same backend only shares a stem with (two
conversations over one document) is kept beside it, and the stem counts twice against the
budget.

What it is worth: ``kvroute bench partition``'s last table (the fleet's memory as one cache)
and ``kvroute simulate --sweep refresh_share=...`` (docs/benchmarks/2026-12-07-routing-at-head.md).
The router runs it as ``routing.retention`` (router/request_path/retention.py).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

#: A prefix shorter than this many blocks is not worth a request of its own.
MIN_KEPT_BLOCKS = 2

#: The insertion rate is averaged over about one turnover, but never over more than this: a
#: backend that went quiet (no turnover at all) is measured again once traffic returns.
MAX_RATE_WINDOW_S = 60.0

Prefix = tuple[int, ...]


@dataclass(slots=True)
class _Entry:
    #: When a request (or a refresh) last asked for the prefix.
    asked: float
    #: What the caller needs to send the refresh (the router: the request to cut it from).
    payload: object


class Due(NamedTuple):
    """A refresh to send: ``prefix`` to ``backend``, with what ``observe`` was given for it."""

    backend: str
    prefix: Prefix
    payload: object


@dataclass(slots=True)
class _Kept:
    #: The kept prefixes on one backend, the one a request asked for least recently first.
    prefixes: OrderedDict[Prefix, _Entry] = field(default_factory=OrderedDict)
    #: Each kept prefix by its last block: a longer prefix that extends it replaces it. Block
    #: keys are chained (each hashes its predecessor's key), so a block names its prefix.
    by_end: dict[int, Prefix] = field(default_factory=dict)
    blocks: int = 0
    #: Blocks sent here uncached since the last check, and their rate, averaged over about a turnover.
    inserted: int = 0
    rate: float | None = None

    def add(self, prefix: Prefix, now: float, payload: object) -> None:
        for block in prefix:
            shorter = self.by_end.get(block)
            if shorter is not None and prefix[: len(shorter)] == shorter:
                self.drop(shorter)
        self.prefixes[prefix] = _Entry(now, payload)
        self.by_end[prefix[-1]] = prefix
        self.blocks += len(prefix)

    def drop(self, prefix: Prefix) -> None:
        del self.prefixes[prefix]
        del self.by_end[prefix[-1]]
        self.blocks -= len(prefix)


class Keeper:
    """Which prefixes to keep on which backend, and when each is due for a refresh.

    ``capacity_of(backend)`` is the backend's capacity in blocks (None: unknown, nothing is
    kept there); ``seen_blocks`` bounds the memory of blocks asked for.
    """

    def __init__(
        self,
        refresh_share: float,
        kept_share: float,
        capacity_of: Callable[[str], int | None],
        seen_blocks: int,
    ) -> None:
        if refresh_share <= 0 or not 0 < kept_share <= 1 or seen_blocks < 1:
            raise ValueError("need refresh_share > 0, kept_share in (0, 1] and seen_blocks >= 1")
        self.refresh_share = refresh_share
        self.kept_share = kept_share
        self.capacity_of = capacity_of
        #: Blocks some request asked for, wherever it went, the least recently asked for
        #: forgotten first: what tells a prefix that comes back from one seen once.
        self._seen: OrderedDict[int, None] = OrderedDict()
        self._seen_blocks = seen_blocks
        self._kept: dict[str, _Kept] = {}
        self._checked: float | None = None

    def observe(
        self,
        backend: str,
        chain: Sequence[int],
        cached: int,
        now: float,
        payload: Callable[[], object] | None = None,
    ) -> None:
        """A request for ``chain`` went to ``backend``, believed to hold its first ``cached``
        blocks: count what it adds there, and keep there what of it came back, with what
        ``payload()`` makes (called only then: most requests keep nothing), which :meth:`due`
        hands back."""
        capacity = self.capacity_of(backend)
        if not capacity:
            return
        kept = self._kept.setdefault(backend, _Kept())
        kept.inserted += len(chain) - cached
        known = 0
        while known < len(chain) and chain[known] in self._seen:
            known += 1
        for block in chain:
            self._seen[block] = None
            self._seen.move_to_end(block)
        while len(self._seen) > self._seen_blocks:
            self._seen.popitem(last=False)
        if known < MIN_KEPT_BLOCKS:
            return
        kept.add(tuple(chain[:known]), now, payload() if payload is not None else None)
        while kept.blocks > self.kept_share * capacity:
            kept.drop(next(iter(kept.prefixes)))

    def turnover(self, backend: str) -> float:
        """Seconds in which ``backend``'s uncached blocks fill its capacity (inf: nothing yet)."""
        kept = self._kept.get(backend)
        capacity = self.capacity_of(backend)
        if kept is None or not kept.rate or not capacity:
            return math.inf
        return capacity / kept.rate

    def due(self, now: float) -> list[Due]:
        """The refreshes to send now; call it every so often (a fraction of a second). Each is
        counted as asked for now; the caller :meth:`forget` s one whose prefix is no longer
        wholly cached where it was kept (a refresh of it would be its whole prefill)."""
        elapsed = now - self._checked if self._checked is not None else 0.0
        self._checked = now
        due = []
        for backend, kept in list(self._kept.items()):
            if not self.capacity_of(backend):  # removed (or never measured): keep nothing there
                del self._kept[backend]
                continue
            # The first check only starts the measurement: what came before it has no interval.
            rate = kept.inserted / elapsed if elapsed > 0 else None
            kept.inserted = 0
            if rate is not None:
                if not kept.rate:  # nothing measured yet, or a quiet spell: start from this
                    kept.rate = rate
                else:
                    window = max(min(self.turnover(backend), MAX_RATE_WINDOW_S), elapsed)
                    kept.rate += (rate - kept.rate) * elapsed / window
            period = self.refresh_share * self.turnover(backend)
            for prefix, entry in kept.prefixes.items():
                if now - entry.asked >= period:
                    entry.asked = now
                    due.append(Due(backend, prefix, entry.payload))
        return due

    def forget(self, backend: str, prefix: Prefix) -> None:
        """Stop keeping ``prefix`` on ``backend`` (no longer cached there)."""
        kept = self._kept.get(backend)
        if kept is not None and prefix in kept.prefixes:
            kept.drop(prefix)

    def kept_blocks(self, backend: str) -> int:
        kept = self._kept.get(backend)
        return kept.blocks if kept is not None else 0
