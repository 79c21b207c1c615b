"""The memory index of one worker of ``kvroute serve --workers N`` with ``index.store: memory``.

Each worker keeps the whole index in its own memory, as one router does, and tells the other
workers what it believes: every belief recorded here also goes to an outbox that
router/fleet/worker_sync.py sends to them within a couple of milliseconds, and their beliefs
come back in through :meth:`apply`, which does not send them on again. Like the Redis-synced
index (router/index/redis_sync.py), each copy evicts by its own capacity and order, so the
copies agree closely but not exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from policies.eviction import BlockSet, LRUBlocks
from router.index.memory import MemoryIndex


class WorkerIndex(MemoryIndex):
    def __init__(self, max_blocks: int, block_set: Callable[[int], BlockSet] = LRUBlocks) -> None:
        super().__init__(max_blocks, block_set)
        #: Beliefs recorded here and not yet sent to the other workers.
        self.outbox: list[tuple[str, Sequence[int]]] = []
        #: Called when the outbox gains its first entry, so the sender schedules a send.
        self.on_outbox: Callable[[], None] = lambda: None

    def record(self, backend: str, chain: Sequence[int]) -> None:
        """Believe it here at once, and put it in the outbox for the other workers."""
        super().record(backend, chain)
        if chain and backend in self._backends:
            self.outbox.append((backend, chain))
            if len(self.outbox) == 1:
                self.on_outbox()

    def take_outbox(self) -> list[tuple[str, Sequence[int]]]:
        taken, self.outbox = self.outbox, []
        return taken

    def apply(self, backend: str, chain: Sequence[int]) -> None:
        """Believe another worker's belief here, without sending it on."""
        super().record(backend, chain)
