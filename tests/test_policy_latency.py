"""The ``latency`` policy (the default): its cost, batch decode, hot-prefix replication, and its
behaviour on the generated workloads in virtual time."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import pytest

from loadtest.simulate import FleetModel, simulate
from loadtest.workloads import generate
from policies.routing import PolicyLoadError, build_policy
from policies.routing.latency import Latency
from policies.types import BackendView, RequestView, Warmup


def req(blocks: int = 10, chain: tuple[int, ...] | None = None, max_tokens: int | None = 100) -> RequestView:
    chain = tuple(range(1000, 1000 + blocks)) if chain is None else chain
    return RequestView(
        model="m",
        tenant="t",
        session_key=None,
        prompt_tokens=blocks * 64,
        block_count=len(chain),
        block_tokens=64,
        max_tokens=max_tokens,
        chain=chain,
    )


def bv(name: str, matched: int = 0, load: int = 0, pending: int = 0, prefilling: int = 0, cached: int = 0):
    return BackendView(
        name=name,
        matched_blocks=matched,
        in_flight=load,
        pending_prefill_tokens=pending,
        pending_prefill_requests=prefilling,
        cached_blocks=cached,
    )


#: Only the gap and the batch: every other term off, no replication discount.
PLAIN = {"queue_weight": 0.0, "load_tokens": 0.0, "decode_weight": 1.0, "reuse_weight": 0.0}


def test_the_deeper_match_wins_at_equal_load() -> None:
    decision = Latency(seed=0).choose(req(), [bv("a", matched=2, load=1), bv("b", matched=8, load=1)])
    assert (decision.backend, decision.reason, decision.matched_blocks) == ("b", "latency_hit", 8)


def test_the_batch_a_request_joins_is_priced_by_its_output() -> None:
    policy = Latency(PLAIN, seed=0)
    # 'deep' holds 8 of 10 blocks (512 tokens less to prefill) but decodes 6 requests.
    deep, idle = bv("deep", matched=8, load=6), bv("idle")
    # A short answer joins the batch for few steps: 10 x 6 = 60 < 512, the hit pays.
    assert policy.choose(req(max_tokens=10), [deep, idle]).backend == "deep"
    # A long one slows (and is slowed by) those 6 for 100 steps: 600 > 512, it goes elsewhere.
    decision = policy.choose(req(max_tokens=100), [deep, idle])
    assert (decision.backend, decision.reason) == ("idle", "latency_spill")


def test_requests_still_in_prefill_are_not_the_decode_batch() -> None:
    policy = Latency(PLAIN, seed=0)
    # The same 6 outstanding requests, 5 of them still waiting for their first byte: 1 x 100 < 512.
    assert policy.choose(req(), [bv("deep", matched=8, load=6, prefilling=5), bv("idle")]).backend == "deep"
    assert bv("x", load=6, prefilling=5).decoding == 1
    assert bv("x", load=2, prefilling=5).decoding == 0


def test_output_length_defaults_and_is_capped() -> None:
    policy = Latency({"default_output": 300, "output_cap": 500}, seed=0)
    assert policy.output_tokens(req(max_tokens=None)) == 300
    assert policy.output_tokens(req(max_tokens=40)) == 40
    assert policy.output_tokens(req(max_tokens=100_000)) == 500


def test_the_cost_adds_the_gap_the_queue_the_batch_and_the_load() -> None:
    policy = Latency({"queue_weight": 0.5, "load_tokens": 10.0, "decode_weight": 2.0}, seed=0)
    backend = bv("a", matched=4, load=3, pending=1000, prefilling=1)
    # gap (8 - 4) x 64 + 0.5 x 1000 + 2 x 100 x 2 decoding + 10 x 3
    assert policy.cost(req(), backend, deepest=8, discount=1.0, queue_weight=0.5) == 256 + 500 + 400 + 30
    assert policy.cost(req(), backend, deepest=8, discount=0.25, queue_weight=0.5) == 64 + 500 + 400 + 30


def test_a_queue_weighs_more_where_most_prefill_lanes_are_idle() -> None:
    policy = Latency({"queue_weight": 0.06, "idle_queue_weight": 1.0}, seed=0)
    busy, idle = bv("busy", pending=100, prefilling=1), bv("idle")
    assert policy.queue_weight([busy] * 8) == pytest.approx(0.06)
    assert policy.queue_weight([idle] * 8) == pytest.approx(1.06)
    assert policy.queue_weight([busy] * 4 + [idle] * 4) == pytest.approx(0.06 + 0.5**3)
    assert policy.queue_weight([busy] + [idle] * 7) == pytest.approx(0.06 + (7 / 8) ** 3)
    assert Latency({"idle_queue_weight": 0.0}, seed=0).queue_weight([idle] * 8) == pytest.approx(0.06)


def test_a_request_leaves_a_queue_for_an_idle_lane_only_on_a_mostly_idle_fleet() -> None:
    """The holder of 8 of 10 blocks has 2,000 prefill tokens queued; another backend lacks 512
    tokens of it. With 6 other lanes idle the queue weighs 0.06 + (7/8)^3 = 0.73: 1,460 > 512,
    the request goes where it can start now. With those lanes busy it weighs 0.06: 120 < 512,
    it waits at the holder, as the extra prefill would delay what is queued on the others."""
    policy = Latency({**PLAIN, "queue_weight": 0.06, "idle_queue_weight": 1.0}, seed=0)
    holder, other = bv("holder", matched=8, pending=2000, prefilling=2), bv("other")
    quiet = [bv(f"quiet{i}") for i in range(6)]
    queued = [bv(f"queued{i}", pending=3000, prefilling=3) for i in range(6)]
    assert policy.choose(req(), [holder, other, *quiet]).backend != "holder"  # an idle lane
    assert policy.choose(req(), [holder, other, *queued]).backend == "holder"
    assert (
        Latency({**PLAIN, "queue_weight": 0.06, "idle_queue_weight": 0.0}, seed=0)
        .choose(req(), [holder, other, *quiet])
        .backend
        == "holder"
    )


def test_a_reused_prefix_is_copied_to_an_idle_backend_and_a_one_off_history_is_not() -> None:
    """The same load gap: a prefix many requests end their match at is worth copying, a
    conversation's own history (its deepest match ends there once) is not."""
    shared = tuple(range(100, 110))
    holder, idle = bv("holder", matched=10, load=3), bv("idle")
    policy = Latency({**PLAIN, "reuse_weight": 3.0, "reuse_half_life": 1000.0}, seed=0)
    # First request with this prefix: 640 tokens of gap against 3 x 100 of batch: stay.
    first = policy.choose(req(chain=shared), [holder, idle])
    assert first.backend == "holder"
    assert policy.reuse(shared[-1]) == pytest.approx(1.0, rel=0.01)  # one request, a routed one ago
    # Now reused: the gap is divided by 1 + 3 x 1 = 4 -> 160 < 300: the prefix is copied.
    second = policy.choose(req(chain=shared), [holder, idle])
    assert (second.backend, second.reason) == ("idle", "latency_spill")
    # A history matched for the first time stays where it is, whatever came before.
    history = tuple(range(200, 210))
    assert policy.choose(req(chain=history), [replace(holder, name="h2"), idle]).backend == "h2"


