"""policies/retention.py: which prefixes a router keeps alive on LRU engines, and when it refreshes them."""

from __future__ import annotations

import math

import pytest

from policies.retention import Keeper

CAPACITY = 100  # blocks per backend


def keeper(refresh_share: float = 0.5, kept_share: float = 0.5) -> Keeper:
    return Keeper(refresh_share, kept_share, CAPACITY, seen_blocks=1000)


def always(backend: str, prefix) -> bool:
    return True


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


def test_kept_prefixes_stay_within_their_share_the_least_recently_asked_dropped_first():
    k = keeper(kept_share=0.3)  # 30 blocks
    k.due(0.0, always)
    for conversation in range(3):
        chain = [1000 * conversation + i for i in range(12)]
        k.observe("a", chain, cached=0, now=conversation)
        k.observe("a", chain, cached=12, now=conversation + 0.5)
    assert k.kept_blocks("a") == 24  # the third 12-block history pushed the first out
    # The first conversation was dropped: it is not refreshed, the other two are.
    k.observe("a", list(range(50_000, 50_100)), cached=0, now=10.0)  # traffic, for a turnover
    refreshed = {prefix[0] for _, prefix in k.due(20.0, always)}
    assert refreshed == {1000, 2000}


def test_the_turnover_is_the_capacity_over_the_rate_of_uncached_blocks():
    k = keeper()
    assert k.turnover("a") == math.inf
    k.due(0.0, always)
    k.observe("a", list(range(50)), cached=0, now=1.0)
    k.observe("a", list(range(100, 160)), cached=10, now=2.0)  # 50 of its 60 blocks uncached
    k.due(10.0, always)
    assert k.turnover("a") == pytest.approx(CAPACITY / (100 / 10.0))


def test_a_kept_prefix_is_refreshed_after_its_share_of_the_turnover_and_dropped_once_evicted():
    """Ten uncached blocks a second fill 100 in 10 s: with a refresh share of a half, a kept
    prefix nobody asks for is refreshed every 5 s while it is cached."""
    k = keeper(refresh_share=0.5)
    k.due(0.0, always)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0)
    refreshed = {}
    fresh = 1000
    for second in range(1, 13):
        k.observe("a", list(range(fresh, fresh + 10)), cached=0, now=float(second))
        fresh += 10
        held = second < 10  # evicted between 9 s and 10 s
        refreshed[second] = k.due(float(second), lambda backend, prefix, held=held: held)
    assert k.turnover("a") == pytest.approx(10.0, rel=0.1)
    assert [s for s, due in refreshed.items() if due] == [5]
    assert refreshed[5] == [("a", (1, 2, 3))]
    assert k.kept_blocks("a") == 0 and k.refreshes == 1  # due again at 10 s: gone, so dropped


def test_a_long_pause_between_checks_neither_overshoots_the_rate_nor_refreshes_everything():
    k = keeper(refresh_share=0.5)
    k.due(0.0, always)
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0)
    k.observe("a", list(range(100, 197)), cached=0, now=1.0)  # 100 blocks in the first 10 s
    assert k.due(10.0, always) == [("a", (1, 2, 3))]
    assert k.due(200.0, always) == []  # quiet for 190 s: no negative rate, no burst of refreshes
    assert k.turnover("a") == math.inf  # nothing came in: nothing flushes the cache


def test_nothing_is_refreshed_before_anything_has_been_measured():
    k = keeper()
    k.observe("a", [1, 2, 3], cached=0, now=0.0)
    k.observe("a", [1, 2, 3], cached=3, now=0.0)
    assert k.due(100.0, always) == []  # the first check only starts the measurement


@pytest.mark.parametrize(
    "args", [(0.0, 0.5, 100, 100), (0.5, 0.0, 100, 100), (0.5, 1.5, 100, 100), (0.5, 0.5, 0, 100)]
)
def test_impossible_settings_are_refused(args):
    with pytest.raises(ValueError):
        Keeper(*args)
