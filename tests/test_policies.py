"""policies.routing: round_robin, least_load, prefix_aware, parameter validation and loading."""

from __future__ import annotations

import dataclasses
import itertools
import random
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from policies.params import ParamError, parse_params
from policies.routing import BUILTIN, PolicyLoadError, build_policy, resolve_policy
from policies.routing.base import RoutingPolicy
from policies.routing.least_load import LeastLoad
from policies.routing.prefix_aware import PrefixAware
from policies.routing.round_robin import RoundRobin
from policies.types import BackendView, Decision, RequestView

POLICIES = ["round_robin", "least_load", "prefix_aware"]


def req(block_count: int = 100) -> RequestView:
    return RequestView(
        model="llama",
        tenant="t",
        session_key=None,
        prompt_tokens=block_count * 64,
        block_count=block_count,
        block_tokens=64,
    )


def bv(name: str, matched: int = 0, load: int = 0, cached: int = 0) -> BackendView:
    return BackendView(name=name, matched_blocks=matched, in_flight=load, cached_blocks=cached)


def choices(policy: RoutingPolicy, backends: list[BackendView], n: int = 300, request=None) -> Counter:
    request = request or req()
    return Counter(policy.choose(request, backends).backend for _ in range(n))


# --- common behaviour -------------------------------------------------------------------------


def test_builtin_registry() -> None:
    registry = {name: BUILTIN[name] for name in POLICIES}
    assert registry == {"round_robin": RoundRobin, "least_load": LeastLoad, "prefix_aware": PrefixAware}
    assert [BUILTIN[n].uses_prefix_match for n in POLICIES] == [False, False, True]


@pytest.mark.parametrize("name", POLICIES)
def test_one_backend(name: str) -> None:
    policy = build_policy(name, seed=0)
    for backend in (bv("only"), bv("only", matched=40, load=9, cached=100)):
        decision = policy.choose(req(), [backend])
        assert isinstance(decision, Decision)
        assert decision.backend == "only"
        assert decision.matched_blocks == backend.matched_blocks


@pytest.mark.parametrize("name", POLICIES)
def test_equal_backends_share_the_traffic(name: str) -> None:
    policy = build_policy(name, seed=1)
    backends = [bv(n, load=2) for n in "abcd"]
    counts = choices(policy, backends, n=400)
    assert set(counts) == set("abcd")
    assert min(counts.values()) >= 50  # never all (or nearly all) on the first


@pytest.mark.parametrize("name", ["least_load", "prefix_aware"])
def test_same_seed_same_decisions(name: str) -> None:
    backends = [bv(n) for n in "abcde"]

    def run() -> list[str]:
        policy = build_policy(name, seed=7)
        return [policy.choose(req(), backends).backend for _ in range(50)]

    first = run()
    assert run() == first
    assert len(set(first)) > 1


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_decision_is_a_candidate_and_carries_its_matched_blocks(name: str, seed: int) -> None:
    rng = random.Random(seed)
    policy = build_policy(name, seed=seed)
    for _ in range(200):
        backends = [
            BackendView(
                name=f"b{i}",
                matched_blocks=rng.randint(0, 20),
                in_flight=rng.randint(0, 12),
                engine_waiting=rng.choice([None, rng.randint(0, 12)]),
                engine_running=rng.choice([None, rng.randint(0, 12)]),
                cached_blocks=rng.randint(0, 50),
            )
            for i in range(rng.randint(1, 6))
        ]
        decision = policy.choose(req(block_count=20), backends)
        chosen = {b.name: b for b in backends}[decision.backend]
        assert decision.matched_blocks == chosen.matched_blocks
        assert decision.reason


# --- BackendView.load -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_flight", "running", "waiting", "expected"),
    [
        (0, None, None, 0),
        (3, None, None, 3),
        (0, 4, None, 4),
        (0, None, 4, 4),
        (1, 2, 3, 5),
        (7, 2, 3, 7),
        (5, 5, 0, 5),
    ],
)
def test_load_is_the_larger_of_in_flight_and_engine_reported(
    in_flight: int, running: int | None, waiting: int | None, expected: int
) -> None:
    view = BackendView("a", in_flight=in_flight, engine_running=running, engine_waiting=waiting)
    assert view.load == expected


# --- round robin ------------------------------------------------------------------------------


