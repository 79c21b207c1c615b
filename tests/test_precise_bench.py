"""The precise-routing benchmark's pure parts: run order, figures pooled over seeds, the report."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from loadtest.bench_precise import (
    Outcome,
    Row,
    _kvroute,
    figures,
    main,
    pool,
    print_report,
    run_order,
    write_outcomes,
)
from router.config import load_config


def outcome(ttft: float, *, routed: bool = True, cached: int = 0, predicted: int | None = 0) -> Outcome:
    return Outcome(True, routed, ttft, prompt_tokens=100, cached_tokens=cached, predicted=predicted)


def test_each_seed_starts_with_the_next_contender() -> None:
    order = run_order(["a", "b", "c"], [7, 8, 9, 10])
    assert order == [
        (7, "a"), (7, "b"), (7, "c"),
        (8, "b"), (8, "c"), (8, "a"),
        (9, "c"), (9, "a"), (9, "b"),
        (10, "a"), (10, "b"), (10, "c"),
    ]  # fmt: skip


def test_figures_are_over_routed_requests_only() -> None:
    f = figures(
        [outcome(0.1, cached=50, predicted=50), outcome(9.0, routed=False, cached=100, predicted=None)]
    )
    assert (f.routed, f.hit_ratio, f.ttft_p99, f.accuracy) == (1, 0.5, 0.1, 1.0)


def test_seeds_are_pooled_and_each_keeps_its_own_p99() -> None:
    # Seed 1: 100 requests at 0.1 s; seed 2: 98 at 0.1 s and two at 5 s (its p99 is one of them).
    runs = [
        Row("stale", "kvroute precise", [outcome(0.1)] * 100, router_cpu_s=2.0, seed=1),
        Row("stale", "kvroute precise", [outcome(0.1)] * 98 + [outcome(5.0)] * 2, router_cpu_s=4.0, seed=2),
        Row("stale", "sglang cache_aware", [], missing="not installed", seed=1),
    ]
    pooled = pool(runs)
    assert list(pooled) == [("stale", "kvroute precise")]
    precise = pooled["stale", "kvroute precise"]
    assert precise.figures.routed == 200
    # Pooled, the two slow requests are the 199th and 200th of 200: above the 99th percentile.
    assert precise.figures.ttft_p99 == 0.1
    assert precise.p99_by_seed == {1: 0.1, 2: 5.0}
    assert precise.cpu_s == 3.0


def test_the_report_gives_pooled_ratios_and_their_spread_per_seed(capsys: pytest.CaptureFixture[str]) -> None:
    rows = [
        Row("stale", "kvroute approximate", [outcome(1.0)] * 10, seed=1),
        Row("stale", "kvroute precise", [outcome(1.5)] * 10, seed=1),
        Row("stale", "kvroute approximate", [outcome(2.0)] * 10, seed=2),
        Row("stale", "kvroute precise", [outcome(1.0)] * 10, seed=2),
    ]
    print_report(rows)
    out = capsys.readouterr().out
    precise_line = next(
        line for line in out.splitlines() if "stale" in line and line.split()[1:3] == ["kvroute", "precise"]
    )
    assert "20" in precise_line.split() and "1000-1500" in precise_line
    ratio_line = next(line for line in out.splitlines() if "precise vs kvroute approximate" in line)
    # Pooled p99: 1.5 s against 2.0 s; seed by seed, 1.5x and 0.5x.
    assert ratio_line.split()[-2:] == ["0.75x", "0.50-1.50x"]


def test_outcomes_are_written_one_json_object_a_line(tmp_path: Path) -> None:
    rows = [Row("routing", "kvroute precise", [outcome(0.2, cached=16, predicted=16)], seed=7)]
    path = tmp_path / "outcomes.jsonl"
    write_outcomes(rows, path)
    (record,) = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert record["scenario"] == "routing" and record["seed"] == 7
    assert (record["ttft"], record["cached_tokens"], record["predicted"]) == (0.2, 16, 16)


def test_seeds_must_be_integers(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--seeds", "7,x"])
    assert exc.value.code == 2
    assert "seeds" in capsys.readouterr().err


def test_policy_params_reach_the_router_config_in_both_modes(tmp_path: Path) -> None:
    for mode in ("approximate", "precise"):
        contender = _kvroute(mode, "cost", "{load_tokens: 1024}", 200_000, ["http://127.0.0.1:1"], tmp_path)
        config = load_config(tmp_path / f"kvroute-{mode}.yaml")
        assert contender.name == f"kvroute {mode}"
        assert (config.routing.policy, config.routing.params) == ("cost", {"load_tokens": 1024})
        assert config.index.mode == ("events" if mode == "precise" else "approximate")
