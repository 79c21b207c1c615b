"""The rules of random, power_of_two, session_affinity, consistent_hash, cost and weighted.

Each policy is a pure function of its views, so these tests call ``choose`` directly with
seeded policies: every outcome is deterministic.
"""

from __future__ import annotations

from collections import Counter

import pytest

from policies.params import ParamError
from policies.routing import BUILTIN, PolicyLoadError, build_policy
from policies.routing.consistent_hash import ConsistentHash
from policies.routing.cost import Cost
from policies.routing.power_of_two import PowerOfTwo
from policies.routing.random_pick import RandomPick
from policies.routing.session_affinity import SessionAffinity
from policies.routing.weighted import Weighted
from policies.types import BackendView, RequestView

NEW = ["random", "power_of_two", "session_affinity", "consistent_hash", "cost", "weighted"]

#: Every reason each policy may give: these become metric labels, so the set is fixed.
REASONS = {
    "random": {"random"},
    "power_of_two": {"power_of_two"},
    "session_affinity": {"session", "no_session_least_load"},
    "consistent_hash": {"ring_owner", "ring_spill", "no_key_least_load"},
    "cost": {"cost_hit", "cost_spill", "cost_no_match"},
    "weighted": {"weighted_hit", "weighted_spill", "weighted_no_match"},
    "latency": {"latency_hit", "latency_spill", "latency_no_match"},
}


def req(
    blocks: int = 10, session: str | None = None, chain: tuple[int, ...] | None = None, block_tokens: int = 64
) -> RequestView:
    chain = tuple(range(1000, 1000 + blocks)) if chain is None else chain
    return RequestView(
        model="m",
        tenant="t",
        session_key=session,
        prompt_tokens=blocks * block_tokens,
        block_count=len(chain),
        block_tokens=block_tokens,
        chain=chain,
    )


def bv(
    name: str, matched: int = 0, load: int = 0, cached: int = 0, kv: float | None = None, in_flight=None
) -> BackendView:
    return BackendView(
        name=name,
        matched_blocks=matched,
        in_flight=load if in_flight is None else in_flight,
        engine_running=load if in_flight is not None else None,
        cached_blocks=cached,
        kv_usage=kv,
    )


def fleet(n: int = 4, **kw) -> list[BackendView]:
    return [bv(f"b{i}", **kw) for i in range(n)]


def varied(i: int) -> RequestView:
    """Request ``i`` of a stream of distinct requests: distinct sessions and prompt heads."""
    return req(session=f"s{i}", chain=(i * 7919 + 1, i * 7919 + 2))


# --- common behaviour ---------------------------------------------------------------------------


def test_registry_holds_every_policy_by_its_name() -> None:
    for name in NEW:
        assert BUILTIN[name].name == name
    assert {RandomPick, PowerOfTwo, SessionAffinity, ConsistentHash, Cost, Weighted} <= set(BUILTIN.values())


@pytest.mark.parametrize("name", NEW)
def test_one_backend_is_always_chosen(name: str) -> None:
    policy = build_policy(name, seed=0)
    for backend in (bv("only"), bv("only", matched=7, load=50, cached=99, kv=0.99)):
        for request in (req(), req(session="s"), req(chain=())):
            decision = policy.choose(request, [backend])
            assert decision.backend == "only"
            assert decision.matched_blocks == backend.matched_blocks
            assert decision.reason in REASONS[name]


@pytest.mark.parametrize("name", NEW)
def test_all_equal_backends_share_the_traffic(name: str) -> None:
    """Equal load, no match anywhere: every backend gets a fair part, never 'the first'."""
    policy = build_policy(name, seed=3)
    backends = fleet(4)
    picks = Counter(policy.choose(varied(i), backends).backend for i in range(800))
    assert set(picks) == {"b0", "b1", "b2", "b3"}
    assert max(picks.values()) < 2 * min(picks.values()), picks


@pytest.mark.parametrize("name", NEW)
def test_all_candidates_heavily_loaded_still_routes(name: str) -> None:
    policy = build_policy(name, seed=1)
    backends = fleet(3, load=500)
    for i in range(50):
        decision = policy.choose(varied(i), backends)
        assert decision.backend in {"b0", "b1", "b2"}
        assert decision.reason in REASONS[name]


