"""router.index.keys: a prompt becomes a chain of xxh3_64 block hashes, seeded per (tenant, model)."""

from __future__ import annotations

import pytest
import xxhash

from router.index.keys import PrefixHasher, chain_seed

SEED = chain_seed("tenant-a", "llama")


def _prompt(n: int) -> bytes:
    """n deterministic, non-repeating-looking bytes."""
    return bytes((i * 31 + 7) % 251 for i in range(n))


@pytest.mark.parametrize(
    ("length", "block_size", "expected"),
    [
        (0, 4, 0),
        (3, 4, 0),
        (4, 4, 1),
        (7, 4, 1),
        (8, 4, 2),
        (9, 4, 2),
        (1000, 16, 62),
        (5, 1, 5),
    ],
)
def test_only_full_blocks_are_hashed(length: int, block_size: int, expected: int) -> None:
    chain = PrefixHasher(block_size).chain(_prompt(length), SEED)
    assert len(chain) == expected == length // block_size


def test_trailing_partial_block_does_not_change_the_chain() -> None:
    hasher = PrefixHasher(8)
    base = _prompt(32)
    assert hasher.chain(base + b"xyz", SEED) == hasher.chain(base, SEED)
    # ... while completing a new full block adds exactly one hash and keeps the others.
    longer = hasher.chain(base + b"12345678", SEED)
    assert longer[:4] == hasher.chain(base, SEED)
    assert len(longer) == 5


def test_equal_prefixes_give_equal_leading_hashes() -> None:
    hasher = PrefixHasher(4)
    a = hasher.chain(b"AAAABBBBCCCC", SEED)
    b = hasher.chain(b"AAAABBBBDDDDEEEE", SEED)
    assert a[:2] == b[:2]
    assert a[2] != b[2]


@pytest.mark.parametrize("block", range(6))
def test_divergence_at_block_i_changes_hash_i_and_every_later_one(block: int) -> None:
    size = 8
    hasher = PrefixHasher(size)
    original = bytearray(_prompt(6 * size))
    changed = bytearray(original)
    # Flip the last byte of block i: blocks after it are byte-identical, only the chain carries it.
    changed[block * size + size - 1] ^= 0xFF
    a = hasher.chain(bytes(original), SEED)
    b = hasher.chain(bytes(changed), SEED)
    assert a[:block] == b[:block]
    assert all(x != y for x, y in zip(a[block:], b[block:], strict=True))


def test_identical_blocks_at_different_positions_hash_differently() -> None:
    chain = PrefixHasher(4).chain(b"abcd" * 5, SEED)
    assert len(set(chain)) == 5


@pytest.mark.parametrize(
    ("other_tenant", "other_model"),
    [("tenant-b", "llama"), ("tenant-a", "mistral"), ("tenant-b", "mistral")],
)
def test_different_tenant_or_model_gives_disjoint_chains(other_tenant: str, other_model: str) -> None:
    hasher = PrefixHasher(16)
    prompt = _prompt(16 * 20)
    mine = hasher.chain(prompt, chain_seed("tenant-a", "llama"))
    theirs = hasher.chain(prompt, chain_seed(other_tenant, other_model))
    assert chain_seed("tenant-a", "llama") != chain_seed(other_tenant, other_model)
    assert len(mine) == len(theirs) == 20
    assert set(mine).isdisjoint(theirs)


def test_tenant_and_model_are_not_interchangeable() -> None:
    assert chain_seed("a", "b") != chain_seed("b", "a")
    assert chain_seed("ab", "") != chain_seed("a", "b")


def test_deterministic_across_calls_and_instances() -> None:
    prompt = "héllo wörld, 東京 ".encode() * 10
    first = PrefixHasher(8).chain(prompt, chain_seed("t", "m"))
    chain_seed.cache_clear()
    second = PrefixHasher(8).chain(prompt, chain_seed("t", "m"))
    assert first == second
    assert len(first) == len(prompt) // 8
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first)


def test_memoryview_slices_hash_like_bytes_slices() -> None:
    prompt = b"abcdefgh" + b"xy"
    h1 = xxhash.xxh3_64_intdigest(b"abcd", seed=SEED)
    h2 = xxhash.xxh3_64_intdigest(b"efgh", seed=h1)
    assert PrefixHasher(4).chain(prompt, SEED) == [h1, h2]


def test_seed_is_used() -> None:
    hasher = PrefixHasher(4)
    assert hasher.chain(b"abcdefgh", 1) != hasher.chain(b"abcdefgh", 2)


@pytest.mark.parametrize("block_size", [0, -1])
def test_non_positive_block_size_is_rejected(block_size: int) -> None:
    with pytest.raises(ValueError, match="block_size"):
        PrefixHasher(block_size)
