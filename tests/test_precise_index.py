"""The precise index's rules: router keys from event tokens, media weights, provisional beliefs."""

from __future__ import annotations

import pytest

from loadtest.sim.cache import PrefixCache
from loadtest.sim.kv_events import Cleared, Removed, Stored
from router.index.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from router.index.keys import block_keys
from router.index.precise import PreciseIndex, tier_of

B = 4
TOKENS = list(range(100, 116))  # four blocks of four tokens
CHAIN = block_keys(TOKENS, B)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_index(clock: Clock | None = None, **weights: float) -> PreciseIndex:
    index = PreciseIndex(B, weights, provisional_ttl_s=2.0, max_blocks=1000, clock=clock or Clock())
    for name in ("a", "b"):
        index.add_backend(name, 0)
    return index


def stored(hashes, parent, tokens, medium: str | None = "GPU", size: int = B, namespace=None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, tuple(tokens), size, medium, namespace)


def batch(*events) -> EventBatch:
    return EventBatch(0.0, tuple(events), 0)


def test_keys_from_event_tokens_meet_the_requests_chain_across_events() -> None:
    index = make_index()
    # The engine's hashes are arbitrary (never reproduced); a later event chains through its parent.
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    index.apply("a", 0, batch(stored([903], 902, TOKENS[8:12])))
    assert index.match_now(CHAIN, ["a", "b"]) == {"a": 3, "b": 0}
    assert index.blocks_of("a") == 3


def test_a_stored_block_whose_parent_is_unknown_is_an_orphan() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([903], 902, TOKENS[8:12])))
    assert index.stats.orphans == 1
    assert index.blocks_of("a") == 0


def test_events_of_another_block_size_are_counted_not_applied() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([901], None, TOKENS[:8], size=8)))
    assert index.stats.block_size_mismatches == 1
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}


def test_namespaced_blocks_never_match_a_plain_request() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8], namespace="('lora',)")))
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}
    assert index.blocks_of("a") == 2


def test_removal_stops_the_match_at_the_removed_block() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([901, 902, 903, 904], None, TOKENS)))
    index.apply("a", 0, batch(BlockRemoved((903,), "GPU")))
    assert index.match_now(CHAIN, ["a"]) == {"a": 2}
    assert index.evictions == 1
    index.apply("a", 0, batch(BlockRemoved((999,), "GPU")))
    assert index.stats.unknown_removals == 1


def test_slower_tiers_are_worth_their_weight() -> None:
    index = make_index(cpu=0.5)
    index.apply("a", 0, batch(stored([901, 902, 903, 904], None, TOKENS, medium="GPU")))
    index.apply("b", 0, batch(stored([801, 802, 803, 804], None, TOKENS, medium="CPU_PINNED")))
    assert index.match_now(CHAIN, ["a", "b"]) == {"a": 4, "b": 2}


def test_a_block_offloaded_then_evicted_from_gpu_still_counts_at_cpu_weight() -> None:
    index = make_index(cpu=0.5)
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8], medium="GPU")))
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8], medium="CPU")))
    index.apply("a", 0, batch(BlockRemoved((901, 902), "GPU")))
    assert index.match_now(CHAIN, ["a"]) == {"a": 1}
    index.apply("a", 0, batch(BlockRemoved((901, 902), "CPU")))
    assert index.blocks_of("a") == 0


@pytest.mark.parametrize(
    ("medium", "tier"),
    [(None, "gpu"), ("GPU", "gpu"), ("CPU", "cpu"), ("cpu", "cpu"), ("CPU_PINNED", "cpu"),
     ("STORAGE", "disk"), ("DISK", "disk"), ("EXTERNAL", "disk"), ("NVME", "disk")],
)  # fmt: skip
def test_engine_media_map_to_tiers(medium: str | None, tier: str) -> None:
    assert tier_of(medium) == tier


def test_provisional_beliefs_expire() -> None:
    clock = Clock()
    index = make_index(clock)
    index.record("a", CHAIN[:2])
    assert index.match_now(CHAIN, ["a"]) == {"a": 2}
    clock.now += 2.5
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}
    index.record("a", CHAIN[:1])  # purges the expired entries
    assert index.size() == 1


def test_events_replace_provisional_beliefs() -> None:
    index = make_index()
    index.record("a", CHAIN)
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    assert index.size() == 2 + 2  # two confirmed, two still provisional
    index.apply("a", 0, batch(BlockRemoved((902,), "GPU")))
    # The engine evicted block 2: neither the event nor the pick's belief keeps it.
    assert index.match_now(CHAIN, ["a"]) == {"a": 1}


def test_data_parallel_ranks_are_separate_streams_of_one_backend() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    index.apply("a", 1, batch(stored([501, 502], None, TOKENS[:8])))
    index.apply("a", 0, batch(AllBlocksCleared()))
    assert index.match_now(CHAIN, ["a"]) == {"a": 2}
    assert index.engine_hashes("a") == {501, 502}
    index.clear_source("a", 1)
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}
    assert index.size() == 0


