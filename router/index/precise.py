"""The precise index: what each engine holds, as its KV events say (``index.mode: events``).

Engines report every block they store and evict (:mod:`router.kv_events`); this index applies
those reports and nothing else is believed for long. Four ideas:

* **The router's own keys.** A stored block is keyed by :func:`router.index.keys.block_keys` over
  the event's ``token_ids``, chained from its parent block's key, so a request tokenized by the
  router produces the same keys. Engine hashes are only *mapped* to those keys, per event
  stream: no engine hash algorithm, seed or signedness is reproduced, and vLLM and SGLang
  engines (of any version) share one index. A stored block whose parent hash the stream never
  announced cannot be keyed (its prefix is unknown) and is counted as an orphan.
* **Provisional entries.** Between a pick and the engine's events for it (queueing plus
  prefill), :meth:`record` believes the backend holds the chain for ``provisional_ttl_s``; an
  event about the block (stored or removed) replaces the belief with the truth at once.
* **Media.** A block can live on the GPU, or in a CPU or disk tier (an offloading connector
  such as LMCache). A match is worth its tier's weight per block (``medium_weights``), so a
  GPU-resident prefix beats an equally long one that must be loaded back first.
* **Eviction ahead.** A match is a promise about the moment the engine runs the request, not
  the moment it is routed: the prefills queued in front of it store new blocks, and a full
  cache evicts its least recently used ones to make room. The index orders each backend's
  GPU blocks by a stamp (the backend's count of GPU blocks stored when the block was stored or
  last used; a chain's tail older than its head, as engines free a request's blocks tail
  first) and learns from the eviction events where the LRU end stands (the newest stamp of
  the latest eviction: a stamp the model got wrong misleads it only until the next one).
  :meth:`match_surviving` counts a GPU block only if its stamp lies beyond that end by more
  than the blocks queued ahead, so a prefix that the queue will evict before the request runs
  is not promised. A stored run's event names its parent, so the prefix it extends (used by
  the request that stored it, even one the router never saw) is stamped anew when the engine
  runs that request; :meth:`used` does the same for this router's requests once they ran,
  since a full hit stores nothing. A backend with several data-parallel ranks is left out:
  the engine picks the rank, and the router knows neither which nor each rank's own queue
  and LRU order.

One engine (a backend) may publish several streams, one per data-parallel rank; a backend
holds a block when any of its streams does.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import xxhash

from router.index.base import Candidate, PrefixIndex
from router.index.events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, EventBatch
from router.index.keys import ROOT_KEY, block_keys, namespace_seed
from router.kv_events.settings import DEFAULT_MEDIUM_WEIGHTS, TIERS

#: The engines' medium names for each storage tier (router/kv_events/settings.py: TIERS).
_MEDIUM_TIERS = {
    "GPU": "gpu",
    "CPU": "cpu",
    "CPU_PINNED": "cpu",
    "STORAGE": "disk",
    "DISK": "disk",
    "EXTERNAL": "disk",
}


@lru_cache(maxsize=64)
def tier_of(medium: str | None) -> str:
    """The tier of an event's medium: no medium is the GPU pool; unknown media count as disk."""
    if medium is None:
        return "gpu"
    return _MEDIUM_TIERS.get(medium.upper(), "disk")


Source = tuple[str, int]

#: An ancestor stamped within this share of the backend's held blocks of now is recent enough:
#: touching stops there, so decode and chunked-prefill events, one block each, cost a few steps
#: instead of a walk back over the whole prompt (ancestors are never older than their children).
TOUCH_SLACK_SHARE = 64


@dataclass(slots=True)
class _Entry:
    """One engine block hash of one stream: its router key, the copies of it in each tier, and
    its parent.

    Copies, not presence: an engine may hold two physical blocks under one hash (vLLM 0.32 does
    when two requests computed the same block at once, before either was cached) and reports a
    store and a removal for each; the hash is held until the last copy is removed.
    """

    key: int
    #: tier -> physical copies the stream reported stored there and not yet removed.
    tiers: dict[str, int]
    #: The engine hash of the block before it in its chain (None: the chain's first).
    parent: BlockHash | None