def test_a_cold_copy_of_a_long_prefix_is_warmed_while_the_request_goes_to_a_holder() -> None:
    shared = tuple(range(100, 120))  # 20 blocks: at least warmup_blocks (16)
    # Once reused, the copy's 1280 tokens count 1280 / (1 + 3) = 320 < 6 x 100 of batch.
    holder, idle = bv("holder", matched=20, load=6), bv("idle")
    policy = Latency({**PLAIN, "reuse_weight": 3.0}, seed=0)
    for other in range(2):  # other traffic keeps the holder within its share of requests
        assert policy.choose(req(chain=(other,)), [bv("holder", load=6), idle]).backend == "idle"
    policy.choose(req(chain=shared), [holder, idle])
    decision = policy.choose(req(chain=shared), [holder, idle])
    assert (decision.backend, decision.reason, decision.matched_blocks) == ("holder", "latency_hit", 20)
    assert decision.warmup == Warmup("idle", 20)
    # Turned off, the request itself makes the copy: a spill, as before.
    plain = Latency({**PLAIN, "reuse_weight": 3.0, "warmup_blocks": 0}, seed=0)
    for other in range(2):
        plain.choose(req(chain=(other,)), [bv("holder", load=6), idle])
    plain.choose(req(chain=shared), [holder, idle])
    spill = plain.choose(req(chain=shared), [holder, idle])
    assert (spill.backend, spill.reason, spill.warmup) == ("idle", "latency_spill", None)


def test_no_warmup_for_a_short_prefix_a_partial_copy_or_a_holder_busier_than_the_copy() -> None:
    policy = Latency({**PLAIN, "reuse_weight": 3.0, "warmup_max_share": 1.2}, seed=0)
    short, long = tuple(range(200, 210)), tuple(range(300, 320))
    for _ in range(3):  # a 10-block prefix is copied by the request itself
        decision = policy.choose(req(chain=short), [bv("holder", matched=10, load=3), bv("idle")])
    assert (decision.backend, decision.warmup) == ("idle", None)
    # The spill target holds part of the prefix already: the request tops it up itself.
    decision = policy.choose(req(chain=long), [bv("holder", matched=20, load=9), bv("half", matched=10)])
    assert (decision.backend, decision.warmup) == ("half", None)
    # Every recent request went to the holder: over its share, it still takes a request for a
    # warm-up's sake while it costs less than the copy would at full price (3 x 100 < 1280
    # tokens: the reuse discount is the copy's worth to later requests, not to this one)...
    busy = Latency({**PLAIN, "reuse_weight": 3.0}, seed=0)
    for _ in range(10):
        busy.choose(req(chain=long), [bv("holder", matched=20), bv("idle", load=9)])
    assert busy.share("holder") > 9 * busy.share("idle")
    decision = busy.choose(req(chain=long), [bv("holder", matched=20, load=3), bv("idle")])
    assert (decision.backend, decision.warmup) == ("holder", Warmup("idle", 20))
    # ... and not once its batch costs more than that copy, however little (13 x 100 > 1280):
    # the request makes it.
    decision = busy.choose(req(chain=long), [bv("holder", matched=20, load=13), bv("idle")])
    assert (decision.backend, decision.reason, decision.warmup) == ("idle", "latency_spill", None)


