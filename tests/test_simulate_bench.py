"""The live routing benchmark's pure parts: the trace slice it sends and the figures it prints."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from loadtest.bench_routing import Bench, Row, Work, figures, load_requests, main, print_work
from loadtest.client import Result


def bench(path: Path, **overrides) -> Bench:
    fields = dict(
        trace=path, minutes=10.0, speedup=10.0, engines=2, capacity_tokens=100_000,
        belief_capacity_tokens=100_000, max_output_tokens=0, no_reuse=False,
    )  # fmt: skip
    return Bench(**{**fields, **overrides})


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 2]},
        {"timestamp": 500, "input_length": 1100, "output_length": 20, "hash_ids": [0, 1, 3]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_slice_keeps_the_trace_unless_told_otherwise(trace: Path) -> None:
    requests = load_requests(bench(trace))
    assert [r.hash_ids for r in requests] == [(0, 1, 2), (0, 1, 3)]
    capped = load_requests(bench(trace, max_output_tokens=64))
    assert [r.output_tokens for r in capped] == [64, 20]


def test_no_reuse_gives_every_block_a_fresh_id_and_keeps_the_load(trace: Path) -> None:
    requests = load_requests(bench(trace, no_reuse=True))
    ids = [h for r in requests for h in r.hash_ids]
    assert len(ids) == len(set(ids)) == 6
    assert [r.input_tokens for r in requests] == [1100, 1100]


def test_figures_of_a_run() -> None:
    results = [
        Result(True, 200, ttft=0.1, latency=1.0, prompt_tokens=100, cached_tokens=50),
        Result(True, 200, ttft=0.3, latency=2.0, prompt_tokens=100, cached_tokens=0),
        Result(False, 502, ttft=None, latency=0.5),
    ]
    f = figures(Row("x", results, wall_s=4.0, work=Work(received=[3, 1])))
    assert (f.ok, f.failed) == (2, 1)
    assert f.hit_ratio == pytest.approx(0.25)
    assert f.ttft_mean == pytest.approx(0.2)
    assert f.throughput == pytest.approx(0.5)
    assert f.share == pytest.approx(1.5)


def test_the_work_table_splits_the_clients_ttft_at_the_engines(capsys) -> None:
    results = [
        Result(True, 200, ttft=0.1, latency=1.0, prompt_tokens=100, cached_tokens=50),
        Result(True, 200, ttft=0.3, latency=2.0, prompt_tokens=100, cached_tokens=0),
    ]
    before = Work(received=[0, 0], first_tokens=5, engines_ttft_s=1.0)
    after = Work(received=[1, 1], first_tokens=7, engines_ttft_s=1.3)
    work = after.since(before)
    assert (work.first_tokens, work.engines_ttft_mean) == (2, pytest.approx(0.15))
    print_work([Row("x", results, wall_s=4.0, work=work)], requests=2)
    row = capsys.readouterr().out.splitlines()[-1].split()
    # The clients' mean is 200 ms: 150 at the engines, 50 outside them.
    assert row[-2:] == ["150.0", "50.0"]


def test_unknown_contenders_are_refused(trace: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--contenders", "cost,nginx"])
    assert "unknown contender 'nginx'" in capsys.readouterr().err


def test_a_baseline_must_be_a_kvroute_source_tree(trace: Path, tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--trace", str(trace), "--baseline", str(tmp_path)])
    assert "not a kvroute source tree" in capsys.readouterr().err


def test_each_kvroute_contender_runs_again_from_the_baseline_tree(
    trace: Path, tmp_path: Path, capsys
) -> None:
    """Live, two requests each: the baseline's row follows its contender's, SGLang-free."""
    tree = tmp_path / "before"
    tree.mkdir()
    repo = Path(__file__).resolve().parents[1]
    for package in ("kvroute", "router", "policies", "loadtest"):
        (tree / package).symlink_to(repo / package)
    argv = ["--trace", str(trace), "--engines", "2", "--speedup", "100", "--capacity", "100000"]
    assert main([*argv, "--contenders", "round_robin,floor", "--baseline", str(tree)]) == 0
    out = capsys.readouterr().out
    ran = [line.split(":")[0].strip() for line in out.splitlines() if line.endswith(" s") and ": " in line]
    assert ran == ["kvroute round_robin", "kvroute baseline round_robin", "floor (aiohttp + upstream client)"]
    results = [re.split(r"\s{2,}", line) for line in out.splitlines() if line.startswith(tuple(ran))]
    answered = {
        fields[0]: tuple(fields[1:3]) for fields in results if len(fields) > 3 and fields[1].isdigit()
    }
    assert answered == dict.fromkeys(ran, ("2", "0")), out  # ok, failed
