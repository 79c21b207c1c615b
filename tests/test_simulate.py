"""The offline simulator: Mooncake traces, the virtual-time fleet model, and ``kvroute simulate``."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from kvroute.cli import main
from loadtest import simulate as simulate_module
from loadtest.sim.protocol import GENERATION_PROMPT, render_chat
from loadtest.sim.timing import EngineTiming
from loadtest.simulate import FleetModel, FloorGap, Simulation, bounds, floor_gap, load_source, simulate
from loadtest.trace import TraceError, TraceRequest, block_text, prompt_messages, prompt_text, read_trace
from policies.routing.prefix_aware import PrefixAware
from policies.types import Outcome

TIMING = EngineTiming()


def row(at_ms: float, tokens: int, out: int, ids: list[int]) -> dict:
    return {"timestamp": at_ms, "input_length": tokens, "output_length": out, "hash_ids": ids}


def write_trace(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def req(at_s: float, tokens: int, out: int, ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(arrival_s=at_s, input_tokens=tokens, output_tokens=out, hash_ids=ids)


def synthetic(n: int = 400, seed: int = 0) -> list[TraceRequest]:
    """Conversations over shared system prompts: each turn extends the previous one's prompt."""
    rng = random.Random(seed)
    next_id = 100
    sessions: list[list[int]] = []
    requests = []
    for i in range(n):
        if not sessions or rng.random() < 0.3:
            sessions.append([rng.randrange(4)])  # one of four system prompts
        session = rng.choice(sessions)
        session.extend(range(next_id, next_id + rng.randint(1, 3)))
        next_id += 3
        requests.append(req(i * 0.05, len(session) * 512 - 100, rng.randint(5, 40), tuple(session)))
    return requests


# --- traces -------------------------------------------------------------------------------------


def test_a_trace_is_read_in_order_and_can_be_cut(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl", [row(0, 600, 5, [0, 1]), row(30_000, 512, 0, [0]), row(90_000, 10, 1, [7])]
    )
    requests = read_trace(path)
    assert [r.arrival_s for r in requests] == [0.0, 30.0, 90.0]
    assert requests[1].output_tokens == 1  # an empty output still produces its first token
    assert len(read_trace(path, minutes=1)) == 2
    assert len(read_trace(path, limit=1)) == 1


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "JSONDecodeError"),
        ('{"timestamp": 1}', "KeyError"),
        (json.dumps(row(0, 0, 1, [1])), "non-empty"),
    ],
)
def test_a_bad_trace_line_is_named(tmp_path: Path, line: str, problem: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, 600, 5, [0, 1])) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=rf"line 2: .*{problem}"):
        read_trace(path)


def test_trace_blocks_become_router_blocks_and_only_full_ones_count() -> None:
    request = req(0, 512 + 200, 1, (5, 9))
    assert request.chain(512) == [5]
    assert request.chain(64) == [5 * 8 + k for k in range(8)] + [9 * 8 + 0, 9 * 8 + 1, 9 * 8 + 2]
    # Equal ids at the same position: equal prefixes, equal chains; prefix-unique ids keep them apart.
    assert req(0, 1024, 1, (5, 10)).chain(64)[:8] == request.chain(64)[:8]


def test_prompt_text_realises_the_trace_prefixes() -> None:
    a, b = req(0, 1000, 1, (1, 2)), req(0, 1000, 1, (1, 3))
    assert len(prompt_text(a)) == 4000
    assert prompt_text(a)[:2048] == prompt_text(b)[:2048]
    assert prompt_text(a)[2048:] != prompt_text(b)[2048:]


def test_prompt_messages_realise_the_trace_prefixes() -> None:
    a, b = req(0, 1000, 1, (1, 2)), req(0, 1000, 1, (1, 3))
    first, second = prompt_messages(a), prompt_messages(b)
    assert first[0] == second[0]
    assert first[1] != second[1]
    # A message per trace block, its text cut from that block's.
    for request, messages in ((a, first), (b, second)):
        assert len(messages) == len(request.hash_ids)
        for hash_id, message in zip(request.hash_ids, messages, strict=True):
            assert block_text(hash_id).startswith(message["content"])


