"""LFU and TTL beliefs, the eviction registry, and their use by the memory index and the config."""

from __future__ import annotations

import random

import pytest

from policies.eviction import POLICIES, BlockSet, LFUBlocks, LRUBlocks, TTLBlocks, block_set_factory
from router.config import ConfigError, config_from_dict
from router.index import MemoryIndex


class Clock:
    """A settable clock: the TTL policy takes its clock as a parameter (virtual time in the simulator)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_registry_and_factory() -> None:
    assert {"lru": LRUBlocks, "lfu": LFUBlocks, "ttl": TTLBlocks} == POLICIES
    assert all(issubclass(cls, BlockSet) for cls in POLICIES.values())
    assert isinstance(block_set_factory("lfu")(8), LFUBlocks)
    ttl = block_set_factory("ttl", ttl_s=5.0)(8)
    assert isinstance(ttl, TTLBlocks) and ttl.ttl_s == 5.0 and ttl.capacity == 8
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        block_set_factory("mru")


@pytest.mark.parametrize("cls", [LFUBlocks, TTLBlocks])
def test_non_positive_capacity_is_refused(cls: type[BlockSet]) -> None:
    with pytest.raises(ValueError, match="capacity"):
        cls(0)


# --- LFU ----------------------------------------------------------------------------------------


def test_lfu_keeps_a_shared_prefix_through_a_flood_of_one_off_prompts() -> None:
    lfu, lru = LFUBlocks(6), LRUBlocks(6)
    for blocks in (lfu, lru):
        for _ in range(3):
            blocks.touch_chain([1, 2])  # a system prompt, used three times
        for start in range(100, 130, 3):
            blocks.touch_chain([start, start + 1, start + 2])  # one-off prompts
    assert 1 in lfu and 2 in lfu
    assert 1 not in lru and 2 not in lru


def test_lfu_at_equal_counts_evicts_a_chains_tail_first() -> None:
    lfu = LFUBlocks(3)
    lfu.touch_chain([1, 2, 3])
    assert lfu.touch_chain([10]) == [3]
    assert lfu.touch_chain([11]) == [2]
    assert lfu.touch_chain([12]) == [1]
    assert sorted(b for b in (10, 11, 12) if b in lfu) == [10, 11, 12]


def test_lfu_chain_longer_than_capacity_keeps_its_head() -> None:
    lfu = LFUBlocks(2)
    assert lfu.touch_chain([1, 2, 3, 4]) == [4, 3]
    assert 1 in lfu and 2 in lfu


def test_lfu_evict_one_goes_by_count_then_recency_and_discard_forgets() -> None:
    lfu = LFUBlocks(10)
    lfu.touch_chain([1, 2])
    lfu.touch_chain([1])
    lfu.touch_chain([3])
    assert lfu.discard(3) is True
    assert lfu.discard(3) is False
    assert [lfu.evict_one() for _ in range(3)] == [2, 1, None]
    assert len(lfu) == 0


def _reference_lfu(ops: list[list[int]], capacity: int) -> tuple[set[int], list[int]]:
    """A brute-force LFU (count, then last-touch order) to check the bucketed one against."""
    count: dict[int, int] = {}
    stamp: dict[int, int] = {}
    tick = 0
    evicted: list[int] = []
    for chain in ops:
        for block in reversed(chain):
            tick += 1
            count[block] = count.get(block, 0) + 1
            stamp[block] = tick
        while len(count) > capacity:
            victim = min(count, key=lambda b: (count[b], stamp[b]))
            del count[victim], stamp[victim]
            evicted.append(victim)
    return set(count), evicted


@pytest.mark.parametrize("seed", range(5))
def test_lfu_agrees_with_a_brute_force_reference(seed: int) -> None:
    rng = random.Random(seed)
    ops = []
    for _ in range(300):
        head = rng.randrange(8)
        ops.append([head, *(rng.randrange(8, 60) for _ in range(rng.randrange(0, 4)))])
        ops[-1] = list(dict.fromkeys(ops[-1]))
    lfu = LFUBlocks(12)
    evicted = [b for chain in ops for b in lfu.touch_chain(chain)]
    held, expected_evicted = _reference_lfu(ops, 12)
    assert evicted == expected_evicted
    assert {b for b in range(60) if b in lfu} == held


# --- TTL ----------------------------------------------------------------------------------------


def test_ttl_blocks_expire_after_their_last_use() -> None:
    clock = Clock()
    ttl = TTLBlocks(100, ttl_s=10.0, clock=clock)
    ttl.touch_chain([1, 2])
    clock.now += 6
    ttl.touch_chain([1, 3])  # refreshes 1
    clock.now += 5  # 2 is 11 s old, 1 and 3 are 5 s old
    assert ttl.expire() == [2]
    assert 1 in ttl and 3 in ttl and 2 not in ttl
    clock.now += 5
    assert sorted(ttl.expire()) == [1, 3]
    assert len(ttl) == 0


def test_ttl_still_bounds_capacity_lru_and_reports_expired_with_evicted() -> None:
    clock = Clock()
    ttl = TTLBlocks(3, ttl_s=10.0, clock=clock)
    ttl.touch_chain([1, 2, 3])
    assert ttl.touch_chain([4]) == [3]
    clock.now += 20
    assert sorted(ttl.touch_chain([5])) == [1, 2, 4]
    assert ttl.discard(5) is True and ttl.evict_one() is None


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        TTLBlocks(4, ttl_s=0)


# --- through the index and the config -----------------------------------------------------------


def test_the_index_stops_matching_expired_beliefs() -> None:
    clock = Clock()
    index = MemoryIndex(1000, block_set_factory("ttl", ttl_s=30.0, clock=clock))
    index.add_backend("a", 100)
    index.add_backend("b", 100)
    index.record("a", [1, 2, 3])
    clock.now += 20
    index.record("b", [1, 2])
    assert index.match_now([1, 2, 3]) == {"a": 3, "b": 2}
    clock.now += 15
    assert index.match_now([1, 2, 3]) == {"b": 2}
    assert index.size() == 2
    assert index.evictions == 3


def test_the_index_with_lfu_keeps_the_hot_head() -> None:
    index = MemoryIndex(1000, block_set_factory("lfu"))
    index.add_backend("a", 4)
    for _ in range(3):
        index.record("a", [1, 2])
    for i in range(10):
        index.record("a", [100 + i, 200 + i])
    assert index.match_now([1, 2]) == {"a": 2}


def _config(**index):
    return config_from_dict({"backends": [{"name": "a", "url": "http://127.0.0.1:9"}], "index": index})


def test_eviction_is_chosen_in_yaml() -> None:
    assert _config().index.eviction == "lru"
    assert _config(eviction="ttl", ttl_s=30).index.ttl_s == 30.0
    with pytest.raises(ConfigError, match=r"index\.eviction: expected one of \['lfu', 'lru', 'ttl'\]"):
        _config(eviction="fifo")
    with pytest.raises(ConfigError, match=r"index\.ttl_s"):
        _config(eviction="ttl", ttl_s=0)


@pytest.mark.parametrize("eviction", ["lfu", "ttl"])
async def test_a_router_with_another_eviction_policy_still_finds_hits(eviction, fleet, make_router, http):
    router = await make_router(
        [{"name": f"e{i}", "url": u} for i, u in enumerate(fleet.urls)], index={"eviction": eviction}
    )
    system = "Shared instructions for every question. " * 30
    reasons = []
    for i in range(3):
        body = {
            "model": "sim-model",
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"q{i}"}],
            "max_tokens": 1,
        }
        async with http.post(f"{router.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            reasons.append(resp.headers["x-kvroute-reason"])
    assert reasons == ["latency_no_match", "latency_hit", "latency_hit"]