def test_round_robin_cycles_in_name_order() -> None:
    policy = build_policy("round_robin", seed=0)
    backends = [bv("c"), bv("a"), bv("b")]
    picks = [policy.choose(req(), backends) for _ in range(7)]
    assert [d.backend for d in picks] == ["a", "b", "c", "a", "b", "c", "a"]
    assert {d.reason for d in picks} == {"round_robin"}


def test_round_robin_ignores_load_and_matches() -> None:
    policy = build_policy("round_robin", seed=0)
    backends = [bv("a", matched=90, load=0), bv("b", matched=0, load=50)]
    assert [policy.choose(req(), backends).backend for _ in range(4)] == ["a", "b", "a", "b"]


def test_round_robin_follows_a_changing_candidate_set() -> None:
    policy = build_policy("round_robin", seed=0)
    for names in ["abc", "ac", "bcde", "e", "abcdef"]:
        backends = [bv(n) for n in reversed(names)]
        picks = [policy.choose(req(), backends).backend for _ in range(len(names))]
        # One full turn over the current set visits each candidate exactly once.
        assert sorted(picks) == sorted(names)
        # ... in name order, starting anywhere.
        start = sorted(names).index(picks[0])
        rotated = sorted(names)[start:] + sorted(names)[:start]
        assert picks == rotated


# --- least load -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("backends", "expected"),
    [
        ([bv("a", load=3), bv("b", load=1), bv("c", load=2)], "b"),
        ([bv("a", load=0, matched=50), bv("b", load=1)], "a"),
        ([bv("a", load=5), bv("b", load=9, matched=99)], "a"),
        (
            [
                BackendView("a", in_flight=1),
                BackendView("b", in_flight=0, engine_waiting=5),
                BackendView("c", in_flight=2, engine_running=1),
            ],
            "a",
        ),
    ],
)
def test_least_load_picks_the_minimum_load(backends: list[BackendView], expected: str) -> None:
    policy = build_policy("least_load", seed=0)
    for _ in range(20):
        decision = policy.choose(req(), backends)
        assert decision.backend == expected
        assert decision.reason == "least_load"


def test_least_load_spreads_ties_only_among_the_least_loaded() -> None:
    counts = choices(build_policy("least_load", seed=3), [bv("a", load=1), bv("b", load=0), bv("c", load=0)])
    assert set(counts) == {"b", "c"}


# --- prefix aware -----------------------------------------------------------------------------


def prefix_aware(**params) -> RoutingPolicy:
    return build_policy("prefix_aware", params, seed=0)


def test_deepest_match_wins_when_balanced() -> None:
    backends = [bv("a", matched=30, load=1), bv("b", matched=70, load=1), bv("c", matched=50, load=1)]
    decision = prefix_aware().choose(req(), backends)
    assert decision == Decision("b", "prefix_hit", 70)


def test_deepest_match_wins_over_a_somewhat_busier_backend() -> None:
    # b is busier but within the thresholds (diff 3 <= 4): locality wins.
    backends = [bv("a", matched=0, load=1), bv("b", matched=40, load=4)]
    assert prefix_aware().choose(req(), backends) == Decision("b", "prefix_hit", 40)


def test_equal_matches_go_to_the_less_loaded() -> None:
    backends = [bv("a", matched=50, load=2), bv("b", matched=50, load=1), bv("c", matched=0, load=0)]
    policy = prefix_aware()
    for _ in range(20):
        assert policy.choose(req(), backends) == Decision("b", "prefix_hit", 50)


def test_equal_matches_and_loads_are_spread_at_random() -> None:
    backends = [bv("a", matched=50, load=1), bv("b", matched=50, load=1), bv("c", matched=10, load=1)]
    counts = choices(prefix_aware(), backends)
    assert set(counts) == {"a", "b"}
    assert min(counts.values()) >= 100


@pytest.mark.parametrize(
    ("matched", "reason", "expected"),
    [
        (9, "no_match_least_load", "b"),  # 9 < 0.1 * 100: ignored, least load wins
        (10, "prefix_hit", "a"),  # exactly the ratio counts
        (11, "prefix_hit", "a"),
    ],
)
def test_min_match_ratio(matched: int, reason: str, expected: str) -> None:
    backends = [bv("a", matched=matched, load=1), bv("b", matched=0, load=0)]
    decision = prefix_aware(min_match_ratio=0.1).choose(req(block_count=100), backends)
    assert (decision.backend, decision.reason) == (expected, reason)
    assert decision.matched_blocks == (matched if expected == "a" else 0)