def test_removed_backends_are_forgotten_and_their_late_events_ignored() -> None:
    index = make_index()
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    index.record("a", CHAIN)
    index.remove_backend("a")
    assert index.size() == 0
    index.apply("a", 0, batch(stored([901], None, TOKENS[:4])))
    assert index.size() == 0
    assert index.match_now(CHAIN, ["a", "b"]) == {"a": 0, "b": 0}


def test_the_memory_budget_refuses_new_blocks() -> None:
    index = PreciseIndex(B, {}, provisional_ttl_s=2.0, max_blocks=2, clock=Clock())
    index.add_backend("a", 0)
    index.apply("a", 0, batch(stored([901, 902, 903], None, TOKENS[:12])))
    assert index.blocks_of("a") == 2
    assert index.stats.dropped == 1


class _Engine:
    """The simulated engine's LRU prefix cache, its events applied to the index as they happen."""

    def __init__(self, index: PreciseIndex, capacity_blocks: int, rank: int = 0) -> None:
        self.cache = PrefixCache(capacity_blocks, B, chars_per_token=1)
        self.cache.listener = lambda events: index.apply("a", rank, batch(*map(self._event, events)))

    @staticmethod
    def _event(event: Stored | Removed | Cleared) -> BlockStored | BlockRemoved | AllBlocksCleared:
        if isinstance(event, Stored):
            return stored(event.hashes, event.parent, event.token_ids)
        if isinstance(event, Removed):
            return BlockRemoved(tuple(event.hashes), "GPU")
        return AllBlocksCleared()

    def run(self, text: str) -> int:
        """Prefill ``text``: the blocks it found cached, then its own blocks stored."""
        hashes = self.cache.hashes(text, "m")
        hit = self.cache.lookup(hashes, len(text) + 1)
        self.cache.insert(hashes, [ord(c) for c in text])
        return hit

    def holds(self, text: str) -> int:
        """Leading blocks of ``text`` cached now, without using them."""
        return self.cache.lookup(self.cache.hashes(text, "m"), len(text) + 1)


def chain_of(text: str) -> list[int]:
    return block_keys([ord(c) for c in text], B)


DOC_X, DOC_Y = "x" * 16, "y" * 16  # four blocks each


def full_engine(index: PreciseIndex) -> _Engine:
    """An engine of eight blocks that ran X, then Y: full, with X the least recently used."""
    engine = _Engine(index, capacity_blocks=8)
    engine.run(DOC_X)
    engine.run(DOC_Y)
    return engine


def test_a_prefix_the_queue_ahead_will_evict_is_not_promised() -> None:
    index = make_index()
    engine = _Engine(index, capacity_blocks=8)
    doc_x, doc_y, doc_z, doc_w = "x" * 16, "y" * 8 + "Y" * 8, "z" * 8, "w" * 8
    for doc in (doc_x, doc_y, doc_z):  # the third evicts the first's two tail blocks
        engine.run(doc)
    x = chain_of(doc_x)
    assert index.match_surviving(x, {"a": 0}) == {"a": 2} == {"a": engine.cache.lookup(
        engine.cache.hashes(doc_x, "m"), 17)}  # fmt: skip
    # Two new blocks will be stored before the request runs: the LRU evicts X's last two first.
    assert index.match_surviving(x, {"a": 2}) == {"a": 0}
    assert index.match_surviving(x, {"a": 1}) == {"a": 1}
    assert index.match_surviving(chain_of(doc_y), {"a": 2}) == {"a": 4}
    assert index.match_now(x, ["a"]) == {"a": 2}  # what is held now, eviction ahead aside
    engine.run(doc_w)  # the queue ahead ran: the prediction for X (none of it left) held
    assert engine.run(doc_x) == 0


def test_a_routed_request_keeps_its_prefix_recent() -> None:
    index = make_index()
    engine = full_engine(index)
    doc_x, doc_y, doc_z = DOC_X, DOC_Y, "z" * 4
    # A request for X ran there, a full hit that stores nothing: its first byte says X was used.
    assert engine.run(doc_x) == 4
    index.used("a", chain_of(doc_x))
    engine.run(doc_z)  # evicts Y's tail, the least recently used now
    assert index.match_surviving(chain_of(doc_x), {"a": 3}) == {"a": 4}
    assert index.match_surviving(chain_of(doc_y), {"a": 3}) == {"a": 0}
    engine.run("v" * 12)
    assert engine.run(doc_x) == 4
    assert engine.run(doc_y) == 0


def test_a_prefix_extended_by_traffic_the_router_never_saw_is_recent_again() -> None:
    index = make_index()
    engine = full_engine(index)
    doc_x, doc_y = DOC_X, DOC_Y
    # Sent around the router: it hits X's four blocks and stores one more after them, which
    # evicts Y's last block: Y is now the least recently used.
    assert engine.run(doc_x + "q" * 4) == 4
    # Two new blocks ahead evict two more of Y's, not X's.
    assert index.match_surviving(chain_of(doc_x), {"a": 2}) == {"a": 4}
    assert index.match_surviving(chain_of(doc_y), {"a": 2}) == {"a": 1}
    engine.run("v" * 8)
    assert engine.run(doc_x) == 4
    assert engine.run(doc_y) == 1


