"""TTL: a block is believed held for ``ttl_s`` after it was last used, and LRU beyond capacity.

Without KV events the router never hears of an eviction; a belief that simply ages out is
the honest bound on how long an unconfirmed belief is worth acting on. NVIDIA Dynamo's
approximate mode expires its routing-time entries after 120 s; llm-d adds ~2 s provisional
entries until events confirm them. Capacity still applies, LRU, so a burst cannot grow the
belief beyond what the engine could hold.

Entries are kept in last-use order, so the expired ones are always at the front and
:meth:`expire` stops at the first live one. The clock is injectable: the offline simulator
runs it in virtual time.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from policies.eviction.base import BlockSet


class TTLBlocks(BlockSet):
    def __init__(
        self, capacity: int, ttl_s: float = 120.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__(capacity)
        if ttl_s <= 0:
            raise ValueError("ttl_s must be positive")
        self.ttl_s = ttl_s
        self._clock = clock
        #: block -> time of last use, oldest first.
        self._blocks: OrderedDict[int, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def touch_chain(self, chain: Sequence[int]) -> list[int]:
        now = self._clock()
        blocks = self._blocks
        for block in reversed(chain):
            blocks[block] = now
            blocks.move_to_end(block)
        evicted = self.expire()
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def expire(self) -> list[int]:
        deadline = self._clock() - self.ttl_s
        blocks = self._blocks
        expired = []
        while blocks:
            block, used = next(iter(blocks.items()))
            if used > deadline:
                break
            del blocks[block]
            expired.append(block)
        return expired

    def discard(self, block: int) -> bool:
        return self._blocks.pop(block, None) is not None

    def rank(self, block: int) -> float | None:
        return self._blocks.get(block)

    def drop_through(self, rank: float) -> list[int]:
        blocks = self._blocks
        dropped = []
        while blocks and next(iter(blocks.values())) <= rank:
            dropped.append(blocks.popitem(last=False)[0])
        return dropped

    def evict_one(self) -> int | None:
        return self._blocks.popitem(last=False)[0] if self._blocks else None