def test_a_match_below_the_ratio_does_not_attract_equal_load_traffic() -> None:
    backends = [bv("a", matched=9), bv("b", matched=0)]
    counts = choices(prefix_aware(min_match_ratio=0.1), backends, request=req(block_count=100))
    assert set(counts) == {"a", "b"}


def test_zero_matches_are_never_a_hit_even_with_ratio_zero() -> None:
    backends = [bv("a", matched=0, load=1), bv("b", matched=0, load=0)]
    assert prefix_aware(min_match_ratio=0.0).choose(req(), backends).reason == "no_match_least_load"


@pytest.mark.parametrize(
    ("others", "expected"),
    [
        pytest.param(
            [bv("b", matched=30, load=2), bv("c", matched=0, load=1)],
            Decision("b", "prefix_hit_spill", 30),
            id="spills-to-the-best-eligible-match",
        ),
        pytest.param(
            [bv("b", matched=0, load=1), bv("c", matched=0, load=2)],
            Decision("b", "overloaded_least_load", 0),
            id="without-an-eligible-match-goes-to-least-load",
        ),
    ],
)
def test_an_overloaded_best_match(others: list[BackendView], expected: Decision) -> None:
    backends = [bv("a", matched=80, load=20), *others]
    decision = prefix_aware(balance_abs_threshold=4, balance_rel_threshold=1.5).choose(req(), backends)
    assert decision == expected


def test_eligible_matches_below_the_ratio_do_not_count_as_a_spill() -> None:
    backends = [bv("a", matched=80, load=20), bv("b", matched=5, load=1), bv("c", matched=0, load=1)]
    decision = prefix_aware(min_match_ratio=0.1).choose(req(block_count=100), backends)
    assert decision.reason == "overloaded_least_load"
    assert decision.backend in {"b", "c"}
    assert decision.matched_blocks == {"b": 5, "c": 0}[decision.backend]


@pytest.mark.parametrize(
    ("a_load", "min_load", "excluded"),
    [
        pytest.param(15, 10, False, id="abs-exceeded-only"),  # 5 > 4 but 15 <= 1.5 * 10
        pytest.param(5, 2, False, id="rel-exceeded-only"),  # 5 > 3 but 3 <= 4
        pytest.param(7, 2, True, id="both-exceeded"),  # 5 > 4 and 7 > 3
        pytest.param(4, 0, False, id="abs-at-threshold"),  # 4 is not > 4
        pytest.param(5, 0, True, id="abs-just-over-from-idle"),
        pytest.param(16, 10, True, id="both-just-over"),  # 6 > 4 and 16 > 15
        pytest.param(3, 3, False, id="equal"),
    ],
)
def test_both_thresholds_must_be_exceeded_to_exclude(a_load: int, min_load: int, excluded: bool) -> None:
    backends = [bv("a", matched=60, load=a_load), bv("b", matched=0, load=min_load)]
    decision = prefix_aware(balance_abs_threshold=4, balance_rel_threshold=1.5).choose(req(), backends)
    if excluded:
        assert decision == Decision("b", "overloaded_least_load", 0)
    else:
        assert decision == Decision("a", "prefix_hit", 60)


def test_thresholds_use_engine_reported_load() -> None:
    backends = [
        BackendView("a", matched_blocks=60, in_flight=0, engine_waiting=30, engine_running=8),
        BackendView("b", matched_blocks=0, in_flight=1),
    ]
    assert prefix_aware().choose(req(), backends) == Decision("b", "overloaded_least_load", 0)


def test_no_match_prefers_the_emptiest_cache_among_equally_loaded() -> None:
    backends = [bv("a", load=1, cached=100), bv("b", load=1, cached=10), bv("c", load=1, cached=50)]
    assert choices(prefix_aware(), backends, n=50) == Counter({"b": 50})
    assert prefix_aware().choose(req(), backends).reason == "no_match_least_load"


def test_no_match_puts_load_before_cache_size() -> None:
    backends = [bv("a", load=0, cached=100), bv("b", load=1, cached=0)]
    assert choices(prefix_aware(), backends, n=50) == Counter({"a": 50})


def test_no_match_ties_on_load_and_cache_are_random() -> None:
    backends = [bv("a", cached=5), bv("b", cached=5), bv("c", cached=6)]
    assert set(choices(prefix_aware(), backends)) == {"a", "b"}


