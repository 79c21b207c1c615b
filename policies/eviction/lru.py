"""LRU: what vLLM's and SGLang's prefix caches do, so the default belief model."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from policies.eviction.base import BlockSet


class LRUBlocks(BlockSet):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def touch_chain(self, chain: Sequence[int]) -> list[int]:
        blocks = self._blocks
        # Walk the chain backwards so block 0 ends up most recently used, evicted last.
        for block in reversed(chain):
            if block in blocks:
                blocks.move_to_end(block)
            else:
                blocks[block] = None
        evicted = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def discard(self, block: int) -> bool:
        return self._blocks.pop(block, 0) is None

    def evict_one(self) -> int | None:
        return self._blocks.popitem(last=False)[0] if self._blocks else None