@pytest.mark.parametrize("tokens", [100, 512, 513, 1000, 1024, 1500])
def test_a_chat_prompt_renders_to_the_trace_input_length(tokens: int) -> None:
    """The simulated engines count the template's tokens too: the rendered prompt, not the
    messages' texts, has the trace's length (a sent whole block's text made it 1.4 % longer)."""
    request = req(0, tokens, 1, (1, 2, 3))
    messages = prompt_messages(request)
    assert len(render_chat(messages)) == tokens * 4


def test_each_whole_block_of_a_chat_prompt_renders_to_one_trace_block() -> None:
    """Conversations share whole blocks: with room for the next message, a message and its
    framing are exactly one trace block (2,048 characters)."""
    messages = prompt_messages(req(0, 1500, 1, (1, 2, 3)))
    assert [len(render_chat([m])) - len(GENERATION_PROMPT) for m in messages[:2]] == [2048, 2048]


# --- the fleet model, against the timing model --------------------------------------------------


def test_a_lone_request_costs_its_prefill_and_its_decode_steps() -> None:
    model = FleetModel(engines=1, capacity_tokens=100_000)
    (first,), _ = simulate([req(0, 1000, 10, (1, 2))], model, "round_robin")
    assert first.ttft_s == pytest.approx(TIMING.prefill_seconds(1000))
    assert first.e2e_s == pytest.approx(first.ttft_s + 9 * TIMING.decode_step_seconds(1))
    assert first.queue_s == 0


def test_a_repeat_finds_its_prefix_cached_but_recomputes_the_last_block() -> None:
    model = FleetModel(engines=1, capacity_tokens=100_000)
    outcomes, summary = simulate([req(0, 1024, 2, (1, 2)), req(10, 1024, 2, (1, 2))], model, "round_robin")
    assert outcomes[0].cached_tokens == 0
    assert outcomes[1].cached_tokens == 1024 - 64
    assert outcomes[1].ttft_s == pytest.approx(TIMING.prefill_seconds(64))
    assert summary.hit_ratio == pytest.approx(960 / 2048)


def test_one_prefill_lane_queues_simultaneous_arrivals() -> None:
    model = FleetModel(engines=1, capacity_tokens=100_000)
    outcomes, summary = simulate(
        [req(0, 2000, 1, (1, 2, 3, 4)), req(0, 2000, 1, (5, 6, 7, 8))], model, "round_robin"
    )
    assert outcomes[1].queue_s == pytest.approx(TIMING.prefill_seconds(2000))
    assert summary.queue_mean == pytest.approx(TIMING.prefill_seconds(2000) / 2)


def test_a_larger_batch_decodes_slower() -> None:
    model = FleetModel(engines=1, capacity_tokens=100_000)
    (alone,), _ = simulate([req(0, 100, 50, (1,))], model, "round_robin")
    crowd, _ = simulate([req(0, 100, 50, (i,)) for i in range(8)], model, "round_robin")
    decode_alone = alone.e2e_s - alone.ttft_s
    assert decode_alone == pytest.approx(49 * TIMING.decode_step_seconds(1))
    assert crowd[0].e2e_s - crowd[0].ttft_s > 49 * TIMING.decode_step_seconds(4)


def test_admission_waits_for_a_slot_when_max_running_is_reached() -> None:
    model = FleetModel(engines=1, capacity_tokens=100_000, timing=EngineTiming(max_running=1))
    outcomes, _ = simulate([req(0, 500, 20, (1,)), req(0, 500, 20, (2,))], model, "round_robin")
    assert outcomes[1].queue_s == pytest.approx(outcomes[0].e2e_s)


def test_a_request_larger_than_the_kv_cache_is_refused() -> None:
    model = FleetModel(engines=2, capacity_tokens=4096)
    outcomes, summary = simulate(
        [req(0, 5000, 1, tuple(range(10))), req(0, 100, 1, (1,))], model, "least_load"
    )
    assert outcomes[0].ttft_s is None
    assert summary.refused == 1
    assert outcomes[1].ttft_s is not None


# --- policies in the model ----------------------------------------------------------------------


def test_cache_aware_routing_finds_more_of_the_prompts_cached() -> None:
    requests = synthetic()
    model = FleetModel(engines=4, capacity_tokens=40_000)
    _, blind = simulate(requests, model, "round_robin")
    _, aware = simulate(requests, model, "prefix_aware")
    limit = bounds(requests, model)
    assert aware.hit_ratio > 1.5 * blind.hit_ratio
    assert aware.ttft_mean < blind.ttft_mean
    assert aware.hit_ratio <= limit.pooled_lru_hit_ratio + 0.05
    assert blind.imbalance == pytest.approx(1.0, abs=0.01)