def test_reuse_decays_with_routed_requests_and_is_bounded() -> None:
    policy = Latency({"reuse_half_life": 10.0, "reuse_entries": 4}, seed=0)
    backends = [bv("a", matched=3), bv("b")]
    policy.choose(req(chain=(1, 2, 3)), backends)
    for i in range(10):  # ten other prefixes, each matched once
        policy.choose(req(chain=(50 + i, 60 + i, 70 + i)), backends)
    assert policy.reuse(3) == 0.0  # forgotten: only the 4 most recent prefixes are kept
    policy.choose(req(chain=(80, 81, 82)), backends)
    for i in range(10):
        policy.choose(req(chain=(90 + i,)), [bv("a"), bv("b")])  # no match: counts nothing
    # Eleven routed requests later (itself and ten more): 1.1 half-lives.
    assert policy.reuse(82) == pytest.approx(0.5**1.1)


def test_without_a_match_the_least_busy_wins_then_the_emptiest_cache() -> None:
    policy = Latency(seed=0)
    decision = policy.choose(req(), [bv("busy", load=2), bv("queued", pending=5000), bv("free")])
    assert (decision.backend, decision.reason) == ("free", "latency_no_match")
    small = [bv("big", cached=900), bv("small", cached=10)]
    assert {policy.choose(req(), small).backend for _ in range(20)} == {"small"}
    assert {policy.choose(req(), [bv("x"), bv("y")]).backend for _ in range(60)} == {"x", "y"}


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"decode_weight": -1}, "decode_weight"),
        ({"reuse_half_life": 0}, "reuse_half_life"),
        ({"output_cap": 0}, "output_cap"),
        ({"bogus": 1}, "bogus"),
    ],
)
def test_bad_params_name_the_key(params: dict, key: str) -> None:
    with pytest.raises(PolicyLoadError, match=key):
        build_policy("latency", params)


# --- on the generated workloads, in virtual time ------------------------------------------------

FLEET = FleetModel(engines=8, capacity_tokens=400_000, speedup=10)


@pytest.mark.parametrize("workload", ["chat", "agent"])
def test_shared_documents_do_not_hot_spot_one_engine_and_keep_their_hits(workload: str) -> None:
    """Issue 20's hot-spot: ``cost`` sends each shared document's traffic to its one holder."""
    requests = generate(workload, seed=0, minutes=6)
    _, cost = simulate(requests, FLEET, "cost", seed=1)
    _, latency = simulate(requests, FLEET, "latency", seed=1)
    assert cost.imbalance > 2.5  # the hot-spot is there to be caught
    assert latency.imbalance <= 1.3
    assert latency.hit_ratio >= 0.97 * cost.hit_ratio
    assert latency.refused == 0


@pytest.mark.parametrize("workload", ["chat", "agent"])
def test_warming_hot_copies_ahead_shortens_the_tail_and_keeps_the_balance(workload: str) -> None:
    """The copies of hot documents were the slowest 1 % of requests (``simulate --slowest``)."""
    requests = generate(workload, seed=0, minutes=6)
    _, paying = simulate(requests, FLEET, "latency", {"warmup_blocks": 0}, seed=1)
    outcomes, warmed = simulate(requests, FLEET, "latency", seed=1)
    assert warmed.ttft_p99 < 0.95 * paying.ttft_p99
    assert warmed.hit_ratio >= paying.hit_ratio
    assert warmed.imbalance <= 1.3
    assert len(outcomes) == len(requests) and warmed.refused == 0


def test_without_reuse_it_balances_at_least_as_well_as_least_load() -> None:
    requests = generate("no_reuse", seed=0, minutes=4)
    _, least = simulate(requests, FLEET, "least_load", seed=1)
    _, latency = simulate(requests, FLEET, "latency", seed=1)
    assert latency.hit_ratio == 0.0
    assert latency.ttft_p99 <= 1.05 * least.ttft_p99
    shares = Counter(o.backend for o in simulate(requests, FLEET, "latency", seed=1)[0])
    assert len(shares) == FLEET.engines
