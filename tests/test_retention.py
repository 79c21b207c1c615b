"""policies/retention.py: which prefixes a router keeps alive on LRU engines, and when it refreshes them."""

from __future__ import annotations

import math

import pytest

from policies.retention import Due, Keeper

CAPACITY = 100  # blocks per backend


def keeper(refresh_share: float = 0.5, kept_share: float = 0.5) -> Keeper:
    return Keeper(refresh_share, kept_share, lambda backend: CAPACITY, seen_blocks=1000)


def test_a_prefix_is_kept_once_a_second_request_comes_back_to_it():
    k = keeper()
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    assert k.kept_blocks("a") == 0  # asked for once: nothing came back yet
    k.observe("b", [1, 2, 3, 4], cached=0, now=1.0)
    assert k.kept_blocks("b") == 3 and k.kept_blocks("a") == 0  # kept where it went this time
    k.observe("b", [1, 2, 3, 4, 5], cached=4, now=2.0)
    assert k.kept_blocks("b") == 4  # the longer history replaced the shorter one it extends


def test_a_one_block_match_is_not_worth_keeping():
    k = keeper()
    k.observe("a", [1, 2], cached=0, now=0.0)
    k.observe("a", [1, 9], cached=1, now=1.0)  # only the first block came back
    assert k.kept_blocks("a") == 0


def test_nothing_is_kept_on_a_backend_of_unknown_capacity():
    k = Keeper(0.5, 0.5, lambda backend: None, seen_blocks=1000)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=1.0)
    assert k.kept_blocks("a") == 0 and k.turnover("a") == math.inf


def test_kept_prefixes_stay_within_their_share_the_least_recently_asked_dropped_first():
    k = keeper(kept_share=0.3)  # 30 blocks
    k.due(0.0)
    for conversation in range(3):
        chain = [1000 * conversation + i for i in range(12)]
        k.observe("a", chain, cached=0, now=conversation)
        k.observe("a", chain, cached=12, now=conversation + 0.5, payload=lambda c=conversation: c)
    assert k.kept_blocks("a") == 24  # the third 12-block history pushed the first out
    # The first conversation was dropped: it is not due, the other two are, with their payloads.
    k.observe("a", list(range(50_000, 50_100)), cached=0, now=10.0)  # traffic, for a turnover
    assert sorted(d.payload for d in k.due(20.0)) == [1, 2]


def test_the_turnover_is_the_capacity_over_the_rate_of_uncached_blocks():
    k = keeper()
    assert k.turnover("a") == math.inf
    k.due(0.0)
    k.observe("a", list(range(50)), cached=0, now=1.0)
    k.observe("a", list(range(100, 160)), cached=10, now=2.0)  # 50 of its 60 blocks uncached
    k.due(10.0)
    assert k.turnover("a") == pytest.approx(CAPACITY / (100 / 10.0))


def test_a_kept_prefix_is_due_after_its_share_of_the_turnover_until_it_is_forgotten():
    """Ten uncached blocks a second fill 100 in 10 s: with a refresh share of a half, a kept
    prefix nobody asks for is due every 5 s, until the caller forgets it (evicted)."""
    k = keeper(refresh_share=0.5)
    k.due(0.0)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0, payload=lambda: "the request")
    due_at = {}
    fresh = 1000
    for second in range(1, 16):
        k.observe("a", list(range(fresh, fresh + 10)), cached=0, now=float(second))
        fresh += 10
        due_at[second] = k.due(float(second))
        if second == 10:
            for d in due_at[second]:
                k.forget(d.backend, d.prefix)  # evicted between 5 s and 10 s
    assert k.turnover("a") == pytest.approx(10.0, rel=0.1)
    assert [s for s, due in due_at.items() if due] == [5, 10]
    assert due_at[5] == [Due("a", (1, 2, 3), "the request")]
    assert k.kept_blocks("a") == 0


def test_a_long_pause_between_checks_neither_overshoots_the_rate_nor_makes_everything_due():
    k = keeper(refresh_share=0.5)
    k.due(0.0)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0)
    k.observe("a", list(range(100, 197)), cached=0, now=1.0)  # 100 blocks in the first 10 s
    assert [d.prefix for d in k.due(10.0)] == [(1, 2, 3)]
    assert k.due(200.0) == []  # quiet for 190 s: no negative rate, no burst of refreshes
    assert k.turnover("a") == math.inf  # nothing came in: nothing flushes the cache


def test_a_backend_whose_capacity_is_gone_keeps_nothing():
    capacities = {"a": CAPACITY}
    k = Keeper(0.5, 0.5, capacities.get, seen_blocks=1000)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0, payload=lambda: "a request")
    assert k.kept_blocks("a") == 3
    del capacities["a"]  # the backend was removed: its kept prefixes (and payloads) go
    assert k.due(1.0) == [] and k.kept_blocks("a") == 0


def test_nothing_is_due_before_anything_has_been_measured():
    k = keeper()
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0)
    assert k.due(100.0) == []  # the first check only starts the measurement


@pytest.mark.parametrize("args", [(0.0, 0.5, 100), (0.5, 0.0, 100), (0.5, 1.5, 100), (0.5, 0.5, 0)])
def test_impossible_settings_are_refused(args):
    refresh_share, kept_share, seen = args
    with pytest.raises(ValueError):
        Keeper(refresh_share, kept_share, lambda backend: CAPACITY, seen)
