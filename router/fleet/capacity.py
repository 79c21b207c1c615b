"""Sizing each backend's believed KV capacity from the cache size its engine reports.

The index bounds what it believes of each backend by a capacity in blocks; past it, the
eviction policy drops beliefs as the engine would drop blocks. A configured number is a
guess, and a wrong one costs either way: too large and the router believes in prefixes the
engine evicted long ago, too small and it forgets ones still cached. The engine knows its
size (vLLM ``cache_config_info``: ``num_gpu_blocks`` x ``block_size``; SGLang
``max_total_num_tokens``), and every scrape carries it as ``EngineStats.capacity_tokens``.

Units. Approximate mode's blocks are ``index.block_size`` characters of prompt, so
``blocks = tokens x chars_per_token / block_size``; events mode's are the events' blocks of
``index.events.block_size`` tokens, and there the number is shown, not enforced (the
engine's own eviction events bound that index).

Who wins. A ``capacity_blocks`` given for a backend (or for its discovery source) is an
operator's decision and stays; ``index.backend_capacity_blocks`` is only the default until
the engine has reported. Without engine metrics (``engine_metrics.enabled: false``) the
configured numbers are all there is.
"""

from __future__ import annotations

import logging

from router.fleet.backends import Backend
from router.fleet.engines.base import EngineStats
from router.index import PrefixIndex
from router.index.settings import IndexConfig

log = logging.getLogger("kvroute.capacity")

#: Reports within this share of the capacity in use change nothing. A real cache size is fixed
#: while an engine runs; what moves a little between scrapes is an estimate (SGLang before
#: 0.5.6 gives only used tokens and a rounded usage), and each re-size may evict beliefs.
RESIZE_TOLERANCE = 0.1


class CapacitySizer:
    """Turns each scrape's KV capacity into index blocks and re-sizes the backend when it moved."""

    def __init__(self, index: PrefixIndex, config: IndexConfig) -> None:
        self.index = index
        if config.mode == "events":
            self._chars_per_token, self._block_units = 1.0, config.events.block_size
        else:
            self._chars_per_token, self._block_units = config.chars_per_token, config.block_size
        #: The capacity applied from each backend's reports (absent: still the configured one).
        self._applied: dict[str, int] = {}

    def blocks(self, capacity_tokens: int) -> int:
        """Index blocks in an engine cache of ``capacity_tokens`` (rounded down, at least one)."""
        return max(1, int(capacity_tokens * self._chars_per_token // self._block_units))

    def observe(self, backend: Backend, stats: EngineStats) -> None:
        """One scrape of ``backend``: re-size its beliefs if the engine's capacity is news."""
        if backend.config.capacity_blocks is not None or stats.capacity_tokens is None:
            return
        blocks = self.blocks(stats.capacity_tokens)
        applied = self._applied.get(backend.name)
        if applied is not None and abs(blocks - applied) <= RESIZE_TOLERANCE * applied:
            return
        before = self.index.capacity_of(backend.name)
        self.index.set_capacity(backend.name, blocks)
        self._applied[backend.name] = blocks
        log.info(
            "backend %s: believed capacity %s -> %d blocks (engine reports %d tokens of KV cache)",
            backend.name,
            before,
            blocks,
            stats.capacity_tokens,
        )

    def forget(self, name: str) -> None:
        """``name`` left the pool; a backend of that name added later starts from its config."""
        self._applied.pop(name, None)