@pytest.mark.parametrize("seed", [0, 1])
def test_prefix_aware_never_chooses_an_overloaded_backend(seed: int) -> None:
    rng = random.Random(seed)
    policy = build_policy(
        "prefix_aware", {"balance_abs_threshold": 2, "balance_rel_threshold": 1.2}, seed=seed
    )
    for _ in range(300):
        backends = [
            bv(f"b{i}", matched=rng.randint(0, 40), load=rng.randint(0, 20)) for i in range(rng.randint(1, 5))
        ]
        decision = policy.choose(req(block_count=40), backends)
        chosen = {b.name: b for b in backends}[decision.backend]
        min_load = min(b.load for b in backends)
        assert not (chosen.load - min_load > 2 and chosen.load > 1.2 * min_load)


# --- parameters -------------------------------------------------------------------------------


def test_default_params() -> None:
    params = build_policy("prefix_aware").params
    assert (params.min_match_ratio, params.balance_abs_threshold, params.balance_rel_threshold) == (
        0.1,
        4,
        1.5,
    )


def test_int_is_accepted_for_a_float_param() -> None:
    params = build_policy("prefix_aware", {"min_match_ratio": 1, "balance_rel_threshold": 2}).params
    assert params.min_match_ratio == 1.0 and isinstance(params.min_match_ratio, float)
    assert params.balance_rel_threshold == 2.0 and isinstance(params.balance_rel_threshold, float)


@pytest.mark.parametrize(
    ("name", "params", "key"),
    [
        ("prefix_aware", {"min_match_rate": 0.2}, "min_match_rate"),
        ("round_robin", {"weights": [1, 2]}, "weights"),
        ("least_load", {"seed": 3}, "seed"),
        ("prefix_aware", {"min_match_ratio": "high"}, "min_match_ratio"),
        ("prefix_aware", {"min_match_ratio": True}, "min_match_ratio"),
        ("prefix_aware", {"min_match_ratio": None}, "min_match_ratio"),
        ("prefix_aware", {"balance_abs_threshold": 2.5}, "balance_abs_threshold"),
        ("prefix_aware", {"balance_abs_threshold": False}, "balance_abs_threshold"),
        ("prefix_aware", {"balance_abs_threshold": "4"}, "balance_abs_threshold"),
        ("prefix_aware", {"balance_rel_threshold": [1.5]}, "balance_rel_threshold"),
        ("prefix_aware", {"min_match_ratio": 1.5}, "min_match_ratio"),
        ("prefix_aware", {"min_match_ratio": -0.1}, "min_match_ratio"),
        ("prefix_aware", {"balance_abs_threshold": -1}, "balance_abs_threshold"),
        ("prefix_aware", {"balance_rel_threshold": 0.99}, "balance_rel_threshold"),
    ],
)
def test_bad_params_name_the_key(name: str, params: dict, key: str) -> None:
    with pytest.raises(PolicyLoadError) as info:
        build_policy(name, params, seed=0)
    assert f"routing.params.{key}" in str(info.value)


@pytest.mark.parametrize(
    "params",
    [
        {"min_match_ratio": 0.0},
        {"min_match_ratio": 1.0},
        {"balance_abs_threshold": 0},
        {"balance_rel_threshold": 1.0},
    ],
)
def test_boundary_params_are_accepted(params: dict) -> None:
    policy = build_policy("prefix_aware", params)
    ((key, value),) = params.items()
    assert getattr(policy.params, key) == value


# --- loading a user's own class ---------------------------------------------------------------

USER_MODULE = """
from dataclasses import dataclass

from policies.routing.base import RoutingPolicy
from policies.types import Decision


@dataclass(frozen=True)
class PinnedParams:
    pick: str = "first"


class Pinned(RoutingPolicy):
    name = "pinned"
    Params = PinnedParams

    def choose(self, request, backends):
        ordered = sorted(backends, key=lambda b: b.name)
        chosen = ordered[-1] if self.params.pick == "last" else ordered[0]
        return Decision(chosen.name, "pinned", chosen.matched_blocks)


class NoSeed(RoutingPolicy):
    def __init__(self, params=None):
        pass

    def choose(self, request, backends):
        raise AssertionError


class Abstract(RoutingPolicy):
    name = "abstract"


class NotAPolicy:
    def choose(self, request, backends):
        return Decision(backends[0].name, "x")


def helper():
    return None
"""

_module_counter = itertools.count()


