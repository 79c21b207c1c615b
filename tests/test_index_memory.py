"""router.index.MemoryIndex: per-backend believed caches, leading-block matches, bounded memory."""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Sequence

import pytest

from router.index import MemoryIndex, PrefixIndex


def make_index(
    max_blocks: int = 1_000_000, capacity: int = 1000, names: Sequence[str] = "abc"
) -> MemoryIndex:
    index = MemoryIndex(max_blocks)
    for name in names:
        index.add_backend(name, capacity)
    return index


def test_is_a_prefix_index() -> None:
    assert isinstance(MemoryIndex(10), PrefixIndex)


async def test_match_depth_per_backend() -> None:
    index = make_index()
    index.record("a", [1, 2, 3, 4])
    index.record("b", [1, 2])
    index.record("c", [9])
    assert await index.match([1, 2, 3, 4, 5], ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    assert await index.match([1, 2, 7], ["a", "b", "c"]) == {"a": 2, "b": 2, "c": 0}
    assert await index.match([9, 1], ["a", "b", "c"]) == {"a": 0, "b": 0, "c": 1}
    assert await index.match([], ["a", "b"]) == {"a": 0, "b": 0}


async def test_only_leading_blocks_count() -> None:
    index = make_index()
    index.record("a", [2, 3])  # holds blocks 2 and 3 of the chain, not block 1
    index.record("b", [1])
    index.record("b", [3])  # holds 1 and 3: a gap at 2
    index.record("c", [1, 2, 3])
    assert await index.match([1, 2, 3], ["a", "b", "c"]) == {"a": 0, "b": 1, "c": 3}


async def test_match_is_restricted_to_the_named_backends() -> None:
    index = make_index()
    for name in "abc":
        index.record(name, [1, 2, 3])
    assert await index.match([1, 2, 3], ["b"]) == {"b": 3}
    assert await index.match([1, 2, 3], ["a", "nope"]) == {"a": 3, "nope": 0}
    assert await index.match([1, 2, 3], []) == {}


def test_match_now_reports_every_holder() -> None:
    index = make_index()
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    assert index.match_now([1, 2, 3]) == {"a": 3, "b": 2}
    assert index.match_now([5]) == {}


def test_record_for_an_unknown_backend_or_empty_chain_is_ignored() -> None:
    index = make_index(names="a")
    index.record("ghost", [1, 2, 3])
    index.record("a", [])
    assert index.size() == 0
    assert index.blocks_of("ghost") == 0
    assert index.match_now([1, 2, 3]) == {}


def test_recording_the_same_chain_twice_counts_once() -> None:
    index = make_index()
    index.record("a", [1, 2, 3])
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2, 3])
    assert index.blocks_of("a") == 3
    assert index.size() == 6


async def test_per_backend_capacity_keeps_a_chains_first_blocks() -> None:
    index = make_index(names="x", capacity=4)
    index.record("x", [1, 2, 3, 4])
    index.record("x", [5, 6])
    assert index.blocks_of("x") == 4
    assert index.size() == 4
    assert index.evictions == 2
    assert await index.match([1, 2, 3, 4], ["x"]) == {"x": 2}
    assert await index.match([5, 6], ["x"]) == {"x": 2}


async def test_per_backend_capacity_is_lru() -> None:
    index = make_index(names="x", capacity=4)
    index.record("x", [1, 2])
    index.record("x", [3, 4])
    index.record("x", [1, 2])  # refresh: now [3, 4] is least recently used
    index.record("x", [5, 6])
    assert await index.match([1, 2], ["x"]) == {"x": 2}
    assert await index.match([3, 4], ["x"]) == {"x": 0}
    assert index.evictions == 2


