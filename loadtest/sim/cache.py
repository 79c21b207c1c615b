"""The simulated engine's block-level LRU prefix cache.

Blocks and tokens: the simulator has no tokenizer. One token is ``chars_per_token`` characters of
the rendered prompt, and a block is ``block_tokens`` consecutive tokens, i.e. ``block_tokens *
chars_per_token`` characters. Only full blocks are cached (a trailing partial block never is), as
in vLLM.

Block identity is a chained hash: block *i*'s key is ``xxh3_64(block_i_text, seed=key_{i-1})``,
starting from a fixed seed derived from the model name. Equal keys therefore mean equal prefixes
up to and including that block, and different models never share entries.

Eviction is LRU over blocks. A prompt's blocks are touched in reverse order, so the first block of
a chain is the most recently used: a chain is eaten from its tail, and a shared system prompt at
the head of many chains survives longest, which is how vLLM frees and evicts blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

import xxhash

from loadtest.sim.kv_events import Cleared, Removed, SimEvent, Stored

#: Fixed root of every hash chain; the model name is mixed into it (see :func:`model_seed`).
_SEED_PREFIX = b"kvroute-sim\x00"


def model_seed(model: str) -> int:
    """The seed of ``model``'s hash chains: fixed across runs and processes, distinct per model."""
    return xxhash.xxh3_64_intdigest(_SEED_PREFIX + model.encode())


def chain_hashes(text: str, seed: int, block_chars: int) -> list[int]:
    """Chained keys of the full ``block_chars``-character blocks of ``text``."""
    keys: list[int] = []
    key = seed
    for start in range(0, len(text) - block_chars + 1, block_chars):
        key = xxhash.xxh3_64_intdigest(text[start : start + block_chars].encode(), seed=key)
        keys.append(key)
    return keys


class PrefixCache:
    """An LRU set of block keys with a capacity in blocks, plus vLLM-style hit accounting.

    ``queries_tokens`` and ``hits_tokens`` count tokens, like vLLM's ``prefix_cache_queries`` and
    ``prefix_cache_hits`` counters: every lookup adds the prompt's length to the first and the
    cached prefix's length to the second.
    """

    def __init__(self, capacity_blocks: int, block_tokens: int, chars_per_token: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        self.block_tokens = block_tokens
        self.block_chars = block_tokens * chars_per_token
        # Least recently used first; a key's value is unused (an ordered set).
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self._seeds: dict[str, int] = {}
        self.queries_tokens = 0
        self.hits_tokens = 0
        self.evictions = 0
        #: Receives each change as KV events (one call per insert or clear), when the engine publishes.
        self.listener: Callable[[list[SimEvent]], None] | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    def keys(self) -> set[int]:
        """The cached blocks' keys (what the engine's KV events describe)."""
        return set(self._blocks)

    def hashes(self, text: str, model: str) -> list[int]:
        """Keys of the full blocks of ``text`` as a prompt for ``model``."""
        seed = self._seeds.get(model)
        if seed is None:
            seed = self._seeds[model] = model_seed(model)
        return chain_hashes(text, seed, self.block_chars)

    def lookup(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """Number of leading blocks of the chain that are cached, and count the query.

        At most ``(prompt_tokens - 1) // block_tokens`` blocks can hit: like vLLM, the engine
        always computes the prompt's last token to get the logits of the first output token, so a
        fully cached prompt still recomputes its last block. A lookup does not touch the blocks;
        :meth:`insert` does, once the prefill that used them is done.
        """
        hit = self.peek(hashes, prompt_tokens)
        self.queries_tokens += prompt_tokens
        self.hits_tokens += hit * self.block_tokens
        return hit

    def peek(self, hashes: Sequence[int], prompt_tokens: int) -> int:
        """What :meth:`lookup` would return, without counting a query (to compare caches first)."""
        limit = min(len(hashes), (prompt_tokens - 1) // self.block_tokens)
        hit = 0
        while hit < limit and hashes[hit] in self._blocks:
            hit += 1
        return hit

    def insert(self, hashes: Sequence[int], token_ids: Sequence[int] = ()) -> None:
        """Add or touch the chain's blocks, first block last (most recent), then evict LRU blocks.

        With a listener, the change is reported as vLLM reports it: one ``Stored`` per run of newly
        cached blocks (with their ``token_ids``, the prompt's tokens), then the evicted blocks.
        """
        blocks = self._blocks
        new: list[int] = []
        for i in range(len(hashes) - 1, -1, -1):
            key = hashes[i]
            if key in blocks:
                blocks.move_to_end(key)
            else:
                blocks[key] = None
                new.append(i)
        excess = len(blocks) - self.capacity_blocks
        evicted = [blocks.popitem(last=False)[0] for _ in range(excess)]
        if excess > 0:
            self.evictions += excess
        if self.listener is not None and (new or evicted):
            events: list[SimEvent] = self._stored_runs(hashes, sorted(new), token_ids)
            if evicted:
                events.append(Removed(evicted))
            self.listener(events)

    def _stored_runs(self, hashes: Sequence[int], new: list[int], token_ids: Sequence[int]) -> list[SimEvent]:
        """One ``Stored`` per run of consecutive new positions of the chain."""
        size = self.block_tokens
        runs: list[SimEvent] = []
        start = 0
        for j in range(1, len(new) + 1):
            if j == len(new) or new[j] != new[j - 1] + 1:
                first, last = new[start], new[j - 1] + 1
                parent = hashes[first - 1] if first else None
                runs.append(Stored(hashes[first:last], parent, token_ids[first * size : last * size]))
                start = j
        return runs

    def clear(self) -> None:
        """Drop every cached block (vLLM's ``reset_prefix_cache``), reported as ``AllBlocksCleared``."""
        self._blocks.clear()
        if self.listener is not None:
            self.listener([Cleared()])
