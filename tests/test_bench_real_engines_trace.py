"""The real-engine benchmark's workload: the trace scaled down keeps its prefix structure."""

from __future__ import annotations

from loadtest.bench_real_engines import Bench, conversation, messages, scaled
from loadtest.trace import DEFAULT_TRACE, TraceRequest


def bench(**overrides: int) -> Bench:
    fields = dict(
        minutes=1, speedup=1, scale=16, max_prompt_tokens=1024, max_output_tokens=16, kv_cache_mib=8
    )
    return Bench(trace=DEFAULT_TRACE, **{**fields, **overrides})


def test_turns_of_a_conversation_share_their_prefix_as_whole_messages() -> None:
    first = TraceRequest(0.0, 3 * 512, 100, (7, 8, 9))
    second = TraceRequest(5.0, 5 * 512, 100, (7, 8, 9, 10, 11))
    one, two = (messages(r, 16) for r in scaled([first, second], bench()))
    assert two[:3] == one and len(one) == 3 and len(two) == 5
    assert all(len(m["content"].split()) == 32 for m in two)
    assert messages(TraceRequest(0.0, 3 * 512, 1, (7, 99, 9)), 16)[1] != one[1]


def test_lengths_are_scaled_and_capped_and_conversations_sampled_whole() -> None:
    # 20 conversations of two turns each.
    requests = [TraceRequest(float(i), 40_000, 500, (i % 20, 1, 2, i)) for i in range(40)]
    out = scaled(requests, bench(max_prompt_tokens=1024))
    assert {(r.input_tokens, r.output_tokens) for r in out} == {(1024, 16)}
    kept = scaled(requests, bench(sample=3))
    assert 0 < len(kept) < len(requests)
    # A conversation is kept or dropped whole.
    kept_ids = {conversation(r) for r in kept}
    kept_at = {r.arrival_s for r in kept}
    assert all((conversation(r) in kept_ids) == (r.arrival_s in kept_at) for r in requests)