async def test_capacity_of_one_backend_does_not_touch_another() -> None:
    index = MemoryIndex(1000)
    index.add_backend("small", 2)
    index.add_backend("big", 100)
    index.record("small", [1, 2, 3, 4])
    index.record("big", [1, 2, 3, 4])
    assert await index.match([1, 2, 3, 4], ["small", "big"]) == {"small": 2, "big": 4}
    assert index.size() == 6


async def test_global_budget_bounds_size_and_evicts_from_the_largest_backend() -> None:
    index = make_index(max_blocks=6, names="ab", capacity=100)
    index.record("a", [1, 2, 3, 4, 5])
    index.record("b", [11, 12, 13])
    assert index.size() == 6
    assert index.blocks_of("a") == 3  # a was the largest: it gave up two blocks
    assert index.blocks_of("b") == 3
    assert index.evictions == 2
    assert await index.match([1, 2, 3, 4, 5], ["a"]) == {"a": 3}  # its first blocks survive
    assert await index.match([11, 12, 13], ["b"]) == {"b": 3}

    index.record("b", [21, 22, 23])  # now b is the largest (6 vs 3)
    assert index.size() == 6
    assert index.blocks_of("a") == 3
    assert index.blocks_of("b") == 3
    assert index.evictions == 5


async def test_remove_backend_drops_its_entries() -> None:
    index = make_index()
    index.record("a", [1, 2, 3])
    index.record("b", [1, 2])
    index.remove_backend("a")
    assert index.size() == 2
    assert index.blocks_of("a") == 0
    assert await index.match([1, 2, 3], ["a", "b"]) == {"a": 0, "b": 2}
    assert index.match_now([1, 2, 3]) == {"b": 2}
    index.remove_backend("a")  # twice: no error
    index.remove_backend("never-added")
    assert index.size() == 2


async def test_a_removed_backend_comes_back_empty() -> None:
    index = make_index(names="a")
    index.record("a", [1, 2, 3])
    index.remove_backend("a")
    index.record("a", [1, 2, 3])  # not tracked any more: ignored
    assert index.size() == 0
    index.add_backend("a", 10)
    assert await index.match([1, 2, 3], ["a"]) == {"a": 0}
    index.record("a", [1, 2])
    assert await index.match([1, 2, 3], ["a"]) == {"a": 2}
    assert index.size() == 2


def test_removal_does_not_count_as_eviction() -> None:
    index = make_index()
    index.record("a", [1, 2, 3])
    index.remove_backend("a")
    assert index.evictions == 0


async def test_close_is_harmless() -> None:
    index = make_index()
    index.record("a", [1])
    await index.close()
    assert index.size() == 1


# --- random operations against a simple reference model ---------------------------------------


class ReferenceIndex:
    """The obvious model: per backend an LRU of blocks, a chain touched from its last block to
    its first; a match counts the leading blocks a backend holds. No global budget."""

    def __init__(self) -> None:
        self.backends: dict[str, tuple[int, OrderedDict[int, None]]] = {}
        self.evictions = 0

    def add(self, name: str, capacity: int) -> None:
        self.backends.setdefault(name, (capacity, OrderedDict()))

    def remove(self, name: str) -> None:
        self.backends.pop(name, None)

    def record(self, name: str, chain: list[int]) -> None:
        if name not in self.backends:
            return
        capacity, blocks = self.backends[name]
        for block in reversed(chain):
            blocks[block] = None
            blocks.move_to_end(block)
        while len(blocks) > capacity:
            blocks.popitem(last=False)
            self.evictions += 1

    def blocks_of(self, name: str) -> int:
        return len(self.backends[name][1]) if name in self.backends else 0

    def match(self, chain: list[int], names: list[str]) -> dict[str, int]:
        out = {}
        for name in names:
            held = self.backends[name][1] if name in self.backends else {}
            depth = 0
            while depth < len(chain) and chain[depth] in held:
                depth += 1
            out[name] = depth
        return out