@dataclass
class PreciseStats:
    """Counters of what the events could not tell; exported as metrics."""

    #: Stored blocks whose parent the stream never announced (their prefix is unknown).
    orphans: int = 0
    #: Stored blocks whose block size differs from ``index.events.block_size``.
    block_size_mismatches: int = 0
    #: Removals of blocks the index did not hold (harmless: missed store, or before a resync).
    unknown_removals: int = 0
    #: Stored blocks refused because the index was at ``max_blocks``.
    dropped: int = 0


class PreciseIndex(PrefixIndex):
    def __init__(
        self,
        block_size: int,
        medium_weights: Mapping[str, float],
        provisional_ttl_s: float,
        max_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.block_size = block_size
        self.weights = {tier: float(medium_weights.get(tier, DEFAULT_MEDIUM_WEIGHTS[tier])) for tier in TIERS}
        self.provisional_ttl_s = provisional_ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._backends: set[str] = set()
        #: Each backend's capacity in event blocks, for display only (see set_capacity).
        self._capacity: dict[str, int] = {}
        self._sources: dict[Source, dict[BlockHash, _Entry]] = {}
        #: key -> backend -> tier -> number of stream entries holding it there.
        self._holders: dict[int, dict[str, dict[str, int]]] = {}
        self._held: dict[str, int] = {}
        self._held_total = 0
        #: backend -> key -> expiry of the provisional belief; ``_expiries`` orders them for purging.
        self._provisional: dict[str, dict[int, float]] = {}
        self._expiries: deque[tuple[float, str, int]] = deque()
        self._provisional_count = 0
        #: backend -> key -> stamp of its GPU blocks; the stamp clock is the backend's count of
        #: GPU blocks stored, and ``_lru_end`` the newest stamp of its latest eviction (see
        #: match_surviving). ``_ranks``: the event streams (data-parallel ranks) of each backend.
        self._stamps: dict[str, dict[int, int]] = {}
        self._stored_blocks: dict[str, int] = {}
        self._lru_end: dict[str, int] = {}
        self._ranks: dict[str, int] = {}
        #: Blocks the engines reported evicted, since start (``kvroute_index_evictions``).
        self.evictions = 0
        self.stats = PreciseStats()

    # -- the PrefixIndex interface -------------------------------------------------------------

    def add_backend(self, name: str, capacity_blocks: int) -> None:
        """Track ``name``; capacity is the engine's business here (its events report evictions)."""
        self._backends.add(name)
        self._capacity.setdefault(name, capacity_blocks)
        self._held.setdefault(name, 0)
        self._provisional.setdefault(name, {})
        self._stamps.setdefault(name, {})
        self._stored_blocks.setdefault(name, 0)

    def set_capacity(self, name: str, capacity_blocks: int) -> None:
        """Recorded, never enforced: the engine evicts and its events say so; evicting here on a
        number would only make the index disagree with the engine it mirrors."""
        if name in self._backends:
            self._capacity[name] = capacity_blocks

    def capacity_of(self, name: str) -> int | None:
        return self._capacity.get(name)

    def remove_backend(self, name: str) -> None:
        self._capacity.pop(name, None)
        for source in [s for s in self._sources if s[0] == name]:
            self.clear_source(name, source[1])
            del self._sources[source]
        self._provisional_count -= len(self._provisional.pop(name, {}))
        self._held.pop(name, None)
        self._stamps.pop(name, None)
        self._stored_blocks.pop(name, None)
        self._lru_end.pop(name, None)
        self._ranks.pop(name, None)
        self._backends.discard(name)

    async def match(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        return self.match_now(chain, backends)

    async def match_for(self, chain: Sequence[int], candidates: Sequence[Candidate]) -> dict[str, int]:
        """What each candidate will still hold of ``chain`` once the prefills this router queued
        there ahead of the request have stored their blocks (:meth:`match_surviving`)."""
        block = self.block_size
        ahead = {c.name: -(-c.pending_prefill_tokens // block) for c in candidates}
        return self.match_surviving(chain, ahead)

    def match_now(self, chain: Sequence[int], backends: Iterable[str]) -> dict[str, int]:
        """Leading blocks of ``chain`` held by each backend, each worth its best tier's weight."""
        return self.match_surviving(chain, {name: None for name in backends})

    def match_surviving(self, chain: Sequence[int], ahead: Mapping[str, int | None]) -> dict[str, int]:
        """Like :meth:`match_now`, for the backends ``ahead`` names, counting only what survives
        until the request runs: ``ahead[name]`` is the number of blocks the prefills queued in
        front of it there will store (0 or None: no eviction foreseen). A GPU block whose stamp is
        within that many of the backend's LRU end is taken as evicted by then, and the match
        ends there (see the module docstring); not for a backend with several ranks."""
        now = self._clock()
        depth = {name: 0.0 for name in ahead}
        alive = [name for name in depth if name in self._backends]
        doomed_upto: dict[str, int | None] = {}
        for name in alive:
            end = self._lru_end.get(name)
            queued = ahead[name]
            single_rank = self._ranks.get(name, 0) <= 1
            doomed_upto[name] = end + queued if end is not None and queued and single_rank else None
        gpu = self.weights["gpu"]
        for key in chain:
            holders = self._holders.get(key)
            still = []
            for name in alive:
                tiers = holders.get(name) if holders else None
                if tiers:
                    limit = doomed_upto[name]
                    stamp = self._stamps[name].get(key) if limit is not None and "gpu" in tiers else None
                    if stamp is not None and stamp <= limit:
                        tiers = {t: n for t, n in tiers.items() if t != "gpu"}
                        if not tiers:
                            continue
                    depth[name] += max(self.weights[t] for t in tiers)
                elif self._provisional[name].get(key, 0.0) > now:
                    depth[name] += gpu
                else:
                    continue
                still.append(name)
            alive = still
            if not alive:
                break
        return {name: round(d) for name, d in depth.items()}

    def record(self, backend: str, chain: Sequence[int]) -> None:
        """Believe ``backend`` holds ``chain`` until its events say otherwise, or the TTL passes."""
        provisional = self._provisional.get(backend)
        if provisional is None:
            return
        now = self._clock()
        self._purge(now)
        expiry = now + self.provisional_ttl_s
        holders = self._holders
        for key in chain:
            held = holders.get(key)
            if held is not None and backend in held:
                continue
            if key not in provisional:
                self._provisional_count += 1
            provisional[key] = expiry
            self._expiries.append((expiry, backend, key))

    # -- the belief lifecycle of an attempt (router/index/base.py) ---------------------------

    def picked(self, backend: str, chain: Sequence[int]) -> None:
        """Believed at once, provisionally (until the engine's events say), so that a burst of
        requests sharing a prefix follows the first one."""
        self.record(backend, chain)

    def accepted(self, backend: str, chain: Sequence[int]) -> None:
        """The engine took the prompt: the provisional belief is renewed, and the blocks it
        already held were just used."""
        self.record(backend, chain)
        self.used(backend, chain)

    def failed(self, backend: str, chain: Sequence[int]) -> None:
        """The pick fell through before the engine took the prompt: no request may follow it there."""
        self.withdraw(backend, chain)

    def used(self, backend: str, chain: Sequence[int]) -> None:
        """``backend``'s engine has just run a request for ``chain`` (its first byte came back): the
        leading blocks it holds were used, and are now its most recently used. Its new blocks'
        events say so for a request that stored any; for a full hit nothing else would. Called
        then rather than at the pick: a request waiting in the engine's queue does not keep its
        blocks from eviction, and a block stamped new but evicted meanwhile would put the LRU
        end far ahead."""
        stamps = self._stamps.get(backend)
        if stamps is None:
            return
        now = self._stored_blocks[backend]
        for key in chain:
            if key not in stamps:
                return
            stamps[key] = now

    def withdraw(self, backend: str, chain: Sequence[int]) -> None:
        """The pick of ``backend`` for ``chain`` fell through before the engine took the prompt
        (it failed, the request went elsewhere): drop the provisional beliefs :meth:`record` made,
        so that no request follows it there for the TTL. A concurrent request's belief in the same
        blocks goes too; its engine's events restore it within moments."""
        provisional = self._provisional.get(backend)
        if not provisional:
            return
        for key in chain:
            if provisional.pop(key, None) is not None:
                self._provisional_count -= 1

    def blocks_of(self, backend: str) -> int:
        return self._held.get(backend, 0)

    def size(self) -> int:
        return self._held_total + self._provisional_count

    async def close(self) -> None:
        """Nothing to release; the subscribers are stopped by their manager."""

    # -- the event side ------------------------------------------------------------------------

    def apply(self, backend: str, rank: int, batch: EventBatch) -> None:
        """Apply one decoded batch of stream ``(backend, rank)``, in order."""
        if backend not in self._backends:
            return
        entries = self._sources.get((backend, rank))
        if entries is None:
            entries = self._sources[(backend, rank)] = {}
            self._ranks[backend] = self._ranks.get(backend, 0) + 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                self._stored(backend, entries, event)
            elif isinstance(event, BlockRemoved):
                self._removed(backend, entries, event)
            elif isinstance(event, AllBlocksCleared):
                self.clear_source(backend, rank)

    def clear_source(self, backend: str, rank: int) -> None:
        """Forget everything stream ``(backend, rank)`` reported (engine restart, AllBlocksCleared)."""
        entries = self._sources.get((backend, rank))
        if not entries:
            return
        for entry in entries.values():
            for tier in entry.tiers:
                self._unhold(backend, entry.key, tier)
            self._unstamp(backend, entry.key)
        entries.clear()
        if not self._stamps[backend]:
            # An empty cache has no LRU end yet; an old one would doom the blocks stored next.
            self._lru_end.pop(backend, None)

    def engine_hashes(self, backend: str) -> set[BlockHash]:
        """The engine hashes ``backend``'s streams report held: what its caches hold, if in sync."""
        return {h for (name, _), entries in self._sources.items() if name == backend for h in entries}

    def _stored(self, backend: str, entries: dict[BlockHash, _Entry], event: BlockStored) -> None:
        hashes = event.block_hashes
        if event.block_size != self.block_size:
            self.stats.block_size_mismatches += len(hashes)
            return
        if event.parent_block_hash is None:
            seed = ROOT_KEY
        else:
            parent = entries.get(event.parent_block_hash)
            if parent is None:
                self.stats.orphans += len(hashes)
                return
            seed = parent.key
        keys = block_keys(event.token_ids, self.block_size, namespace_seed(seed, event.namespace))
        # A trailing partial page (SGLang) has no full-block key; key it so no request matches it.
        while len(keys) < len(hashes):
            keys.append(xxhash.xxh3_64_intdigest(b"partial", seed=keys[-1] if keys else seed))
        tier = tier_of(event.medium)
        gpu = tier == "gpu"
        provisional = self._provisional[backend]
        budget = self.max_blocks - self.size()
        # Stamps run backwards along the chain: its tail is the first to go (engines free a
        # request's blocks tail first, and the LRU evicts the earliest freed). Only GPU stores
        # move the clock: the LRU being modelled is the GPU's.
        stamps, first_stamp = self._stamps[backend], self._stored_blocks[backend]
        now = first_stamp + len(hashes) if gpu else first_stamp
        self._stored_blocks[backend] = now
        stamp = now
        parent_hash = event.parent_block_hash
        for block_hash, key in zip(hashes, keys, strict=False):
            stamp -= 1
            entry = entries.get(block_hash)
            if entry is None:
                if budget <= 0:
                    self.stats.dropped += 1
                    continue
                budget -= 1
                entry = entries[block_hash] = _Entry(key, {tier: 1}, parent_hash)
                self._hold(backend, key, tier)
            elif tier not in entry.tiers:
                entry.tiers[tier] = 1
                self._hold(backend, entry.key, tier)
            else:
                entry.tiers[tier] += 1
            if gpu:
                stamps[entry.key] = stamp
            if provisional and provisional.pop(entry.key, None) is not None:
                self._provisional_count -= 1
            parent_hash = block_hash
        if gpu:
            fresh = first_stamp - len(stamps) // TOUCH_SLACK_SHARE
            self._touch_ancestors(entries, stamps, event.parent_block_hash, now, fresh)

    @staticmethod
    def _touch_ancestors(
        entries: dict[BlockHash, _Entry],
        stamps: dict[int, int],
        block_hash: BlockHash | None,
        now: int,
        fresh: int,
    ) -> None:
        """The prefix a stored run extends was just used by the request that stored it (a hit,
        perhaps of traffic the router never saw): it becomes the most recently used, up to the
        first ancestor already stamped ``fresh`` or later."""
        while block_hash is not None:
            entry = entries.get(block_hash)
            if entry is None:
                return
            stamp = stamps.get(entry.key)
            if stamp is None or stamp >= fresh:
                return
            stamps[entry.key] = now
            block_hash = entry.parent

    def _removed(self, backend: str, entries: dict[BlockHash, _Entry], event: BlockRemoved) -> None:
        tier = tier_of(event.medium)
        provisional = self._provisional[backend]
        newest_evicted: int | None = None
        for block_hash in event.block_hashes:
            entry = entries.get(block_hash)
            if entry is None or tier not in entry.tiers:
                self.stats.unknown_removals += 1
                continue
            self.evictions += 1
            entry.tiers[tier] -= 1
            if entry.tiers[tier]:
                continue  # another copy of the block is still there
            del entry.tiers[tier]
            self._unhold(backend, entry.key, tier)
            if tier == "gpu":
                stamp = self._unstamp(backend, entry.key)
                if stamp is not None and (newest_evicted is None or stamp > newest_evicted):
                    newest_evicted = stamp
            if not entry.tiers:
                del entries[block_hash]
            if provisional and provisional.pop(entry.key, None) is not None:
                self._provisional_count -= 1
        if newest_evicted is not None:
            self._lru_end[backend] = newest_evicted

    def _unstamp(self, backend: str, key: int) -> int | None:
        """Drop the stamp of a block no stream of ``backend`` holds on the GPU any more; its stamp."""
        tiers = self._holders.get(key, {}).get(backend)
        if tiers and "gpu" in tiers:
            return None
        return self._stamps[backend].pop(key, None)

    def _hold(self, backend: str, key: int, tier: str) -> None:
        held = self._holders.get(key)
        if held is None:
            held = self._holders[key] = {}
        tiers = held.get(backend)
        if tiers is None:
            tiers = held[backend] = {}
            self._held[backend] += 1
            self._held_total += 1
        tiers[tier] = tiers.get(tier, 0) + 1

    def _unhold(self, backend: str, key: int, tier: str) -> None:
        held = self._holders[key]
        tiers = held[backend]
        tiers[tier] -= 1
        if tiers[tier] == 0:
            del tiers[tier]
            if not tiers:
                del held[backend]
                self._held[backend] -= 1
                self._held_total -= 1
                if not held:
                    del self._holders[key]

    def _purge(self, now: float) -> None:
        """Drop provisional beliefs whose time has passed (oldest first; stale queue items skipped)."""
        expiries = self._expiries
        while expiries and expiries[0][0] <= now:
            expiry, backend, key = expiries.popleft()
            provisional = self._provisional.get(backend)
            if provisional is not None and provisional.get(key) == expiry:
                del provisional[key]
                self._provisional_count -= 1
