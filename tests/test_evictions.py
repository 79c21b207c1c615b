"""loadtest/evictions.py: the pooled cache under ARC, W-TinyLFU and a router's refreshes, against LRU
and Belady's bound."""

from __future__ import annotations

import random

import pytest

from loadtest.evictions import ARC, LRU, WTinyLFU, hit_ratio, refreshed_lru
from loadtest.simulate import belady_hit_ratio
from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest

BLOCK = 16


def _reused_prefix_among_scans(rounds: int) -> list[list[int]]:
    """A three-block prefix asked for twice in a row (a conversation's two quick turns), then a
    scan of eight fresh blocks that are never asked for again, round after round: an LRU of
    eight blocks loses the whole prefix to each scan."""
    chains, fresh = [], 1000
    for _ in range(rounds):
        chains += [[1, 2, 3], [1, 2, 3]]
        for _ in range(4):
            chains.append([fresh, fresh + 1])
            fresh += 2
    return chains


def _ratio(cache, chains: list[list[int]]) -> float:
    return hit_ratio(cache, chains, [len(c) * BLOCK for c in chains], BLOCK)


def test_a_scan_evicts_the_reused_prefix_from_lru_but_not_from_arc_or_tinylfu():
    chains = _reused_prefix_among_scans(rounds=20)
    tokens = [len(c) * BLOCK for c in chains]
    lru, arc, tiny = _ratio(LRU(8), chains), _ratio(ARC(8), chains), _ratio(WTinyLFU(8, window=0.25), chains)
    # LRU hits only each round's second ask (3 of its 14 blocks); Belady every ask but the first.
    assert lru == pytest.approx(3 / 14)
    assert belady_hit_ratio(chains, tokens, 8, BLOCK) == pytest.approx((20 * 6 - 3) / (20 * 14))
    assert arc == pytest.approx((20 * 6 - 3) / (20 * 14)) and tiny == pytest.approx((20 * 6 - 3) / (20 * 14))


def test_a_window_as_large_as_the_cache_is_lru():
    rng = random.Random(0)
    chains = [[rng.randrange(40) for _ in range(rng.randrange(1, 6))] for _ in range(500)]
    assert _ratio(WTinyLFU(12, window=1.0), chains) == _ratio(LRU(12), chains)


def test_a_request_hits_only_its_leading_cached_blocks():
    cache = LRU(4)
    cache.request([1, 2])
    assert cache.leading([1, 2, 3]) == 2
    assert cache.leading([3, 1]) == 0


@pytest.mark.parametrize(
    "make", [lambda: LRU(0), lambda: WTinyLFU(8, window=0.0), lambda: WTinyLFU(8, window=1.5)]
)
def test_impossible_sizes_are_refused(make):
    with pytest.raises(ValueError):
        make()


def _conversation_among_scans(turns: int) -> list[TraceRequest]:
    """A conversation growing by a block a turn, a turn every 10 s, each followed by four
    one-shot prompts of two fresh blocks, one a second: eight new blocks between turns, which
    push the whole history out of an LRU of eight blocks."""
    requests, fresh = [], 1000
    for turn in range(turns):
        at = 10.0 * turn
        requests.append(TraceRequest(at, (turn + 3) * TRACE_BLOCK_TOKENS + 1, 1, tuple(range(turn + 3))))
        for scan in range(1, 5):
            requests.append(TraceRequest(at + scan, 2 * TRACE_BLOCK_TOKENS + 1, 1, (fresh, fresh + 1)))
            fresh += 2
    return requests


def test_refreshes_keep_a_returning_conversation_through_the_scans_that_flush_lru():
    requests = _conversation_among_scans(turns=6)
    chains = [r.chain(TRACE_BLOCK_TOKENS) for r in requests]
    lru = hit_ratio(LRU(8), chains, [r.input_tokens for r in requests], TRACE_BLOCK_TOKENS)
    refreshed = refreshed_lru(requests, 8, TRACE_BLOCK_TOKENS, refresh_share=0.1, kept_share=1.0)
    assert lru == 0.0
    # The second turn makes the history it found (the first turn's blocks) a kept prefix, and
    # each turn after it hits the prefix its predecessor found: turn + 1 blocks from the third on
    # (a turn's own newest block is kept only once the next turn has come back to it).
    hit_blocks = sum(turn + 1 for turn in range(2, 6))
    queried = sum(r.input_tokens for r in requests)
    assert refreshed.hit_ratio == pytest.approx(hit_blocks * TRACE_BLOCK_TOKENS / queried)
    assert refreshed.refreshes > 0


@pytest.mark.parametrize(
    ("refresh_share", "kept_share"),
    [(1.0, 1.0), (0.1, 2 / 8)],
    ids=["no refresh before the scans flush it", "too small a share to keep a history"],
)
def test_without_a_timely_refresh_or_room_to_keep_it_is_lru(refresh_share: float, kept_share: float):
    requests = _conversation_among_scans(turns=6)
    assert refreshed_lru(requests, 8, TRACE_BLOCK_TOKENS, refresh_share, kept_share).hit_ratio == 0.0