class ChainMaker:
    """Chains with real prefix structure: block i's id stands for the whole prefix up to i."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.ids: dict[tuple[int, ...], int] = {}

    def __call__(self) -> list[int]:
        tokens = tuple(self.rng.randrange(3) for _ in range(self.rng.randint(1, 8)))
        return [self.ids.setdefault(tokens[: i + 1], len(self.ids) + 1) for i in range(len(tokens))]


NAMES = ["a", "b", "c", "d"]


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_operations_agree_with_the_reference(seed: int) -> None:
    rng = random.Random(seed)
    new_chain = ChainMaker(rng)
    index = MemoryIndex(max_blocks=10**9)
    ref = ReferenceIndex()
    for name in NAMES[:3]:
        capacity = rng.randint(2, 12)
        index.add_backend(name, capacity)
        ref.add(name, capacity)

    for _ in range(600):
        op = rng.random()
        name = rng.choice(NAMES)
        if op < 0.7:
            chain = new_chain()
            index.record(name, chain)
            ref.record(name, chain)
        elif op < 0.8:
            index.remove_backend(name)
            ref.remove(name)
        elif op < 0.9:
            capacity = rng.randint(2, 12)
            index.add_backend(name, capacity)
            ref.add(name, capacity)
        else:
            chain = new_chain()
            assert await index.match(chain, [*NAMES, "zz"]) == ref.match(chain, [*NAMES, "zz"])

        assert [index.blocks_of(n) for n in NAMES] == [ref.blocks_of(n) for n in NAMES]
        assert index.size() == sum(index.blocks_of(n) for n in NAMES)

    assert ref.evictions > 0  # the sequence did exercise per-backend eviction
    assert index.evictions == ref.evictions
    hits = 0
    for chain in (new_chain() for _ in range(200)):
        expected = {n: d for n, d in ref.match(chain, NAMES).items() if d}
        assert index.match_now(chain) == expected
        hits += len(expected)
    assert hits > 0  # and the final state does hold matches to compare


@pytest.mark.parametrize("seed", [4, 5])
def test_random_operations_under_a_tight_global_budget(seed: int) -> None:
    rng = random.Random(seed)
    new_chain = ChainMaker(rng)
    max_blocks = 15
    index = MemoryIndex(max_blocks=max_blocks)
    capacities = {name: rng.randint(3, 12) for name in NAMES}
    for name, capacity in capacities.items():
        index.add_backend(name, capacity)
    recorded: list[list[int]] = []

    for _ in range(500):
        chain = new_chain()
        recorded.append(chain)
        name = rng.choice(NAMES)
        if rng.random() < 0.05:
            index.remove_backend(name)
            index.add_backend(name, capacities[name])
        else:
            index.record(name, chain)
        assert index.size() == sum(index.blocks_of(n) for n in NAMES)
        assert index.size() <= max_blocks
        assert all(index.blocks_of(n) <= capacities[n] for n in NAMES)
        depth = index.match_now(chain)
        assert all(0 < d <= len(chain) for d in depth.values())

    assert index.evictions > 0
    for name in NAMES:
        index.remove_backend(name)
    # Nothing stale is left behind in the reverse map.
    assert index.size() == 0
    assert all(index.match_now(chain) == {} for chain in recorded)


def test_a_pick_is_believed_at_once_and_withdrawn_when_it_fails() -> None:
    index = MemoryIndex(1000)
    index.add_backend("a", 100)
    index.add_backend("b", 100)
    index.record("a", [1])  # held before this attempt
    index.picked("a", [1, 2, 3])
    index.picked("b", [1, 2])
    assert index.match_now([1, 2, 3, 4]) == {"a": 3, "b": 2}
    index.failed("a", [1, 2, 3])  # its cache is in doubt: the whole chain goes
    assert index.match_now([1, 2, 3, 4]) == {"b": 2}
    assert (index.blocks_of("a"), index.size()) == (0, 2)
    index.failed("gone", [1])  # an unknown backend: nothing to withdraw
