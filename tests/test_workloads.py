"""The generated workloads (loadtest/workloads.py) and the bounds ``kvroute simulate`` prints."""

from __future__ import annotations

from collections import Counter

import pytest

from kvroute.cli import main
from loadtest.simulate import FleetModel, belady_hit_ratio, bounds
from loadtest.trace import TRACE_BLOCK_TOKENS, TraceRequest
from loadtest.workloads import NAMES, generate


@pytest.mark.parametrize("name", NAMES)
def test_a_workload_is_a_function_of_its_seed(name: str) -> None:
    assert generate(name, seed=3, minutes=2) == generate(name, seed=3, minutes=2)
    assert generate(name, seed=3, minutes=2) != generate(name, seed=4, minutes=2)


@pytest.mark.parametrize("name", NAMES)
def test_requests_are_in_order_within_the_span_and_well_formed(name: str) -> None:
    requests = generate(name, seed=0, minutes=3)
    assert len(requests) > 100
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    assert requests[-1].arrival_s < 180
    for r in requests:
        assert r.output_tokens >= 1
        assert len(r.hash_ids) == -(-r.input_tokens // TRACE_BLOCK_TOKENS)


def _first_blocks(requests: list[TraceRequest], blocks: int) -> Counter:
    return Counter(r.hash_ids[:blocks] for r in requests)


def test_chat_has_a_few_long_shared_documents_of_zipf_popular_tenants() -> None:
    requests = generate("chat", seed=0, minutes=10)
    documents = _first_blocks(requests, 6)  # the shortest document is 6 blocks
    assert len(documents) == 4
    shares = sorted(documents.values(), reverse=True)
    assert shares[0] > 0.4 * len(requests)  # far more than one engine's share of eight
    # Sessions grow turn by turn: some request's prompt is another's prompt extended.
    prompts = {r.hash_ids for r in requests}
    grown = sum(1 for r in requests if any(r.hash_ids[:k] in prompts for k in range(1, len(r.hash_ids))))
    assert grown > len(requests) / 2
    # Now and then a pasted document: a turn that adds thousands of tokens at once.
    assert max(r.input_tokens for r in requests) > 12_000


def test_agent_steps_extend_their_task_and_answer_briefly() -> None:
    requests = generate("agent", seed=0, minutes=5)
    assert len(_first_blocks(requests, 4)) == 3  # three agent kinds
    assert max(r.output_tokens for r in requests) <= 160
    by_task = Counter(r.hash_ids[:12] for r in requests if len(r.hash_ids) >= 12)
    assert max(by_task.values()) >= 4  # a task is a run of steps over one growing prompt


def test_no_reuse_keeps_the_sizes_and_shares_no_block() -> None:
    chat, fresh = generate("chat", seed=0, minutes=2), generate("no_reuse", seed=0, minutes=2)
    assert [(r.arrival_s, r.input_tokens) for r in chat] == [(r.arrival_s, r.input_tokens) for r in fresh]
    ids = [h for r in fresh for h in r.hash_ids]
    assert len(ids) == len(set(ids))


def test_an_unknown_workload_is_named() -> None:
    with pytest.raises(ValueError, match="unknown workload 'nope'"):
        generate("nope")


# --- bounds -------------------------------------------------------------------------------------


def test_belady_keeps_what_is_needed_soonest_where_lru_thrashes() -> None:
    # A cycle of three one-block prompts through a cache of two: LRU always evicts the next one
    # (no hit at all); Belady keeps 1 and 2 and never admits 3, needed later than both.
    chains = [[1], [2], [3]] * 4
    tokens = [64] * len(chains)
    assert belady_hit_ratio(chains, tokens, capacity_blocks=2, block_tokens=64) == pytest.approx(6 / 12)
    assert belady_hit_ratio(chains, tokens, capacity_blocks=3, block_tokens=64) == pytest.approx(9 / 12)


def test_belady_counts_only_the_leading_cached_blocks() -> None:
    chains = [[1, 2, 3], [1, 2, 3], [9, 2, 3]]  # block ids are prefix-unique in real chains
    ratio = belady_hit_ratio(chains, [192] * 3, capacity_blocks=10, block_tokens=64)
    assert ratio == pytest.approx(192 / 576)


@pytest.mark.parametrize("name", ["chat", "agent"])
def test_no_eviction_beats_belady_and_lru_does_not_beat_it(name: str) -> None:
    requests = generate(name, seed=0, minutes=3)
    for capacity in (20_000, 100_000):
        b = bounds(requests, FleetModel(engines=2, capacity_tokens=capacity))
        assert 0 < b.pooled_lru_hit_ratio <= b.belady_hit_ratio + 1e-9


def test_simulate_prints_both_bounds_for_a_generated_workload(capsys) -> None:
    args = ["simulate", "--workload", "agent", "--minutes", "1", "--policy", "latency,round_robin"]
    assert main([*args, "--capacity", "50000", "--speedup", "10"]) == 0
    out = capsys.readouterr().out
    assert "pooled-LRU hit ratio" in out and "Belady (optimal eviction)" in out
    rows = [line.split()[0] for line in out.splitlines() if line.startswith(("latency ", "round_robin "))]
    assert rows == ["latency", "round_robin"]


def test_simulate_refuses_an_unknown_workload(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["simulate", "--workload", "nope", "--policy", "latency"])
    assert "invalid choice: 'nope'" in capsys.readouterr().err
