"""The pooled cache under other evictions than LRU: what the engines' eviction, not placement, could win.

The pooled-LRU bound is one LRU cache as large as the fleet; Belady's bound is that cache
evicting with knowledge of the future. Between them lie the online evictions and admission
filters a cache could run without that knowledge. The engines run LRU and a router cannot
change it, so these are not kvroute's levers: they say how much of the gap to Belady an
engine-side change would close (``kvroute bench partition`` prints them beside the placement
it measures).

* ``LRU``: the pooled-LRU bound again, in the same accounting as the others.
* ``ARC`` (Megiddo and Modha, FAST'03): a recency list and a frequency list whose sizes adapt to
  the misses their ghost lists would have saved. No parameter.
* ``W-TinyLFU`` (Einziger, Friedman and Manes, 2017): an LRU window of ``window`` of the
  capacity in front of an LRU main cache; a block leaving the window enters the main cache only
  if it was asked for more often than the block it would evict there. Counts are exact here
  (the paper's sketch is only a way of keeping them small) and halve every ten capacities'
  worth of requests for blocks, so that yesterday's favourites fade.

Every model sees a request as the engines do: it hits the leading blocks of its chain that are
cached, then holds the whole chain, its first block most recently used (an engine frees a
finished request's blocks last block first, so the deepest go first).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from loadtest.trace import TraceRequest
from policies.retention import Keeper

#: W-TinyLFU's counts halve after this many capacities' worth of block requests.
TINYLFU_RESET_CAPACITIES = 10


class PooledCache(ABC):
    """A cache of ``capacity`` blocks that a chain of block keys is looked up in and then touches."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least one block")
        self.capacity = capacity

    @abstractmethod
    def __contains__(self, block: int) -> bool: ...

    @abstractmethod
    def touch(self, block: int) -> None:
        """A request asks for ``block``: hold it (or not: admission is the policy's call)."""

    def leading(self, chain: Sequence[int]) -> int:
        """How many leading blocks of ``chain`` are held: what a request hits."""
        held = 0
        while held < len(chain) and chain[held] in self:
            held += 1
        return held

    def request(self, chain: Sequence[int]) -> None:
        for block in reversed(chain):
            self.touch(block)


class LRU(PooledCache):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def touch(self, block: int) -> None:
        if block in self._blocks:
            self._blocks.move_to_end(block)
            return
        self._blocks[block] = None
        if len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


class ARC(PooledCache):
    """Adaptive replacement: ``recent`` holds blocks asked for once lately, ``frequent`` those asked
    for again; the ghosts remember what each evicted, and a hit on a ghost moves the target size
    of ``recent`` towards the list that would have kept it."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._target = 0.0
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._frequent: OrderedDict[int, None] = OrderedDict()
        self._recent_ghosts: OrderedDict[int, None] = OrderedDict()
        self._frequent_ghosts: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._recent or block in self._frequent

    def touch(self, block: int) -> None:
        if block in self._recent:
            del self._recent[block]
            self._frequent[block] = None
        elif block in self._frequent:
            self._frequent.move_to_end(block)
        elif block in self._recent_ghosts:
            ratio = len(self._frequent_ghosts) / len(self._recent_ghosts)
            self._target = min(self.capacity, self._target + max(ratio, 1.0))
            self._replace(in_frequent_ghosts=False)
            del self._recent_ghosts[block]
            self._frequent[block] = None
        elif block in self._frequent_ghosts:
            ratio = len(self._recent_ghosts) / len(self._frequent_ghosts)
            self._target = max(0.0, self._target - max(ratio, 1.0))
            self._replace(in_frequent_ghosts=True)
            del self._frequent_ghosts[block]
            self._frequent[block] = None
        else:
            self._admit_new()
            self._recent[block] = None

    def _admit_new(self) -> None:
        """Make room for a block no list knows, keeping each side's ghosts within the capacity."""
        recent_side = len(self._recent) + len(self._recent_ghosts)
        if recent_side == self.capacity:
            if len(self._recent) < self.capacity:
                self._recent_ghosts.popitem(last=False)
                self._replace(in_frequent_ghosts=False)
            else:
                self._recent.popitem(last=False)
            return
        everything = recent_side + len(self._frequent) + len(self._frequent_ghosts)
        if everything >= self.capacity:
            if everything == 2 * self.capacity:
                self._frequent_ghosts.popitem(last=False)
            self._replace(in_frequent_ghosts=False)

    def _replace(self, in_frequent_ghosts: bool) -> None:
        """Evict from ``recent`` when it is over its target, else from ``frequent``, into its ghosts."""
        over = len(self._recent) > self._target or (in_frequent_ghosts and len(self._recent) == self._target)
        if self._recent and (over or not self._frequent):
            victim, _ = self._recent.popitem(last=False)
            self._recent_ghosts[victim] = None
        elif self._frequent:
            victim, _ = self._frequent.popitem(last=False)
            self._frequent_ghosts[victim] = None