@pytest.mark.parametrize("name", NEW)
def test_the_same_seed_gives_the_same_decisions(name: str) -> None:
    backends = [bv("b0", matched=3, load=2), bv("b1", load=1), bv("b2", matched=3, load=2), bv("b3")]

    def run(seed: int) -> list[str]:
        policy = build_policy(name, seed=seed)
        return [policy.choose(varied(i % 5), backends).backend for i in range(60)]

    assert run(11) == run(11)


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("consistent_hash", {"virtual_nodes": 0}, "virtual_nodes"),
        ("consistent_hash", {"load_factor": 0.9}, "load_factor"),
        ("consistent_hash", {"key_blocks": 0}, "key_blocks"),
        ("consistent_hash", {"prefer_session": "yes"}, "prefer_session"),
        ("cost", {"load_tokens": -1}, "load_tokens"),
        ("cost", {"temperature": -0.5}, "temperature"),
        ("cost", {"queue_weight": -0.1}, "queue_weight"),
        ("cost", {"bogus": 1}, "bogus"),
        ("weighted", {"queue": -1}, "queue"),
        ("weighted", {"prefix": 0, "queue": 0, "kv_usage": 0, "in_flight": 0}, "prefix"),
        ("random", {"anything": 1}, "anything"),
    ],
)
def test_bad_params_are_refused_naming_the_key(name: str, params: dict, key: str) -> None:
    with pytest.raises(PolicyLoadError, match=rf"routing\.params\.{key}"):
        build_policy(name, params)


# --- random and power of two --------------------------------------------------------------------


def test_random_ignores_load_and_cache() -> None:
    policy = RandomPick(seed=5)
    backends = [bv("hot", matched=10, load=0), bv("busy", load=100)]
    picks = Counter(policy.choose(req(), backends).backend for _ in range(400))
    assert 150 < picks["busy"] < 250


def test_power_of_two_never_picks_the_unique_most_loaded() -> None:
    policy = PowerOfTwo(seed=2)
    backends = [bv("a", load=1), bv("b", load=3), bv("c", load=3), bv("worst", load=9)]
    picks = Counter(policy.choose(req(), backends).backend for _ in range(600))
    assert "worst" not in picks
    # 'a' wins every pair it is drawn into: half of all pairs.
    assert 250 < picks["a"] < 350


def test_power_of_two_with_two_backends_is_least_load_and_ties_at_random() -> None:
    policy = PowerOfTwo(seed=4)
    assert {policy.choose(req(), [bv("x", load=2), bv("y", load=1)]).backend for _ in range(50)} == {"y"}
    assert {policy.choose(req(), [bv("x", load=2), bv("y", load=2)]).backend for _ in range(50)} == {"x", "y"}


# --- session affinity ---------------------------------------------------------------------------


def test_a_session_sticks_whatever_the_order_and_load_of_candidates() -> None:
    policy = SessionAffinity(seed=0)
    backends = fleet(5)
    first = policy.choose(req(session="alice"), backends)
    assert first.reason == "session"
    for shift in range(5):
        rotated = backends[shift:] + backends[:shift]
        loaded = [bv(b.name, load=100 if b.name == first.backend else 0) for b in rotated]
        assert policy.choose(req(session="alice"), loaded).backend == first.backend
    # A fresh policy object (another router replica, a restart) agrees without shared state.
    assert SessionAffinity(seed=99).choose(req(session="alice"), backends).backend == first.backend


def test_removing_a_backend_moves_only_its_own_sessions() -> None:
    policy = SessionAffinity(seed=0)
    backends = fleet(5)
    before = {s: policy.choose(req(session=f"u{s}"), backends).backend for s in range(300)}
    survivors = [b for b in backends if b.name != "b2"]
    after = {s: policy.choose(req(session=f"u{s}"), survivors).backend for s in range(300)}
    moved = {s for s in before if before[s] != after[s]}
    assert moved == {s for s in before if before[s] == "b2"}
    assert moved  # b2 did own some sessions


def test_without_a_session_it_falls_back_to_least_load() -> None:
    policy = SessionAffinity(seed=0)
    backends = [bv("a", load=3), bv("b", load=1), bv("c", load=1)]
    picks = Counter(policy.choose(req(session=None), backends).backend for _ in range(100))
    assert set(picks) == {"b", "c"}
    assert policy.choose(req(session=None), backends).reason == "no_session_least_load"


# --- consistent hashing with bounded loads ------------------------------------------------------


def test_equal_prompt_heads_meet_on_one_backend() -> None:
    policy = ConsistentHash(seed=0)
    backends = fleet(4)
    head = (42, 43)
    picks = {policy.choose(req(chain=(*head, 100 + i)), backends).backend for i in range(20)}
    assert len(picks) == 1
    assert policy.choose(req(chain=head), backends).reason == "ring_owner"


def test_key_blocks_decides_how_much_of_the_head_is_the_key() -> None:
    one = ConsistentHash({"key_blocks": 1}, seed=0)
    two = ConsistentHash({"key_blocks": 2}, seed=0)
    backends = fleet(8)
    chains = [(7, 500 + i, 900 + i) for i in range(40)]
    assert len({one.choose(req(chain=c), backends).backend for c in chains}) == 1
    assert len({two.choose(req(chain=c), backends).backend for c in chains}) > 4