def test_the_gap_to_the_floor_is_queueing_and_the_prefix_prefilled_again() -> None:
    # One lane, two arrivals at once: the second waits the first's prefill; no cache to lose.
    model = FleetModel(engines=1, capacity_tokens=100_000)
    requests = [req(0, 2000, 1, (1, 2, 3, 4)), req(0, 2000, 1, (5, 6, 7, 8))]
    outcomes, summary = simulate(requests, model, "round_robin")
    gap = floor_gap(requests, model, outcomes)
    assert gap.queueing_s == pytest.approx(TIMING.prefill_seconds(2000) / 2)
    assert gap.cache_s == pytest.approx(0.0)
    # Two engines, a repeat sent to the other one: it prefills again what the pooled cache held.
    model = FleetModel(engines=2, capacity_tokens=100_000)
    requests = [req(0, 1024, 2, (1, 2)), req(10, 1024, 2, (1, 2))]
    outcomes, summary = simulate(requests, model, "round_robin")
    gap = floor_gap(requests, model, outcomes)
    again = TIMING.prefill_seconds(1024) - TIMING.prefill_seconds(64)
    assert (gap.queueing_s, gap.cache_s) == (0.0, pytest.approx(again / 2))
    assert gap.total_s == pytest.approx(summary.ttft_mean - bounds(requests, model).ttft_floor_mean)
    # A refused prompt is cached nowhere: a later request on its first blocks lost nothing.
    model = FleetModel(engines=1, capacity_tokens=4096)
    requests = [req(0, 8000, 1, tuple(range(16))), req(10, 1000, 1, (0, 1))]
    outcomes, _ = simulate(requests, model, "round_robin")
    assert outcomes[0].ttft_s is None
    assert floor_gap(requests, model, outcomes) == FloorGap(0.0, 0.0)


def test_the_same_seed_replays_the_same_run() -> None:
    requests = synthetic(150)
    model = FleetModel(engines=3, capacity_tokens=30_000)
    first, _ = simulate(requests, model, "power_of_two", seed=4)
    again, _ = simulate(requests, model, "power_of_two", seed=4)
    assert first == again


def test_ttl_beliefs_expire_in_virtual_time() -> None:
    requests = [req(0, 1024, 2, (1, 2)), req(100, 1024, 2, (1, 2))]
    model = FleetModel(engines=2, capacity_tokens=100_000, eviction="ttl", ttl_s=50.0)
    _, summary = simulate(requests, model, "prefix_aware")
    assert summary.reasons == {"no_match_least_load": 2}
    _, held = simulate(requests, FleetModel(engines=2, capacity_tokens=100_000), "prefix_aware")
    assert held.reasons == {"no_match_least_load": 1, "prefix_hit": 1}


def test_beliefs_larger_than_the_engines_overpredict() -> None:
    requests = synthetic(300)
    honest = FleetModel(engines=2, capacity_tokens=20_000)
    inflated = FleetModel(engines=2, capacity_tokens=20_000, belief_capacity_tokens=2_000_000)
    _, right = simulate(requests, honest, "prefix_aware")
    _, wrong = simulate(requests, inflated, "prefix_aware")
    assert right.belief_accuracy > 0.9
    assert wrong.belief_accuracy < right.belief_accuracy


def test_closed_loop_beliefs_recover_accuracy_in_the_simulator() -> None:
    requests = synthetic(300)
    inflated = FleetModel(engines=2, capacity_tokens=20_000, belief_capacity_tokens=2_000_000)
    _, open_loop = simulate(requests, inflated, "prefix_aware")
    _, closed = simulate(requests, replace(inflated, closed_loop=True), "prefix_aware")
    assert closed.belief_accuracy > open_loop.belief_accuracy + 0.1


class Listening(PrefixAware):
    """prefix_aware, keeping the outcomes it is told."""

    def __init__(self, params=None, *, seed=None) -> None:
        super().__init__(params, seed=seed)
        self.heard: list[Outcome] = []

    def on_outcome(self, outcome: Outcome) -> None:
        self.heard.append(outcome)