def test_a_pick_whose_prefix_is_evicted_before_it_runs_does_not_throw_the_lru_end_off() -> None:
    index = make_index()
    engine = full_engine(index)
    doc_x, doc_y, doc_z = DOC_X, DOC_Y, "z" * 16
    index.record("a", chain_of(doc_x))  # routed there, queued behind another prefill...
    engine.run(doc_z)  # ...which runs first and evicts X, the least recently used
    # One more stored block evicts Y's tail, and nothing of Z.
    assert index.match_surviving(chain_of(doc_y), {"a": 1}) == {"a": 3}
    assert index.match_surviving(chain_of(doc_z), {"a": 1}) == {"a": 4}
    engine.run("v" * 4)
    assert (engine.holds(doc_y), engine.holds(doc_z)) == (3, 4)


def test_backends_with_several_ranks_get_no_eviction_ahead() -> None:
    """The engine picks the rank: a busy rank's evictions say nothing of another's room."""
    index = make_index()
    rank0, rank1 = _Engine(index, capacity_blocks=8, rank=0), _Engine(index, capacity_blocks=1000, rank=1)
    rank1.run("x" * 16)
    for letter in "abcdef":
        rank0.run(letter * 16)
    assert index.match_surviving(chain_of("x" * 16), {"a": 1}) == {"a": 4}


def test_blocks_stored_on_a_slower_tier_do_not_move_the_gpu_lru_clock() -> None:
    def ahead_of_y(offloading: bool) -> int:
        index = make_index(cpu=0.5)
        engine_hashes = iter(range(10_000, 20_000))

        def gpu_store(text: str) -> list[int]:
            hashes = [next(engine_hashes) for _ in range(len(text) // B)]
            index.apply("a", 0, batch(stored(hashes, None, [ord(c) for c in text])))
            if offloading:  # the connector offloads other blocks to CPU meanwhile
                others = [next(engine_hashes) for _ in range(len(text) // B)]
                index.apply("a", 0, batch(stored(others, None, [ord("w")] * len(text), "CPU")))
            return hashes

        x = gpu_store("x" * 16)
        gpu_store("y" * 16)
        gpu_store("z" * 16)
        index.apply("a", 0, batch(BlockRemoved(tuple(x), "GPU")))  # a GPU of 8 blocks evicts X
        return index.match_surviving(chain_of("y" * 16), {"a": 2})["a"]

    assert ahead_of_y(offloading=False) == ahead_of_y(offloading=True) == 2


def test_a_large_cpu_tier_does_not_stop_a_used_prefix_from_becoming_recent() -> None:
    index = make_index()
    cpu_blocks = 640
    tokens = [1000 + i // B for i in range(cpu_blocks * B)]
    index.apply("a", 0, batch(stored(range(50_000, 50_000 + cpu_blocks), None, tokens, "CPU")))
    engine = full_engine(index)
    doc_x = DOC_X
    assert engine.run(doc_x + "q" * 4) == 4  # X used, one block stored: Y's tail goes
    assert index.match_surviving(chain_of(doc_x), {"a": 2}) == {"a": 4}
    engine.run("v" * 8)
    assert engine.holds(doc_x) == 4


def test_a_cleared_cache_starts_without_an_lru_end() -> None:
    index = make_index()
    engine = _Engine(index, capacity_blocks=4)
    engine.run("x" * 16)
    engine.run("y" * 16)  # evicts X: the LRU end is known
    index.apply("a", 0, batch(AllBlocksCleared()))
    index.apply("a", 0, batch(stored([1, 2, 3, 4], None, [ord("z")] * 16)))
    # A long queue ahead, but the cache restarted empty: no eviction is known to be coming.
    assert index.match_surviving(chain_of("z" * 16), {"a": 8}) == {"a": 4}


def test_a_block_stored_twice_under_one_hash_is_held_until_its_last_copy_goes() -> None:
    # vLLM 0.32 can hold two physical blocks under one hash (two requests computed the same block
    # at once) and reports a store and a removal for each copy.
    index = make_index()
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    index.apply("a", 0, batch(stored([901, 902], None, TOKENS[:8])))
    index.apply("a", 0, batch(BlockRemoved((901, 902), "GPU")))
    assert index.match_now(CHAIN, ["a"]) == {"a": 2}
    # A block chained under the surviving copy is keyed, not an orphan.
    index.apply("a", 0, batch(stored([903], 902, TOKENS[8:12])))
    assert index.stats.orphans == 0
    assert index.match_now(CHAIN, ["a"]) == {"a": 3}
    index.apply("a", 0, batch(BlockRemoved((901, 902), "GPU")))
    assert index.match_now(CHAIN, ["a"]) == {"a": 0}
    assert index.stats.unknown_removals == 0
    assert index.evictions == 4
    assert index.blocks_of("a") == 1  # 903 still there, unreachable without its prefix
