"""LFU: the blocks touched most often stay; among equals, the least recently touched goes first.

Shared prefixes (a system prompt, a long document many questions ask about) are touched by
every request that uses them, so under LFU a burst of one-off long prompts cannot flush
them, which LRU does. The cost: a block that was hot an hour ago keeps its count. Engines
themselves evict LRU, so ``lru`` is the faithful default and ``lfu`` the belief to try when
many one-off prompts pass through engines whose caches favour reuse.

Counts live in frequency buckets, each an LRU-ordered set, so touching and evicting are
O(1) (finding the next-lowest count after a bucket empties is over the distinct counts).
A chain is touched from its last block to its first, so at equal counts its first blocks
are the more recent and outlive its tail.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.eviction.base import BlockSet


class LFUBlocks(BlockSet):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._count: dict[int, int] = {}
        #: count -> {block: touch number of its last use}, least recently used first.
        self._buckets: dict[int, OrderedDict[int, int]] = {}
        self._min_count = 0
        self._touches = 0

    def __len__(self) -> int:
        return len(self._count)

    def __contains__(self, block: int) -> bool:
        return block in self._count

    def _unlink(self, block: int, count: int) -> None:
        bucket = self._buckets[count]
        del bucket[block]
        if not bucket:
            del self._buckets[count]
            if count == self._min_count:
                self._min_count = min(self._buckets, default=0)

    def _link(self, block: int, count: int) -> None:
        self._count[block] = count
        self._touches += 1
        self._buckets.setdefault(count, OrderedDict())[block] = self._touches
        if self._min_count == 0 or count < self._min_count:
            self._min_count = count

    def touch_chain(self, chain: Sequence[int]) -> list[int]:
        for block in reversed(chain):
            count = self._count.get(block, 0)
            if count:
                self._unlink(block, count)
            self._link(block, count + 1)
        evicted = []
        while len(self._count) > self.capacity:
            evicted.append(self._pop_least())
        return evicted

    def _pop_least(self) -> int:
        count = self._min_count
        block = next(iter(self._buckets[count]))
        self._unlink(block, count)
        del self._count[block]
        return block

    def discard(self, block: int) -> bool:
        count = self._count.pop(block, 0)
        if not count:
            return False
        self._unlink(block, count)
        return True

    def evict_one(self) -> int | None:
        return self._pop_least() if self._count else None

    def rank(self, block: int) -> tuple[int, int] | None:
        count = self._count.get(block)
        return None if count is None else (count, self._buckets[count][block])

    def drop_through(self, rank: tuple[int, int]) -> list[int]:
        dropped = []
        while self._count:
            count = self._min_count
            touched = next(iter(self._buckets[count].values()))
            if (count, touched) > rank:
                break
            dropped.append(self._pop_least())
        return dropped