class WTinyLFU(PooledCache):
    def __init__(self, capacity: int, window: float = 0.01) -> None:
        super().__init__(capacity)
        if not 0 < window <= 1:
            raise ValueError("window must be in (0, 1]")
        self._window_size = max(1, round(capacity * window))
        self._main_size = capacity - self._window_size
        self._window: OrderedDict[int, None] = OrderedDict()
        self._main: OrderedDict[int, None] = OrderedDict()
        self._counts: dict[int, int] = {}
        self._requests = 0

    def __contains__(self, block: int) -> bool:
        return block in self._window or block in self._main

    def touch(self, block: int) -> None:
        self._count(block)
        if block in self._main:
            self._main.move_to_end(block)
        elif block in self._window:
            self._window.move_to_end(block)
        else:
            self._window[block] = None
            if len(self._window) > self._window_size:
                self._admit(self._window.popitem(last=False)[0])

    def _admit(self, candidate: int) -> None:
        """The block leaving the window enters the main cache if there is room, or if it was asked
        for more often than the main cache's least recently used block, which it then evicts."""
        if len(self._main) < self._main_size:
            self._main[candidate] = None
            return
        if not self._main:
            return
        victim = next(iter(self._main))
        if self._counts.get(candidate, 0) > self._counts.get(victim, 0):
            del self._main[victim]
            self._main[candidate] = None

    def _count(self, block: int) -> None:
        self._counts[block] = self._counts.get(block, 0) + 1
        self._requests += 1
        if self._requests >= TINYLFU_RESET_CAPACITIES * self.capacity:
            self._counts = {b: n // 2 for b, n in self._counts.items() if n > 1}
            self._requests = 0


def hit_ratio(
    cache: PooledCache, chains: Sequence[Sequence[int]], prompt_tokens: Sequence[int], block_tokens: int
) -> float:
    """Prompt tokens the leading cached blocks cover, over all prompt tokens (as Belady's bound
    in loadtest/simulate.py counts them)."""
    hits = queried = 0
    for chain, tokens in zip(chains, prompt_tokens, strict=True):
        hits += min(cache.leading(chain) * block_tokens, tokens)
        queried += tokens
        cache.request(chain)
    return hits / queried if queried else 0.0


#: How often ``refreshed_lru`` looks for refreshes due, in trace seconds.
REFRESH_CHECK_S = 1.0
#: The pool's name for the keeper: the fleet's memory as one cache is one backend.
_POOL = "pool"


@dataclass(frozen=True)
class Refreshed:
    hit_ratio: float
    #: Refresh requests sent: each one a kept prefix asked for again with one output token.
    refreshes: int


def refreshed_lru(
    requests: Sequence[TraceRequest],
    capacity_blocks: int,
    block_tokens: int,
    refresh_share: float,
    kept_share: float,
) -> Refreshed:
    """One LRU cache (the fleet pooled, as for the pooled-LRU bound) in which a router keeps the
    prefixes that come back alive by asking for them again (policies/retention.py's keeper, as
    ``kvroute simulate --refresh-share`` runs it on a fleet): the one lever on the engines'
    eviction that a router has on an LRU engine. A refresh touches the prefix's blocks, as an
    engine does for a request of that prefix with one output token; the keeper looks for the
    refreshes due every ``REFRESH_CHECK_S`` of trace time.
    """
    cache = LRU(capacity_blocks)
    keeper = Keeper(refresh_share, kept_share, lambda _: capacity_blocks, seen_blocks=4 * capacity_blocks)
    hits = queried = refreshes = 0
    check = 0.0
    for request in requests:
        while check <= request.arrival_s:
            for _, prefix, _ in keeper.due(check):
                if cache.leading(prefix) < len(prefix):
                    keeper.forget(_POOL, prefix)
                    continue
                cache.request(prefix)
                refreshes += 1
            check += REFRESH_CHECK_S
        chain = request.chain(block_tokens)
        cached = cache.leading(chain)
        hits += min(cached * block_tokens, request.input_tokens)
        queried += request.input_tokens
        keeper.observe(_POOL, chain, cached, request.arrival_s)
        cache.request(chain)
    return Refreshed(hits / queried if queried else 0.0, refreshes)