@pytest.mark.parametrize("closed_loop", [False, True])
def test_a_learning_policy_hears_each_request_offline_as_it_would_live(closed_loop: bool) -> None:
    """One outcome per request, at its end: served ones with their time to first token, the
    refused one with the engine's 400; the engine's cached tokens only with the closed loop."""
    model = FleetModel(engines=2, capacity_tokens=60_000, closed_loop=closed_loop)
    requests = [*synthetic(60), req(4.0, 100_000, 1, tuple(range(200)))]
    policy = Listening(seed=0)
    results = Simulation(model, [policy]).run(requests)
    assert len(policy.heard) == len(requests)
    served = [r for r in results if r.ttft_s is not None]
    heard_served = [o for o in policy.heard if o.status == 200]
    assert sorted(o.ttft_s for o in heard_served) == sorted(r.ttft_s for r in served)
    assert all(o.success and o.error is None for o in heard_served)
    (refused,) = [o for o in policy.heard if o.status == 400]
    assert refused.ttft_s is None and refused.request.prompt_tokens == 100_000
    assert max(o.matched_tokens for o in heard_served) > 0
    if closed_loop:
        assert sorted(o.cached_tokens for o in heard_served) == sorted(r.cached_tokens for r in served)
    else:
        assert all(o.cached_tokens is None for o in policy.heard)


# --- router replicas ----------------------------------------------------------------------------


def bursts(count: int, size: int, spacing_s: float) -> list[TraceRequest]:
    """``count`` bursts, 0.5 s apart, of ``size`` distinct 4,000-token prompts ``spacing_s``
    apart: each prompt's prefill (82 ms) outlasts its burst, so a burst spreads over the
    engines only if each pick sees the ones before it."""
    return [req(b * 0.5 + k * spacing_s, 4000, 2, (1000 * b + k,)) for b in range(count) for k in range(size)]


def test_replicas_with_a_fresh_load_view_spread_a_burst_as_one_router_does() -> None:
    requests = bursts(10, 4, 0.005)
    one = FleetModel(engines=4, capacity_tokens=100_000)
    fresh = replace(one, replicas=4, load_interval_s=0.001, load_idle_interval_s=0.001)
    stale = replace(one, replicas=4, load_interval_s=1.0, load_idle_interval_s=1.0)
    _, alone = simulate(requests, one, "least_load")
    _, shared = simulate(requests, fresh, "least_load")
    _, blind = simulate(requests, stale, "least_load")
    assert alone.queue_mean == shared.queue_mean == 0.0
    # Each replica sees only its own request of a burst: they pick idle-looking engines at
    # random, and every collision queues a prefill.
    assert blind.queue_mean > 0.005
    assert blind.ttft_mean > shared.ttft_mean == alone.ttft_mean


def test_each_replica_counts_and_hears_only_its_own_requests() -> None:
    """Round robin over three replicas; each one's counts go back to zero and its policy hears
    exactly the requests it routed (every third, from its number on)."""
    model = FleetModel(engines=3, capacity_tokens=60_000, replicas=3)
    requests = synthetic(90)
    policies = [Listening(seed=n) for n in range(3)]
    simulation = Simulation(model, policies)
    simulation.run(requests)
    for number, replica in enumerate(simulation.replicas):
        assert set(replica.in_flight.values()) == set(replica.pending_prefill.values()) == {0}
        assert set(replica.prefilling.values()) == {0}
        heard = sorted(o.request.prompt_tokens for o in policies[number].heard)
        assert heard == sorted(r.input_tokens for r in requests[number::3])


def test_an_idle_replica_reads_the_others_only_every_idle_interval() -> None:
    """As the live router: a replica with nothing in flight anywhere (as of its last read)
    calls only every ``load_idle_interval_s``, so after a quiet spell its first picks of a
    burst miss the others' until that call comes; a replica that calls every interval sees
    them, and one that never calls sees none."""
    requests = bursts(10, 4, 0.005)
    base = FleetModel(engines=4, capacity_tokens=100_000, replicas=4, load_interval_s=0.001)
    _, busy = simulate(requests, replace(base, load_idle_interval_s=0.001), "least_load")
    _, idle = simulate(requests, replace(base, load_idle_interval_s=0.3), "least_load")
    _, blind = simulate(requests, replace(base, load_interval_s=1.0, load_idle_interval_s=1.0), "least_load")
    assert busy.queue_mean == 0.0 < idle.queue_mean < blind.queue_mean