def test_an_owner_at_the_bound_spills_to_the_same_next_backend() -> None:
    policy = ConsistentHash({"load_factor": 1.25}, seed=0)
    names = [f"b{i}" for i in range(4)]
    owner = policy.choose(req(chain=(5,)), fleet(4)).backend
    # Total load 11 over 4 backends: bound ceil(1.25 * 12 / 4) = 4; the owner is over it.
    loaded = [bv(n, load=5 if n == owner else 2) for n in names]
    spills = {policy.choose(req(chain=(5,)), loaded) for _ in range(10)}
    assert len(spills) == 1
    (spill,) = spills
    assert spill.backend != owner
    assert spill.reason == "ring_spill"


def test_no_backend_is_pushed_past_the_load_bound() -> None:
    """Feed one hot key and count load as it lands: the spread never exceeds the bound."""
    policy = ConsistentHash({"load_factor": 1.5}, seed=0)
    loads = dict.fromkeys((f"b{i}" for i in range(4)), 0)
    for _ in range(200):
        backends = [bv(n, load=v) for n, v in loads.items()]
        bound = -(-1.5 * (sum(loads.values()) + 1) // 4)
        chosen = policy.choose(req(chain=(77,)), backends).backend
        assert loads[chosen] < bound
        loads[chosen] += 1
    assert max(loads.values()) <= 1.5 * 200 / 4 + 1


def test_all_equally_loaded_backends_leave_every_key_with_its_owner() -> None:
    policy = ConsistentHash(seed=0)
    idle = {policy.choose(varied(i), fleet(4)).backend for i in range(30)}
    busy = [policy.choose(varied(i), fleet(4, load=40)) for i in range(30)]
    assert {d.reason for d in busy} == {"ring_owner"}
    assert {d.backend for d in busy} == idle


def test_the_session_is_the_key_when_present_unless_told_otherwise() -> None:
    backends = fleet(6)
    by_session = ConsistentHash(seed=0)
    by_prompt = ConsistentHash({"prefer_session": False}, seed=0)
    sticky = {by_session.choose(req(session="s1", chain=(i,)), backends).backend for i in range(30)}
    assert len(sticky) == 1
    spread = {by_prompt.choose(req(session="s1", chain=(i,)), backends).backend for i in range(30)}
    assert len(spread) > 3


def test_a_prompt_without_a_block_or_session_goes_least_loaded() -> None:
    policy = ConsistentHash(seed=0)
    decision = policy.choose(req(chain=()), [bv("a", load=2), bv("b", load=0)])
    assert (decision.backend, decision.reason) == ("b", "no_key_least_load")


def test_a_removed_backend_moves_only_its_keys() -> None:
    policy = ConsistentHash(seed=0)
    before = {i: policy.choose(req(chain=(i,)), fleet(5)).backend for i in range(300)}
    survivors = [b for b in fleet(5) if b.name != "b1"]
    after = {i: policy.choose(req(chain=(i,)), survivors).backend for i in range(300)}
    assert {i for i in before if before[i] != after[i]} == {i for i in before if before[i] == "b1"}


# --- cost ---------------------------------------------------------------------------------------


def test_cost_takes_the_deeper_match_at_equal_load() -> None:
    policy = Cost(seed=0)
    decision = policy.choose(req(blocks=10), [bv("a", matched=2, load=1), bv("b", matched=8, load=1)])
    assert (decision.backend, decision.reason, decision.matched_blocks) == ("b", "cost_hit", 8)


def test_cost_trades_match_against_load_in_one_currency() -> None:
    # 10 blocks x 64 tokens: 'deep' saves 512 tokens of prefill over 'idle'.
    policy = Cost({"load_tokens": 100.0}, seed=0)
    deep, idle = bv("deep", matched=8, load=5), bv("idle", matched=0, load=0)
    # deep: 128 + 500 = 628 < idle: 640 -> the match still pays for the queue.
    assert policy.choose(req(blocks=10), [deep, idle]).backend == "deep"
    # One more request ahead: 728 > 640 -> the queue costs more than the prefill saved.
    deeper_queue = bv("deep", matched=8, load=6)
    decision = policy.choose(req(blocks=10), [deeper_queue, idle])
    assert (decision.backend, decision.reason) == ("idle", "cost_spill")


def test_cost_counts_the_prefill_already_pending_ahead() -> None:
    deep = BackendView("deep", matched_blocks=8, in_flight=1, pending_prefill_tokens=1000)
    idle = BackendView("idle")
    as_ttft = Cost({"queue_weight": 1.0, "load_tokens": 0.0}, seed=0)
    # deep: 128 uncached + 1000 queued = 1128 > idle: 640 uncached.
    assert as_ttft.cost(req(blocks=10), deep) == 1128
    assert as_ttft.choose(req(blocks=10), [deep, idle]).reason == "cost_spill"
    # The default weight values the hit above the wait: 128 + 100 + 64 < 640.
    assert Cost(seed=0).choose(req(blocks=10), [deep, idle]).backend == "deep"


def test_cost_ties_go_to_the_smaller_cache_then_at_random() -> None:
    policy = Cost(seed=0)
    small = [bv("big", cached=900), bv("small", cached=10)]
    assert {policy.choose(req(), small).backend for _ in range(30)} == {"small"}
    assert policy.choose(req(), small).reason == "cost_no_match"
    equal = [bv("x", cached=5), bv("y", cached=5)]
    assert {policy.choose(req(), equal).backend for _ in range(60)} == {"x", "y"}


def test_cost_estimate_counts_only_uncached_tokens() -> None:
    policy = Cost({"load_tokens": 10.0}, seed=0)
    request = req(blocks=10)
    assert policy.cost(request, bv("a", matched=4, load=3)) == 6 * 64 + 30
    # A belief deeper than the prompt (another tenant's longer chain) never costs below zero.
    assert policy.cost(request, bv("a", matched=50)) == 0


def test_temperature_samples_among_near_equal_costs_only() -> None:
    policy = Cost({"temperature": 0.2, "load_tokens": 10.0}, seed=1)
    near = [bv("a", load=0), bv("b", load=1), bv("far", load=10_000)]
    picks = Counter(policy.choose(req(blocks=10), near).backend for _ in range(400))
    assert "far" not in picks
    assert picks["a"] > picks["b"] > 50
    cold = Cost({"temperature": 0.0, "load_tokens": 10.0}, seed=1)
    assert {cold.choose(req(blocks=10), near).backend for _ in range(50)} == {"a"}


# --- weighted -----------------------------------------------------------------------------------


def test_weighted_prefix_only_follows_the_deepest_match() -> None:
    policy = Weighted({"prefix": 1.0, "queue": 0.0, "kv_usage": 0.0}, seed=0)
    backends = [bv("a", matched=3, load=50), bv("b", matched=9, load=90), bv("c")]
    decision = policy.choose(req(blocks=10), backends)
    assert (decision.backend, decision.reason) == ("b", "weighted_hit")


def test_weighted_queue_only_is_least_load() -> None:
    policy = Weighted({"prefix": 0.0, "queue": 1.0, "kv_usage": 0.0}, seed=0)
    backends = [bv("a", matched=9, load=5), bv("b", load=2), bv("c", load=2)]
    picks = Counter(policy.choose(req(blocks=10), backends).backend for _ in range(100))
    assert set(picks) == {"b", "c"}
    assert policy.choose(req(blocks=10), backends).reason == "weighted_spill"


def test_weighted_balances_a_partial_match_against_a_long_queue() -> None:
    policy = Weighted(seed=0)  # prefix 3, queue 2, kv 2
    # 'hit' holds 40 % of the prompt (3 x 0.4 = 1.2) but has the longest queue (0);
    # 'idle' holds nothing and has the shortest (2): the queue wins.
    backends = [bv("hit", matched=4, load=10), bv("idle", load=0), bv("mid", load=5)]
    assert policy.choose(req(blocks=10), backends).backend == "idle"
    # A full match (3) beats the queue score the idle one gains (2).
    backends = [bv("hit", matched=10, load=10), bv("idle", load=0)]
    assert policy.choose(req(blocks=10), backends).backend == "hit"


def test_weighted_kv_usage_prefers_free_cache_and_unknown_is_neutral() -> None:
    policy = Weighted({"prefix": 0.0, "queue": 0.0, "kv_usage": 1.0}, seed=0)
    assert policy.choose(req(), [bv("full", kv=0.9), bv("free", kv=0.1)]).backend == "free"
    scores = policy.scores(req(), [bv("full", kv=0.9), bv("free", kv=0.1), bv("unknown")])
    assert scores[2] == pytest.approx(0.5)
    assert policy.scores(req(), [bv("u1"), bv("u2")]) == [1.0, 1.0]


def test_weighted_in_flight_scores_the_routers_own_count() -> None:
    policy = Weighted({"prefix": 0.0, "queue": 0.0, "kv_usage": 0.0, "in_flight": 1.0}, seed=0)
    # Engines report the same queue, but this router sent more to 'a'.
    backends = [bv("a", load=9, in_flight=6), bv("b", load=9, in_flight=1)]
    assert policy.choose(req(), backends).backend == "b"


def test_params_are_validated_by_the_dataclass() -> None:
    with pytest.raises(ParamError):
        Weighted({"prefix": "lots"})
