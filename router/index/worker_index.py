"""The memory index of one worker of ``kvroute serve --workers N`` with ``index.store: memory``.

Each worker keeps the whole index in its own memory, as one router does, and tells the other
workers what it believes: every belief recorded here, and every one withdrawn after a failed
pick, also goes to an outbox that router/fleet/worker_sync.py sends to them within a couple of
milliseconds, and their changes come back in through :meth:`apply`, which does not send them on
again. Like the Redis-synced
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
        #: What changed here and is not yet sent to the other workers, in order: (backend, chain,
        #: True) for a belief recorded, (backend, chain, False) for one withdrawn after a failure.
        self.outbox: list[tuple[str, Sequence[int], bool]] = []
        #: Called when the outbox gains its first entry, so the sender schedules a send.
        self.on_outbox: Callable[[], None] = lambda: None

    def record(self, backend: str, chain: Sequence[int]) -> None:
        """Believe it here at once, and put it in the outbox for the other workers."""
        super().record(backend, chain)
        if chain and backend in self._backends:
            self._post(backend, chain, True)

    def failed(self, backend: str, chain: Sequence[int]) -> None:
        """Withdraw it here, and from the other workers too: the belief recorded at the pick may
        have gone out to them already (within a millisecond), and a worker that kept it would
        send the next request with that prefix to where this one just failed."""
        super().failed(backend, chain)
        if chain and backend in self._backends:
            self._post(backend, chain, False)

    def _post(self, backend: str, chain: Sequence[int], held: bool) -> None:
        self.outbox.append((backend, chain, held))
        if len(self.outbox) == 1:
            self.on_outbox()

    def take_outbox(self) -> list[tuple[str, Sequence[int], bool]]:
        taken, self.outbox = self.outbox, []
        return taken

    def apply(self, backend: str, chain: Sequence[int], held: bool) -> bool:
        """Take another worker's change here, without sending it on; False when ``backend`` is
        not known here (yet: each worker discovers backends on its own), and it is dropped."""
        if backend not in self._backends:
            return False
        if held:
            super().record(backend, chain)
        else:
            super().failed(backend, chain)
        return True