def test_the_view_on_lookups_spreads_a_burst_however_rare_the_periodic_calls() -> None:
    """``load_on_lookup``: each lookup reads the others' load as their last write published
    it, so a burst spreads as one router spreads it with periodic calls 1 s apart; not on a
    fleet past ``load_interval_fleet``, where the view does not ride (16 x 4 > 32). (It rides on
    lookups and writes, which only a policy that matches prefixes makes.)"""
    requests = bursts(10, 4, 0.005)
    slow = FleetModel(
        engines=4,
        capacity_tokens=100_000,
        replicas=4,
        load_interval_s=0.9,
        load_idle_interval_s=0.9,
        belief_delay_s=0.001,
    )
    _, periodic = simulate(requests, slow, "prefix_aware")
    _, riding = simulate(requests, replace(slow, load_on_lookup=True), "prefix_aware")
    _, large = simulate(requests, replace(slow, load_on_lookup=True, replicas=16), "prefix_aware")
    assert riding.queue_mean == 0.0 < periodic.queue_mean
    assert large.queue_mean > 0.0


def test_a_replica_sees_another_ones_belief_only_after_the_delay() -> None:
    model = FleetModel(engines=4, capacity_tokens=100_000, replicas=2, belief_delay_s=0.01)
    # The first request goes to replica 0, the second (the same prompt) to replica 1.
    before = [req(0.0, 2048, 2, (1, 2, 3, 4)), req(0.005, 2048, 2, (1, 2, 3, 4))]
    after = [req(0.0, 2048, 2, (1, 2, 3, 4)), req(0.02, 2048, 2, (1, 2, 3, 4))]
    _, early = simulate(before, model, "prefix_aware")
    _, late = simulate(after, model, "prefix_aware")
    assert early.reasons == {"no_match_least_load": 2}
    assert late.reasons == {"no_match_least_load": 1, "prefix_hit": 1}
    _, one = simulate(before, replace(model, replicas=1), "prefix_aware")
    assert one.reasons == late.reasons


def test_replicas_stretch_their_load_calls_as_the_router_does() -> None:
    """Past ``load_interval_fleet`` (32) replicas x backends each replica calls less often (the
    router's own rule, ``RedisConfig.load_interval``). A view is at most two intervals old
    (the publisher's and the reader's), so picks 3 ms apart all see each other at 1 ms, and
    not all at the 4 ms that 16 replicas x 8 backends stretch it to."""
    requests = bursts(10, 8, 0.003)
    few = FleetModel(
        engines=8, capacity_tokens=100_000, replicas=4, load_interval_s=0.001, load_idle_interval_s=0.001
    )
    many = replace(few, replicas=16)
    assert few.load_view().load_interval(4, 8) == 0.001
    assert many.load_view().load_interval(16, 8) == 0.004
    _, fresh = simulate(requests, few, "least_load")
    _, older = simulate(requests, many, "least_load")
    assert fresh.queue_mean == 0.0 < older.queue_mean


def test_the_fleet_model_refuses_replicas_it_cannot_model() -> None:
    with pytest.raises(ValueError, match="closed loop is modelled for one router"):
        FleetModel(replicas=2, closed_loop=True)
    with pytest.raises(ValueError, match="load_ttl_s"):
        FleetModel(replicas=2, load_interval_s=5.0)
    with pytest.raises(ValueError, match="keeper is modelled for one router"):
        FleetModel(replicas=2, refresh_share=0.25)


def _conversation_among_scans(turns: int) -> list[TraceRequest]:
    """A conversation growing by a 512-token block a turn, a turn every 10 s, each followed by
    four one-shot prompts of two fresh blocks, one a second: enough to flush an engine of
    eight blocks between two turns."""
    requests, fresh = [], 1000
    for turn in range(turns):
        at = 10.0 * turn
        requests.append(req(at, (turn + 3) * 512 - 100, 2, tuple(range(turn + 3))))
        for scan in range(1, 5):
            requests.append(req(at + scan, 2 * 512 - 100, 2, (fresh, fresh + 1)))
            fresh += 2
    return requests


