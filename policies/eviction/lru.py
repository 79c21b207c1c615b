"""LRU: what vLLM's and SGLang's prefix caches do, so the default belief model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.eviction.base import BlockSet


class LRUBlocks(BlockSet):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        #: block -> the touch count when it was last used; least recently used first.
        self._blocks: OrderedDict[int, int] = OrderedDict()
        self._touches = 0

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def touch_chain(self, chain: Sequence[int]) -> list[int]:
        blocks = self._blocks
        # Walk the chain backwards so block 0 ends up most recently used, evicted last.
        for block in reversed(chain):
            self._touches += 1
            blocks[block] = self._touches
            blocks.move_to_end(block)
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def discard(self, block: int) -> bool:
        return self._blocks.pop(block, None) is not None

    def evict_one(self) -> int | None:
        return self._blocks.popitem(last=False)[0] if self._blocks else None

    def rank(self, block: int) -> int | None:
        return self._blocks.get(block)

    def drop_through(self, rank: int) -> list[int]:
        blocks = self._blocks
        dropped = []
        while blocks and next(iter(blocks.values())) <= rank:
            dropped.append(blocks.popitem(last=False)[0])
        return dropped
