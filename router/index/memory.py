"""The in-memory prefix index: the embedded default, one router process, no dependency.

Two structures: per backend a bounded BlockSet (its believed cache, with an eviction
policy), and a reverse map block -> backends holding it, which makes a lookup walk the
chain once, touching only the owners of each block.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from policies.eviction import BlockSet, LRUBlocks
from router.index.base import Candidate, PrefixIndex


class MemoryIndex(PrefixIndex):
    def __init__(self, max_blocks: int, block_set: Callable[[int], BlockSet] = LRUBlocks) -> None:
        self.max_blocks = max_blocks
        self._new_block_set = block_set
        self._backends: dict[str, BlockSet] = {}
        self._capacity: dict[str, int] = {}
        self._owners: dict[int, set[str]] = {}
        self._size = 0
        #: Blocks dropped by per-backend capacity or the global budget, for metrics.
        self.evictions = 0

    def add_backend(self, name: str, capacity_blocks: int) -> None:
        if name not in self._backends:
            self._backends[name] = self._new_block_set(capacity_blocks)
            #: The believed capacity (configured, or the engine's report): closed-loop corrections
            #: lower the live bound (the BlockSet's) and let it grow back to this.
            self._capacity[name] = capacity_blocks

    def set_capacity(self, name: str, capacity_blocks: int) -> None:
        blocks = self._backends.get(name)
        if blocks is None:
            return
        # A bound the closed loop lowered stays lowered (and regrows up to the new capacity).
        lowered = blocks.capacity < self._capacity[name]
        blocks.capacity = min(blocks.capacity, capacity_blocks) if lowered else capacity_blocks
        self._capacity[name] = capacity_blocks
        while len(blocks) > blocks.capacity and (block := blocks.evict_one()) is not None:
            self._forget(name, block)
            self.evictions += 1

    def capacity_of(self, name: str) -> int | None:
        blocks = self._backends.get(name)
        return blocks.capacity if blocks is not None else None

    def remove_backend(self, name: str) -> None:
        blocks = self._backends.pop(name, None)
        if blocks is None:
            return
        del self._capacity[name]
        while (block := blocks.evict_one()) is not None:
            self._forget(name, block)

    async def match(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        depth = self.match_now(chain)
        return {name: depth.get(name, 0) for name in backends}

    async def match_for(self, chain: Sequence[int], candidates: Sequence[Candidate]) -> dict[str, int]:
        depth = self.match_now(chain)
        return {c.name: depth.get(c.name, 0) for c in candidates}

    def match_now(self, chain: Sequence[int]) -> dict[str, int]:
        """Synchronous match over every backend (the offline simulator calls this directly)."""
        self._expire()
        depth: dict[str, int] = {}
        alive: set[str] | None = None
        for i, block in enumerate(chain, start=1):
            owners = self._owners.get(block)
            if not owners:
                break
            alive = set(owners) if alive is None else alive & owners
            if not alive:
                break
            for name in alive:
                depth[name] = i
        return depth

    def record(self, backend: str, chain: Sequence[int]) -> None:
        blocks = self._backends.get(backend)
        if blocks is None or not chain:
            return
        before = len(blocks)
        evicted = blocks.touch_chain(chain)
        for block in chain:
            owners = self._owners.get(block)
            if owners is None:
                self._owners[block] = {backend}
            else:
                owners.add(backend)
        self._size += len(blocks) - before + len(evicted)
        for block in evicted:
            self._forget(backend, block)
        self.evictions += len(evicted)
        while self._size > self.max_blocks:
            largest = max(self._backends, key=lambda n: len(self._backends[n]))
            block = self._backends[largest].evict_one()
            if block is None:
                break
            self._forget(largest, block)
            self.evictions += 1

    def picked(self, backend: str, chain: Sequence[int]) -> None:
        """Believed at the pick (see the belief lifecycle in router/index/base.py), as the
        simulator and SGLang's router do: a request sharing the prefix that arrives while this
        one's prefill runs, or while the router's event loop is late with its first byte, finds
        it where it went."""
        self.record(backend, chain)

    def failed(self, backend: str, chain: Sequence[int]) -> None:
        """The pick fell through before the engine took the prompt: no request may follow it
        there. The whole chain is dropped from ``backend``'s beliefs, the part it held before
        too: after a failure its cache is in doubt, and a miss costs less than a second failure."""
        blocks = self._backends.get(backend)
        if blocks is None:
            return
        for block in chain:
            if blocks.discard(block):
                self._forget(backend, block)

    def _expire(self) -> None:
        """Drop beliefs that time alone made stale (time-based eviction) before answering a match."""
        for name, blocks in self._backends.items():
            for block in blocks.expire():
                self._forget(name, block)
                self.evictions += 1

    def _forget(self, backend: str, block: int) -> None:
        """Drop one (backend, block) entry, already gone from its BlockSet, from the reverse map."""
        owners = self._owners.get(block)
        if owners is not None:
            owners.discard(backend)
            if not owners:
                del self._owners[block]
        self._size -= 1

    def blocks_of(self, backend: str) -> int:
        blocks = self._backends.get(backend)
        return len(blocks) if blocks is not None else 0

    def size(self) -> int:
        return self._size

    def belief_rank(self, backend: str, block: int) -> Any:
        blocks = self._backends.get(backend)
        return blocks.rank(block) if blocks is not None else None

    def forget_through(self, backend: str, rank: Any) -> int:
        blocks = self._backends.get(backend)
        if blocks is None:
            return 0
        dropped = blocks.drop_through(rank)
        for block in dropped:
            self._forget(backend, block)
        # Had the engine room for one more than what it used since, the lost block would be there.
        blocks.capacity = max(1, min(blocks.capacity, len(blocks)))
        return len(dropped)

    def regrow(self, backend: str, blocks: int) -> None:
        held = self._backends.get(backend)
        if held is not None:
            held.capacity = min(self._capacity[backend], held.capacity + blocks)

    async def close(self) -> None:
        """Nothing to release: the index lives and dies with the process."""