def test_the_keeper_keeps_a_returning_conversation_cached_through_the_scans() -> None:
    requests = _conversation_among_scans(turns=4)
    is_turn = [r.hash_ids[0] == 0 for r in requests]
    off_model = FleetModel(engines=1, capacity_tokens=8 * 512)
    off_outcomes, off = simulate(requests, off_model, "latency")
    on_outcomes, on = simulate(requests, replace(off_model, refresh_share=0.2), "latency")
    assert off.refreshes_per_request is None
    assert on.refreshes_per_request is not None and on.refreshes_per_request > 0
    assert on.hit_ratio > 1.5 * off.hit_ratio
    # Without refreshes the scans flush all but the first block of the history before each
    # turn; kept alive, the third and fourth turns find more than two blocks of theirs.
    assert all(o.cached_tokens <= 512 for o, turn in zip(off_outcomes, is_turn, strict=True) if turn)
    found = [o.cached_tokens for o, turn in zip(on_outcomes, is_turn, strict=True) if turn]
    assert min(found[2:]) > 2 * 512


def test_refreshes_beyond_the_routers_limit_are_skipped_as_live(monkeypatch) -> None:
    """Virtual time applies the router's limits on warm-ups in flight (router/request_path/warmup.py):
    with none allowed the keeper still finds refreshes due, and none is sent."""
    requests = _conversation_among_scans(turns=4)
    model = FleetModel(engines=1, capacity_tokens=8 * 512, refresh_share=0.2)
    _, allowed = simulate(requests, model, "latency")
    monkeypatch.setattr(simulate_module, "REFRESHES_IN_FLIGHT", 0)
    _, none = simulate(requests, model, "latency")
    _, off = simulate(requests, replace(model, refresh_share=0.0), "latency")
    assert allowed.refreshes_per_request is not None and allowed.refreshes_per_request > 0
    assert none.refreshes_per_request == 0
    assert none.hit_ratio == off.hit_ratio < allowed.hit_ratio


# --- the command --------------------------------------------------------------------------------


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    rows = [
        row(r.arrival_s * 1000, r.input_tokens, r.output_tokens, list(r.hash_ids)) for r in synthetic(120)
    ]
    return write_trace(tmp_path / "trace.jsonl", rows)


