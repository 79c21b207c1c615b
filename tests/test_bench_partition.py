"""``kvroute bench partition``: a clairvoyant two-pool partition against the pooled-LRU bound."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from kvroute.cli import main
from loadtest.bench_partition import LRU_ROW, eviction_ratios, partition, reused_later
from loadtest.simulate import FleetModel, bounds
from loadtest.trace import DEFAULT_TRACE, TRACE_BLOCK_TOKENS, TraceRequest, read_trace
from loadtest.workloads import generate


def _request(i: int, *blocks: int) -> TraceRequest:
    # One token past the last full block, so that every block can hit (the engine recomputes
    # the prompt's last token).
    return TraceRequest(float(i), len(blocks) * TRACE_BLOCK_TOKENS + 1, 1, blocks)


def _conversation_among_one_shot_prompts(turns: int) -> list[TraceRequest]:
    """A conversation that grows by a block a turn, each turn after three one-shot prompts of
    two fresh blocks: enough new blocks between turns to push its history out of an LRU as
    large as the whole (two-engine, four-block) fleet."""
    requests, fresh = [], 1000
    for turn in range(turns):
        requests.append(_request(len(requests), 0, *range(1, turn + 3)))
        for _ in range(3):
            requests.append(_request(len(requests), 0, fresh, fresh + 1))
            fresh += 2
    return requests


def _run(requests: list[TraceRequest], scratch_engines: int, cap: float | None, capacity_blocks: int = 4):
    return partition(
        requests,
        engines=2,
        capacity_blocks=capacity_blocks,
        block_tokens=TRACE_BLOCK_TOKENS,
        scratch_engines=scratch_engines,
        cap=cap,
        keep=reused_later([r.chain(TRACE_BLOCK_TOKENS) for r in requests]),
    )


def test_the_oracle_keeps_prompts_whose_new_blocks_come_back():
    chains = [[0, 1], [0, 2], [0, 1, 3], [0, 4]]
    assert reused_later(chains) == [True, False, False, False]


def test_one_shot_prompts_on_a_scratch_engine_leave_the_conversation_its_cache():
    requests = _conversation_among_one_shot_prompts(turns=6)
    pooled = _run(requests, scratch_engines=0, cap=None)
    split = _run(requests, scratch_engines=1, cap=None)
    # Pooled: only the shared first block ever hits. Split: every later turn hits its history too.
    assert pooled.hit_ratio < split.hit_ratio
    assert split.scratch_load > 1.0 > split.kept_load  # the price: the scratch engine does most prefill


def test_a_cap_of_one_keeps_each_pool_at_its_share_of_the_prefill():
    requests = read_trace(DEFAULT_TRACE, minutes=3)
    capped = partition(
        requests,
        engines=8,
        capacity_blocks=400_000 // 64,
        block_tokens=64,
        scratch_engines=3,
        cap=1.0,
        keep=reused_later([r.chain(64) for r in requests]),
    )
    assert capped.scratch_load == pytest.approx(1.0, abs=0.05)
    assert capped.kept_load == pytest.approx(1.0, abs=0.05)


def test_no_scratch_engine_is_the_pooled_lru_bound_that_simulate_prints():
    requests = generate("agent", seed=2, minutes=3)
    model = FleetModel(engines=4, capacity_tokens=100_000)
    pooled = partition(
        requests,
        engines=4,
        capacity_blocks=100_000 // model.block_tokens,
        block_tokens=model.block_tokens,
        scratch_engines=0,
        cap=None,
        keep=[False] * len(requests),
    )
    assert pooled.hit_ratio == pytest.approx(bounds(requests, model).pooled_lru_hit_ratio)


def test_the_eviction_table_reads_other_evictions_against_the_same_pooled_lru_bound():
    requests = _conversation_among_one_shot_prompts(turns=8)
    ratios = eviction_ratios(requests, capacity_blocks=2 * 4, block_tokens=TRACE_BLOCK_TOKENS)
    assert ratios[LRU_ROW] == pytest.approx(_run(requests, scratch_engines=0, cap=None).hit_ratio)
    # The one-shot prompts are asked for once: an admission filter keeps the conversation.
    assert ratios["W-TinyLFU, 1 % window"] > ratios[LRU_ROW]
    assert max(ratios.values()) == ratios["Belady (clairvoyant)"]


def test_the_command_prints_all_four_tables(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    trace = tmp_path / "trace.jsonl"
    trace.write_bytes(
        b"\n".join(
            orjson.dumps(
                {
                    "timestamp": r.arrival_s * 1000,
                    "input_length": r.input_tokens,
                    "output_length": 1,
                    "hash_ids": r.hash_ids,
                }
            )
            for r in _conversation_among_one_shot_prompts(turns=4)
        )
    )
    args = [
        "bench",
        "partition",
        "--trace",
        str(trace),
        "--engines",
        "2",
        "--capacity",
        "2048",
        "--block-tokens",
        "512",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "0 (pooled LRU)" in out and "x pooled LRU" in out
    assert "continues an earlier prompt" in out and "reused later" in out
    assert "LRU (the pooled-LRU bound)" in out and "W-TinyLFU" in out and "Belady (clairvoyant)" in out
    assert "refreshes a request" in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--caps", "lots"], "could not convert"),
        (["--engines", "1"], "--engines >= 2"),
        (["--kept-shares", "2"], "--kept-shares in (0, 1]"),
        (["--refresh-shares", "0"], "--refresh-shares > 0"),
        (["--minutes", "0"], "no requests"),
    ],
)
def test_bad_options_exit_2_with_the_reason(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
):
    assert main(["bench", "partition", *options]) == 2
    assert message in capsys.readouterr().err