@pytest.fixture
def user_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A module of the user's own on sys.path; its name is unique so no import is cached."""
    name = f"kvroute_user_policy_{next(_module_counter)}"
    (tmp_path / f"{name}.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


def test_user_class_loads_with_its_params(user_module: str) -> None:
    policy = build_policy(f"{user_module}:Pinned", {"pick": "last"}, seed=0)
    assert type(policy).__name__ == "Pinned"
    assert resolve_policy(f"{user_module}:Pinned") is type(policy)
    decision = policy.choose(req(), [bv("b", matched=3), bv("c", matched=7), bv("a")])
    assert decision == Decision("c", "pinned", 7)


def test_user_class_params_are_validated(user_module: str) -> None:
    with pytest.raises(PolicyLoadError, match=r"routing\.params\.pick"):
        build_policy(f"{user_module}:Pinned", {"pick": 3})
    with pytest.raises(PolicyLoadError, match=r"routing\.params\.other"):
        build_policy(f"{user_module}:Pinned", {"other": 3})


@pytest.mark.parametrize("attr", ["NotAPolicy", "helper", "Missing"])
def test_a_name_that_is_not_a_policy_class(user_module: str, attr: str) -> None:
    with pytest.raises(PolicyLoadError) as info:
        build_policy(f"{user_module}:{attr}")
    assert "routing.policy" in str(info.value)
    assert f"{user_module}:{attr}" in str(info.value)
    assert "RoutingPolicy" in str(info.value)


@pytest.mark.parametrize("attr", ["Abstract", "NoSeed"])
def test_a_class_that_cannot_be_constructed(user_module: str, attr: str) -> None:
    with pytest.raises(PolicyLoadError, match=r"routing\.policy: cannot construct"):
        build_policy(f"{user_module}:{attr}")


def test_an_unimportable_module() -> None:
    with pytest.raises(PolicyLoadError) as info:
        build_policy("kvroute_no_such_module_xyz:Policy")
    assert "routing.policy" in str(info.value)
    assert "cannot import" in str(info.value)
    assert "kvroute_no_such_module_xyz" in str(info.value)


@pytest.mark.parametrize("name", ["prefix", "Round_Robin", "round-robin", ""])
def test_an_unknown_name(name: str) -> None:
    with pytest.raises(PolicyLoadError) as info:
        build_policy(name)
    message = str(info.value)
    assert "routing.policy" in message
    assert "unknown policy" in message
    assert all(builtin in message for builtin in POLICIES)


@pytest.mark.parametrize(
    "source",
    [
        pytest.param("raise RuntimeError('boom at import')\n", id="raises-at-import"),
        pytest.param("def broken(:\n", id="syntax-error"),
    ],
)
def test_a_module_that_fails_to_import_gives_a_policy_load_error(
    source: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # SOURCE BUG (policies/routing/__init__.py resolve_policy): only ImportError is caught, so an
    # exception raised while importing the user's module escapes build_policy (and config loading).
    name = f"kvroute_broken_policy_{next(_module_counter)}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        with pytest.raises(PolicyLoadError, match=r"routing\.policy"):
            build_policy(f"{name}:Policy")
    finally:
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name", [":Policy", "..relative:Policy"])
def test_a_malformed_module_reference_gives_a_policy_load_error(name: str) -> None:
    # SOURCE BUG (policies/routing/__init__.py resolve_policy): importlib.import_module raises
    # ValueError for an empty module name and TypeError for a relative one; neither is caught.
    with pytest.raises(PolicyLoadError, match=r"routing\.policy"):
        build_policy(name)


@dataclasses.dataclass(frozen=True)
class _Span:
    low: int = 0
    high: int = 1
    #: What ``validate`` answers, to see each shape a user's rule may return.
    answer: str = "list"

    def validate(self) -> object:
        broken = self.low > self.high
        if self.answer == "str":
            return "low: expected at most high" if broken else None
        if self.answer == "bool":
            return not broken
        return ["low: expected at most high"] if broken else []


@pytest.mark.parametrize("answer", ["list", "str", "bool"])
def test_a_params_rule_may_return_its_messages_one_message_or_a_verdict(answer: str) -> None:
    assert parse_params(_Span, {"answer": answer}) == _Span(answer=answer)
    message = "validate: returned False" if answer == "bool" else "low: expected at most high$"
    with pytest.raises(ParamError, match=rf"^params\.{message}"):
        parse_params(_Span, {"low": 2, "answer": answer})