def test_simulate_command_prints_one_row_per_policy_and_sweep_value(trace_file, capsys) -> None:
    code = main(
        ["simulate", "--trace", str(trace_file), "--policy", "round_robin,cost", "--engines", "3",
         "--capacity", "30000", "--sweep", "capacity_tokens=20000,60000"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    assert "120 requests" in out
    table = [line.split() for line in out.splitlines() if line.startswith(("round_robin ", "cost "))]
    assert [(r[0], r[1]) for r in table] == [
        ("round_robin", "capacity_tokens=20000"),
        ("round_robin", "capacity_tokens=60000"),
        ("cost", "capacity_tokens=20000"),
        ("cost", "capacity_tokens=60000"),
    ]
    assert "pooled-LRU hit ratio" in out


def test_simulate_command_says_how_far_each_run_is_above_the_floor(trace_file, capsys) -> None:
    args = ["simulate", "--trace", str(trace_file), "--policy", "round_robin,cost", "--engines", "3"]
    assert main([*args, "--capacity", "30000"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith(("round_robin ", "cost "))]
    ttft_means = {row[0]: float(row[2]) for row in rows}
    floor_mean = float(out.split("TTFT floor mean ")[1].split()[0])
    _, _, section = out.partition("TTFT above the floor (each run's own fleet's), ms per request")
    gaps = {line.split(":")[0].strip(): line.split(":")[1] for line in section.splitlines()[1:3]}
    assert set(gaps) == {"round_robin", "cost"}
    for policy, figures in gaps.items():
        total, parts = figures.split("=")
        queueing, _ = (float(part) for part in parts.split(" + "))
        assert float(total) == pytest.approx(ttft_means[policy] - floor_mean, abs=1.0)  # whole ms
        assert queueing >= 0
    # Blind to the cache, round robin prefills again what cost finds cached.
    assert float(gaps["round_robin"].split(" + ")[1]) > float(gaps["cost"].split(" + ")[1])


def test_simulate_command_compares_router_replicas_with_one_router(trace_file, capsys) -> None:
    args = ["simulate", "--trace", str(trace_file), "--policy", "least_load", "--replicas", "4"]
    assert main([*args, "--sweep", "replicas=1,4", "--spread-s", "3", "--load-interval-s", "0.02"]) == 0
    out = capsys.readouterr().out
    assert "4 router replicas (load view every 20 ms, beliefs after 5 ms)" in out
    assert [line.split()[1] for line in out.splitlines() if line.startswith("least_load ")] == [
        "replicas=1",
        "replicas=4",
    ]


def test_simulate_command_sweeps_a_policy_parameter(trace_file, capsys) -> None:
    args = ["simulate", "--trace", str(trace_file), "--policy", "cost", "--sweep", "load_tokens=0,4096"]
    assert main([*args, "--params", '{"temperature": 0.1}']) == 0
    out = capsys.readouterr().out
    assert "load_tokens=0" in out and "load_tokens=4096" in out


def test_simulate_command_sweeps_the_keeper_and_counts_its_refreshes(trace_file, capsys) -> None:
    args = ["simulate", "--trace", str(trace_file), "--policy", "latency", "--capacity", "20000"]
    assert main([*args, "--sweep", "refresh_share=0,0.25"]) == 0
    out = capsys.readouterr().out
    assert "refresh_share=0.25" in out and "refreshes/request" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--policy", "nope"], "unknown policy 'nope'"),
        (["--policy", "cost", "--params", "{bad"], "--params: not valid JSON"),
        (["--policy", "cost", "--params", '{"load_tokens": -1}'], "load_tokens"),
        (["--policy", "cost", "--sweep", "load_tokens"], "--sweep: expected key=v1,v2"),
        (["--policy", "round_robin", "--sweep", "load_tokens=1,2"], "load_tokens: unknown key"),
        (["--policy", "cost", "--engines", "0"], "at least one engine"),
        (["--policy", "cost", "--eviction", "fifo"], "unknown eviction policy"),
        (["--policy", "cost", "--replicas", "0"], "replicas must be at least 1"),
        (["--policy", "cost", "--spread-s", "-1"], "--spread-s must be >= 0"),
        (["--policy", "cost", "--prefill-per-token-s", "-1"], "prefill_per_token_s must be >= 0"),
        (["--policy", "cost", "--refresh-share", "0.3", "--kept-share", "2"], "kept_share in (0, 1]"),
    ],
)
def test_simulate_command_refuses_bad_arguments(trace_file, capsys, extra, message) -> None:
    assert main(["simulate", "--trace", str(trace_file), *extra]) == 2
    assert message in capsys.readouterr().err


def test_simulate_command_reports_a_missing_trace(tmp_path, capsys) -> None:
    assert main(["simulate", "--trace", str(tmp_path / "none.jsonl"), "--policy", "cost"]) == 2
    assert "none.jsonl" in capsys.readouterr().err


def test_simulate_command_shows_each_runs_slowest_requests_and_why(trace_file, capsys) -> None:
    args = ["simulate", "--trace", str(trace_file), "--policy", "round_robin,cost", "--engines", "3"]
    assert main([*args, "--capacity", "30000", "--slowest", "3"]) == 0
    out = capsys.readouterr().out
    for policy in ("round_robin", "cost"):
        _, _, rest = out.partition(f"\n{policy}: slowest 1 % (2 requests) by reason: ")
        assert rest, out  # 120 requests: their slowest hundredth is two
        reasons, table = rest.split("\n", 1)
        assert sum(int(part.split()[-1]) for part in reasons.split(", ")) == 2
        rows = [line.split() for line in table.splitlines()[2:5]]
        ttfts = [int(r[0]) for r in rows]
        assert len(rows) == 3 and ttfts == sorted(ttfts, reverse=True)
        assert all(r[4].startswith(policy.split("_")[0]) for r in rows)


def test_max_output_tokens_caps_every_output_as_the_live_benchmark_does() -> None:
    capped = load_source("agent", minutes=2, limit=None, seed=0, max_output_tokens=7)
    whole = load_source("agent", minutes=2, limit=None, seed=0)
    assert [r.output_tokens for r in capped] == [min(7, r.output_tokens) for r in whole]
    assert max(r.output_tokens for r in whole) > 7


def test_simulate_command_refuses_a_negative_cap(trace_file, capsys) -> None:
    assert main(["simulate", "--trace", str(trace_file), "--max-output-tokens", "-1"]) == 2
    assert "--max-output-tokens, --slowest and --spread-s must be >= 0" in capsys.readouterr().err
