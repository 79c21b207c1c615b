"""policies.eviction.LRUBlocks: one backend's believed cache, first blocks of a chain evicted last."""

from __future__ import annotations

import pytest

from policies.eviction import POLICIES, BlockSet, LRUBlocks


def test_registry_names_lru() -> None:
    assert POLICIES["lru"] is LRUBlocks
    assert issubclass(LRUBlocks, BlockSet)


@pytest.mark.parametrize("capacity", [0, -3])
def test_non_positive_capacity_is_rejected(capacity: int) -> None:
    with pytest.raises(ValueError, match="capacity"):
        LRUBlocks(capacity)


def test_touch_within_capacity_evicts_nothing() -> None:
    lru = LRUBlocks(3)
    assert lru.touch_chain([1, 2, 3]) == []
    assert len(lru) == 3
    assert all(b in lru for b in (1, 2, 3))
    assert 4 not in lru


def test_a_chains_last_block_is_evicted_first_and_its_first_block_last() -> None:
    lru = LRUBlocks(3)
    lru.touch_chain([1, 2, 3])
    assert lru.touch_chain([10]) == [3]
    assert lru.touch_chain([11]) == [2]
    assert lru.touch_chain([12]) == [1]
    assert len(lru) == 3
    assert [b in lru for b in (10, 11, 12)] == [True, True, True]


def test_evict_one_drains_in_lru_order() -> None:
    lru = LRUBlocks(10)
    lru.touch_chain([1, 2, 3])
    lru.touch_chain([4, 5])
    assert [lru.evict_one() for _ in range(5)] == [3, 2, 1, 5, 4]
    assert len(lru) == 0


def test_touching_again_refreshes_a_chain() -> None:
    lru = LRUBlocks(4)
    lru.touch_chain([1, 2])
    lru.touch_chain([3, 4])
    assert lru.touch_chain([1, 2]) == []  # refresh only: nothing new, nothing evicted
    assert lru.touch_chain([5, 6]) == [4, 3]
    assert 1 in lru and 2 in lru


def test_touching_a_shared_prefix_refreshes_only_that_prefix() -> None:
    lru = LRUBlocks(4)
    lru.touch_chain([1, 2, 3])
    lru.touch_chain([4])
    assert lru.touch_chain([1]) == []  # 1 is refreshed past 4; 3 and 2 stay the oldest
    assert lru.touch_chain([7, 8]) == [3, 2]
    assert lru.touch_chain([9]) == [4]
    assert 1 in lru


def test_chain_longer_than_capacity_keeps_its_first_blocks() -> None:
    lru = LRUBlocks(2)
    evicted = lru.touch_chain([1, 2, 3, 4])
    assert evicted == [4, 3]
    assert 1 in lru and 2 in lru
    assert len(lru) == 2


def test_eviction_returns_exactly_the_dropped_blocks() -> None:
    lru = LRUBlocks(5)
    held: set[int] = set()
    for start in range(0, 40, 3):
        chain = [start, start + 1, start + 2]
        evicted = lru.touch_chain(chain)
        held |= set(chain)
        held -= set(evicted)
        assert len(lru) <= 5
        assert len(lru) == len(held)
        assert all(b not in lru for b in evicted)
        assert all(b in lru for b in held)


def test_discard() -> None:
    lru = LRUBlocks(4)
    lru.touch_chain([1, 2, 3])
    assert lru.discard(2) is True
    assert 2 not in lru
    assert len(lru) == 2
    assert lru.discard(2) is False
    assert lru.discard(99) is False
    assert len(lru) == 2


def test_discarded_block_is_not_returned_by_later_evictions() -> None:
    lru = LRUBlocks(3)
    lru.touch_chain([1, 2, 3])
    lru.discard(3)
    assert lru.evict_one() == 2
    assert lru.evict_one() == 1
    assert lru.evict_one() is None


def test_evict_one_on_empty_returns_none() -> None:
    lru = LRUBlocks(1)
    assert lru.evict_one() is None
    assert len(lru) == 0
